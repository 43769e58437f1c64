"""The KV blocks the ring algorithms pass and attend over, and the check that a ring fits a plan.

A rank's KV block holds, per request of the step, the cached tokens it holds and then its share of
the new tokens, in ``plan.kv_layout(rank)`` order, padded to ``plan.max_kv_block`` rows so that every
hop of pass-KV has one size (:func:`build_kv_block`). Pass-KV (:mod:`~megacp.attention.pass_kv`),
pass-Q (:mod:`~megacp.attention.pass_q`) and the training ring (:mod:`~megacp.attention.training`)
share these types and :func:`check_ring`.

With an FP8 KV cache the block is an :class:`FP8KVBlock`. A prefill chunk late in a long prompt
attends over every cached row of its request; dequantising the whole block to the compute dtype
first would make the chunk's transient grow with the cached length (at 896K cached tokens of the
Llama-3.1-8B shape, 1.75 GiB of bf16 keys and values per layer). Instead the planned tiles are cut
by key range (:func:`~megacp.placement.split_keys`: the keys every query of a tile sees in pieces of
``tile_rows``, a causal tile's own square whole), grouped by the key span they read
(:func:`~megacp.placement.key_groups`), and each group's span is dequantised just before its kernel
calls and folded into the running (out, LSE) state. A chunk's transient is then O(chunk +
``tile_rows``) for any cached length, as with an unquantised cache (whose block is a view of the
cache rows). The FP8 bytes are what travels around the ring (:meth:`FP8KVBlock.wire`), half of
bf16's; the per-request scales are the same on every CP rank and do not travel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from megacp.attention.kernels.tile_attention import run_tiles
from megacp.kv_cache import FP8_TILE_ROWS, dequantize_fp8
from megacp.parallel.ring import Block, Ring
from megacp.placement import ShardPlan, Tile, key_groups, split_keys

KVBlock = Tensor | tuple[Tensor, Tensor]
"""A rank's KV block: ``[2, L, Hkv, D]`` (keys ``[0]``, values ``[1]``), or the pair ``(k, v)`` of
``[L, Hkv, D]`` contiguous tensors when they already are the block (no copy; see
:func:`build_kv_block`)."""


@dataclass(frozen=True)
class FP8KVBlock:
    """A rank's KV block in an FP8 KV cache's format (:mod:`megacp.kv_cache`).

    Attributes:
        data: the block (:data:`KVBlock`) as ``float8_e4m3fn``, ``L`` rows in
            ``plan.kv_layout(rank)`` order.
        scales: ``[B, 2, Hkv]`` fp32 power-of-two scales of each request of the step (K then V),
            the same on every CP rank, so they need not travel with the block.
        owners: ``[N, L]`` int64, the request of each row of rank ``j``'s block (padding rows:
            any; their bytes are zero), :func:`block_owners`.
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
        """:func:`~megacp.attention.kernels.tile_attention.run_tiles` of ``q`` ``[Lq, Hq, D]`` over rank
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


def build_kv_block(
    plan: ShardPlan,
    k: Tensor,
    v: Tensor,
    cached: Callable[[int], tuple[Tensor, Tensor]] | None = None,
) -> KVBlock:
    """This rank's KV block (``plan.max_kv_block`` rows in ``plan.kv_layout(rank)`` order).

    When the blocks are just the ranks' new tokens (:attr:`ShardPlan.kv_blocks_unpadded`: no cached
    tokens, every rank as many tokens, as with one sequence split evenly) the pair ``(k, v)`` is the
    block and nothing is copied (unless they are not contiguous). Otherwise a new
    ``[2, plan.max_kv_block, Hkv, D]`` tensor (zero padding at the end). The form depends on the plan
    only, so every rank of the ring passes blocks of the same form.

    Args:
        k, v: ``[n_local, Hkv, D]`` this rank's new keys/values (``plan.q_layout`` order).
        cached: ``cached(i) -> (k_i, v_i)`` each ``[prefix_i, Hkv, D]``, this rank's cached tokens of
            request ``i`` (required when the plan has cached tokens on this rank).
    """
    if k.shape[0] != plan.num_local() or v.shape != k.shape:
        raise ValueError(f"k and v must hold this rank's {plan.num_local()} new tokens; got {tuple(k.shape)}, {tuple(v.shape)}")
    if plan.kv_blocks_unpadded:
        return k.contiguous(), v.contiguous()
    kv_lay, q_lay = plan.kv_layout(plan.rank), plan.q_layout(plan.rank)
    block = k.new_zeros((2, plan.max_kv_block, *k.shape[1:]))
    if not any(lay.prefix for lay in kv_lay):
        block[0, : k.shape[0]] = k
        block[1, : v.shape[0]] = v
        return block
    if cached is None:
        raise ValueError("the plan has cached tokens on this rank but no cache was given")
    for i, (kl, ql) in enumerate(zip(kv_lay, q_lay)):
        if kl.prefix:
            ck, cv = cached(i)
            block[0, kl.offset : kl.offset + kl.prefix] = ck
            block[1, kl.offset : kl.offset + kl.prefix] = cv
        a, b = kl.offset + kl.prefix, kl.offset + kl.length
        block[0, a:b] = k[ql.offset : ql.offset + ql.num_new]
        block[1, a:b] = v[ql.offset : ql.offset + ql.num_new]
    return block


def block_owners(plan: ShardPlan) -> Tensor:
    """``[N, plan.max_kv_block]`` int64 (CPU): the request of each row of each rank's KV block
    (:meth:`ShardPlan.kv_layout`; padding rows: 0), what :class:`FP8KVBlock` dequantises by."""
    out = torch.zeros((plan.cp_size, plan.max_kv_block), dtype=torch.long)
    for j in range(plan.cp_size):
        for i, lay in enumerate(plan.kv_layout(j)):
            out[j, lay.offset : lay.offset + lay.length] = i
    return out


def check_ring(plan: ShardPlan, ring: Ring | None) -> None:
    """Raise ``ValueError`` unless ``ring`` fits ``plan``: a ring of ``plan.cp_size`` ranks, or
    ``None`` for CP = 1 (a missing ring would otherwise compute only the own block's share)."""
    if plan.cp_size > 1 and ring is None:
        raise ValueError(f"CP size {plan.cp_size} needs a ring (process group)")
    if ring is not None and ring.size != plan.cp_size:
        raise ValueError(f"plan is for CP size {plan.cp_size} but the group has {ring.size} ranks")
