"""Attention over an FP8 KV block one key tile at a time (:mod:`megacp.attention.blocks`).

* the key splitting (:func:`~megacp.placement.split_keys`, :func:`~megacp.placement.key_groups`)
  keeps every tile's mask: attention over the split tiles equals attention over the planned tiles,
  and both equal a masked fp32 reference computed here;
* a prefill chunk over an FP8 block (pass-KV and pass-Q) equals attention over the block
  dequantised whole (fp32, 1e-6), and its largest allocation (torch's CPU profiler) is the same
  with 2x and 8x the cached history: the transient does not grow with the cached length, while
  the whole block's dequantised keys alone are larger than it at 8x.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megacp.attention.blocks import FP8KVBlock
from megacp.attention.kernels.tile_attention import run_tiles
from megacp.attention.pass_kv import ring_pass_kv
from megacp.attention.pass_q import ring_pass_q
from megacp.kv_cache import dequantize_fp8, fp8_scale, quantize_fp8
from megacp.placement import ShardPlan, Tile, key_groups, split_keys

HQ, HKV, D = 4, 2, 16


def _masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[Tile]) -> torch.Tensor:
    """fp32 softmax attention with the union of the tiles' masks (bottom-right causal, ``left`` bands)."""
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for t in tiles:
        nq, nk = t.q1 - t.q0, t.k1 - t.k0
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        ok = j <= i + (nk - nq) if t.causal else torch.ones(nq, nk, dtype=torch.bool)
        if t.left is not None:
            ok &= j >= i + (nk - nq) - t.left
        allowed[t.q0:t.q1, t.k0:t.k1] |= ok
    kk = k.repeat_interleave(HQ // HKV, dim=1)
    vv = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / D**0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1).nan_to_num(0.0), vv)


TILE_SETS = {
    "chunk after a cached prefix": [Tile(0, 16, 0, 100, True)],
    "dense": [Tile(0, 8, 0, 70, False)],
    "packed documents": [Tile(0, 4, 0, 4, True), Tile(4, 10, 4, 10, True), Tile(10, 16, 10, 40, True)],
    "windowed stays whole": [Tile(0, 16, 0, 60, True, left=20)],
    "more queries than keys": [Tile(0, 16, 0, 12, True)],
}


@pytest.mark.parametrize("name", sorted(TILE_SETS))
def test_split_tiles_keep_the_mask(name: str) -> None:
    tiles = TILE_SETS[name]
    g = torch.Generator().manual_seed(0)
    lk = max(t.k1 for t in tiles)
    q, k, v = (torch.randn(n, h, D, generator=g) for n, h in ((16, HQ), (lk, HKV), (lk, HKV)))
    split = split_keys(tiles, 8)
    if name == "windowed stays whole":
        assert split == tiles
    else:
        assert max(t.k1 - t.k0 for t in split) <= max([8] + [t.q1 - t.q0 for t in tiles if t.causal])
    ref = _masked_reference(q, k, v, tiles)
    for cut in (tiles, split):
        out, _ = run_tiles(q, k, v, cut, None)
        rows = sorted({r for t in tiles for r in range(t.q0, t.q1)})
        torch.testing.assert_close(out[rows], ref[rows], rtol=1e-5, atol=1e-6)
    for k0, k1, group in key_groups(split, 8):
        assert all(k0 <= t.k0 and t.k1 <= k1 for t in group)
        assert k1 - k0 <= 8 or len(group) == 1


def _fp8_chunk(history: int, chunk: int, tile_rows: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """A chunk of ``chunk`` queries after ``history`` cached tokens of one request, CP = 1: the
    plan, the queries, the FP8 block and the block dequantised whole (fp32)."""
    g = torch.Generator().manual_seed(seed)
    plan = ShardPlan([history], [chunk], 1, 0, prefix_counts=[[history]])
    rows = plan.max_kv_block
    k, v = torch.randn(rows, HKV, D, generator=g), torch.randn(rows, HKV, D, generator=g)
    scales = torch.stack([fp8_scale(k.abs().amax((0, 2))), fp8_scale(v.abs().amax((0, 2)))])[None]  # [1, 2, Hkv]
    k8, v8 = quantize_fp8(k, scales[0, 0, :, None]), quantize_fp8(v, scales[0, 1, :, None])
    whole = dequantize_fp8(k8, scales[0, 0, :, None], torch.float32), dequantize_fp8(v8, scales[0, 1, :, None], torch.float32)
    block = FP8KVBlock((k8, v8), scales, torch.zeros(1, rows, dtype=torch.long), torch.float32, tile_rows)
    return plan, torch.randn(chunk, HQ, D, generator=g), block, whole


def _largest_allocation(fn) -> int:  # type: ignore[no-untyped-def]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("ring", [ring_pass_kv, ring_pass_q], ids=["pass_kv", "pass_q"])
def test_fp8_chunk_equals_the_whole_block_and_its_transient_does_not_grow(ring) -> None:  # type: ignore[no-untyped-def]
    # 8K and 32K cached tokens (32 and 128 tiles): the profiler's per-op events, not the attention, are
    # the test's cost; the whole block's keys at 8x (4 MiB) stay 16x the 256 KiB tile transient
    chunk, tile_rows, base = 64, 256, 4096
    largest = {}
    for times in (2, 8):
        plan, q, block, whole = _fp8_chunk(times * base, chunk, tile_rows)
        out, lse = ring(q, block, plan, None)
        ref_out, ref_lse = run_tiles(q, *whole, plan.tiles(0, 0), None)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
        assert out.dtype == q.dtype
        largest[times] = _largest_allocation(lambda: ring(q, block, plan, None))  # noqa: B023  # called at once
        whole_bytes = whole[0].numel() * whole[0].element_size()
    assert largest[2] == largest[8], largest
    assert largest[8] < whole_bytes / 4, (largest, whole_bytes)
