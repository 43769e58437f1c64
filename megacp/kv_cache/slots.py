"""The KV cache's slot table: which request slots are in use, for each request how many tokens every
CP rank holds and at which positions — host-side bookkeeping with no device tensors.

Every rank keeps the same table: a request's history of step lengths determines, by the placement
rule of :mod:`megacp.placement`, which positions each rank holds (prefill tokens where the
load-balanced sharding put them, also across chunked prefill and multi-turn continuation; a decoded
token at position ``t`` only on rank ``t mod N``), so no communication is needed to plan a step. The
device storage (:class:`~megacp.kv_cache.storage.KVStorage`) keeps each rank's tokens of a request in
position order from row 0; the table says how many rows are filled.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megacp.placement import ShardPlan, held_after, shard_ranges
from megacp.placement.sharding import Range


class CacheCapacityError(RuntimeError):
    """A request would not fit in the cache (raised before anything is written)."""


SlotState = tuple[list[int], list[int], list[list[Range]]]
"""A slot's bookkeeping as :meth:`SlotTable.snapshot` returns it: its lengths history, the tokens
each rank holds and the position runs of each rank's rows."""


def _extend(runs: list[Range], lo: int, hi: int) -> None:
    """Append positions ``[lo, hi)`` to ``runs`` (merged with the last run where they continue it)."""
    if hi <= lo:
        return
    if runs and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi)
    else:
        runs.append((lo, hi))


class SlotTable:
    """The request slots of a CP-sharded KV cache and their lengths.

    Args:
        max_requests: concurrent request slots.
        capacity: tokens per request slot **on this rank** (a request of S tokens needs about
            S/N + 1 per rank with load balancing).
        cp_size, cp_rank: the CP group.
        load_balance: 2N-chunk prefill sharding (default) or contiguous chunks.
    """

    def __init__(self, *, max_requests: int, capacity: int, cp_size: int = 1, cp_rank: int = 0,
                 load_balance: bool = True) -> None:
        for name, val in (("max_requests", max_requests), ("capacity", capacity), ("cp_size", cp_size)):
            if val < 1:
                raise ValueError(f"ShardedKVCache {name} must be >= 1, got {val}")
        self.capacity, self.max_requests = capacity, max_requests
        self.cp_size, self.cp_rank, self.load_balance = cp_size, cp_rank, load_balance
        self._free = list(range(max_requests - 1, -1, -1))
        self._history: dict[int, list[int]] = {}
        self._held: dict[int, list[int]] = {}  # slot -> tokens held by each CP rank
        self._runs: dict[int, list[list[Range]]] = {}  # slot -> per rank, position runs of its rows in row order

    # ------------------------------------------------------------------ slots
    def allocate(self) -> int:
        """A free request slot (raises :class:`CacheCapacityError` when all are in use)."""
        if not self._free:
            raise CacheCapacityError(f"all {self.max_requests} KV cache request slots are in use; free one or raise max_requests")
        slot = self._free.pop()
        self._history[slot] = [0]
        self._held[slot] = [0] * self.cp_size
        self._runs[slot] = [[] for _ in range(self.cp_size)]
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot`` for reuse (its rows are overwritten by the next request)."""
        self._check_slot(slot)
        del self._history[slot], self._held[slot], self._runs[slot]
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
        """Tokens of the request held by ``rank`` (default: this rank): its filled rows there."""
        self._check_slot(slot)
        return self._held[slot][self.cp_rank if rank is None else rank]

    @property
    def positions(self) -> Tensor:
        """``[max_requests, capacity]`` int64 (CPU): the global position of each row this rank
        holds of each slot, -1 where empty (made when asked, for checks and diagnostics; nothing on
        the step path reads it)."""
        out = torch.full((self.max_requests, self.capacity), -1, dtype=torch.long)
        for slot, runs in self._runs.items():
            rows = [p for a, b in runs[self.cp_rank] for p in range(a, b)]
            out[slot, : len(rows)] = torch.tensor(rows, dtype=torch.long)
        return out

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
            load_balance=self.load_balance, cached_runs=[[list(self._runs[s][j]) for s in slots] for j in range(self.cp_size)],
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

    def commit(self, slots: Sequence[int], plan: ShardPlan) -> None:
        """Advance the bookkeeping after every layer has written the step."""
        for s, i in zip(slots, range(plan.num_requests)):
            for j in range(self.cp_size):
                for a, b in plan.ranges[j][i]:
                    _extend(self._runs[s][j], a, b)
                self._held[s][j] += sum(b - a for a, b in plan.ranges[j][i])
            self._history[s].append(self._history[s][-1] + plan.new[i])

    def advance_decoded(self, slot: int, count: int) -> None:
        """Bookkeeping of ``count`` decode steps whose keys and values a static decode step already
        wrote on the device (one token per step, placed by :func:`~megacp.placement.shard_ranges`)."""
        self._check_slot(slot)
        held, pos = self._held[slot], self.length(slot)
        for t in range(pos, pos + count):
            for j in range(self.cp_size):
                for a, b in shard_ranges(t, 1, self.cp_size, j, load_balance=self.load_balance):
                    held[j] += b - a
                    _extend(self._runs[slot][j], a, b)
            self._history[slot].append(t + 1)

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
        # every rank keeps its rows of positions < length: a prefix of its rows (they are in position
        # order); the runs keep where the steps placed them (a step cut part-way is not a shorter step)
        runs = [[(a, min(b, length)) for a, b in rank_runs if a < length] for rank_runs in self._runs[slot]]
        self._runs[slot] = runs
        self._held[slot] = [sum(b - a for a, b in r) for r in runs]
        self._history[slot] = [h for h in history if h < length] + [length]

    # ------------------------------------------------------------------ rollback of a failed step
    def snapshot(self, slot: int) -> SlotState:
        """The bookkeeping of ``slot`` (its lengths history, tokens held per rank): what
        :meth:`restore` puts back after a turn that failed part-way. Keys and values past the
        restored lengths are never read again, so they need no copy."""
        self._check_slot(slot)
        return list(self._history[slot]), list(self._held[slot]), [list(r) for r in self._runs[slot]]

    def restore(self, slot: int, state: SlotState) -> None:
        """Put back ``slot``'s bookkeeping as :meth:`snapshot` returned it."""
        self._check_slot(slot)
        history, held, runs = state
        self._history[slot], self._held[slot], self._runs[slot] = list(history), list(held), [list(r) for r in runs]
