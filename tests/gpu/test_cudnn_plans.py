"""cuDNN attention forward and backward at tile lengths that share plans (padded to a plan length,
several lengths in one process, batched calls) against the exact fp32 reference, on a CUDA GPU
(skips without one: the CI machine). The regression this pins: with torch's own plan reuse across
lengths (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``) the cuDNN backward of a length other than the
plan's was off by 10-1000× the gradients' size on an H100 (torch 2.11, cuDNN 9.19)."""

from __future__ import annotations

import pytest
import torch

from megacp.attention.kernels import cudnn
from megacp.attention.kernels import partial as pa
from megacp.attention.kernels import partial_backward as pb
from megacp.attention.kernels.plans import plans_reused_across_lengths

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(plans_reused_across_lengths(), reason="TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 is set: "
                                 "the cuDNN backward is refused there")]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error over the reference's largest value (at least 0.01: one query over one key has dQ = 0)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-2)).item()


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (32, 8, 128)])
def test_lengths_sharing_plans_give_exact_gradients(heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (4096, 3000, 2500, 3001, 700, 1024, 65, 1):  # 3000 / 3001 / 2500 share a plan length, as 700 / 1024 do
        q, dout = (torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        out, lse = pa.partial_attention(q, k, v, causal=True, backend="cudnn")
        ref, ref_lse = pa.partial_attention(q.float(), k.float(), v.float(), causal=True, backend="reference")
        assert _relative(out, ref) < 2e-2 and _relative(lse, ref_lse) < 1e-4, n
        grads = pb.partial_attention_backward(q, k, v, out, lse, dout, causal=True, backend="cudnn")
        want = pb.reference_backward(q.float(), k.float(), v.float(), ref, ref_lse, dout.float(), causal=True,
                                     scale=dim ** -0.5)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            assert g.shape == w.shape and _relative(g, w) < 3e-2, (n, name, _relative(g, w))


def test_batched_backward_is_exact() -> None:
    """Batched square causal calls (the sliding-window band's blocks)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    b, n, h, hkv, d = 3, 777, 8, 2, 128
    q, dout = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out, lse = pa._kernel_attention(cudnn.forward, q, k, v, causal=True, scale=d ** -0.5, padded=True)
    grads = pb._kernel_backward(cudnn.backward, q, k, v, out, lse, dout, causal=True, scale=d ** -0.5,
                                padded=True)
    for i in range(b):
        ref, ref_lse = pa.partial_attention(q[i].float(), k[i].float(), v[i].float(), causal=True, backend="reference")
        assert _relative(out[i], ref) < 2e-2
        want = pb.reference_backward(q[i].float(), k[i].float(), v[i].float(), ref, ref_lse, dout[i].float(),
                                     causal=True, scale=d ** -0.5)
        for g, w in zip(grads, want):
            assert _relative(g[i], w) < 3e-2


def test_plans_are_warmed_on_the_thread_the_backward_runs_on() -> None:
    """torch keeps cuDNN plans per thread and runs a CUDA backward on autograd's device thread: the
    warm-up must run there (it did not, and every new tile length slowed its first training step)."""
    import threading

    from megacp.attention.kernels.warmup import run_on_backward_thread
    from tests.helpers.threads import backward_thread

    names: list[str] = []
    run_on_backward_thread(lambda: names.append(threading.current_thread().name), torch.device("cuda"))
    assert names == [backward_thread("cuda")] and names[0] != threading.current_thread().name
