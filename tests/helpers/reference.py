"""An independent single-process attention reference (float64, dense, explicit masks) for tests."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def naive_attention(q: Tensor, k: Tensor, v: Tensor, *, q_positions: Tensor, k_positions: Tensor,
                    scale: float | None = None, window: int | None = None) -> Tensor:
    """Causal-by-position attention: query at position x sees keys at positions <= x (softmax
    ``scale``, default ``1/sqrt(D)``); with a sliding ``window`` only those at positions
    ``> x - window`` (transformers' sliding-window mask).

    q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]`` (GQA by repeating heads here, which is fine for a
    reference). Returns float32 ``[Lq, Hq, D]``; a query seeing no key returns zeros.
    """
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    visible = k_positions[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, vv).float()


def packed_causal(q: Tensor, k: Tensor, v: Tensor, lens: list[int], window: int | None = None) -> Tensor:
    """Causal attention within each of the packed sequences of lengths ``lens`` (optionally under a
    sliding ``window``)."""
    outs, s = [], 0
    for n in lens:
        pos = torch.arange(n)
        outs.append(naive_attention(q[s : s + n], k[s : s + n], v[s : s + n], q_positions=pos, k_positions=pos,
                                    window=window))
        s += n
    return torch.cat(outs)


def session_step_reference(q: Tensor, k: Tensor, v: Tensor, slots: list[int], new: list[int],
                           hist_k: dict, hist_v: dict, scale: float | None = None) -> Tensor:
    """Reference of one step of a multi-request session: the step's packed new tokens (``new[i]`` of
    request ``slots[i]``, q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``) are appended to each request's key and
    value history (``hist_k[slot]``, ``hist_v[slot]``, updated in place), and each new query attends
    causally over its request's whole history. ``scale``: softmax scale (default ``1/sqrt(D)``).
    Returns float32 ``[T, Hq, D]`` in the step's packed order."""
    refs, s = [], 0
    for slot, t in zip(slots, new):
        p = hist_k[slot].shape[0]
        hist_k[slot] = torch.cat([hist_k[slot], k[s:s + t]])
        hist_v[slot] = torch.cat([hist_v[slot], v[s:s + t]])
        pos = torch.arange(p + t)
        refs.append(naive_attention(q[s:s + t], hist_k[slot], hist_v[slot], q_positions=pos[p:], k_positions=pos,
                                    scale=scale))
        s += t
    return torch.cat(refs)


def rel_err(a: Tensor, b: Tensor) -> float:
    """Max abs difference relative to the reference's largest magnitude (0 for empty tensors)."""
    if b.numel() == 0:
        assert a.numel() == 0, (a.shape, b.shape)
        return 0.0
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
