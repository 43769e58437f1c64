"""An independent single-process attention reference (float64, dense, explicit masks) for tests."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def naive_attention(q: Tensor, k: Tensor, v: Tensor, *, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """Causal-by-position attention: query at position x sees keys at positions <= x.

    q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]`` (GQA by repeating heads here, which is fine for a
    reference). Returns float32 ``[Lq, Hq, D]``; a query seeing no key returns zeros.
    """
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) / math.sqrt(q.shape[-1])
    visible = k_positions[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, vv).float()


def packed_causal(q: Tensor, k: Tensor, v: Tensor, lens: list[int]) -> Tensor:
    """Causal attention within each of the packed sequences of lengths ``lens``."""
    outs, s = [], 0
    for n in lens:
        pos = torch.arange(n)
        outs.append(naive_attention(q[s : s + n], k[s : s + n], v[s : s + n], q_positions=pos, k_positions=pos))
        s += n
    return torch.cat(outs)


def rel_err(a: Tensor, b: Tensor) -> float:
    """Max abs difference relative to the reference's largest magnitude (0 for empty tensors)."""
    if b.numel() == 0:
        assert a.numel() == 0, (a.shape, b.shape)
        return 0.0
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
