"""Training: gradients of CP ring attention equal single-process autograd (fp32, gloo processes)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.reference import packed_causal, rel_err

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
    from megacp.attention.backward import ring_attention
    from megacp.placement import ShardPlan
    from megacp.layers.cp_attention import CPDotProductAttention
    from megacp.parallel.ring import Ring

    ring = Ring() if n > 1 else None
    plan = ShardPlan([0] * len(LENS), LENS, n, rank)
    idx = plan.local_index()
    q, k, v, w = _inputs()
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    if through_layer:  # a swapped model in training: TE's CP convention, whole-sequence cu_seqlens
        layer = CPDotProductAttention(HQ, D, HKV, qkv_format="thd", ring=ring)
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
