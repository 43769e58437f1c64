"""All-gather decode: replicated decode queries, KV sharded over the CP ranks.

Each request's decode query (one token) is the same on every CP rank. Each rank attends over the
tokens of the request it holds (prefill shards + its round-robin share of decoded tokens; zero
tokens is fine), then the partial (out, LSE) of the whole batch travel in **one** all-gather (packed
into one byte buffer: two collectives would cost twice the latency) and every rank merges the N
partials exactly. No host synchronisation happens inside, so the step can be captured in a CUDA
graph when the per-request lengths are fixed; :func:`static_decode` reads the lengths from device
memory, so one captured step serves every token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megacp.attention.kernels import fp8_decode_kernel
from megacp.attention.kernels.merge import merge_stack, pack_states, unpack_states
from megacp.attention.kernels.partial import cache_decode_states, empty_state, partial_attention, softmax_scale
from megacp.parallel.ring import Ring


def local_decode_states(
    q: Tensor,
    kv: Sequence[tuple[Tensor, Tensor]] | tuple[Tensor, Tensor],
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Partial attention of each request's query over this rank's keys of that request.

    Args:
        q: ``[B, Hq, D]`` one query token per request.
        kv: per request ``(k_i, v_i)`` each ``[L_i, Hkv, D]`` (ragged), or one pair of batched
            tensors ``[B, L, Hkv, D]`` when every request has L local tokens (one kernel call).

    Returns:
        ``(out [B, Hq, D], lse [B, Hq] fp32)``.
    """
    if isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], Tensor) and kv[0].dim() == 4:
        out, lse = partial_attention(q.unsqueeze(1), kv[0], kv[1], scale=scale, backend=backend)
        return out[:, 0], lse[:, 0]
    if len(kv) != q.shape[0]:
        raise ValueError(f"{q.shape[0]} decode queries but KV for {len(kv)} requests")
    if not kv:  # no request
        return empty_state(*q.shape, dtype=q.dtype, device=q.device)
    pairs: Sequence[tuple[Tensor, Tensor]] = kv  # type: ignore[assignment]  # ragged: one pair per request
    states = [partial_attention(q[i : i + 1], k, v, scale=scale, backend=backend) for i, (k, v) in enumerate(pairs)]
    return torch.cat([o for o, _ in states]), torch.cat([lse for _, lse in states])


def allgather_decode(
    q: Tensor,
    kv: Sequence[tuple[Tensor, Tensor]] | tuple[Tensor, Tensor],
    ring: Ring | None,
    *,
    scale: float | None = None,
    backend: str | None = None,
    fused_merge: bool | None = None,
) -> Tensor:
    """Exact decode attention over KV sharded across the CP ring.

    Args:
        q: ``[B, Hq, D]`` (identical on every CP rank); kv: see :func:`local_decode_states`.
        ring: the CP ring (``None`` or size 1: local attention only).
        fused_merge: merge with the one-kernel Triton merge (``None`` = where it applies; see
            :func:`~megacp.attention.kernels.merge.merge_stack`).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``, identical on every rank.
    """
    out, lse = local_decode_states(q, kv, scale=scale, backend=backend)
    return merge_over_ring(out, lse, ring, q.dtype, fused_merge=fused_merge)


def merge_over_ring(out: Tensor, lse: Tensor, ring: Ring | None, dtype: torch.dtype, *,
                    fused_merge: bool | None = None) -> Tensor:
    """Every rank's partial ``(out [B, Hq, D], lse [B, Hq] fp32)`` in one all-gather, merged
    exactly; returns ``[B, Hq, D]`` in ``dtype``, identical on every rank (``ring`` ``None`` or of
    size 1: ``out`` itself)."""
    if ring is None or ring.size == 1:
        return out.to(dtype)
    gathered = ring.all_gather(pack_states(out.to(dtype), lse))  # [N, B, bytes]
    outs, lses = unpack_states(gathered, out.shape[1], out.shape[2], dtype)
    return merge_stack(outs, lses, fused=fused_merge)[0]


def static_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    starts: Tensor,
    used: Tensor,
    capacity: int,
    ring: Ring | None,
    *,
    scale: float | None = None,
    fp8_scales: Tensor | None = None,
) -> Tensor:
    """All-gather decode with every length in device memory (the step a CUDA graph replays).

    Args:
        q: ``[B, Hq, D]`` (identical on every CP rank); k, v: this rank's packed cache rows
            ``[R * capacity, Hkv, D]``; starts, used, capacity: each request's first row and the
            rows it attends over on this rank (:func:`~megacp.attention.kernels.partial.cache_decode_states`).
        ring: the CP ring (``None`` or size 1: local attention only).
        fp8_scales: with ``k``/``v`` as an FP8 cache stores them (``float8_e4m3fn`` or ``uint8``),
            each request's ``[B, 2, Hkv]`` fp32 key and value scales: the rows are read as stored
            (:mod:`~megacp.attention.kernels.fp8_decode_kernel`; where its ``available`` says it applies).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``, identical on every rank.
    """
    if fp8_scales is not None:
        out, lse = fp8_decode_kernel.fp8_cache_decode_states(q, k, v, fp8_scales, starts, used, capacity,
                                                             scale=softmax_scale(scale, q.shape[-1]))
    else:
        out, lse = cache_decode_states(q, k, v, starts, used, capacity, scale=scale)
    return merge_over_ring(out, lse, ring, q.dtype)

