"""Building cuDNN's execution plans before a training step needs them.

torch builds a plan for every shape a cuDNN attention call meets (:mod:`~megacp.attention.kernels.plans`);
a training job builds those of every padded square causal tile length once, at start, on the
threads its steps run the calls on (:func:`warm_kernel_plans`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from megacp.attention.kernels import registry
from megacp.attention.kernels.partial import kernel_order, kernels_apply, partial_attention
from megacp.attention.kernels.partial_backward import partial_attention_backward
from megacp.attention.kernels.plans import plan_lengths, plans_reused_across_lengths
from megacp.attention.kernels.registry import resolve_backend


def warm_kernel_plans(heads: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device,
                      tokens: int, backend: str | None = None) -> list[int]:
    """Build the cuDNN plans of every padded square causal tile length up to ``tokens`` (the
    longest tile a step will run, local tokens per rank; :func:`~megacp.attention.kernels.plans.plan_lengths`),
    forward and backward, through the calls a training step makes, so that no step stalls on
    building one (~33 lengths, tens of milliseconds each, once per process).

    torch keeps its cuDNN attention plans per thread, and autograd runs the backward of CUDA
    tensors (with the layers' recomputed forward under activation checkpointing) on its own device
    thread: the forward plans are built on the calling thread and, forward and backward, on that
    device thread (:func:`run_on_backward_thread`). Built on the calling thread alone, every new
    length cost its first training step tens of milliseconds (measured on an H100).

    Runs only where the first kernel ``backend`` tries on such tensors pads its square causal calls
    to plan lengths (registry ``plan_padding``: cuDNN, for CUDA fp16/bf16 under ``"auto"`` or
    ``"cudnn"``), and torch does not reuse plans across lengths (under it the backward runs
    FlashAttention-2).

    Returns:
        The lengths warmed (rows), ``[]`` when nothing ran.
    """
    backend = resolve_backend(backend)
    probe = torch.empty(0, dtype=dtype, device=device)
    kernels = kernel_order(backend, probe)
    if not kernels_apply(probe) or not kernels or not registry.get(kernels[0]).plan_padding \
            or plans_reused_across_lengths():
        return []
    lengths = plan_lengths(tokens)

    def warm(backward: bool) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        for n in lengths:
            q, dout = (torch.randn(n, heads, head_dim, dtype=dtype, device=device, generator=gen) for _ in range(2))
            k, v = (torch.randn(n, kv_heads, head_dim, dtype=dtype, device=device, generator=gen) for _ in range(2))
            out, lse = partial_attention(q, k, v, causal=True, backend=backend)
            if backward:
                partial_attention_backward(q, k, v, out, lse, dout, causal=True, backend=backend)

    with torch.no_grad():
        warm(backward=False)
    run_on_backward_thread(lambda: warm(backward=True), device)
    torch.cuda.synchronize(device)
    return lengths


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward calls ``fn`` (on the thread autograd runs the input's device on)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Any) -> Tensor:
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        ctx.fn()
        return grad, None


def run_on_backward_thread(fn: Callable[[], None], device: torch.device) -> None:
    """Call ``fn`` where autograd runs the backward of tensors on ``device`` (for a CUDA device,
    autograd's device thread, not the caller's), through a one-element backward pass."""
    x = torch.zeros((), device=device, requires_grad=True)
    _RunInBackward.apply(x, fn).backward()
