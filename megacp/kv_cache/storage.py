"""The KV cache's device storage: every layer's keys and values of this CP rank's tokens of each
request slot (gpt-fast style: static preallocated buffers of fixed shape, CUDA-graph friendly), the
FP8 scales (:mod:`megacp.kv_cache.fp8`), and the reads and writes the steps of
:mod:`megacp.layers.step` make. Which rows are filled is the slot table's business
(:class:`~megacp.kv_cache.slots.SlotTable`): writes are told where a slot's new rows go, reads how
many rows to read.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from megacp.kv_cache.fp8 import (
    FP8,
    FP8_TILE_ROWS,
    AmaxReduce,
    dequantize_fp8,
    fp8_scale,
    kv_cache_format,
    quantize_fp8,
)
from megacp.placement import ShardPlan


def available_bytes(device: torch.device | str) -> int:
    """Bytes new tensors on ``device`` can take now: on CUDA its free memory plus what torch's
    allocator holds unused; elsewhere the host's available memory (``MemAvailable``; its total
    memory where that is unreadable)."""
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def storage_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, max_requests: int, capacity: int,
                  dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of the tensors a :class:`KVStorage` of these arguments allocates (keys, values and,
    FP8 only, the scales)."""
    quantized = kv_cache_format(kv_cache_dtype, dtype) == "fp8_e4m3"
    rows = num_layers * max_requests * capacity * num_kv_heads * head_dim
    scales = num_layers * max_requests * 2 * num_kv_heads * 4 if quantized else 0
    return 2 * rows * (1 if quantized else dtype.itemsize) + scales


