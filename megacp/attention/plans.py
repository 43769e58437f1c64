"""cuDNN execution plans built ahead of the first step that needs them.

Under ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (set by :mod:`megacp.attention.partial`) torch keys
its cuDNN SDPA plans by the sequence lengths rounded up to powers of two, so a plan is built (tens
of milliseconds for the forward and as much for the backward) the first time a call lands in a new
bucket and reused after. Packed training documents of every length fall into a handful of
buckets, but the first step that meets each one pays for its plans: on one GPU at 16K tokens that
step took twice the median. :func:`warm_kernel_plans` builds the square causal plans of every
bucket up to a step's local length once, before the first step, through the same calls the
training step makes (:func:`~megacp.attention.partial.partial_attention` and its backward), so
they land under the same keys.

Rectangular tiles (CP > 1: a rank's query chunk over another rank's KV block) are keyed by pairs
of buckets and are not built ahead.
"""

from __future__ import annotations

import os

import torch

from megacp.attention.partial import CUDNN_PLAN_REUSE, kernels_apply, partial_attention, resolve_backend
from megacp.attention.partial_backward import partial_attention_backward

LONGEST_WARMED = 1 << 14
"""Longest bucket warmed: past it one call's kernels take longer than its plan is built."""


def plan_buckets(tokens: int, longest: int = LONGEST_WARMED) -> list[int]:
    """The powers of two ``1, 2, 4, ...`` up to the bucket of ``tokens`` (the smallest power of two
    ``>= tokens``), none above ``longest``; ``[]`` for ``tokens < 1``."""
    if tokens < 1:
        return []
    top = min(1 << (tokens - 1).bit_length(), longest)
    return [1 << k for k in range(top.bit_length()) if 1 << k <= top]


def warm_kernel_plans(heads: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device,
                      tokens: int, backend: str | None = None) -> list[int]:
    """Build the forward and backward plans of square causal tiles for every bucket of
    :func:`plan_buckets` (``tokens``: the longest tile a step will run, local tokens per rank).

    Runs only where cuDNN's plans are reused across lengths: CUDA fp16/bf16 tensors, ``backend``
    ``"auto"`` or ``"cudnn"`` and ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``; elsewhere nothing is built.

    Returns:
        The bucket lengths warmed (tokens), ``[]`` when nothing ran.
    """
    backend = resolve_backend(backend)
    probe = torch.empty(0, dtype=dtype, device=device)
    if backend not in ("auto", "cudnn") or not kernels_apply(probe) or os.environ.get(CUDNN_PLAN_REUSE) != "1":
        return []
    buckets = plan_buckets(tokens)
    gen = torch.Generator(device=device).manual_seed(0)
    for n in buckets:
        q, dout = (torch.randn(n, heads, head_dim, dtype=dtype, device=device, generator=gen) for _ in range(2))
        k, v = (torch.randn(n, kv_heads, head_dim, dtype=dtype, device=device, generator=gen) for _ in range(2))
        out, lse = partial_attention(q, k, v, causal=True, backend=backend)
        partial_attention_backward(q, k, v, out, lse, dout, causal=True, backend=backend)
    torch.cuda.synchronize(device)
    return buckets
