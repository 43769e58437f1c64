"""FlashAttention-2 (registry backend ``"flash"``): torch's ``aten._scaled_dot_product_flash_attention``
and its backward, and the varlen ``aten._flash_attention_forward`` / ``_backward`` for sliding-window
bands (``window_size_left`` / ``window_size_right``), runs of packed tiles
(:mod:`~megacp.attention.kernels.varlen`) and decode over a packed cache (``seqused_k``).

The functions follow :mod:`~megacp.attention.kernels.registry`'s conventions: ``q`` ``[B, Hq, Lq, D]``,
``k``/``v`` ``[B, Hkv, Lk, D]`` (views; fewer KV heads than query heads are taken as they are),
``lse`` ``[B, Hq, Lq]`` fp32 natural log; band tiles and runs ``[L, H, D]`` (the buffers the tiles
index), their LSE ``[L, H]``. The varlen kernel keeps its LSE as ``[H, total_q]``, or
``[B, H, max_q]`` in older FlashAttention layouts (probed once, :func:`_padded_lse_layout`).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from megacp.attention.kernels.partial import Grads, State
from megacp.attention.kernels.partial_backward import zero_seed
from megacp.attention.kernels.varlen import TileRun


def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> State:
    """``(out [B, Hq, Lq, D] q.dtype, lse [B, Hq, Lq] fp32)``: no mask or a square causal one."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
             scale: float) -> Grads:
    """``(dq, dk, dv)`` in ``q.dtype`` given the final ``out`` and ``lse`` ``[B, Hq, Lq]``."""
    lq, lk, seed = q.shape[2], k.shape[2], zero_seed(q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, lq, lk, 0.0, causal, seed, seed, scale=scale)


def band_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, left: int) -> State:
    """One banded tile (``[L, H, D]``) through the varlen forward: one sequence,
    ``window_size_left=left``, ``window_size_right`` 0 (causal) or unbounded (-1). Queries that see
    no key get ``out = 0``, ``lse = -inf`` (the kernel writes +inf there)."""
    lq, lk = q.shape[0], k.shape[0]
    cu_q = torch.tensor([0, lq], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, lk], dtype=torch.int32, device=q.device)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, lq, lk, 0.0, causal, False, scale=scale,
                                                  window_size_left=left, window_size_right=0 if causal else -1)
    out, lse = res[0], res[1]
    lse = (lse.transpose(0, 1) if lse.dim() == 2 else lse.reshape(q.shape[1], lq).t()).float()
    empty = ~torch.isfinite(lse)
    return out.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))


def band_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *, causal: bool,
                  scale: float, left: int) -> Grads:
    """One banded tile (``[L, H, D]``) through the varlen backward (one sequence, the forward's
    window: ``window_size_left=left``, right 0 when causal else unbounded)."""
    lq, lk, seed = q.shape[0], k.shape[0], zero_seed(q.device)
    cu_q = torch.tensor([0, lq], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, lk], dtype=torch.int32, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.t().contiguous(), cu_q, cu_k, lq, lk, 0.0, causal, seed, seed, scale=scale,
        window_size_left=left, window_size_right=0 if causal else -1)
    return dq, dk, dv


# --------------------------------------------------------------------------- runs of packed tiles


