"""Banded (sliding-window) tiles on a CUDA GPU through each band kernel (batched square causal cuDNN
calls, FlashAttention-2's window arguments, and ``"auto"``'s choice), forward and backward, against
the exact fp32 reference with the band masked by index (bf16 tolerances). Skips without CUDA (the
CI machine)."""

from __future__ import annotations

import pytest
import torch

from megacp.attention.partial import partial_attention
from megacp.attention.partial_backward import partial_attention_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash"])
@pytest.mark.parametrize("lq, lk, causal, left", [(300, 300, True, 63), (128, 512, False, 400), (257, 190, True, 0),
                                                   (64, 64, True, 1000), (1000, 1000, True, 255),
                                                   (700, 955, True, 255), (511, 511, False, 0)])
def test_band_kernels_equal_reference(backend: str, lq: int, lk: int, causal: bool, left: int) -> None:
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
