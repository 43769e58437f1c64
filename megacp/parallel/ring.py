"""Point-to-point ring exchange and collectives over one process group (the CP ring).

The ring of a group of N ranks: rank ``i`` (rank within the group) sends to ``i+1`` and receives from
``i-1`` (mod N). Exchanges are asynchronous: :meth:`Ring.start` posts the send and the receive
(``batch_isend_irecv``; NCCL runs them on its own stream, gloo on its own threads) and returns at
once, so the caller computes on the block in hand while the next block travels; :meth:`Ring.wait`
completes them (on CUDA it makes the current stream wait, without a host sync).

:meth:`Ring.rotate` has two transports (``transport=``; megacp's config key
``runtime.ring_transport``, env ``MEGACP_RING_TRANSPORT`` read by :func:`megacp.initialize`):

* ``"nccl"`` — each block is relayed rank to rank with P2P send/recv (NCCL on GPU, gloo on CPU);
* ``"copy_engine"`` — every rank *pushes* its block (or only the rows the target reads) straight
  into the :class:`~megacp.parallel.peer.PeerWindow` of rank ``r + s`` for step ``s``, with copies
  that run on a copy engine and flags that the GPU front end writes and waits on, so nothing
  competes with the attention kernels for SMs (a block larger than a window slot of
  ``window_mb`` MiB rotates over NCCL instead);
* ``"auto"`` (default) — ``copy_engine`` for CUDA tensors on a group that supports it
  (:func:`~megacp.parallel.peer.copy_engine_supported`), else ``nccl``.

A block may be several tensors of one shape that travel together (:data:`Block`: pass-KV's keys
and values, never stacked into one buffer first).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.parallel.peer import (
    DEFAULT_WINDOW_MB,
    TRANSPORTS,
    PeerWindow,
    copy_engine_supported,
    peer_window,
    push_schedule,
    wait_value,
    write_value,
)

# torch >= 2.12 names it all_gather_single (and deprecates the old name); older torch (2.4-2.11)
# only has all_gather_into_tensor. Both take the output concatenated along dim 0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


Block = Tensor | tuple[Tensor, ...]
"""What :meth:`Ring.rotate` passes around: one tensor, or a tuple of contiguous tensors of one shape
and dtype that travel together (pass-KV's keys and values, without stacking them first). Received
tuples come stacked, ``[P, *part.shape]``, so ``block[i]`` is part ``i`` either way."""


def _parts(block: Block) -> list[Tensor]:
    """The tensors of ``block``, checked: a tuple's parts share shape, dtype and device and are contiguous."""
    if not isinstance(block, tuple):
        if block.dim() == 0:
            raise ValueError("a ring block needs at least one dimension")
        return [block]
    first = block[0]
    if first.dim() == 0:
        raise ValueError("a ring block needs at least one dimension")
    for t in block:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous():
            raise ValueError("the parts of a ring block must be contiguous tensors of one shape, dtype and device; "
                             f"got {[(tuple(x.shape), x.dtype, x.is_contiguous()) for x in block]}")
    return list(block)


def _received_shape(block: Block) -> tuple[int, ...]:
    """Shape in which a received ``block`` is handed out."""
    return (len(block), *block[0].shape) if isinstance(block, tuple) else tuple(block.shape)


@functools.cache
def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """One CUDA stream per ``device`` and ``role``, made on first use and kept: e.g. ``"post"``, from
    which :meth:`Ring.rotate` posts NCCL exchanges that wait on a ``ready`` event."""
    return torch.cuda.Stream(device=device)


@dataclass
class Ring:
    """The CP ring of ``group`` (``None`` = the default group); ``transport`` of :meth:`rotate`
    (one of :data:`~megacp.parallel.peer.TRANSPORTS`) and ``window_mb``, the MiB of each slot of
    the group's copy-engine window. A job's ring is :meth:`megacp.ParallelState.ring`."""

    group: dist.ProcessGroup | None = None
    transport: str = "auto"
    window_mb: int = DEFAULT_WINDOW_MB

    def __post_init__(self) -> None:
        self.group = group = self.group or dist.group.WORLD
        assert group is not None  # torch.distributed is initialised
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ring transport {self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.transport == "auto":
            self.transport = "copy_engine" if copy_engine_supported(group) else "nccl"
        elif self.transport == "copy_engine" and not copy_engine_supported(group):
            raise ValueError("ring transport 'copy_engine' needs an NCCL group of CUDA ranks on one host "
                             f"with symmetric memory (backend {dist.get_backend(self.group)!r})")
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: Tensor | list[Tensor], recv: Tensor | list[Tensor], tag: int = 0) -> list:
        """Post ``send`` → next rank and ``recv`` ← previous rank (tensors, or lists of tensors
        matched pairwise: message ``i`` has tag ``tag + 16·i``); returns the pending works.

        Two exchanges in flight at once (the backward's KV blocks and their gradients) need
        distinct ``tag``s below 16: gloo does not promise to match same-tag messages in posting order.
        """
        sends = send if isinstance(send, list) else [send]
        recvs = recv if isinstance(recv, list) else [recv]
        ops = []
        for i, (a, b) in enumerate(zip(sends, recvs, strict=True)):
            ops += [dist.P2POp(dist.isend, a, self._next, self.group, tag + 16 * i),
                    dist.P2POp(dist.irecv, b, self._prev, self.group, tag + 16 * i)]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()

    def rotate(self, block: Block, stream: torch.cuda.Stream | None = None,
               ready: torch.cuda.Event | None = None, rows: Sequence[int] | None = None
               ) -> Iterator[tuple[int, Block]]:
        """Pass ``block`` around the ring: yields ``(step, block in hand)`` for ``size`` steps,
        starting with this rank's own block; at step ``s`` the block of rank ``r - s`` is in hand
        (a tuple :data:`Block` comes stacked from step 1 on). Every rank passes blocks of one shape.

        The transfer of the next block is posted *before* each yield and completed after it, so
        whatever the caller computes on the block in hand overlaps the transfer. Received blocks
        alternate between two buffers (scratch tensors, or the slots of a peer window): a block in
        hand is valid until the caller resumes the iterator, and the caller's work on it must be
        queued on the stream that was current when the rotation began. ``block`` itself is only
        read, so the caller may keep using it (but must not change it before the rotation ends).
        Iterate it to the end: the last step also releases the transport's buffers.

        ``stream`` (CUDA): the stream on which the caller consumes the blocks of steps ``>= 1``
        (default: the current one), e.g. a second compute stream, so that their compute can fill the
        SMs that step 0's kernel leaves idle at its tail. The caller must have made it wait for the
        inputs it needs.

        ``ready`` (CUDA): an event recorded once ``block`` was complete. The transfers then wait on
        it instead of on the current stream, so the caller may queue work before starting the
        rotation (pass-KV queues step 0's compute first) without the transfers waiting behind it.

        ``rows`` (copy-engine transport): ``rows[t]`` is how many leading rows (dim 0) of each part
        of this rank's block group rank ``t`` reads; the push to ``t`` carries only those, and the
        rest of the block ``t`` is handed is undefined. The relay always carries whole blocks (each
        is forwarded on). Default: every row.
        """
        parts = _parts(block)
        if self.transport == "copy_engine" and parts[0].is_cuda and self.size > 1:
            assert self.group is not None
            win = peer_window(self.group, sum(t.nbytes for t in parts), parts[0].device, self.window_mb)
            if win is not None:
                yield from self._rotate_push(block, parts, win, stream, ready, rows)
                return
        yield from self._rotate_relay(block, parts, stream, ready)

    def _rotate_relay(self, block: Block, parts: list[Tensor], consumer: torch.cuda.Stream | None,
                      ready: torch.cuda.Event | None) -> Iterator[tuple[int, Block]]:
        """:meth:`rotate` by P2P send/recv, rank to rank (``parts``: the tensors of ``block``). NCCL's
        stream waits on the stream that is current when an exchange is posted: the caller's, or with
        ``ready`` a side stream that waits on that event only."""
        dev, streams = parts[0].device, parts[0].is_cuda
        caller = torch.cuda.current_stream(dev) if streams else None
        consumer = consumer or caller
        poster = caller
        assert not streams or (caller is not None and consumer is not None)
        if ready is not None:
            poster = side_stream(dev, "post")
            poster.wait_event(ready)
        with torch.cuda.stream(poster) if streams else contextlib.nullcontext():
            shape = _received_shape(block)
            scratch = [parts[0].new_empty(shape) for _ in range(min(self.size - 1, 2))]
        split = isinstance(block, tuple)
        for buf in scratch if streams else ():  # read on the consumer streams, freed on the poster
            for s in {consumer, caller} - {poster}:
                buf.record_stream(s)  # type: ignore[arg-type]  # CUDA streams here
        cur = block
        for step in range(self.size):
            works = None
            if step + 1 < self.size:
                nxt = scratch[step % 2]
                with torch.cuda.stream(poster) if streams else contextlib.nullcontext():
                    if streams and step >= 2 and consumer != poster:
                        poster.wait_stream(consumer)  # type: ignore[union-attr,arg-type]  # nxt held step - 1's block
                    works = self.start(list(cur) if split else cur, list(nxt) if split else nxt)  # type: ignore[arg-type]
            yield step, cur
            if works is not None:
                with torch.cuda.stream(consumer) if streams else contextlib.nullcontext():
                    self.wait(works)
                cur = nxt

    def _rotate_push(self, block: Block, parts: list[Tensor], win: PeerWindow,
                     consumer: torch.cuda.Stream | None, ready: torch.cuda.Event | None,
                     rows: Sequence[int] | None) -> Iterator[tuple[int, Block]]:
        """:meth:`rotate` over peer windows (see :mod:`megacp.parallel.peer`). Rank ``r`` pushes
        its block into slot ``(s-1) % 2`` of rank ``r+s``, for ``s = 1..N-1``, with copy-engine copies
        on the window's stream, at most two steps ahead (a push first waits until the target has
        released that slot's previous use). Step 0 (the own block) is handed out first, so its
        compute is queued before any transfer; step ``s`` makes the consumer stream wait for slot
        ``(s-1) % 2`` to be filled and hands out the slot itself (valid until the caller resumes the
        iterator); the release is written on the consumer stream after the caller's work on it.
        Nothing here needs an SM or a host sync. The order of operations is
        :func:`~megacp.parallel.peer.push_schedule`'s."""
        n, r = self.size, self.rank
        main = torch.cuda.current_stream(parts[0].device)
        consumer = consumer or main
        part_bytes = parts[0].nbytes
        row_bytes = part_bytes // max(parts[0].shape[0], 1)
        nbytes, dtype, shape = part_bytes * len(parts), parts[0].dtype, _received_shape(block)
        ops, win.uses = push_schedule(n, r, win.uses)
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(main)
        yield 0, block
        win.stream.wait_event(ready)
        for op in ops:
            if op.kind == "wait_free":
                wait_value(win.stream, win.free_flag(r, op.peer, op.slot), op.value)
            elif op.kind == "push":
                size = part_bytes if rows is None else min(rows[op.peer] * row_bytes, part_bytes)
                if size:
                    with torch.cuda.stream(win.stream):
                        dst = win.slot(op.peer, op.slot, nbytes)
                        for i, t in enumerate(parts):
                            dst[i * part_bytes:i * part_bytes + size].copy_(t.reshape(-1).view(torch.uint8)[:size])
            elif op.kind == "ready":
                write_value(win.stream, win.ready_flag(op.peer, op.slot), op.value)
            elif op.kind == "wait_ready":
                wait_value(consumer, win.ready_flag(r, op.slot), op.value)
            elif op.kind == "hand_out":
                yield op.step, win.slot(r, op.slot, nbytes).view(dtype).view(shape)
            else:  # release
                for p in range(n):
                    if p != r:
                        write_value(consumer, win.free_flag(p, r, op.slot), op.value)
        pushed = torch.cuda.Event()
        pushed.record(win.stream)
        main.wait_event(pushed)  # ``block`` is read until here

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
