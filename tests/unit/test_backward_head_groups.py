"""The fused attention backward split over groups of KV heads (a bounded kernel workspace) gives
the gradients of one call: checked with the exact fp32 backward standing in for the kernel, on
GQA shapes, causal and not."""

from __future__ import annotations

import pytest
import torch

from megacp.attention.kernels import partial_backward as pb
from megacp.attention.kernels.partial import partial_attention


def _as_kernel(dout4, q4, k4, v4, out4, lse3, causal, scale):
    """The reference backward with a fused kernel's ``[1, H, L, D]`` calling convention."""
    def rows(x):
        return x[0].transpose(0, 1)

    dq, dk, dv = pb.reference_backward(rows(q4), rows(k4), rows(v4), rows(out4), lse3[0].t(), rows(dout4),
                                       causal=causal, scale=scale)
    return tuple(x.unsqueeze(0).transpose(1, 2) for x in (dq, dk, dv))


def test_head_groups_bound_the_workspace():
    assert pb.head_groups(1024, 32, 8, 128) == 1
    assert pb.head_groups(1 << 14, 32, 8, 128) == 1   # 256 MiB of fp32 dQ: one call
    assert pb.head_groups(1 << 15, 32, 8, 128) == 2   # 512 MiB -> two calls of 256 MiB
    assert pb.head_groups(1 << 20, 32, 8, 128) == 8   # never more calls than KV heads
    assert pb.head_groups(1 << 15, 24, 3, 128) == 3   # only divisors of the KV heads


@pytest.mark.parametrize("causal", [True, False])
def test_split_backward_equals_one_call(monkeypatch, causal):
    g = torch.Generator().manual_seed(0)
    lq, hq, hkv, d = 12, 8, 4, 16
    q, dout = (torch.randn(lq, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(lq, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = partial_attention(q, k, v, causal=causal, backend="reference")
    one = pb._kernel_call(_as_kernel, q, k, v, out.to(q.dtype), lse, dout, causal, 0.25)
    monkeypatch.setattr(pb, "WORKSPACE_BYTES", 4 * lq * hq * d // 4)  # four calls of one KV head
    assert pb.head_groups(lq, hq, hkv, d) == 4
    split = pb._kernel_call(_as_kernel, q, k, v, out.to(q.dtype), lse, dout, causal, 0.25)
    for a, b in zip(one, split):
        assert torch.allclose(a.to(b.dtype), b, rtol=0, atol=1e-12)


def test_head_group_slices_cover_every_head_with_its_gqa_group():
    slices = pb.head_group_slices(32, 8, 4)
    assert slices == [(slice(8 * i, 8 * i + 8), slice(2 * i, 2 * i + 2)) for i in range(4)]
    assert pb.head_group_slices(6, 3, 1) == [(slice(0, 6), slice(0, 3))]
