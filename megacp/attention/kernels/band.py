"""Sliding-window band tiles as batched square causal calls (exact; no windowed kernel needed).

Convention as :mod:`~megacp.attention.kernels.partial`: ``q`` ``[Lq, Hq, D]``, ``k``/``v`` ``[Lk, Hkv, D]``,
bottom-right aligned: query ``i``'s diagonal key is ``p = i + Lk - Lq``. A causal band (``left=w``)
lets query ``i`` see keys ``[p - w, p]`` (``W = w + 1`` keys); a non-causal band keys ``[p - w, Lk)``.
Fused causal kernels (cuDNN) only take square causal masks, and :func:`band_attention` /
:func:`band_backward` build every band from calls of a ``causal`` kernel on ``[(B,) L, H, D]``
tensors that applies a bottom-right causal mask for any lengths (``_kernel_attention`` in
:mod:`~megacp.attention.kernels.partial` splits those into square calls):

* non-causal band: reversing queries and keys (``torch.flip`` on the token dim) turns "keys from
  ``p - w`` on" into "keys up to ``i' + w``": one causal call over the first ``Lk - w`` reversed
  queries and the dense rest;
* causal band: when the first query's band is clipped at key 0 (``p < w``), the queries up to
  ``p = w`` are a plain causal call (the *head*); the others are cut into blocks of ``W`` consecutive queries (by ``p``; the last block may
  be shorter, ``n < W`` queries). Block ``[p0, p0 + n)`` sees its *diagonal* keys ``[p0, p0 + n)``
  (a square causal mask) and its *edge* keys ``[p0 - w, p0)``, of which query ``p0 + t`` sees key
  ``p0 - w + c`` iff ``c >= t``: with the block's first ``m = min(n, w)`` queries and the ``w`` edge
  keys both reversed that is a bottom-right causal ``m × w`` mask. All full blocks go in one batched
  call per part (queries and diagonal keys are reshapes of the tile, edge keys an ``as_strided`` view
  ``[nb, w, Hkv, D]`` with a stride of ``W`` tokens), and the two parts' ``(out, LSE)`` are merged.

The backward takes the tile's final ``out``/``lse`` (see :mod:`~megacp.attention.kernels.partial_backward`)
and runs the same pieces through a causal backward kernel: each piece's dQ lands on its query rows
and dK/dV on its keys (reversed back, added up where pieces share keys).

Costs beyond the causal calls: reversed copies of the edge queries, keys and values (and of out,
dout and LSE rows in the backward), the reversed results, and the merge of the edge rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megacp.attention.kernels.merge import merge_into

State = tuple[Tensor, Tensor]
Grads = tuple[Tensor, Tensor, Tensor]
CausalAttention = Callable[[Tensor, Tensor, Tensor, bool], State]
"""``(q, k, v, causal) -> (out, lse)`` on ``[(B,) L, H, D]`` tensors, bottom-right causal for any lengths."""
CausalBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool], Grads]
"""``(q, k, v, out, lse, dout, causal) -> (dq, dk, dv)`` on ``[(B,) L, H, D]`` tensors (``lse`` ``[(B,) L, H]``)."""


@dataclass(frozen=True)
class _Blocks:
    """``nb`` blocks of ``n`` queries from query row ``q0``, diagonal keys from ``k0``; ``m`` edge
    queries (each block's first) over the ``w`` keys before each block's diagonal."""

    q0: int
    k0: int
    nb: int
    n: int
    m: int
    w: int


def _causal_plan(lq: int, lk: int, w: int) -> tuple[tuple[int, int, int] | None, list[_Blocks]]:
    """The pieces of a causal band (``w >= 0``): the head ``(q0, q1, k1)`` (queries ``[q0, q1)``
    over keys ``[0, k1)``, bottom-right causal) or ``None``, and the full blocks then the short one."""
    o, big_w = lk - lq, w + 1
    p_start = max(o, 0)  # queries with p < 0 see nothing
    if p_start >= lk:
        return None, []
    head = None
    p0 = p_start
    if p_start < w:  # bands clipped at key 0: up to p = w (a whole first block when p_start = 0)
        p0 = min(big_w, lk)
        head = (p_start - o, p0 - o, p0)
    full, rest = divmod(lk - p0, big_w)
    blocks = []
    if full:
        blocks.append(_Blocks(p0 - o, p0, full, big_w, min(big_w, w), w))
    if rest:
        p = p0 + full * big_w
        blocks.append(_Blocks(p - o, p, 1, rest, min(rest, w), w))
    return head, blocks


def _blocks(x: Tensor, start: int, count: int, step: int, length: int) -> Tensor:
    """View ``[count, length, ...]`` of ``x`` (token dim 0): rows ``start + b·step + t``."""
    s0 = x.stride(0)
    return x.as_strided((count, length, *x.shape[1:]), (step * s0, s0, *x.stride()[1:]),
                        x.storage_offset() + start * s0)


def _edge(x: Tensor, b: _Blocks, rows: bool) -> Tensor:
    """Reversed (a copy) edge part of ``x``: the ``m`` first query rows of each block (``rows``) or
    the ``w`` keys before each block's diagonal."""
    view = _blocks(x, b.q0, b.nb, b.n, b.m) if rows else _blocks(x, b.k0 - b.w, b.nb, b.n, b.w)
    return view.flip(1)


def band_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, left: int, attend: CausalAttention) -> State:
    """``partial_attention(q, k, v, causal=causal, left=left)`` built from ``attend`` calls.

    Args:
        q: ``[Lq, Hq, D]``; k, v: ``[Lk, Hkv, D]``; left: the band, ``>= 0``.
        attend: the causal kernel (see :data:`CausalAttention`).

    Returns:
        ``(out [Lq, Hq, D] q.dtype, lse [Lq, Hq] fp32)``; ``out = 0``, ``lse = -inf`` where a query sees no key.
    """
    lq, lk, w = q.shape[0], k.shape[0], left
    if not causal:
        qf, kf, vf = q.flip(0), k.flip(0), v.flip(0)
        a = min(lq, max(lk - w, 0))  # reversed queries [0, a) see keys [0, i' + w]; the rest all keys
        if a == lq:
            out, lse = attend(qf, kf[:a + w], vf[:a + w], True)
        else:
            out, lse = _empty(q)
            if a:
                out[:a], lse[:a] = attend(qf[:a], kf[:a + w], vf[:a + w], True)
            out[a:], lse[a:] = attend(qf[a:], kf, vf, False)
        return out.flip(0), lse.flip(0)
    out, lse = _empty(q)
    head, pieces = _causal_plan(lq, lk, w)
    if head is not None:
        q0, q1, k1 = head
        out[q0:q1], lse[q0:q1] = attend(q[q0:q1], k[:k1], v[:k1], True)
    for b in pieces:
        o, l = attend(_blocks(q, b.q0, b.nb, b.n, b.n), _blocks(k, b.k0, b.nb, b.n, b.n),
                      _blocks(v, b.k0, b.nb, b.n, b.n), True)
        _blocks(out, b.q0, b.nb, b.n, b.n).copy_(o)
        _blocks(lse, b.q0, b.nb, b.n, b.n).copy_(l)
        if b.m == 0:
            continue
        o, l = attend(_edge(q, b, True), _edge(k, b, False), _edge(v, b, False), True)
        o, l = o.flip(1), l.flip(1)
        for i in range(b.nb):
            r = b.q0 + i * b.n
            merge_into(out[r:r + b.m], lse[r:r + b.m], o[i], l[i])
    return out, lse


