"""Training: gradients of CP ring attention equal single-process autograd (fp32, gloo processes)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.reference import packed_causal, rel_err

HQ, HKV, D = 8, 2, 16
LENS = [37, 3, 1, 20]


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    total = sum(LENS)
    q, k, v, w = (torch.randn(total, h, D, generator=g) for h in (HQ, HKV, HKV, HQ))
    return q, k, v, w


def _reference_grads() -> tuple[torch.Tensor, ...]:
    q, k, v, w = _inputs()
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    (packed_causal(q, k, v, LENS).double() * w.double()).sum().backward()
    return q.grad.float(), k.grad.float(), v.grad.float()


def _cp_grads(rank: int, n: int, through_layer: bool) -> tuple[torch.Tensor, ...]:
    from megacp.attention.training import ring_attention
    from megacp.layers.cp_attention import CPDotProductAttention
    from megacp.layers.settings import CPSettings
    from megacp.parallel.ring import Ring
    from megacp.placement import ShardPlan

    ring = Ring() if n > 1 else None
    plan = ShardPlan([0] * len(LENS), LENS, n, rank)
    idx = plan.local_index()
    q, k, v, w = _inputs()
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    if through_layer:  # a swapped model in training: TE's CP convention, whole-sequence cu_seqlens
        layer = CPDotProductAttention(HQ, D, HKV, qkv_format="thd", settings=CPSettings(ring=ring))
        cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
        out = layer(ql, kl, vl, cu_seqlens_q=cu, cu_seqlens_kv=cu).view(-1, HQ, D)
    else:
        out = ring_attention(ql, kl, vl, plan, ring)
    (out * w[idx]).sum().backward()
    return idx, ql.grad, kl.grad, vl.grad


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_attention_gradients_match_single_process(n: int) -> None:
    ref = _reference_grads()
    for through_layer in (False, True):
        for idx, *grads in run_distributed(_cp_grads, n, through_layer):
            for name, got, want in zip("qkv", grads, ref):
                assert rel_err(got, want[idx]) < 1e-5, (n, through_layer, name)


# --------------------------------------------------------------------------- per-tile kernels


def _sdpa_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lens: list[int],
                kernel: str | None = None) -> tuple:
    """Per-document causal attention gradients of torch's SDPA in the inputs' dtype: fp64 inputs give
    the reference; bf16 on GPU with ``kernel`` ("cudnn" / "flash") forced gives that kernel's own
    error, what megacp's use of the kernel is measured against."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, None: SDPBackend.MATH}
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs, s = [], 0
    for n in lens:
        qs, ks, vs = (x[s:s + n].unsqueeze(0).transpose(1, 2) for x in (q, k, v))  # [1, H, n, D]
        # SDPA's cuDNN refuses some short documents; those take flash, as SDPA's own choice would
        with sdpa_kernel([kernels[kernel], SDPBackend.FLASH_ATTENTION] if kernel else [kernels[None]], set_priority=True):
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2)[0])
        s += n
    torch.autograd.backward(torch.cat(outs), dout)
    return q.grad, k.grad, v.grad


def _tile_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lens: list[int], n: int,
                backend: str) -> tuple:
    """Gradients of the pass-KV ring's tiles of every rank of a CP=n group, computed in one process:
    each rank's forward state over every block (the tiles the ring runs), then each block's
    gradients from :func:`block_gradients`, summed at the block's owner as the ring does."""
    from megacp.attention.kernels.tile_attention import run_tiles
    from megacp.attention.training import accumulate, block_gradients
    from megacp.placement import ShardPlan

    plans = [ShardPlan([0] * len(lens), lens, n, r) for r in range(n)]
    idx = [p.local_index().to(q.device) for p in plans]
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v))
    blocks = [(k[i], v[i]) for i in idx]
    for r, plan in enumerate(plans):
        qr, dor, state = q[idx[r]], dout[idx[r]], None
        for j in range(n):
            state = run_tiles(qr, *blocks[j], plan.tiles(r, j), state, backend=backend)
        out, lse = state[0].to(q.dtype), state[1]
        dqr = None
        for j in range(n):
            pq, pk, pv = block_gradients(qr, blocks[j], out, lse, dor, plan.tiles(r, j), scale=None, backend=backend)
            dqr = accumulate(dqr, pq, qr.shape, q.device)
            dk[idx[j]] += accumulate(None, pk, blocks[j][0].shape, q.device)
            dv[idx[j]] += accumulate(None, pv, blocks[j][1].shape, q.device)
        dq[idx[r]] = dqr
    return dq, dk, dv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius-norm relative error (the measure of bf16 gradient noise)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tile_gradients_exact_on_reference_backend(n: int) -> None:
    """The per-tile backward (exact fp32 path) summed as the ring sums it equals full attention's."""
    q, k, v, w = _inputs()
    ref = _sdpa_grads(*(x.double() for x in (q, k, v, w)), LENS)
    got = _tile_grads(q, k, v, w, LENS, n, "reference")
    for name, g, want in zip("qkv", got, ref):
        assert rel_err(g, want) < 1e-5, (n, name)


GPU_LENS = [4096, 1000, 37, 1, 2923]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused attention backward kernels need a CUDA GPU")
@pytest.mark.parametrize("lens", [GPU_LENS, [8192]], ids=["packed", "one"])
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_fused_tile_gradients_within_sdpa_noise(backend: str, n: int, lens: list[int]) -> None:
    """bf16 on one GPU: gradients of CP=n ranks' tiles (n=1: the whole ring_attention call) through
    the fused backward are within 1.2x the error of SDPA's own bf16 gradients (same kernel) against
    fp64, for GQA 32/8 heads and packed documents of ragged lengths."""
    from megacp.attention.training import ring_attention
    from megacp.placement import ShardPlan

    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lens)
    q, k, v, dout = (torch.randn(total, h, 128, generator=g, device="cuda", dtype=torch.bfloat16)
                     for h in (32, 8, 8, 32))
    ref = _sdpa_grads(*(x.double() for x in (q, k, v, dout)), lens)
    base = _sdpa_grads(q, k, v, dout, lens, backend)
    if n == 1:
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        out = ring_attention(ql, kl, vl, ShardPlan([0] * len(lens), lens, 1, 0), None, backend=backend)
        out.backward(dout)
        got = (ql.grad, kl.grad, vl.grad)
    else:
        got = _tile_grads(q, k, v, dout, lens, n, backend)
    for name, gm, gb, want in zip("qkv", got, base, ref):
        err, sdpa_err = _rel(gm, want), _rel(gb, want)
        print(f"{backend} n={n} lens={len(lens)} d{name}: megacp {err:.3e} sdpa {sdpa_err:.3e} ratio {err / sdpa_err:.3f}")
        assert err <= 1.2 * sdpa_err, (backend, n, name, err, sdpa_err)
