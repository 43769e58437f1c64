"""Running planned tiles (:func:`megacp.placement.plan_tiles`) through the partial-attention
kernels and folding them into a running (out, LSE) state; runs of short contiguous tiles (packed
documents) take one varlen call (:mod:`~megacp.attention.kernels.varlen`)."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from megacp.attention.kernels.merge import merge_into
from megacp.attention.kernels.partial import empty_state, partial_attention, softmax_scale
from megacp.attention.kernels.registry import resolve_backend
from megacp.attention.kernels.varlen import Unit, tile_runs, varlen_attention
from megacp.placement.tiles import Tile


def run_tiles(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tiles: Sequence[Tile],
    acc: tuple[Tensor, Tensor] | None,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Run ``tiles`` (queries of ``q`` ``[Lq,Hq,D]`` over ``k``/``v`` ``[Lk,Hkv,D]``) and fold them
    into the running state ``acc = (out [Lq,Hq,D], lse [Lq,Hq] fp32)``.

    With ``acc=None`` the tiles start a fresh state: rows no tile covers are ``out = 0``,
    ``lse = -inf``, and a single tile covering every row becomes the state without a copy; tiles
    that share query rows (a windowed plan: one tile per key segment) are merged there.
    Returns the (possibly new) state.
    """
    lq, hq, d = q.shape
    backend = resolve_backend(backend)
    scale = softmax_scale(scale, d)
    units = tile_runs(tiles, backend, q)

    def attend(t: Unit) -> tuple[Tensor, Tensor]:
        if isinstance(t, Tile):
            return partial_attention(q[t.q0:t.q1], k[t.k0:t.k1], v[t.k0:t.k1], causal=t.causal, scale=scale,
                                     backend=backend, left=t.left)
        return varlen_attention(q, k, v, t, scale=scale, backend=backend)

    if acc is None:
        if len(units) == 1 and units[0].q0 == 0 and units[0].q1 == lq:
            return attend(units[0])
        out, lse = empty_state(lq, hq, d, dtype=q.dtype, device=q.device)
        spans = sorted((t.q0, t.q1) for t in units)
        if all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:])):
            for t in units:
                out[t.q0:t.q1], lse[t.q0:t.q1] = attend(t)
            return out, lse
        acc = out, lse
    out, lse = acc
    for t in units:
        merge_into(out[t.q0:t.q1], lse[t.q0:t.q1], *attend(t))
    return out, lse
