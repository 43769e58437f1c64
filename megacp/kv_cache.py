"""The CP-sharded incremental KV cache.

Each CP rank keeps, for every layer, a static preallocated buffer of ``max_requests`` slots ×
``capacity`` tokens (gpt-fast style: fixed shapes, CUDA-graph friendly) holding only **this rank's**
tokens of each request, in position order, plus their global positions. Placement follows
:mod:`megacp.placement`: prefill tokens stay where the load-balanced sharding put them
(also across chunked prefill and multi-turn continuation), a decoded token at position t lives only
on rank ``t mod N``. The host keeps, for every request, how many tokens *each* rank holds — every
rank can derive it from the request's history, so no communication is needed to plan a step.

A step is planned with :meth:`ShardedKVCache.plan`; the steps of :mod:`megacp.layers.step` write
each layer's new keys and values with :meth:`write` (or :meth:`write_rows` on the device) and read
with :meth:`kv` / :meth:`decode_kv`, and :meth:`commit` advances the bookkeeping once every layer
has written.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megacp.placement import ShardPlan, held_after, shard_ranges


class CacheCapacityError(RuntimeError):
    """A request would not fit in the cache (raised before anything is written)."""


class ShardedKVCache:
    """This CP rank's shard of the KV cache of every layer.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (KV heads of this TP rank).
        max_requests: concurrent request slots.
        capacity: tokens per request slot **on this rank** (a request of S tokens needs about
            S/N + 1 per rank with load balancing).
        cp_size, cp_rank: the CP group.
        load_balance: 2N-chunk prefill sharding (default) or contiguous chunks.

    Storage: ``k``/``v`` ``[num_layers, max_requests, capacity, num_kv_heads, head_dim]`` and
    ``positions`` ``[max_requests, capacity]`` (int64, -1 where empty) on ``device``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_requests: int,
        capacity: int,
        cp_size: int = 1,
        cp_rank: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        load_balance: bool = True,
    ) -> None:
        for name, val in (("num_layers", num_layers), ("max_requests", max_requests), ("capacity", capacity), ("cp_size", cp_size)):
            if val < 1:
                raise ValueError(f"ShardedKVCache {name} must be >= 1, got {val}")
        self.num_layers, self.capacity, self.max_requests = num_layers, capacity, max_requests
        self.cp_size, self.cp_rank, self.load_balance = cp_size, cp_rank, load_balance
        shape = (num_layers, max_requests, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.full((max_requests, capacity), -1, dtype=torch.long, device=device)
        self._free = list(range(max_requests - 1, -1, -1))
        self._history: dict[int, list[int]] = {}
        self._held: dict[int, list[int]] = {}  # slot -> tokens held by each CP rank

    # ------------------------------------------------------------------ slots
    def allocate(self) -> int:
        """A free request slot (raises :class:`CacheCapacityError` when all are in use)."""
        if not self._free:
            raise CacheCapacityError(f"all {self.max_requests} KV cache request slots are in use; free one or raise max_requests")
        slot = self._free.pop()
        self._history[slot] = [0]
        self._held[slot] = [0] * self.cp_size
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot`` for reuse (its contents are overwritten by the next request)."""
        self._check_slot(slot)
        del self._history[slot], self._held[slot]
        self.positions[slot] = -1
        self._free.append(slot)

    def _check_slot(self, slot: int) -> None:
        if slot not in self._history:
            raise KeyError(f"KV cache slot {slot} is not allocated")

    def history(self, slot: int) -> list[int]:
        """Computed-token counts after each step of the request in ``slot`` (starts with 0)."""
        self._check_slot(slot)
        return list(self._history[slot])

    def length(self, slot: int) -> int:
        """Tokens of the request computed so far (all ranks together)."""
        self._check_slot(slot)
        return self._history[slot][-1]

    def local_length(self, slot: int, rank: int | None = None) -> int:
        """Tokens of the request held by ``rank`` (default: this rank)."""
        self._check_slot(slot)
        return self._held[slot][self.cp_rank if rank is None else rank]

    def check_room(self, slot: int, steps: Sequence[int], spare: int = 0) -> None:
        """Raise :class:`CacheCapacityError` unless the request in ``slot`` can take ``steps`` (its
        new-token counts, step by step: prefill chunks, then 1 per decode step) on every CP rank
        with ``spare`` rows left over on each (a static decode step writes one row past a rank's
        tokens when it does not own the step's token)."""
        self._check_slot(slot)
        pos = self.length(slot) + sum(steps)
        held = held_after(self._held[slot], self.length(slot), steps, self.cp_size, load_balance=self.load_balance)
        worst = max(range(self.cp_size), key=held.__getitem__)
        if held[worst] + spare > self.capacity:
            raise CacheCapacityError(
                f"{pos} tokens in all would need {held[worst] + spare} KV cache rows on CP rank {worst}, which holds "
                f"{self.capacity} per request; raise the cache capacity or the CP size"
            )

    # ------------------------------------------------------------------ steps
    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> ShardPlan:
        """Plan a step that adds ``new_tokens[i]`` tokens to the request in ``slots[i]``.

        Checks capacity on every rank first: nothing is written when a request would not fit.
        """
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step lists a slot twice: {list(slots)}")
        for s in slots:
            self._check_slot(s)
        plan = ShardPlan(
            [self.length(s) for s in slots], new_tokens, self.cp_size, self.cp_rank,
            prefix_counts=[[self._held[s][j] for s in slots] for j in range(self.cp_size)],
            load_balance=self.load_balance, histories=[self._history[s] for s in slots],
        )
        for j in range(self.cp_size):
            for i, s in enumerate(slots):
                need = self._held[s][j] + sum(b - a for a, b in plan.ranges[j][i])
                if need > self.capacity:
                    raise CacheCapacityError(
                        f"request in slot {s} needs {need} tokens on CP rank {j} but the KV cache holds "
                        f"{self.capacity} per request per rank ({self.length(s) + plan.new[i]} tokens in all); "
                        "raise the cache capacity or the CP size"
                    )
        return plan

    def write(self, layer: int, slots: Sequence[int], plan: ShardPlan, k: Tensor, v: Tensor) -> None:
        """Store this rank's new keys/values of a planned step for ``layer``.

        Args:
            k, v: ``[plan.num_local(), Hkv, D]`` in ``plan.q_layout(rank)`` order.
        """
        want = (plan.num_local(), *self.k.shape[3:])
        if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != self.k.dtype or v.dtype != self.k.dtype:
            raise ValueError(
                f"KV cache write expects k and v of shape {want} and dtype {self.k.dtype}; got "
                f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        for s, lay in zip(slots, plan.q_layout(self.cp_rank)):
            n = lay.num_new
            if n:
                start = self._held[s][self.cp_rank]
                self.k[layer, s, start : start + n] = k[lay.offset : lay.offset + n]
                self.v[layer, s, start : start + n] = v[lay.offset : lay.offset + n]

    def kv(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Views ``[length, Hkv, D]`` of the first ``length`` tokens this rank holds of ``slot``."""
        return self.k[layer, slot, :length], self.v[layer, slot, :length]

    def decode_kv(self, layer: int, slots: Sequence[int], lengths: Sequence[int]) -> tuple[Tensor, Tensor] | list[tuple[Tensor, Tensor]]:
        """What a decode step attends over for ``layer``: the first ``lengths[i]`` tokens this rank
        holds of ``slots[i]``. Consecutive slots of equal lengths come as one pair of views
        ``[B, length, Hkv, D]`` (no copy), others as a list of :meth:`kv` pairs."""
        s0 = slots[0]
        if len(set(lengths)) == 1 and list(slots) == list(range(s0, s0 + len(slots))):
            end = s0 + len(slots)
            return self.k[layer, s0:end, : lengths[0]], self.v[layer, s0:end, : lengths[0]]
        return [self.kv(layer, s, n) for s, n in zip(slots, lengths)]

    def commit(self, slots: Sequence[int], plan: ShardPlan) -> None:
        """Advance the bookkeeping after every layer has written the step."""
        local = plan.local_positions().to(self.positions.device)
        for s, i, lay in zip(slots, range(plan.num_requests), plan.q_layout(self.cp_rank)):
            start = self._held[s][self.cp_rank]
            self.positions[s, start : start + lay.num_new] = local[lay.offset : lay.offset + lay.num_new]
            for j in range(self.cp_size):
                self._held[s][j] += sum(b - a for a, b in plan.ranges[j][i])
            self._history[s].append(self._history[s][-1] + plan.new[i])

    # ------------------------------------------------------------------ static decode (device-side)
    def flat_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Views ``[max_requests * capacity, Hkv, D]`` of ``layer``'s keys and values: slot ``s``'s
        row ``j`` is row ``s * capacity + j`` (a static decode step indexes rows on the device)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write_rows(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` ``[B, Hkv, D]`` at device-held ``rows [B]`` (int64) of :meth:`flat_kv`
        (no host synchronisation: a CUDA graph replays it); returns ``flat_kv(layer)``."""
        kf, vf = self.flat_kv(layer)
        kf.index_copy_(0, rows, k)
        vf.index_copy_(0, rows, v)
        return kf, vf

    def decode_state(self, slots: Sequence[int], device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
        """Device tensors a static decode step starts from, for the requests in ``slots``:
        ``positions [B]`` int64 (each request's next position = its length), ``held [B]`` int32
        (tokens this rank holds) and ``starts [B]`` int64 (row of each slot's first token in
        :meth:`flat_kv`)."""
        for s in slots:
            self._check_slot(s)
        return (torch.tensor([self.length(s) for s in slots], dtype=torch.long, device=device),
                torch.tensor([self.local_length(s) for s in slots], dtype=torch.int32, device=device),
                torch.tensor([s * self.capacity for s in slots], dtype=torch.long, device=device))

    def advance_decoded(self, slot: int, count: int) -> None:
        """Host bookkeeping of ``count`` decode steps whose keys and values a static decode step
        already wrote on the device (one token per step, placed by :func:`~megacp.placement.shard_ranges`)."""
        self._check_slot(slot)
        held, pos, mine = self._held[slot], self.length(slot), []
        for t in range(pos, pos + count):
            for j in range(self.cp_size):
                ranges = shard_ranges(t, 1, self.cp_size, j, load_balance=self.load_balance)
                held[j] += len(ranges)
                if ranges and j == self.cp_rank:
                    mine.append(t)
            self._history[slot].append(t + 1)
        start = held[self.cp_rank] - len(mine)
        self.positions[slot, start : start + len(mine)] = torch.tensor(mine, dtype=torch.long)

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` tokens (positions ``< length``) of the request in ``slot``:
        every rank drops its rows of later positions (its rows are in position order, so they are a
        tail) and the next step continues at position ``length``. A no-op at the slot's length.

        Raises:
            ValueError: ``length`` is negative or more than the slot holds.
        """
        self._check_slot(slot)
        history = self._history[slot]
        if not 0 <= length <= history[-1]:
            raise ValueError(f"cannot truncate KV cache slot {slot} of {history[-1]} tokens to {length}")
        if length == history[-1]:
            return
        held = [0] * self.cp_size
        for start, end in zip(history, history[1:]):  # replay the placement of every step, clipped at length
            if start >= length:
                break
            for j in range(self.cp_size):
                held[j] += sum(min(b, length) - a for a, b in
                               shard_ranges(start, end - start, self.cp_size, j, load_balance=self.load_balance) if a < length)
        self._history[slot] = [h for h in history if h < length] + [length]
        self._held[slot] = held
        self.positions[slot, held[self.cp_rank]:] = -1

    # ------------------------------------------------------------------ rollback of a failed step
    def snapshot(self, slot: int) -> tuple[list[int], list[int], Tensor]:
        """The bookkeeping of ``slot`` (its lengths history, tokens held per rank, positions row):
        what :meth:`restore` puts back after a turn that failed part-way. Keys and values past the
        restored lengths are never read again, so they need no copy."""
        self._check_slot(slot)
        return list(self._history[slot]), list(self._held[slot]), self.positions[slot].clone()

    def restore(self, slot: int, state: tuple[list[int], list[int], Tensor]) -> None:
        """Put back ``slot``'s bookkeeping as :meth:`snapshot` returned it."""
        self._check_slot(slot)
        history, held, positions = state
        self._history[slot], self._held[slot] = list(history), list(held)
        self.positions[slot].copy_(positions)
