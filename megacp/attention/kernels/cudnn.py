"""cuDNN's fused attention (registry backend ``"cudnn"``): torch's
``aten._scaled_dot_product_cudnn_attention`` and its backward, and cuDNN's own sliding-window band
through the cuDNN frontend (:mod:`~megacp.attention.kernels.cudnn_band`) where it is installed.

The functions follow :mod:`~megacp.attention.kernels.registry`'s conventions: ``q`` ``[B, Hq, Lq, D]``,
``k``/``v`` ``[B, Hkv, Lk, D]`` (views; fewer KV heads than query heads are taken as they are),
``lse`` ``[B, Hq, Lq]`` fp32 natural log (cuDNN's Stats ``[B, Hq, Lq, 1]``); band tiles ``[L, H, D]``.
Its square causal calls run padded to plan lengths (registry ``plan_padding``; torch builds a cuDNN
plan per shape, :mod:`~megacp.attention.kernels.plans`), and its backward is wrong where torch
reuses plans across lengths (``backward_under_plan_reuse`` false).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megacp.attention.kernels import cudnn_band
from megacp.attention.kernels.partial import Grads, State
from megacp.attention.kernels.partial_backward import head_group_slices, head_groups, reference_backward, zero_seed


def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> State:
    """``(out [B, Hq, Lq, D] q.dtype, lse [B, Hq, Lq] fp32)``: no mask or a square causal one."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(res[1].shape[0], res[1].shape[1], -1)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
             scale: float) -> Grads:
    """``(dq, dk, dv)`` in ``q.dtype`` given the final ``out`` and ``lse`` ``[B, Hq, Lq]``. cuDNN
    (9.19) refuses one query over one key ("s_q = s_kv = 1 is not supported"): such a call takes
    the exact path, per batch element."""
    lq, lk, seed = q.shape[2], k.shape[2], zero_seed(q.device)
    if lq == 1 and lk == 1:
        rows = [x.transpose(1, 2) for x in (q, k, v, out, dout)]  # [B, L, H, D]
        grads = [reference_backward(qb, kb, vb, ob, lb.t(), db, causal=causal, scale=scale)
                 for qb, kb, vb, ob, db, lb in zip(*rows, lse)]
        dq, dk, dv = (torch.stack(g).to(q.dtype).transpose(1, 2) for g in zip(*grads))
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1), seed, seed, None, None, None, lq, lk, 0.0, causal, scale=scale)


def band_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, left: int) -> State | None:
    """A banded tile through cuDNN's band (:func:`~megacp.attention.kernels.cudnn_band.band_attention`)
    where the cuDNN frontend serves it, else ``None`` (square causal calls build it)."""
    if not cudnn_band.serves(q, k, causal=causal, left=left, backward=False):
        return None
    return cudnn_band.band_attention(q, k, v, causal=causal, left=left, scale=scale)


def band_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *, causal: bool,
                  scale: float, left: int) -> Grads | None:
    """A banded tile's backward through cuDNN's band backward, per group of KV heads as
    :func:`~megacp.attention.kernels.partial_backward.head_groups` says, where the cuDNN frontend
    serves it, else ``None`` (square causal backward calls build it)."""
    if not cudnn_band.serves(q, k, causal=causal, left=left, backward=True):
        return None
    groups = head_groups(q.shape[0], q.shape[1], k.shape[1], q.shape[2])
    return cudnn_band.band_backward(q, k, v, out, lse, dout, causal=causal, left=left, scale=scale,
                                    heads=head_group_slices(q.shape[1], k.shape[1], groups))