class KVStorage:
    """Keys and values of every layer for ``max_requests`` slots of ``capacity`` rows on this rank.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (KV heads of this TP rank).
        max_requests, capacity: slots, and rows per slot on this rank.
        dtype: the compute dtype (what writes take and reads return).
        device: where the tensors live.
        kv_cache_dtype: the storage (:func:`~megacp.kv_cache.fp8.kv_cache_format`): ``"auto"``
            (``dtype``) or ``"fp8_e4m3"``.

    Tensors: ``k``/``v`` ``[num_layers, max_requests, capacity, num_kv_heads, head_dim]`` (``dtype``,
    or ``float8_e4m3fn``) and ``scales`` ``[num_layers, max_requests, 2, num_kv_heads]`` fp32 (K then
    V; FP8 only, else ``None``); slot ``s``'s rows hold this rank's tokens of its request in position order.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, max_requests: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto") -> None:
        if num_layers < 1:
            raise ValueError(f"ShardedKVCache num_layers must be >= 1, got {num_layers}")
        self.num_layers, self.capacity = num_layers, capacity
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_format(kv_cache_dtype, dtype)
        self.quantized = self.kv_cache_dtype == "fp8_e4m3"
        shape = (num_layers, max_requests, capacity, num_kv_heads, head_dim)
        store = FP8 if self.quantized else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.scales = (torch.ones((num_layers, max_requests, 2, num_kv_heads), dtype=torch.float32, device=device)
                       if self.quantized else None)
        self.fp8_tile_rows = FP8_TILE_ROWS
        """Rows of a KV block a prefill over this (FP8) storage dequantises at a time."""

    def write(self, layer: int, slots: Sequence[int], plan: ShardPlan, k: Tensor, v: Tensor, filled: Sequence[int],
              amax_reduce: AmaxReduce | None = None) -> tuple[Tensor, Tensor]:
        """Store this rank's new keys/values of a planned step for ``layer``.

        Args:
            k, v: ``[plan.num_local(), Hkv, D]`` in ``plan.q_layout(plan.rank)`` order, in :attr:`dtype`.
            filled: the rows this rank already holds of each slot (the new rows go after them).
            amax_reduce: FP8 only, needed under CP > 1 when a request makes its first step (it fixes
                the request's scales from the step's largest magnitudes on all ranks: every rank
                calls it, with ``[requests, 2, Hkv]`` fp32).

        Returns:
            ``(k, v)`` as stored (``float8_e4m3fn`` in an FP8 cache, else the inputs).
        """
        want = (plan.num_local(), *self.k.shape[3:])
        if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(
                f"KV cache write expects k and v of shape {want} and dtype {self.dtype}; got "
                f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        lays = plan.q_layout(plan.rank)
        if self.quantized:
            k, v = self._quantize(layer, slots, plan, k, v, amax_reduce)
        for s, start, lay in zip(slots, filled, lays):
            n = lay.num_new
            if n:
                self.k[layer, s, start : start + n] = k[lay.offset : lay.offset + n]
                self.v[layer, s, start : start + n] = v[lay.offset : lay.offset + n]
        return k, v

    def _quantize(self, layer: int, slots: Sequence[int], plan: ShardPlan, k: Tensor, v: Tensor,
                  amax_reduce: AmaxReduce | None) -> tuple[Tensor, Tensor]:
        """``k``, ``v`` of :meth:`write` in FP8, each request's rows with its slot's scales (fixed
        first for the requests that make their first step)."""
        assert self.scales is not None  # an FP8 cache
        lays = plan.q_layout(plan.rank)
        first = [i for i in range(plan.num_requests) if plan.cached[i] == 0]
        if first:
            if amax_reduce is None and plan.cp_size > 1:
                raise ValueError("an FP8 KV cache under CP > 1 fixes a request's scales over all CP ranks: "
                                 "its first step's write needs amax_reduce")
            amax = torch.zeros((len(first), 2, self.k.shape[3]), dtype=torch.float32, device=k.device)
            for j, i in enumerate(first):
                a, b = lays[i].offset, lays[i].offset + lays[i].num_new
                if b > a:
                    amax[j, 0] = k[a:b].abs().amax(dim=(0, 2)).float()
                    amax[j, 1] = v[a:b].abs().amax(dim=(0, 2)).float()
            if amax_reduce is not None:
                amax = amax_reduce(amax)
            self.scales[layer, [slots[i] for i in first]] = fp8_scale(amax)
        k8, v8 = torch.empty_like(k, dtype=FP8), torch.empty_like(v, dtype=FP8)
        for s, lay in zip(slots, lays):
            a, b = lay.offset, lay.offset + lay.num_new
            if b > a:
                k8[a:b] = quantize_fp8(k[a:b], self.scales[layer, s, 0, :, None])
                v8[a:b] = quantize_fp8(v[a:b], self.scales[layer, s, 1, :, None])
        return k8, v8

    def stored_kv(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Views ``[length, Hkv, D]`` of the first ``length`` tokens this rank holds of ``slot``,
        as stored (``float8_e4m3fn`` in an FP8 cache)."""
        return self.k[layer, slot, :length], self.v[layer, slot, :length]

    def step_scales(self, layer: int, slots: Sequence[int]) -> Tensor:
        """``[len(slots), 2, Hkv]`` fp32: the FP8 scales of ``layer`` for the requests in ``slots``
        (K then V), the same on every CP rank."""
        if self.scales is None:
            raise ValueError("a KV cache that is not FP8 has no scales")
        return self.scales[layer, list(slots)]

    def kv(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """``[length, Hkv, D]`` in :attr:`dtype`: the first ``length`` tokens this rank holds of
        ``slot`` (views; dequantised copies in an FP8 cache)."""
        k, v = self.stored_kv(layer, slot, length)
        if self.scales is None:
            return k, v
        scale = self.scales[layer, slot, :, :, None]  # [2, Hkv, 1]
        return dequantize_fp8(k, scale[0], self.dtype), dequantize_fp8(v, scale[1], self.dtype)

    def decode_kv(self, layer: int, slots: Sequence[int], lengths: Sequence[int]) -> tuple[Tensor, Tensor] | list[tuple[Tensor, Tensor]]:
        """What a decode step attends over for ``layer``: the first ``lengths[i]`` tokens this rank
        holds of ``slots[i]``, in :attr:`dtype`. Consecutive slots of equal lengths come as one pair
        ``[B, length, Hkv, D]`` (views, no copy; one dequantised copy in an FP8 cache), others as a
        list of :meth:`kv` pairs."""
        s0 = slots[0]
        if len(set(lengths)) == 1 and list(slots) == list(range(s0, s0 + len(slots))):
            end = s0 + len(slots)
            k, v = self.k[layer, s0:end, : lengths[0]], self.v[layer, s0:end, : lengths[0]]
            if self.scales is None:
                return k, v
            scale = self.scales[layer, s0:end, :, None, :, None]  # [B, 2, 1, Hkv, 1]
            return dequantize_fp8(k, scale[:, 0], self.dtype), dequantize_fp8(v, scale[:, 1], self.dtype)
        return [self.kv(layer, s, n) for s, n in zip(slots, lengths)]

    def flat_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Views ``[max_requests * capacity, Hkv, D]`` of ``layer``'s keys and values as stored:
        slot ``s``'s row ``j`` is row ``s * capacity + j`` (a static decode step indexes rows on the
        device)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write_rows(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Write ``k``/``v`` ``[B, Hkv, D]`` (:attr:`dtype`) at device-held ``rows [B]`` (int64) of
        :meth:`flat_kv`, quantised with each row's slot's scales in an FP8 cache (fixed by the
        request's first step, a prefill) (no host synchronisation: a CUDA graph replays it)."""
        kf, vf = self.flat_kv(layer)
        if self.scales is not None:
            scale = self.scales[layer].index_select(0, torch.div(rows, self.capacity, rounding_mode="floor"))
            k = quantize_fp8(k, scale[:, 0, :, None]).view(torch.uint8)
            v = quantize_fp8(v, scale[:, 1, :, None]).view(torch.uint8)
            kf, vf = kf.view(torch.uint8), vf.view(torch.uint8)  # index_copy_ has no float8 kernel
        kf.index_copy_(0, rows, k)
        vf.index_copy_(0, rows, v)

    def stored_rows(self, layer: int, starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """An FP8 cache's rows as stored, for a decode kernel that reads them so
        (:mod:`~megacp.attention.kernels.fp8_decode_kernel`): ``(k, v, scales)``, the :meth:`flat_kv` views
        and the ``[B, 2, Hkv]`` fp32 scales of the requests whose first rows are ``starts [B]``
        (int64). No host synchronisation."""
        if self.scales is None:
            raise ValueError("a KV cache that is not FP8 has no scales")
        kf, vf = self.flat_kv(layer)
        return kf, vf, self.scales[layer].index_select(0, torch.div(starts, self.capacity, rounding_mode="floor"))

    def static_rows(self, layer: int, starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What a static decode step attends over for ``layer``, for the requests whose first rows
        of :meth:`flat_kv` are ``starts [B]`` (int64): ``(k, v, starts)``, where request ``b``'s rows
        are ``k[starts[b] : starts[b] + capacity]`` in :attr:`dtype`. The flat views themselves, or
        in an FP8 cache each request's ``capacity`` rows gathered and dequantised (``[B * capacity,
        Hkv, D]``, ``starts = b * capacity``). No host synchronisation."""
        kf, vf = self.flat_kv(layer)
        if self.scales is None:
            return kf, vf, starts
        b, c = starts.shape[0], self.capacity
        rows = (starts.unsqueeze(1) + torch.arange(c, device=starts.device)).flatten()
        scale = self.scales[layer].index_select(0, torch.div(starts, c, rounding_mode="floor"))[:, :, None, :, None]
        k, v = (dequantize_fp8(t.view(torch.uint8).index_select(0, rows).view(b, c, *t.shape[1:]), scale[:, i], self.dtype)
                for i, t in enumerate((kf, vf)))  # scale[:, i]: [B, 1, Hkv, 1]
        return k.flatten(0, 1), v.flatten(0, 1), torch.arange(b, dtype=starts.dtype, device=starts.device) * c
