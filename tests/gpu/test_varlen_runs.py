"""Packed documents through one FlashAttention-2 varlen call per run of tiles
(:mod:`megacp.attention.kernels.varlen`), forward and the training backward, against the exact fp32
reference of each document alone, on a CUDA GPU (skips without one: the CI machine)."""

from __future__ import annotations

import pytest
import torch

from megacp.attention.kernels import partial as pa
from megacp.attention.kernels import partial_backward as pb
from megacp.attention.kernels.tile_attention import run_tiles
from megacp.attention.kernels.varlen import TileRun, tile_runs
from megacp.attention.training import accumulate, block_gradients
from megacp.placement import ShardPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-2)).item()


@pytest.mark.parametrize("heads, kv_heads, dim, backend", [(9, 3, 64, "auto"), (32, 8, 128, "auto"), (8, 2, 128, "flash")])
def test_packed_documents_in_one_call_equal_each_document_alone(heads: int, kv_heads: int, dim: int,
                                                                 backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [int(x) for x in torch.randint(1, 700, (23,), generator=gen)] + [3000, 1, 129]
    plan = ShardPlan([0] * len(lens), lens, 1, 0)
    tiles = plan.tiles(0, 0)
    n = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    units = tile_runs(tiles, backend, q)
    assert any(isinstance(u, TileRun) for u in units) and len(units) < len(tiles)
    out, lse = run_tiles(q, k, v, tiles, None, backend=backend)
    pq, pk, pv = block_gradients(q, (k, v), out, lse, dout, tiles, scale=None, backend=backend)
    dq, dk, dv = (accumulate(None, p, x.shape, q.device) for p, x in ((pq, q), (pk, k), (pv, v)))
    for t in tiles:
        rows = slice(t.q0, t.q1)
        ref, ref_lse = pa.partial_attention(q[rows].float(), k[rows].float(), v[rows].float(), causal=True,
                                            backend="reference")
        assert _relative(out[rows], ref) < 2e-2 and _relative(lse[rows], ref_lse) < 1e-4, t
        want = pb.reference_backward(q[rows].float(), k[rows].float(), v[rows].float(), ref, ref_lse,
                                     dout[rows].float(), causal=True, scale=dim ** -0.5)
        for name, got, w in zip(("dq", "dk", "dv"), (dq[rows], dk[rows], dv[rows]), want):
            assert _relative(got, w) < 3e-2, (t, name, _relative(got, w))


@pytest.mark.parametrize("lq", [1, 96, 700])
def test_new_tokens_after_a_cached_prefix_in_one_call(lq: int) -> None:
    """One tile after its cached prefix: the forward's batched call (split over the keys) and the
    varlen backward fed its out/LSE."""
    from megacp.placement import Tile

    gen = torch.Generator(device="cuda").manual_seed(2)
    hq, hkv, d, lk = 32, 8, 128, 33000
    q, dout = (torch.randn(lq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(lk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    tiles = [Tile(0, lq, 0, lk, True)]
    assert isinstance(tile_runs(tiles, "auto", q)[0], TileRun)
    out, lse = run_tiles(q, k, v, tiles, None)
    ref, ref_lse = pa.partial_attention(q.float(), k.float(), v.float(), causal=True, backend="reference")
    assert _relative(out, ref) < 2e-2 and _relative(lse, ref_lse) < 1e-4
    pq, pk, pv = block_gradients(q, (k, v), out, lse, dout, tiles, scale=None, backend="auto")
    want = pb.reference_backward(q.float(), k.float(), v.float(), ref, ref_lse, dout.float(), causal=True,
                                 scale=d ** -0.5)
    for (_, _, got), w in zip((pq[0], pk[0], pv[0]), want):
        assert _relative(got, w) < 3e-2
