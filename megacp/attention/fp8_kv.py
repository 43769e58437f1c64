"""Attention over a KV block held in an FP8 KV cache's format, dequantised one key tile at a time.

A prefill chunk late in a long prompt attends over every cached row of its request. Dequantising
the whole block to the compute dtype first would make the chunk's transient grow with the cached
length (at 896K cached tokens of the Llama-3.1-8B shape, 1.75 GiB of bf16 keys and values per
layer). Instead the planned tiles are cut by key range (:func:`~megacp.placement.split_keys`: the
keys every query of a tile sees in pieces of ``tile_rows``, a causal tile's own square whole),
grouped by the key span they read (:func:`~megacp.placement.key_groups`), and each group's span is
dequantised just before its kernel calls and folded into the running (out, LSE) state. A chunk's
transient is then O(chunk + ``tile_rows``) for any cached length, as with an unquantised cache
(whose block is a view of the cache rows).

The FP8 bytes are what travels around the ring (:meth:`FP8KVBlock.wire`), half of bf16's; the
per-request scales are the same on every CP rank and do not travel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from megacp.attention.tile_attention import run_tiles
from megacp.kv_cache import FP8_TILE_ROWS, dequantize_fp8
from megacp.parallel.ring import Block
from megacp.placement import Tile, key_groups, split_keys

KVBlock = Tensor | tuple[Tensor, Tensor]
"""A rank's KV block: ``[2, L, Hkv, D]`` (keys ``[0]``, values ``[1]``), or the pair ``(k, v)`` of
``[L, Hkv, D]`` contiguous tensors when they already are the block (no copy; see
:func:`~megacp.attention.prefill.build_kv_block`)."""


@dataclass(frozen=True)
class FP8KVBlock:
    """A rank's KV block in an FP8 KV cache's format (:mod:`megacp.kv_cache`).

    Attributes:
        data: the block (:data:`KVBlock`) as ``float8_e4m3fn``, ``L`` rows in
            ``plan.kv_layout(rank)`` order.
        scales: ``[B, 2, Hkv]`` fp32 power-of-two scales of each request of the step (K then V),
            the same on every CP rank, so they need not travel with the block.
        owners: ``[N, L]`` int64, the request of each row of rank ``j``'s block (padding rows:
            any; their bytes are zero), :func:`~megacp.attention.prefill.block_owners`.
        dtype: the compute dtype the rows are dequantised to.
        tile_rows: the most rows dequantised at a time (a causal tile's own square and a windowed
            tile are read whole; see :func:`~megacp.placement.split_keys`).
    """

    data: KVBlock
    scales: Tensor
    owners: Tensor
    dtype: torch.dtype
    tile_rows: int = FP8_TILE_ROWS

    def wire(self) -> Block:
        """The block as the ring passes it: ``uint8`` views of :attr:`data` (gloo has no float8)."""
        if isinstance(self.data, tuple):
            return self.data[0].view(torch.uint8), self.data[1].view(torch.uint8)
        return self.data.view(torch.uint8)

    def dequantize(self, block: Block, src: int, k0: int, k1: int) -> tuple[Tensor, Tensor]:
        """Keys and values ``[k1 - k0, Hkv, D]`` in :attr:`dtype`: rows ``[k0, k1)`` of ``block``,
        rank ``src``'s block as stored or received (``float8_e4m3fn`` or ``uint8``, stacked or a pair)."""
        scale = self.scales.index_select(0, self.owners[src, k0:k1])[:, :, :, None]  # [rows, 2, Hkv, 1]
        return (dequantize_fp8(block[0][k0:k1], scale[:, 0], self.dtype),
                dequantize_fp8(block[1][k0:k1], scale[:, 1], self.dtype))

    def attend(self, q: Tensor, block: Block, src: int, tiles: Sequence[Tile], acc: tuple[Tensor, Tensor] | None, *,
               scale: float | None = None, backend: str | None = None) -> tuple[Tensor, Tensor]:
        """:func:`~megacp.attention.tile_attention.run_tiles` of ``q`` ``[Lq, Hq, D]`` over rank
        ``src``'s ``block``, dequantising at most :attr:`tile_rows` rows (or one tile's) at a time.

        Returns the running state ``(out [Lq, Hq, D], lse [Lq, Hq] fp32)``: ``out`` in ``q.dtype``
        when one key group serves every tile, else in fp32 (a sum of partials is kept in fp32 and
        rounded once by the caller, as between ring steps).
        """
        groups = key_groups(split_keys(tiles, self.tile_rows), self.tile_rows)
        if not groups:
            return run_tiles(q, *self.dequantize(block, src, 0, 0), [], acc, scale=scale, backend=backend)
        for i, (k0, k1, group) in enumerate(groups):
            if i and acc is not None and acc[0].dtype != torch.float32:
                acc = (acc[0].float(), acc[1])
            k, v = self.dequantize(block, src, k0, k1)
            shifted = [dataclasses.replace(t, k0=t.k0 - k0, k1=t.k1 - k0) for t in group]
            acc = run_tiles(q, k, v, shifted, acc, scale=scale, backend=backend)
        assert acc is not None  # at least one group ran
        return acc
