"""Point-to-point ring exchange and collectives over one process group (the CP ring).

The ring of a group of N ranks: rank ``i`` (rank within the group) sends to ``i+1`` and receives from
``i-1`` (mod N). Exchanges are asynchronous: :meth:`Ring.start` posts the send and the receive
(``batch_isend_irecv``; NCCL runs them on its own stream, gloo on its own threads) and returns at
once, so the caller computes on the block in hand while the next block travels; :meth:`Ring.wait`
completes them (on CUDA it makes the current stream wait, without a host sync).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.12 names it all_gather_single (and deprecates the old name); older torch (2.4-2.11)
# only has all_gather_into_tensor. Both take the output concatenated along dim 0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Ring:
    """The CP ring of ``group`` (``None`` = the default group)."""

    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        self.group = self.group or dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def start(self, send: Tensor, recv: Tensor, tag: int = 0) -> list:
        """Post ``send`` → next rank and ``recv`` ← previous rank; returns the pending works.

        Two exchanges in flight at once (the backward's KV blocks and their gradients) need
        distinct ``tag``s: gloo does not promise to match same-tag messages in posting order.
        """
        ops = [
            dist.P2POp(dist.isend, send, self._next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self._prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()

    def rotate(self, block: Tensor) -> Iterator[tuple[int, Tensor]]:
        """Pass ``block`` around the ring: yields ``(step, block in hand)`` for ``size`` steps,
        starting with this rank's own block; at step ``s`` the block of rank ``r - s`` is in hand.

        The transfer of the next block is posted *before* each yield and completed after it, so
        whatever the caller computes on the block in hand overlaps the transfer. Received blocks
        alternate between two scratch buffers (a buffer is received into only after its own send
        has completed); ``block`` itself is only read, so the caller may keep using it.
        """
        scratch = [torch.empty_like(block) for _ in range(min(self.size - 1, 2))]
        cur = block
        for step in range(self.size):
            works = None
            if step + 1 < self.size:
                nxt = scratch[step % 2]
                works = self.start(cur, nxt)
            yield step, cur
            if works is not None:
                self.wait(works)
                cur = nxt

    def all_gather(self, t: Tensor) -> Tensor:
        """``[N, *t.shape]``: every rank's ``t`` in group-rank order (one collective)."""
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t.contiguous(), group=self.group)
        return out.view(self.size, *t.shape)

    def all_to_all(self, t: Tensor) -> Tensor:
        """``t`` is ``[N, ...]``; slice ``j`` goes to rank ``j``; returns the slices received, ``[N, ...]``."""
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t.contiguous(), group=self.group)
        return out
