"""Decode attention that reads an FP8 KV cache as stored (Triton, split-KV).

A decode query over an FP8 cache would otherwise gather and dequantise every row it reads into a
bf16 copy first: a transient of ``2 × B × capacity × Hkv × D × 2`` bytes per layer (3.5 GiB at 900K
tokens of the Llama-3.1-8B shape) and three passes over the bytes where one suffices. This kernel
reads each request's ``float8_e4m3fn`` rows straight from the cache's packed rows, converts them to
the query's dtype in registers (exact: every e4m3 value is a bf16 and an fp16 value) and applies the request's power-of-two
scales to the scores (keys) and to the output (values), which is exact as well.

Layout (as :func:`~megacp.attention.kernels.partial.cache_decode_states`): ``q`` ``[B, Hq, D]``; ``k``/``v``
``[R * capacity, Hkv, D]`` float8 (or its ``uint8`` view); request ``b`` owns rows
``starts[b] .. starts[b] + capacity`` and attends over the first ``used[b]``, both read from device
memory, so a CUDA graph replays one captured step for every token. Work is split over
``(request, KV head, key split)`` programs; each program serves the ``Hq / Hkv`` query heads of its KV
head (GQA) over ``ceil(capacity / splits)`` rows and writes a partial (out, LSE); the partials of the
splits are merged exactly in fp32 (:func:`~megacp.attention.kernels.merge.merge_stack`). Returns
``out [B, Hq, D]`` (``q.dtype``) and ``lse [B, Hq]`` fp32 natural log; a request with ``used = 0`` gets
``out = 0``, ``lse = -inf``. Available when Triton imports, on CUDA (or any device under
``TRITON_INTERPRET=1``, how the tests run it without a GPU).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from megacp.attention.kernels.merge import merge_stack

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: FP8 decode dequantises with torch ops
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_BLOCK_N = 64
"""Key rows per inner iteration."""
_ROWS_PER_SPLIT = 2048
"""Rows a program covers at least: the split count is ``capacity / _ROWS_PER_SPLIT``, capped at
:data:`_MAX_SPLITS` (fixed by the capacity, so a captured graph keeps its shapes)."""
_MAX_SPLITS = 64


def available(q: Tensor, k: Tensor) -> bool:
    """Whether :func:`fp8_cache_decode_states` applies: Triton present, CUDA tensors (or the
    interpreter), fp16/bf16 queries, a power-of-two head dim >= 16, an FP8 cache (float8 or uint8 rows)."""
    d = q.shape[-1]
    return (
        triton is not None
        and (q.is_cuda or _INTERPRET)
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype in (torch.float8_e4m3fn, torch.uint8)
        and d >= 16
        and d & (d - 1) == 0
    )


def splits_for(capacity: int) -> int:
    """Key splits of a cache of ``capacity`` rows per request."""
    return max(1, min(_MAX_SPLITS, -(-capacity // _ROWS_PER_SPLIT)))


if triton is not None:

    @triton.jit
    def _fp8_decode_kernel(
        q_ptr, k_ptr, v_ptr, sc_ptr, starts_ptr, used_ptr, o_ptr, l_ptr,
        sq_b, sq_h, sk_r, sk_h, sc_b, sc_w, so_s, so_b, so_h, sl_s, sl_b, sl_h,
        sm_scale, rows_per_split,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_T: tl.constexpr,
    ):
        dot_t = DOT_T
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        start = tl.load(starts_ptr + b).to(tl.int64)
        used = tl.load(used_ptr + b).to(tl.int64)
        lo = s.to(tl.int64) * rows_per_split
        hi = tl.minimum(lo + rows_per_split, used)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        live = g < G
        qh = h * G + g
        q = tl.load(q_ptr + b * sq_b + qh[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        q = q.to(dot_t)
        k_scale = tl.load(sc_ptr + b * sc_b + h)
        v_scale = tl.load(sc_ptr + b * sc_b + sc_w + h)
        qk_scale = sm_scale * k_scale
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            inside = n < hi
            rows = (start + n) * sk_r + h * sk_h
            kb = tl.load(k_ptr + rows[:, None] + d[None, :], mask=inside[:, None], other=0.0)
            kb = kb.to(dot_t)
            scores = tl.dot(q, tl.trans(kb)) * qk_scale  # [GP, BLOCK_N] fp32
            scores = tl.where(inside[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            vb = tl.load(v_ptr + rows[:, None] + d[None, :], mask=inside[:, None], other=0.0)
            vb = vb.to(dot_t)
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_t), vb)
            m = m_new
        empty = total == 0.0
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, total)[:, None] * v_scale)
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
        tl.store(o_ptr + s * so_s + b * so_b + qh[:, None] * so_h + d[None, :], out, mask=live[:, None])
        tl.store(l_ptr + s * sl_s + b * sl_b + qh * sl_h, lse, mask=live)


def fp8_cache_decode_states(q: Tensor, k: Tensor, v: Tensor, scales: Tensor, starts: Tensor, used: Tensor,
                            capacity: int, *, scale: float) -> tuple[Tensor, Tensor]:
    """One decode query per request over that request's FP8 rows of a packed cache (see the module).

    Args:
        q: ``[B, Hq, D]`` fp16/bf16; k, v: ``[R * capacity, Hkv, D]`` float8_e4m3fn (or uint8 views).
        scales: ``[B, 2, Hkv]`` fp32, each request's key and value scales (a stored ``x8`` stands
            for ``x8 * scale``); starts: ``[B]`` int64 multiples of ``capacity``; used: ``[B]`` int32.
        scale: the softmax scale.

    Returns:
        ``(out [B, Hq, D] q.dtype, lse [B, Hq] fp32)``.
    """
    b, hq, d = q.shape
    hkv = k.shape[-2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    splits = splits_for(capacity)
    rows_per_split = -(-capacity // splits)
    k8 = k.view(torch.float8_e4m3fn) if k.dtype == torch.uint8 else k
    v8 = v.view(torch.float8_e4m3fn) if v.dtype == torch.uint8 else v
    scales = scales.float().contiguous()
    outs = torch.empty((splits, b, hq, d), dtype=torch.float32, device=q.device)
    lses = torch.empty((splits, b, hq), dtype=torch.float32, device=q.device)
    # the dot products take q's dtype (e4m3 converts exactly to bf16 and fp16); Triton's CPU
    # interpreter multiplies bf16 wrongly, so there they run in fp32
    _fp8_decode_kernel[(b, hkv, splits)](
        q, k8, v8, scales, starts, used, outs, lses,
        q.stride(0), q.stride(1), k8.stride(0), k8.stride(1), scales.stride(0), scales.stride(1),
        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1), lses.stride(2),
        scale, rows_per_split,
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=_BLOCK_N,
        DOT_T=tl.float32 if _INTERPRET else tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16,
    )
    out, lse = merge_stack(outs, lses)
    return out.to(q.dtype), lse
