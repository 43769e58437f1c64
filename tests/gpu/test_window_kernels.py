"""Banded (sliding-window) tiles on a CUDA GPU through each band kernel (cuDNN's own band through the
cuDNN frontend, batched square causal cuDNN calls, FlashAttention-2's window arguments, and
``"auto"``'s choice), forward and backward, against the exact fp32 reference with the band masked by
index (bf16 tolerances). Skips without CUDA (the CI machine); the frontend cases skip where the
``nvidia-cudnn-frontend`` package is not installed."""

from __future__ import annotations

import pytest
import torch

from megacp.attention.kernels import cudnn_band, partial_backward
from megacp.attention.kernels.partial import partial_attention
from megacp.attention.kernels.partial_backward import partial_attention_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("backend, frontend", [("auto", True), ("cudnn", True), ("cudnn", False), ("flash", False)])
@pytest.mark.parametrize("lq, lk, causal, left", [(300, 300, True, 63), (128, 512, False, 400), (257, 190, True, 0),
                                                   (64, 64, True, 1000), (1000, 1000, True, 255),
                                                   (700, 955, True, 255), (511, 511, False, 0),
                                                   (600, 200, False, 30), (900, 400, True, 100)])
def test_band_kernels_equal_reference(backend: str, frontend: bool, lq: int, lk: int, causal: bool, left: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if frontend and not cudnn_band.installed():
        pytest.skip("needs the cuDNN frontend package (nvidia-cudnn-frontend)")
    if not frontend:  # the square-causal composition (or flash): the frontend set aside
        monkeypatch.setattr(cudnn_band, "installed", lambda: False)
    else:  # several KV-head groups in the frontend's backward
        monkeypatch.setattr(partial_backward, "WORKSPACE_BYTES", 4 * lq * 8 * 64 // 2)
    torch.manual_seed(0)
    q = torch.randn(lq, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(lk, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = partial_attention(q, k, v, causal=causal, left=left, backend=backend)
    ref, ref_lse = partial_attention(q, k, v, causal=causal, left=left, backend="reference")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-2, rtol=1e-3)
    dout = torch.randn_like(q)
    got = partial_attention_backward(q, k, v, ref, ref_lse, dout, causal=causal, left=left, backend=backend)
    want = partial_attention_backward(q, k, v, ref, ref_lse, dout, causal=causal, left=left,
                                      backend="reference")
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=5e-2, rtol=5e-2)
