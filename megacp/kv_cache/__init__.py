"""The CP-sharded incremental KV cache, in two parts:

* :class:`~megacp.kv_cache.slots.SlotTable` — host bookkeeping without device tensors: slot
  allocation, each request's lengths and the tokens every CP rank holds (placement rules:
  :mod:`megacp.placement`), room checks, step plans, truncation and snapshots;
* :class:`~megacp.kv_cache.storage.KVStorage` — the device tensors (keys, values and, for an FP8
  cache, their scales: :mod:`megacp.kv_cache.fp8`) and the reads and writes a step makes.

:class:`ShardedKVCache` is one rank's cache: a table and a storage of the same slots, side by side
(:attr:`~ShardedKVCache.table`, :attr:`~ShardedKVCache.storage`). The request engine schedules on
the table alone (``check_room``, ``truncate``, ``snapshot``); the steps of :mod:`megacp.layers.step`
plan on the table, read and write the storage (``write``, ``kv``, ``decode_kv``, the static decode
rows) and ``commit`` the table once every layer has written.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megacp.kv_cache.fp8 import (
    FP8,
    FP8_HEADROOM,
    FP8_MAX,
    FP8_TILE_ROWS,
    KV_CACHE_DTYPES,
    AmaxReduce,
    dequantize_fp8,
    fp8_scale,
    kv_cache_format,
    quantize_fp8,
)
from megacp.kv_cache.slots import CacheCapacityError, SlotState, SlotTable
from megacp.kv_cache.storage import KVStorage
from megacp.placement import ShardPlan

__all__ = [
    "FP8", "FP8_HEADROOM", "FP8_MAX", "FP8_TILE_ROWS", "KV_CACHE_DTYPES", "AmaxReduce", "CacheCapacityError",
    "KVStorage", "ShardedKVCache", "SlotState", "SlotTable", "dequantize_fp8", "fp8_scale", "kv_cache_format",
    "quantize_fp8",
]


class ShardedKVCache:
    """This CP rank's shard of the KV cache of every layer: a :class:`SlotTable` (:attr:`table`)
    and a :class:`KVStorage` (:attr:`storage`) of the same slots and capacity. Its methods are the
    table's and the storage's, and the two that join them: :meth:`write` (the table says where a
    slot's new rows go) and :meth:`decode_state`.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (KV heads of this TP rank).
        max_requests: concurrent request slots.
        capacity: tokens per request slot **on this rank** (a request of S tokens needs about
            S/N + 1 per rank with load balancing).
        cp_size, cp_rank: the CP group.
        load_balance: 2N-chunk prefill sharding (default) or contiguous chunks.
        dtype: the compute dtype (what writes take and reads return).
        device: where the storage lives.
        kv_cache_dtype: ``"auto"`` (``dtype``) or ``"fp8_e4m3"`` (:mod:`megacp.kv_cache.fp8`).
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, max_requests: int, capacity: int,
                 cp_size: int = 1, cp_rank: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", load_balance: bool = True, kv_cache_dtype: str = "auto") -> None:
        self.table = SlotTable(max_requests=max_requests, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank,
                               load_balance=load_balance)
        """The slots' bookkeeping (what the request engine schedules on)."""
        self.storage = KVStorage(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 max_requests=max_requests, capacity=capacity, dtype=dtype, device=device,
                                 kv_cache_dtype=kv_cache_dtype)
        """The slots' keys and values (what the steps read and write)."""
        self.capacity, self.cp_size, self.cp_rank = capacity, cp_size, cp_rank
        self.num_layers, self.dtype = num_layers, dtype
        self.kv_cache_dtype, self.quantized = self.storage.kv_cache_dtype, self.storage.quantized
        self.k, self.v, self.scales = self.storage.k, self.storage.v, self.storage.scales
        """The storage's tensors (:class:`KVStorage`)."""

    # ------------------------------------------------------------------ the joins
    def write(self, layer: int, slots: Sequence[int], plan: ShardPlan, k: Tensor, v: Tensor,
              amax_reduce: AmaxReduce | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`KVStorage.write` of a step planned on this cache: each slot's new rows go after
        the rows this rank holds of it."""
        return self.storage.write(layer, slots, plan, k, v, [self.table.local_length(s) for s in slots], amax_reduce)

    def decode_state(self, slots: Sequence[int], device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
        """Device tensors a static decode step starts from, for the requests in ``slots``:
        ``positions [B]`` int64 (each request's next position = its length), ``held [B]`` int32
        (tokens this rank holds) and ``starts [B]`` int64 (row of each slot's first token in
        :meth:`flat_kv`)."""
        table = self.table
        return (torch.tensor([table.length(s) for s in slots], dtype=torch.long, device=device),
                torch.tensor([table.local_length(s) for s in slots], dtype=torch.int32, device=device),
                torch.tensor([s * self.capacity for s in slots], dtype=torch.long, device=device))

    # ------------------------------------------------------------------ the table's side
    def allocate(self) -> int:
        """:meth:`SlotTable.allocate`."""
        return self.table.allocate()

    def free(self, slot: int) -> None:
        """:meth:`SlotTable.free`."""
        self.table.free(slot)

    def history(self, slot: int) -> list[int]:
        """:meth:`SlotTable.history`."""
        return self.table.history(slot)

    def length(self, slot: int) -> int:
        """:meth:`SlotTable.length`."""
        return self.table.length(slot)

    def local_length(self, slot: int, rank: int | None = None) -> int:
        """:meth:`SlotTable.local_length`."""
        return self.table.local_length(slot, rank)

    @property
    def positions(self) -> Tensor:
        """:attr:`SlotTable.positions`."""
        return self.table.positions

    def check_room(self, slot: int, steps: Sequence[int], spare: int = 0) -> None:
        """:meth:`SlotTable.check_room`."""
        self.table.check_room(slot, steps, spare)

    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> ShardPlan:
        """:meth:`SlotTable.plan`."""
        return self.table.plan(slots, new_tokens)

    def commit(self, slots: Sequence[int], plan: ShardPlan) -> None:
        """:meth:`SlotTable.commit`."""
        self.table.commit(slots, plan)

    def advance_decoded(self, slot: int, count: int) -> None:
        """:meth:`SlotTable.advance_decoded`."""
        self.table.advance_decoded(slot, count)

    def truncate(self, slot: int, length: int) -> None:
        """:meth:`SlotTable.truncate`."""
        self.table.truncate(slot, length)

    def snapshot(self, slot: int) -> SlotState:
        """:meth:`SlotTable.snapshot`."""
        return self.table.snapshot(slot)

    def restore(self, slot: int, state: SlotState) -> None:
        """:meth:`SlotTable.restore`."""
        self.table.restore(slot, state)

    # ------------------------------------------------------------------ the storage's side
    @property
    def fp8_tile_rows(self) -> int:
        """:attr:`KVStorage.fp8_tile_rows` (settable)."""
        return self.storage.fp8_tile_rows

    @fp8_tile_rows.setter
    def fp8_tile_rows(self, rows: int) -> None:
        self.storage.fp8_tile_rows = rows

    def stored_kv(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """:meth:`KVStorage.stored_kv`."""
        return self.storage.stored_kv(layer, slot, length)

    def step_scales(self, layer: int, slots: Sequence[int]) -> Tensor:
        """:meth:`KVStorage.step_scales`."""
        return self.storage.step_scales(layer, slots)

    def kv(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """:meth:`KVStorage.kv`."""
        return self.storage.kv(layer, slot, length)

    def decode_kv(self, layer: int, slots: Sequence[int],
                  lengths: Sequence[int]) -> tuple[Tensor, Tensor] | list[tuple[Tensor, Tensor]]:
        """:meth:`KVStorage.decode_kv`."""
        return self.storage.decode_kv(layer, slots, lengths)

    def flat_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """:meth:`KVStorage.flat_kv`."""
        return self.storage.flat_kv(layer)

    def write_rows(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """:meth:`KVStorage.write_rows`."""
        self.storage.write_rows(layer, rows, k, v)

    def stored_rows(self, layer: int, starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`KVStorage.stored_rows`."""
        return self.storage.stored_rows(layer, starts)

    def static_rows(self, layer: int, starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`KVStorage.static_rows`."""
        return self.storage.static_rows(layer, starts)
