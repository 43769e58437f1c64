"""The sharding plan of one batch step: per-rank position ranges, buffer layouts, local indices
and the tiles (kernel calls) between any two ranks' blocks. Identical on every rank; no
communication."""

from __future__ import annotations

import copy
from functools import cached_property
from typing import Callable, Sequence, TypeVar, cast

import torch
from torch import Tensor

from megacp.placement.layout import SeqLayout, pack_layouts
from megacp.placement.sharding import Range, shard_ranges
from megacp.placement.tiles import Tile, plan_tiles, restrict_rows

_T = TypeVar("_T")


class ShardPlan:
    """The sharding of one batch step over N CP ranks, identical on every rank.

    Args:
        cached: per request, tokens already in its KV cache (P_i; the new tokens start there).
        new: per request, new tokens of this step (T_i).
        cp_size, rank: N and this rank.
        prefix_counts: ``prefix_counts[j][i]`` = cached tokens of request i held by rank j
            (from the KV cache's bookkeeping); ``None`` means no cache (all zeros; then ``cached``
            only shifts positions).
        load_balance: 2N-chunk load balancing (default) or N contiguous chunks.
        cached_runs: ``cached_runs[j][i]``, the position runs ``[a, b)`` of request ``i``'s cached
            tokens rank ``j`` holds, in its cache order (the KV cache's
            slot table, :class:`~megacp.kv_cache.slots.SlotTable`); they place the cached
            tokens, which a windowed plan over a cache needs (``None``: no positions for cached tokens).
        window: sliding window of the attention the tiles serve (a query at position ``x`` sees the
            keys at ``x - window + 1 .. x``); ``None``: full causal. :meth:`with_window` gives a
            layer's windowed plan of the same step.

    The new tokens are given packed: request after request, ``sum(new)`` tokens ("thd").
    A rank's local buffer holds its new tokens of each request in request order, in position order.
    """

    def __init__(
        self,
        cached: Sequence[int],
        new: Sequence[int],
        cp_size: int,
        rank: int,
        *,
        prefix_counts: Sequence[Sequence[int]] | None = None,
        load_balance: bool = True,
        cached_runs: Sequence[Sequence[Sequence[Range]]] | None = None,
        window: int | None = None,
    ) -> None:
        if len(cached) != len(new):
            raise ValueError(f"cached ({len(cached)}) and new ({len(new)}) must list the same requests")
        if not 0 <= rank < cp_size:
            raise ValueError(f"rank {rank} outside CP group of size {cp_size}")
        if any(t < 1 for t in new) or any(p < 0 for p in cached):
            raise ValueError(f"every request needs new >= 1 and cached >= 0; got new={list(new)}, cached={list(cached)}")
        self.cached = [int(p) for p in cached]
        self.new = [int(t) for t in new]
        self.cp_size, self.rank, self.load_balance = cp_size, rank, load_balance
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must hold at least 1 key, got {window}")
        self.window = window
        if cached_runs is not None and (len(cached_runs) != cp_size or any(len(r) != len(new) for r in cached_runs)):
            raise ValueError("cached_runs must be [cp_size][num_requests] lists of position runs")
        self.cached_runs = cached_runs
        if prefix_counts is None:
            prefix_counts = [[0] * len(new) for _ in range(cp_size)]
        elif len(prefix_counts) != cp_size or any(len(row) != len(new) for row in prefix_counts):
            raise ValueError("prefix_counts must be [cp_size][num_requests]")
        elif any(x < 0 for row in prefix_counts for x in row) or any(
                sum(row[i] for row in prefix_counts) != p for i, p in enumerate(self.cached)):
            raise ValueError(f"prefix_counts must be >= 0 and sum over the ranks to each request's cached "
                             f"tokens {self.cached}; got {[list(row) for row in prefix_counts]}")
        self.prefix_counts = [[int(x) for x in row] for row in prefix_counts]
        self._cache: dict[tuple, object] = {}
        self.ranges = [
            [shard_ranges(p, t, cp_size, j, load_balance=load_balance) for p, t in zip(self.cached, self.new)]
            for j in range(cp_size)
        ]

    def with_window(self, window: int | None) -> "ShardPlan":
        """This step's plan for an attention of sliding ``window`` (``None``: full causal): the same
        sharding, tiles planned for the window (once per window, shared by the layers that use it).
        A window at least as long as every request's context is full causal attention (``self``
        without a window)."""
        if window is not None and window >= max(p + t for p, t in zip(self.cached, self.new)):
            window = None
        if window == self.window:
            return self

        def make() -> "ShardPlan":
            plan = copy.copy(self)
            plan.window, plan._cache = window, {}
            return plan

        return self._memo(("window", window), make)

    @property
    def num_requests(self) -> int:
        return len(self.new)

    @property
    def is_decode(self) -> bool:
        """Every request adds exactly one token."""
        return all(t == 1 for t in self.new)

    def q_layout(self, rank: int) -> list[SeqLayout]:
        """Layout of ``rank``'s local new tokens (queries); computed once per plan."""
        return self._memo(("q", rank), lambda: pack_layouts([0] * self.num_requests, self.ranges[rank]))

    def kv_layout(self, rank: int) -> list[SeqLayout]:
        """Layout of ``rank``'s KV block: per request, its cached tokens then its new tokens."""
        return self._memo(("kv", rank), lambda: pack_layouts(self.prefix_counts[rank], self.ranges[rank]))

    def _memo(self, key: tuple, make: Callable[[], _T]) -> _T:
        """The plan is immutable and every layer asks the same questions: answer each once."""
        if key not in self._cache:
            self._cache[key] = make()
        return cast(_T, self._cache[key])

    def num_local(self, rank: int | None = None) -> int:
        """New tokens held by ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        return sum(b - a for rs in self.ranges[r] for a, b in rs)

    @cached_property
    def max_local(self) -> int:
        return max(self.num_local(j) for j in range(self.cp_size))

    @cached_property
    def max_kv_block(self) -> int:
        """Tokens in the largest KV block (the pass-KV message size: max over ranks of cache + new)."""
        return max(sum(self.prefix_counts[j]) + self.num_local(j) for j in range(self.cp_size))

    @cached_property
    def has_cached_kv(self) -> bool:
        """Some rank holds cached tokens of some request (``prefix_counts`` not all zero)."""
        return any(any(row) for row in self.prefix_counts)

    @cached_property
    def kv_blocks_unpadded(self) -> bool:
        """Every rank's KV block is just its new tokens, all blocks of one length (no cached tokens,
        no padding): the local keys and values can travel as they are."""
        return not self.has_cached_kv and all(self.num_local(j) == self.max_kv_block for j in range(self.cp_size))

    def kv_rows_read(self, q_rank: int, kv_rank: int) -> int:
        """Leading rows of ``kv_rank``'s KV block that ``q_rank``'s queries read (0: none). With the
        load-balanced layout a later rank reads only the first chunk of an earlier rank's block."""
        return self._memo(("rows", q_rank, kv_rank), lambda: max((t.k1 for t in self.tiles(q_rank, kv_rank)), default=0))

    def tiles(self, q_rank: int, kv_rank: int, rows: tuple[int, int] | None = None) -> list[Tile]:
        """Kernel calls for ``q_rank``'s queries over ``kv_rank``'s KV block; computed once per plan
        and reused by every layer. ``rows``: only the queries of local rows ``[a, b)``, renumbered
        from ``a`` (:func:`~megacp.placement.tiles.restrict_rows`; a query tile of a training layer)."""
        if rows is not None:
            return self._memo(("tiles", q_rank, kv_rank, rows), lambda: restrict_rows(self.tiles(q_rank, kv_rank), *rows))
        return self._memo(("tiles", q_rank, kv_rank), lambda: plan_tiles(
            self.q_layout(q_rank), self.kv_layout(kv_rank), self.window,
            self.prefix_runs(kv_rank) if self.window is not None and self.has_cached_kv else None))

    def prefix_runs(self, rank: int) -> Sequence[Sequence[Range]] | None:
        """Per request, the position runs ``[a, b)`` of the cached tokens ``rank`` holds, in its
        cache order (:attr:`cached_runs`; ``None`` without them)."""
        return None if self.cached_runs is None else self.cached_runs[rank]

    def local_index(self, rank: int | None = None) -> Tensor:
        """Indices into the packed new tokens of ``rank``'s local tokens (LongTensor ``[n_local]``)."""
        r = self.rank if rank is None else rank
        return self._memo(("index", r), lambda: self._local_index(r))

    def _local_index(self, r: int) -> Tensor:
        starts = [0]
        for t in self.new[:-1]:
            starts.append(starts[-1] + t)
        idx = [s - p + x for s, p, rs in zip(starts, self.cached, self.ranges[r]) for a, b in rs for x in range(a, b)]
        return torch.tensor(idx, dtype=torch.long)

    def local_positions(self, rank: int | None = None) -> Tensor:
        """Global position of each of ``rank``'s local tokens (LongTensor ``[n_local]``)."""
        r = self.rank if rank is None else rank
        return torch.tensor([x for rs in self.ranges[r] for a, b in rs for x in range(a, b)], dtype=torch.long)

    def local_cu_seqlens(self, rank: int | None = None) -> Tensor:
        """int32 ``[B+1]`` prefix sums of ``rank``'s local tokens per request."""
        r = self.rank if rank is None else rank
        counts = [sum(b - a for a, b in rs) for rs in self.ranges[r]]
        return torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
