"""The CP-sharded incremental KV cache, in two parts:

* :class:`~megacp.kv_cache.slots.SlotTable` — host bookkeeping without device tensors: slot
  allocation, each request's lengths and the tokens every CP rank holds (placement rules:
  :mod:`megacp.placement`), room checks, step plans, truncation and snapshots;
* :class:`~megacp.kv_cache.storage.KVStorage` — the device tensors (keys, values and, for an FP8
  cache, their scales: :mod:`megacp.kv_cache.fp8`) and the reads and writes a step makes.

:class:`ShardedKVCache` is one rank's cache: both together, the table telling the storage where a
slot's new rows go. Entry points call the table's side (``allocate``, ``check_room``, ``plan``,
``truncate``, ``snapshot``); the steps of :mod:`megacp.layers.step` call the storage's (``write``,
``kv``, ``decode_kv``, the static decode rows) and ``commit`` once every layer has written.
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


class ShardedKVCache(SlotTable, KVStorage):
    """This CP rank's shard of the KV cache of every layer: a :class:`SlotTable` over a
    :class:`KVStorage` of the same slots and capacity.

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
        SlotTable.__init__(self, max_requests=max_requests, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank,
                           load_balance=load_balance)
        KVStorage.__init__(self, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           max_requests=max_requests, capacity=capacity, dtype=dtype, device=device,
                           kv_cache_dtype=kv_cache_dtype)

    def write(self, layer: int, slots: Sequence[int], plan: ShardPlan, k: Tensor, v: Tensor,  # type: ignore[override]
              amax_reduce: AmaxReduce | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`KVStorage.write` of a step planned on this cache: each slot's new rows go after
        the rows this rank holds of it."""
        return KVStorage.write(self, layer, slots, plan, k, v, [self.local_length(s) for s in slots], amax_reduce)

    def decode_state(self, slots: Sequence[int], device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
        """Device tensors a static decode step starts from, for the requests in ``slots``:
        ``positions [B]`` int64 (each request's next position = its length), ``held [B]`` int32
        (tokens this rank holds) and ``starts [B]`` int64 (row of each slot's first token in
        :meth:`flat_kv`)."""
        return (torch.tensor([self.length(s) for s in slots], dtype=torch.long, device=device),
                torch.tensor([self.local_length(s) for s in slots], dtype=torch.int32, device=device),
                torch.tensor([s * self.capacity for s in slots], dtype=torch.long, device=device))
