"""Fused GPU kernels (Triton) for the merges of :mod:`megacp.attention.kernels.merge`.

* :func:`merge_stack_fused` — N stacked partial states → one. It sits on the decode critical path
  right after the all-gather; written in torch it is about ten small kernels (logsumexp, weights,
  weighted sum, cast), each a few microseconds of launch inside a CUDA graph — a sizeable share of
  a ~90 µs decode step. The kernel reads the N partials once, straight from the strided views
  :func:`~megacp.attention.kernels.merge.unpack_states` returns (the packed buffer is never copied).
* :func:`merge_into_fused` — the online merge of the pass-KV ring, in place: one pass that reads
  the running and the new state and writes the running state (torch needs weight tensors and
  several passes over mixed layouts; even a single-``lerp_`` torch merge was ~3× slower on H200 at
  8K rows × 32 heads: 0.155 vs 0.054 ms).

Both compute in fp32 and take states of mixed dtypes (an fp32 running output with bf16 partials);
the result is rounded once, to the destination's dtype. A NaN in any partial makes the row NaN.

Both take any strides with a unit last stride (cuDNN's outputs are head-major views; the online
merge walks the states in the order of the running output's memory). Available
when Triton imports; :func:`available` says whether they apply. Under ``TRITON_INTERPRET=1`` they
also run on CPU tensors (how the tests check them without a GPU).
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
_BLOCK_M = 16  # (row, head) states per program of the stack merge
_BLOCK_M_INTO = 16  # ... of the online merge


def available(out: Tensor, dims: int) -> bool:
    """Whether the kernels apply to ``out`` (``[N, L, H, D]`` for the stack merge, ``dims=4``;
    ``[L, H, D]`` for the online merge, ``dims=3``): Triton present, D a power of two >= 16, unit
    last stride, on CUDA (or any device under ``TRITON_INTERPRET=1``)."""
    d = out.shape[-1]
    return (
        triton is not None
        and (out.is_cuda or _INTERPRET)
        and out.dim() == dims
        and d >= 16
        and d & (d - 1) == 0
        and out.stride(-1) == 1
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
            top = tl.maximum(top, tl.load(l_ptr + i * sl_n + l_off, mask=live, other=float("-inf")),
                             propagate_nan=tl.PropagateNan.ALL)  # a NaN partial makes the row NaN
        top = tl.where(top == float("-inf"), 0.0, top)  # all partials empty: weights exp(-inf) = 0
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for i in tl.static_range(N):
            w = tl.exp(tl.load(l_ptr + i * sl_n + l_off, mask=live, other=float("-inf")) - top)
            o = tl.load(o_ptr + i * so_n + o_off[:, None] + d[None, :], mask=live[:, None], other=0.0)
            total += w
            acc += o.to(tl.float32) * w[:, None]
        seen = total != 0  # NaN counts as seen: it must reach the output
        inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
        m = m.to(tl.int64)
        tl.store(r_ptr + m[:, None] * D + d[None, :], (acc * inv[:, None]).to(r_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(rl_ptr + m, tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf")), mask=live)


    @triton.jit
    def _merge_into_kernel(
        a_ptr, al_ptr, o_ptr, ol_ptr, M, L, H,
        sa_l, sa_h, sal_l, sal_h, so_l, so_h, sol_l, sol_h,
        D: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    ):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = m < M
        if HEAD_MAJOR:  # consecutive states are consecutive rows of one head: contiguous in cuDNN's layout
            row = (m % L).to(tl.int64)
            head = (m // L).to(tl.int64)
        else:
            row = (m // H).to(tl.int64)
            head = (m % H).to(tl.int64)
        d = tl.arange(0, D)
        la = tl.load(al_ptr + row * sal_l + head * sal_h, mask=live, other=float("-inf"))
        lb = tl.load(ol_ptr + row * sol_l + head * sol_h, mask=live, other=float("-inf"))
        top = tl.maximum(la, lb, propagate_nan=tl.PropagateNan.ALL)
        top = tl.where(top == float("-inf"), 0.0, top)
        wa = tl.exp(la - top)
        wb = tl.exp(lb - top)
        total = wa + wb
        seen = total != 0
        inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
        a_off = (row * sa_l + head * sa_h)[:, None] + d[None, :]
        a = tl.load(a_ptr + a_off, mask=live[:, None], other=0.0).to(tl.float32)
        o = tl.load(o_ptr + (row * so_l + head * so_h)[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        res = a * (wa * inv)[:, None] + o * (wb * inv)[:, None]
        tl.store(a_ptr + a_off, res.to(a_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(al_ptr + row * sal_l + head * sal_h,
                 tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf")), mask=live)


def merge_into_fused(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """:func:`~megacp.attention.kernels.merge.merge_into` in one kernel (in place).

    Args:
        acc_out: ``[L, H, D]`` running output, any float dtype (updated); acc_lse: ``[L, H]`` fp32 (updated).
        out: ``[L, H, D]`` the partial to add, any float dtype; lse: ``[L, H]`` fp32.
    """
    rows, h, d = acc_out.shape
    total = rows * h
    if total:
        _merge_into_kernel[(triton.cdiv(total, _BLOCK_M_INTO),)](
            acc_out, acc_lse, out, lse, total, rows, h,
            acc_out.stride(0), acc_out.stride(1), acc_lse.stride(0), acc_lse.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            D=d, BLOCK_M=_BLOCK_M_INTO, HEAD_MAJOR=acc_out.stride(1) > acc_out.stride(0),
        )


def merge_stack_fused(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`~megacp.attention.kernels.merge.merge_stack` in one kernel.

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
