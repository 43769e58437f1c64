"""Padded cuDNN plan lengths: the grid, the padding's exactness on the reference, the warm-up's scope."""

from __future__ import annotations

import pytest
import torch

from megacp.attention.kernels.partial import partial_attention
from megacp.attention.kernels.partial_backward import partial_attention_backward
from megacp.attention.kernels.plans import LONGEST_PADDED, pad_rows, plan_length, plan_lengths
from megacp.attention.kernels.warmup import warm_kernel_plans


def test_plan_length_is_the_next_of_four_per_octave() -> None:
    assert [plan_length(n) for n in (1, 64, 65, 80, 81, 128, 129, 161, 256, 257)] == \
        [64, 64, 80, 80, 96, 128, 160, 192, 256, 320]
    assert plan_length(LONGEST_PADDED) == LONGEST_PADDED
    assert plan_length(LONGEST_PADDED + 1) == LONGEST_PADDED + 1
    for n in range(1, 5000, 7):
        m = plan_length(n)
        assert n <= m <= max(64, n + n // 4 + 1), n


def test_plan_lengths_are_every_padded_length_once() -> None:
    assert plan_lengths(0) == []
    assert plan_lengths(100) == [64, 80, 96, 112]
    every = plan_lengths(1 << 20)
    assert every[-1] == LONGEST_PADDED and len(every) == 33
    assert sorted({plan_length(n) for n in range(1, LONGEST_PADDED + 1)}) == every


def test_zero_padded_rows_change_no_real_row() -> None:
    """The padding's claim, on the exact path: a causal square padded with zero rows (LSE 0 and
    dout 0 on the padded rows) gives the real rows' out, LSE and gradients unchanged (the reference
    sums in fp32 blocks, hence 1e-6)."""
    g = torch.Generator().manual_seed(0)
    n, m, h, hkv, d = 37, 48, 4, 2, 8
    q, dout = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = partial_attention(q, k, v, causal=True, backend="reference")
    grads = partial_attention_backward(q, k, v, out.to(q.dtype), lse, dout, causal=True, backend="reference")
    qp, kp, vp, dp = (pad_rows(x, m) for x in (q, k, v, dout))
    out_p, lse_p = partial_attention(qp, kp, vp, causal=True, backend="reference")
    torch.testing.assert_close(out_p[:n], out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_p[:n], lse, rtol=1e-6, atol=1e-6)
    out_p = pad_rows(out.to(q.dtype), m)
    lse_p = pad_rows(lse, m, dim=-2)
    assert lse_p[n:].eq(0).all()
    grads_p = partial_attention_backward(qp, kp, vp, out_p, lse_p, dp, causal=True, backend="reference")
    for got, want in zip(grads_p, grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[:n], want, rtol=1e-6, atol=1e-6)


def test_nothing_is_warmed_on_cpu() -> None:
    assert warm_kernel_plans(4, 2, 16, dtype=torch.bfloat16, device=torch.device("cpu"), tokens=4096) == []


def test_cudnn_backward_is_refused_under_torchs_plan_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")
    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1"):
        partial_attention_backward(q, q, q, q, torch.zeros(8, 2), q, causal=True, backend="cudnn")
    grads = partial_attention_backward(q, q, q, q, torch.zeros(8, 2), q, causal=True, backend="auto")
    assert all(torch.isfinite(g).all() for g in grads)  # auto on CPU: the exact path


def test_run_on_backward_thread_runs_where_a_backward_runs() -> None:
    """The plan warm-up's hook: ``fn`` runs once, on the thread autograd runs a backward of tensors
    of that device on (the caller's on CPU; autograd's device thread on a GPU, checked in
    tests/gpu/test_cudnn_plans.py)."""
    import threading

    import torch

    from megacp.attention.kernels.warmup import run_on_backward_thread
    from tests.helpers.threads import backward_thread

    calls: list[str] = []
    run_on_backward_thread(lambda: calls.append(threading.current_thread().name), torch.device("cpu"))
    assert calls == [backward_thread("cpu")]
