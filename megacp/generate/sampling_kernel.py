"""The Gumbel-max draw of :mod:`megacp.generate.sampling` as one fused GPU kernel (Triton).

Written in torch, the draw is some twenty passes over ``[B, V]``: the integer hash of (seed, token
index, vocabulary index) in int64 ops, two logs, the temperature, the min-p floor, the subtraction
and the argmax — each a few microseconds of launch inside the decode step's CUDA graph, the whole
of a sampled step's extra cost at small batches. :func:`gumbel_argmax_fused` reads the values once
and writes one candidate per (row, chunk) of ``CHUNK`` columns; a second tiny kernel picks each
row's token. With top-k / top-p the filters become each row's first kept column of the sorted
values (:func:`nucleus_start` for top-p: two passes), which the draw starts from, in place of the
torch form's softmax, cumulative sum and masks over ``[B, V]``. The hash is computed in int64
exactly as :func:`~megacp.generate.sampling.mix32` does and the temperature is divided with IEEE
rounding, so the drawn tokens are those of the torch
form (:func:`~megacp.generate.sampling.gumbel_argmax`) but for a last-bit difference of the two
logs (Triton's fast ``log``), which can flip a draw only where two candidates tie to within it.
Available when Triton imports and the values are on CUDA (:func:`available`).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the draw uses torch ops
    triton = None

_BLOCK = 1024  # columns per loop iteration of a program
_CHUNK = 4 * _BLOCK  # columns per program
_SCAN = 4096  # columns per program of the top-p cut (:func:`nucleus_start`)


def available(values: Tensor) -> bool:
    """Whether the fused draw applies to ``values``: Triton present, on CUDA."""
    return triton is not None and values.is_cuda


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        return (x >> 16) ^ x

    @triton.jit
    def _draw_kernel(val_ptr, idx_ptr, key_ptr, step_ptr, temp_ptr, floor_ptr, quiet_ptr, start_ptr, best_ptr, tok_ptr,
                     N, stride_v, stride_i, SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_INDEX: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_FLOOR: tl.constexpr,
                     HAS_QUIET: tl.constexpr, HAS_START: tl.constexpr):
        b = tl.program_id(0)
        s = tl.program_id(1)
        key = tl.load(key_ptr + b).to(tl.int64)
        step = tl.load(step_ptr + b).to(tl.int64)
        row = _mix32((key + step * 0x9E3779B1) & 0xFFFFFFFF)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        pos = tl.full([BLOCK], N, tl.int32)
        tok = tl.zeros([BLOCK], tl.int64)
        for off in range(0, CHUNK, BLOCK):
            n = s * CHUNK + off + tl.arange(0, BLOCK)
            inside = n < N
            x = tl.load(val_ptr + b.to(tl.int64) * stride_v + n, mask=inside, other=float("-inf"))
            if HAS_TEMP:
                x = tl.fdiv(x, tl.load(temp_ptr + b), ieee_rounding=True)
            if HAS_FLOOR:
                x = tl.where(x < tl.load(floor_ptr + b), float("-inf"), x)
            if HAS_START:  # the sorted columns that the top-k / top-p filters drop
                x = tl.where(n < tl.load(start_ptr + b), float("-inf"), x)
            if HAS_INDEX:
                v = tl.load(idx_ptr + b.to(tl.int64) * stride_i + n, mask=inside, other=0).to(tl.int64)
            else:
                v = n.to(tl.int64)
            bits = _mix32(row ^ _mix32(v)) >> 8
            u = (bits.to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
            g = tl.log(tl.maximum(-tl.log(u), 5.9604644775390625e-08))  # u = 1 at the largest hash
            if HAS_QUIET:
                g = tl.where(tl.load(quiet_ptr + b) != 0, 0.0, g)
            y = x - g
            # a lane takes its first column even at -inf: a row that is -inf throughout gives its first column
            better = (y > best) | ((pos == N) & inside & (y == y))
            best = tl.where(better, y, best)
            pos = tl.where(better, n, pos)
            tok = tl.where(better, v, tok)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, pos, N), 0)
        tl.store(best_ptr + b * SPLITS + s, top)
        tl.store(tok_ptr + b * SPLITS + s, tl.sum(tl.where(pos == first, tok, 0), 0))

    @triton.jit
    def _mass_kernel(val_ptr, start_ptr, sums_ptr, N, stride_v, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                     HAS_START: tl.constexpr):
        b = tl.program_id(0)
        s = tl.program_id(1)
        n = s * CHUNK + tl.arange(0, CHUNK)
        row = val_ptr + b.to(tl.int64) * stride_v
        x = tl.load(row + n, mask=n < N, other=float("-inf"))
        e = tl.exp(x - tl.load(row + N - 1))  # the row's largest value is its last (sorted ascending)
        if HAS_START:
            e = tl.where(n < tl.load(start_ptr + b), 0.0, e)
        tl.store(sums_ptr + b * SPLITS + s, tl.sum(e, 0))

    @triton.jit
    def _nucleus_kernel(val_ptr, start_ptr, sums_ptr, floor_ptr, drop_ptr, N, stride_v, SPLITS: tl.constexpr,
                        WIDTH: tl.constexpr, CHUNK: tl.constexpr, HAS_START: tl.constexpr):
        b = tl.program_id(0)
        s = tl.program_id(1)
        c = tl.arange(0, WIDTH)
        sums = tl.load(sums_ptr + b * SPLITS + c, mask=c < SPLITS, other=0.0)
        total = tl.sum(sums, 0)
        before = tl.sum(tl.where(c < s, sums, 0.0), 0) / total  # the probability of the chunks before
        n = s * CHUNK + tl.arange(0, CHUNK)
        row = val_ptr + b.to(tl.int64) * stride_v
        x = tl.load(row + n, mask=n < N, other=float("-inf"))
        p = tl.exp(x - tl.load(row + N - 1)) / total
        if HAS_START:
            p = tl.where(n < tl.load(start_ptr + b), 0.0, p)
        drop = ((tl.cumsum(p, 0) + before) <= tl.load(floor_ptr + b)) & (n < N)
        tl.store(drop_ptr + b * SPLITS + s, tl.sum(drop.to(tl.int32), 0))

    @triton.jit
    def _pick_kernel(best_ptr, tok_ptr, out_ptr, SPLITS: tl.constexpr, WIDTH: tl.constexpr):
        b = tl.program_id(0)
        s = tl.arange(0, WIDTH)
        inside = s < SPLITS
        best = tl.load(best_ptr + b * SPLITS + s, mask=inside, other=float("-inf"))
        tok = tl.load(tok_ptr + b * SPLITS + s, mask=inside, other=0)
        first = tl.min(tl.where(best == tl.max(best, 0), s, WIDTH), 0)
        tl.store(out_ptr + b, tl.sum(tl.where(s == first, tok, 0), 0))


def nucleus_start(ordered: Tensor, start: Tensor | None, top_p_floor: Tensor) -> Tensor:
    """:func:`~megacp.generate.sampling.kept_start`'s top-p part in two kernels: the first column
    ``[B]`` int64 of ``ordered [B, V]`` (fp32, sorted ascending, unit last stride) that top-p keeps,
    given the first one top-k keeps (``start [B]`` int64, ``None``: 0) and ``top_p_floor [B]`` fp32
    (``1 - top_p``). The first kernel sums ``exp(x - max)`` over each (row, chunk of ``_SCAN``
    columns) from the row's top-k start; the second divides by the row's total, runs the cumulative
    sum of each chunk after the chunks before it and counts the columns at or below the floor. The
    same probabilities and cumulative sums as the torch form (softmax, :func:`chunked_cumsum
    <megacp.generate.sampling.chunked_cumsum>`) but for the last bits of another summation order and
    Triton's ``exp``: a column whose cumulative sum is within those bits of the floor can fall on
    the other side of it."""
    rows, n = ordered.shape
    splits = triton.cdiv(n, _SCAN)
    sums = torch.empty(rows, splits, dtype=torch.float32, device=ordered.device)
    drops = torch.empty(rows, splits, dtype=torch.int32, device=ordered.device)
    has_start = start is not None
    _mass_kernel[(rows, splits)](ordered, start if has_start else ordered, sums, n, ordered.stride(0), SPLITS=splits,
                                 CHUNK=_SCAN, HAS_START=has_start, num_warps=8)
    _nucleus_kernel[(rows, splits)](ordered, start if has_start else ordered, sums, top_p_floor, drops, n,
                                    ordered.stride(0), SPLITS=splits, WIDTH=max(triton.next_power_of_2(splits), 2),
                                    CHUNK=_SCAN, HAS_START=has_start, num_warps=8)
    return drops.sum(-1).clamp_(max=n - 1)


def gumbel_argmax_fused(values: Tensor, keys: Tensor, steps: Tensor, index: Tensor | None, temperature: Tensor | None,
                        floor: Tensor | None, noiseless: Tensor | None, start: Tensor | None = None) -> Tensor:
    """:func:`~megacp.generate.sampling.gumbel_argmax` in two kernels (same arguments; ``values``
    and ``index`` with a unit last stride)."""
    rows, n = values.shape
    splits = triton.cdiv(n, _CHUNK)
    best = torch.empty(rows, splits, dtype=torch.float32, device=values.device)
    toks = torch.empty(rows, splits, dtype=torch.long, device=values.device)
    out = torch.empty(rows, dtype=torch.long, device=values.device)
    _draw_kernel[(rows, splits)](
        values, values if index is None else index, keys, steps,
        values if temperature is None else temperature, values if floor is None else floor,
        keys if noiseless is None else noiseless, keys if start is None else start, best, toks, n, values.stride(0),
        0 if index is None else index.stride(0), SPLITS=splits, CHUNK=_CHUNK, BLOCK=_BLOCK,
        HAS_INDEX=index is not None, HAS_TEMP=temperature is not None, HAS_FLOOR=floor is not None,
        HAS_QUIET=noiseless is not None, HAS_START=start is not None, num_warps=4,
    )
    _pick_kernel[(rows,)](best, toks, out, SPLITS=splits, WIDTH=max(triton.next_power_of_2(splits), 2))
    return out