def band_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *, causal: bool,
                  left: int, grads: CausalBackward) -> Grads:
    """``partial_attention_backward(..., causal=causal, left=left)`` built from ``grads`` calls.

    Args:
        q, out, dout: ``[Lq, Hq, D]``; k, v: ``[Lk, Hkv, D]``; lse: ``[Lq, Hq]`` fp32, the final state.
        left: the band, ``>= 0``; grads: the causal backward kernel (see :data:`CausalBackward`).

    Returns:
        fp32 ``(dq [Lq, Hq, D], dk [Lk, Hkv, D], dv [Lk, Hkv, D])`` (the pieces' sums).
    """
    lq, lk, w = q.shape[0], k.shape[0], left
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
    if not causal:
        qf, kf, vf, of, lf, df = (x.flip(0) for x in (q, k, v, out, lse, dout))
        a = min(lq, max(lk - w, 0))
        if a:
            dq[:a], dk[:a + w], dv[:a + w] = grads(qf[:a], kf[:a + w], vf[:a + w], of[:a], lf[:a], df[:a], True)
        if a < lq:
            gq, gk, gv = grads(qf[a:], kf, vf, of[a:], lf[a:], df[a:], False)
            dq[a:] = gq
            dk += gk
            dv += gv
        return dq.flip(0), dk.flip(0), dv.flip(0)
    head, pieces = _causal_plan(lq, lk, w)
    if head is not None:
        q0, q1, k1 = head
        dq[q0:q1], dk[:k1], dv[:k1] = grads(q[q0:q1], k[:k1], v[:k1], out[q0:q1], lse[q0:q1], dout[q0:q1], True)
    for b in pieces:
        qb, ob, lb, db = (_blocks(x, b.q0, b.nb, b.n, b.n) for x in (q, out, lse, dout))
        gq, gk, gv = grads(qb, _blocks(k, b.k0, b.nb, b.n, b.n), _blocks(v, b.k0, b.nb, b.n, b.n), ob, lb, db, True)
        _blocks(dq, b.q0, b.nb, b.n, b.n).copy_(gq)
        _blocks(dk, b.k0, b.nb, b.n, b.n).add_(gk)
        _blocks(dv, b.k0, b.nb, b.n, b.n).add_(gv)
        if b.m == 0:
            continue
        qb, ob, lb, db = (_edge(x, b, True) for x in (q, out, lse, dout))
        gq, gk, gv = grads(qb, _edge(k, b, False), _edge(v, b, False), ob, lb, db, True)
        _blocks(dq, b.q0, b.nb, b.n, b.m).add_(gq.flip(1))
        _blocks(dk, b.k0 - b.w, b.nb, b.n, b.w).add_(gk.flip(1))
        _blocks(dv, b.k0 - b.w, b.nb, b.n, b.w).add_(gv.flip(1))
    return dq, dk, dv


def _empty(q: Tensor) -> State:
    """``out = 0`` ``[L, H, D]`` in ``q.dtype`` and ``lse = -inf`` ``[L, H]`` fp32 (queries that see no key)."""
    return (torch.zeros(q.shape, dtype=q.dtype, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device))