@dataclass(frozen=True)
class _Seqs:
    """A run's sequence boundaries on the device and, where the kernel keeps its LSE as
    ``[B, H, max_q]`` (older FlashAttention layouts) rather than ``[H, total_q]``, the index of each
    query row into that layout."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    padded: tuple[Tensor, Tensor] | None  # ([total_q] sequence of each row, [total_q] its row in it)


@functools.lru_cache(maxsize=256)
def _seqs(run: TileRun, device: torch.device) -> _Seqs:
    """Built once per run and device: a step runs the same tiles in every layer, forward,
    recomputation and backward."""
    lq = [t.q1 - t.q0 for t in run.tiles]
    lk = [t.k1 - t.k0 for t in run.tiles]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    padded = None
    if _padded_lse_layout(device):
        seq = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
        padded = seq.to(device), (torch.arange(int(cu_q[-1])) - cu_q[:-1].long()[seq]).to(device)
    return _Seqs(cu_q.to(device), cu_k.to(device), max(lq), max(lk), padded)


@functools.cache
def _padded_lse_layout(device: torch.device) -> bool:
    """Whether the installed FlashAttention-2 keeps a varlen LSE as ``[B, H, max_q]`` (probed once
    with two sequences; otherwise it is ``[H, total_q]``)."""
    x = torch.zeros(3, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    lse = torch.ops.aten._flash_attention_forward(x, x, x, cu, cu, 2, 2, 0.0, False, False)[1]
    return lse.dim() == 3


def varlen_forward(q: Tensor, k: Tensor, v: Tensor, run: TileRun, *, scale: float) -> State:
    """Forward of every tile of ``run`` in one call (q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``: the
    buffers the tiles index): ``out`` ``[q1 - q0, Hq, D]`` (q.dtype), ``lse`` ``[q1 - q0, Hq]`` fp32.
    A run of one tile (after its cached prefix) takes the batched call, whose forward splits the
    keys over the SMs (split-KV)."""
    if len(run.tiles) == 1:
        res = torch.ops.aten._flash_attention_forward(
            q[None, run.q0:run.q1], k[None, run.k0:run.k1], v[None, run.k0:run.k1], None, None, run.q1 - run.q0,
            run.k1 - run.k0, 0.0, run.causal, False, scale=scale)
        return res[0][0], res[1][0].t().float()
    s = _seqs(run, q.device)
    res = torch.ops.aten._flash_attention_forward(
        q[run.q0:run.q1], k[run.k0:run.k1], v[run.k0:run.k1], s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, run.causal,
        False, scale=scale)
    out, lse = res[0], res[1]
    lse = lse.t() if s.padded is None else lse[s.padded[0], :, s.padded[1]]
    return out, lse.float()


def varlen_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, run: TileRun, *,
                    scale: float) -> Grads:
    """Gradients of every tile of ``run`` in one call, given the queries' final ``out``/``lse``
    (q, out, dout ``[Lq, Hq, D]``, lse ``[Lq, Hq]`` fp32, k/v ``[Lk, Hkv, D]``: the whole buffers):
    ``dq`` ``[q1 - q0, Hq, D]`` and ``dk``/``dv`` ``[k1 - k0, Hkv, D]`` in q.dtype."""
    s = _seqs(run, q.device)
    rows = slice(run.q0, run.q1)
    lse_rows = lse[rows]
    if s.padded is None:
        lse_k = lse_rows.t().contiguous()
    else:
        lse_k = lse_rows.new_zeros(len(run.tiles), lse_rows.shape[1], s.max_q)
        lse_k[s.padded[0], :, s.padded[1]] = lse_rows
    seed = zero_seed(q.device)
    keys = slice(run.k0, run.k1)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout[rows], q[rows], k[keys], v[keys], out[rows], lse_k, s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, run.causal,
        seed, seed, scale=scale)
    return dq, dk, dv


# --------------------------------------------------------------------------- decode over a packed cache


def cache_decode(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, used: Tensor, capacity: int,
                 scale: float) -> State:
    """One query per request (``q`` ``[B, Hq, D]``) over its rows of a packed cache (``k``/``v``
    ``[R * capacity, Hkv, D]``): the varlen forward with ``cum_seq_k`` = each request's first row
    (``starts`` ``[B]``) and ``seqused_k`` = its length (``used`` ``[B]`` int32), so the kernel reads
    only those rows. Returns ``out [B, Hq, D]``, ``lse [B, Hq]`` fp32 (+inf where ``used = 0``)."""
    b, hq, _ = q.shape
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    cu_k = torch.cat((starts, starts[-1:] + capacity)).to(torch.int32)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 1, capacity, 0.0, False, False,
                                                  scale=scale, seqused_k=used)
    out, lse = res[0], res[1]
    # the varlen LSE is [B, Hq, 1] (padded layout) or [Hq, total_q] (unpadded layout)
    lse = lse.transpose(0, 1) if lse.dim() == 2 else lse.reshape(b, hq)
    return out.reshape(b, hq, -1), lse.float()
