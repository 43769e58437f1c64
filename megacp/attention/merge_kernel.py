"""One fused GPU kernel (Triton) for :func:`megacp.attention.merge.merge_stack`.

The merge of N stacked partial states sits on the decode critical path right after the all-gather;
written in torch it is about ten small kernels (logsumexp, weights, weighted sum, cast), each a
few microseconds of launch inside a CUDA graph — a sizeable share of a ~90 µs decode step. This
kernel reads the N partials once (straight from the strided views :func:`unpack_states` returns,
so the packed all-gather buffer is never copied) and writes the merged output and LSE.

Available when Triton imports; :func:`available` says whether it applies to given tensors. Under
``TRITON_INTERPRET=1`` it also runs on CPU tensors (how the tests check it without a GPU).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: merge_stack uses torch ops
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_BLOCK_M = 16  # (row, head) states per program


def available(outs: Tensor) -> bool:
    """Whether the kernel applies: Triton present, ``outs`` ``[N, L, H, D]`` with D a power of two,
    on CUDA (or any device under ``TRITON_INTERPRET=1``)."""
    d = outs.shape[-1]
    return (
        triton is not None
        and (outs.is_cuda or _INTERPRET)
        and outs.dim() == 4
        and d >= 16
        and d & (d - 1) == 0
        and outs.stride(-1) == 1
    )


if triton is not None:

    @triton.jit
    def _merge_stack_kernel(
        o_ptr, l_ptr, r_ptr, rl_ptr, M, H,
        so_n, so_l, so_h, sl_n, sl_l, sl_h,
        N: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = m < M
        row = (m // H).to(tl.int64)  # row * stride can exceed 2**31 for long pass-Q stacks
        head = (m % H).to(tl.int64)
        d = tl.arange(0, D)
        l_off = row * sl_l + head * sl_h
        o_off = row * so_l + head * so_h
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for i in tl.static_range(N):
            top = tl.maximum(top, tl.load(l_ptr + i * sl_n + l_off, mask=live, other=float("-inf")))
        top = tl.where(top == float("-inf"), 0.0, top)  # all partials empty: weights exp(-inf) = 0
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for i in tl.static_range(N):
            w = tl.exp(tl.load(l_ptr + i * sl_n + l_off, mask=live, other=float("-inf")) - top)
            o = tl.load(o_ptr + i * so_n + o_off[:, None] + d[None, :], mask=live[:, None], other=0.0)
            total += w
            acc += o.to(tl.float32) * w[:, None]
        seen = total > 0
        inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
        m = m.to(tl.int64)
        tl.store(r_ptr + m[:, None] * D + d[None, :], (acc * inv[:, None]).to(r_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(rl_ptr + m, tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf")), mask=live)


def merge_stack_fused(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`~megacp.attention.merge.merge_stack` in one kernel.

    Args:
        outs: ``[N, L, H, D]`` partial outputs (any strides with a unit last stride).
        lses: ``[N, L, H]`` fp32 natural-log LSEs (any strides).

    Returns:
        ``(out [L, H, D] outs.dtype, lse [L, H] fp32)``.
    """
    n, rows, h, d = outs.shape
    out = torch.empty((rows, h, d), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((rows, h), dtype=torch.float32, device=outs.device)
    total = rows * h
    if total:
        grid = (triton.cdiv(total, _BLOCK_M),)
        _merge_stack_kernel[grid](
            outs, lses, out, lse, total, h,
            outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1), lses.stride(2),
            N=n, D=d, BLOCK_M=_BLOCK_M,
        )
    return out, lse
