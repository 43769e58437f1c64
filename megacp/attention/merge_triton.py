"""A fused in-place merge of partial attention states on CUDA (Triton).

The online merge of the ring (:func:`megacp.attention.merge.merge_into`) written with torch ops
launches about a dozen kernels and materialises fp32 copies of both outputs; on H200 that costs
~15% of a 16K-token CP prefill. This kernel reads the running state and the new partial once and
writes the merged state once, computing in fp32. Same formulas and −inf handling as ``merge.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _merge_rows(acc, acc_lse, out, lse, rows, heads,
                sa_l, sa_h, sal_l, sal_h, so_l, so_h, sl_l, sl_h,
                D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    t = r // heads
    h = r % heads
    a = tl.load(acc_lse + t * sal_l + h * sal_h, mask=rmask, other=float("-inf"))
    b = tl.load(lse + t * sl_l + h * sl_h, mask=rmask, other=float("-inf"))
    m = tl.maximum(a, b)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(a - m)
    wb = tl.exp(b - m)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    tl.store(acc_lse + t * sal_l + h * sal_h, m + tl.log(total), mask=rmask)
    d = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (d[None, :] < D)
    pa = acc + (t * sa_l + h * sa_h)[:, None] + d[None, :]
    pb = out + (t * so_l + h * so_h)[:, None] + d[None, :]
    xa = tl.load(pa, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(pb, mask=mask, other=0.0).to(tl.float32)
    merged = xa * (wa * inv)[:, None] + xb * (wb * inv)[:, None]
    tl.store(pa, merged.to(pa.dtype.element_ty), mask=mask)


def fused_merge_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """In place: ``(acc_out [L,H,D], acc_lse [L,H] fp32) ⊕= (out [L,H,D], lse [L,H] fp32)``.

    Any strides for the L and H dimensions; D must be contiguous (stride 1).
    """
    rows_l, heads, d = acc_out.shape
    rows = rows_l * heads
    if rows == 0:
        return
    block_r = 16
    _merge_rows[(triton.cdiv(rows, block_r),)](
        acc_out, acc_lse, out, lse, rows, heads,
        acc_out.stride(0), acc_out.stride(1), acc_lse.stride(0), acc_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d),
    )
