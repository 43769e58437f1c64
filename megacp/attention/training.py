"""CP attention for training: the differentiable pass-KV ring (forward and backward).

Forward is :func:`~megacp.attention.pass_kv.ring_pass_kv`; it keeps this rank's queries, its KV
block and the merged ``(out, lse)``. Backward replays the same rotation (:meth:`Ring.rotate`) and
the same per-step tiles: at step ``s`` a rank holds the KV block of rank ``r - s`` together with the
gradient accumulator of that block (filled by the ranks that held it before), adds the gradients of
its own tiles (:func:`~megacp.attention.kernels.partial_backward.partial_attention_backward`, a fused kernel
on GPU fed the *final* ``out``/``lse``, so no tile needs a correction; runs of short packed-document
tiles one varlen call, :mod:`~megacp.attention.kernels.varlen`), and passes the accumulator on;
after N steps every accumulator is back at its owner, as in Transformer Engine's p2p CP. The tile
gradients of step ``s`` are queued before the wait for the accumulator that arrives with it, so the
transfers overlap the kernels. dQ stays local; the travelling dK/dV accumulators and dQ are fp32
(:func:`accumulate`), except dQ at N = 2, where a row sums at most two kernel results (bf16/fp16)
and one rounding of their sum in that dtype equals what an fp32 accumulator would give.

Gradients of the replicated weights are reduced over DP×CP by the training engine (DeepSpeed
through :class:`megacp.parallel.mpu.DeepSpeedMPU`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from megacp.attention.blocks import KVBlock, build_kv_block
from megacp.attention.kernels.partial import softmax_scale
from megacp.attention.kernels.partial_backward import partial_attention_backward
from megacp.attention.kernels.registry import resolve_backend
from megacp.attention.kernels.varlen import TileRun, tile_runs, varlen_backward
from megacp.attention.pass_kv import ring_pass_kv
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan, Tile

Piece = tuple[int, int, Tensor]
"""Rows ``[a, b)`` of an accumulator and the value to add there."""


def accumulate(acc: Tensor | None, pieces: Sequence[Piece], shape: Sequence[int], device: torch.device,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """Sum of ``pieces`` placed into ``acc`` (``shape``, ``dtype``, updated in place).

    With ``acc=None`` a new accumulator starts: when the pieces do not overlap each is written
    (cast) rather than added to zeros and only the rows no piece covers are zeroed (one piece that
    covers every row in ``dtype`` already is the accumulator), which saves passes over a block's
    gradient — a training rank's memory traffic beside its kernels.
    """
    if acc is None:
        if len(pieces) == 1 and pieces[0][:2] == (0, shape[0]) and pieces[0][2].dtype == dtype:
            return pieces[0][2].contiguous()  # the ring sends it (the fp32 reference returns dK/dV permuted)
        if _disjoint(pieces):
            acc = torch.empty(tuple(shape), dtype=dtype, device=device)
            end = 0
            for a, b in sorted((a, b) for a, b, _ in pieces) + [(shape[0], shape[0])]:
                if a > end:
                    acc[end:a].zero_()
                end = max(end, b)
            for a, b, x in pieces:
                acc[a:b].copy_(x)
            return acc
        acc = torch.zeros(tuple(shape), dtype=dtype, device=device)
    for a, b, x in pieces:
        acc[a:b] += x
    return acc


def _disjoint(pieces: Sequence[Piece]) -> bool:
    """Whether no row is in two of ``pieces``."""
    spans = sorted((a, b) for a, b, _ in pieces)
    return all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))


def block_gradients(q: Tensor, block: KVBlock, out: Tensor, lse: Tensor, dout: Tensor, tiles: Sequence[Tile], *,
                    scale: float | None, backend: str | None) -> tuple[list[Piece], list[Piece], list[Piece]]:
    """Gradients of ``tiles`` (this rank's queries over one KV block), as pieces for :func:`accumulate`.

    Args:
        q, out, dout: ``[n_local, Hq, D]``; lse: ``[n_local, Hq]`` fp32 (final, merged).
        block: the KV block the tiles index (:data:`~megacp.attention.blocks.KVBlock`, ``M`` rows).

    Returns:
        ``(dq, dk, dv)`` pieces: rows of the queries ``[n_local, Hq, D]`` and of the block's keys
        and values ``[M, Hkv, D]``.
    """
    k, v = block[0], block[1]
    backend = resolve_backend(backend)
    run_scale = softmax_scale(scale, q.shape[-1])
    dq, dk, dv = [], [], []
    for t in tile_runs(tiles, backend, q):
        if isinstance(t, TileRun):
            gq, gk, gv = varlen_backward(q, k, v, out, lse, dout, t, scale=run_scale, backend=backend)
        else:
            rows, keys = slice(t.q0, t.q1), slice(t.k0, t.k1)
            gq, gk, gv = partial_attention_backward(q[rows], k[keys], v[keys], out[rows], lse[rows], dout[rows],
                                                    causal=t.causal, scale=scale, backend=backend, left=t.left)
        dq.append((t.q0, t.q1, gq))
        dk.append((t.k0, t.k1, gk))
        dv.append((t.k0, t.k1, gv))
    return dq, dk, dv


def _whole(tiles: Sequence[Tile], rows: int, keys: int) -> Tile | None:
    """The single tile that covers every query row and key of a block, if that is all there is."""
    if len(tiles) == 1 and (tiles[0].q0, tiles[0].q1, tiles[0].k0, tiles[0].k1) == (0, rows, 0, keys):
        return tiles[0]
    return None


def ring_backward(q: Tensor, bk: Tensor, bv: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: ShardPlan,
                  ring: Ring | None, *, scale: float | None, backend: str | None, rows: tuple[int, int] | None = None,
                  into: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The pass-KV ring's backward: gradients of this rank's queries and of its KV block.

    Args:
        q, out, dout: ``[m, Hq, D]``; lse: ``[m, Hq]`` fp32 (final, merged) — this rank's queries,
            or with ``rows = (a, b)`` only its local query rows ``[a, b)`` (``m = b - a``).
        bk, bv: this rank's KV block ``[M, Hkv, D]`` (``plan.max_kv_block`` rows).
        into: fp32 ``[M, Hkv, D]`` accumulators of this block's K and V gradients, which this
            backward adds to (over CP they travel the ring as this block's accumulators): the
            gradients of several query tiles then sum there.

    Returns:
        ``(dq, dk, dv)``: ``dq [m, Hq, D]`` (fp32, or ``q.dtype`` where one kernel result is all a
        row sums); ``dk``/``dv [M, Hkv, D]`` — with ``into``, the accumulators holding the sums (new
        tensors over CP), else fp32 sums or a single kernel's result.
    """
    r, n, m = plan.rank, plan.cp_size, q.shape[0]
    dout = dout.contiguous()
    dev, kv_shape = q.device, bk.shape
    if ring is None or n == 1:
        own = plan.tiles(r, r, rows)
        whole = _whole(own, m, kv_shape[0]) if into is None else None
        if whole is not None:  # one kernel call: its gradients are the answer, no fp32 accumulation
            return partial_attention_backward(q, bk, bv, out, lse, dout, causal=whole.causal, scale=scale,
                                              backend=backend, left=whole.left)
        pq, pk, pv = block_gradients(q, (bk, bv), out, lse, dout, own, scale=scale, backend=backend)
        # rows that one piece alone covers are written, not summed: q.dtype holds them exactly
        q_dtype, kv_dtype = (q.dtype if _disjoint(p) else torch.float32 for p in (pq, pk))
        dq = accumulate(None, pq, q.shape, dev, q_dtype)
        if into is not None:
            return dq, accumulate(into[0], pk, kv_shape, dev), accumulate(into[1], pv, kv_shape, dev)
        return dq, accumulate(None, pk, kv_shape, dev, kv_dtype), accumulate(None, pv, kv_shape, dev, kv_dtype)
    dq_sum: Tensor | None = None
    recv: list[Tensor] | None = None
    pending = None
    # without a window the tiles of one block never overlap in queries, so a query row sums at
    # most n partial gradients: with two, one rounding of their sum in q.dtype is what fp32 would give
    dq_dtype = q.dtype if n == 2 and plan.window is None else torch.float32
    need = [plan.kv_rows_read(j, r) for j in range(n)]
    start = list(into) if into is not None else None  # this block's running sums set out with it
    for step, held in ring.rotate((bk, bv), rows=need):  # held: KV block of rank r - step
        pq, pk, pv = block_gradients(q, (held[0], held[1]), out, lse, dout, plan.tiles(r, (r - step) % n, rows),
                                     scale=scale, backend=backend)
        dq_sum = accumulate(dq_sum, pq, q.shape, dev, dq_dtype)
        if pending is not None:
            Ring.wait(pending)  # what the ranks that held this block before have added
        base = recv if recv is not None else start
        acc = [accumulate(base[i] if base else None, p, kv_shape, dev) for i, p in enumerate((pk, pv))]
        recv = [torch.empty_like(a) for a in acc]
        pending = ring.start(acc, recv, tag=1)  # on to the next holder; the last hop goes home
    assert recv is not None and pending is not None and dq_sum is not None  # n > 1 steps ran
    Ring.wait(pending)
    return dq_sum, recv[0], recv[1]


class _RingAttention(torch.autograd.Function):
    """Differentiable pass-KV ring prefill of new tokens (no KV cache)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: ShardPlan, ring: Ring | None,
                scale: float | None, backend: str | None) -> Tensor:
        block = build_kv_block(plan, k, v)
        out, lse = ring_pass_kv(q, block, plan, ring, scale=scale, backend=backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, block[0], block[1], out, lse)
        ctx.plan, ctx.ring, ctx.scale, ctx.backend = plan, ring, scale, backend
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        q, bk, bv, out, lse = ctx.saved_tensors
        m = q.shape[0]
        dq, dk, dv = ring_backward(q, bk, bv, out, lse, dout, ctx.plan, ctx.ring, scale=ctx.scale, backend=ctx.backend)
        return dq.to(q.dtype), dk[:m].to(q.dtype), dv[:m].to(q.dtype), None, None, None, None


class KVGradients:
    """fp32 accumulators of one KV block's gradients, ``k``/``v`` ``[M, Hkv, D]``, that the backward
    passes of several query tiles over the block add to (:func:`ring_attention_rows`)."""

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = k, v


class _RowAttention(torch.autograd.Function):
    """Differentiable (in the queries) pass-KV ring of some local query rows over fixed KV blocks;
    the blocks' gradients are added to a :class:`KVGradients`."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, block: tuple[Tensor, Tensor], plan: ShardPlan, ring: Ring | None,
                rows: tuple[int, int], grads: KVGradients, scale: float | None, backend: str | None) -> Tensor:
        out, lse = ring_pass_kv(q, block, plan, ring, scale=scale, backend=backend, rows=rows)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse)
        ctx.block, ctx.plan, ctx.ring, ctx.rows, ctx.grads = block, plan, ring, rows, grads
        ctx.scale, ctx.backend = scale, backend
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        q, out, lse = ctx.saved_tensors
        grads: KVGradients = ctx.grads
        bk, bv = ctx.block
        dq, grads.k, grads.v = ring_backward(q, bk, bv, out, lse, dout, ctx.plan, ctx.ring, scale=ctx.scale,
                                             backend=ctx.backend, rows=ctx.rows, into=(grads.k, grads.v))
        return dq.to(q.dtype), None, None, None, None, None, None, None


def ring_attention_rows(q: Tensor, block: tuple[Tensor, Tensor], plan: ShardPlan, ring: Ring | None, *,
                        rows: tuple[int, int], grads: KVGradients | None, scale: float | None = None,
                        backend: str | None = None) -> Tensor:
    """CP attention (pass-KV) of this rank's local query rows ``[a, b)`` over every rank's KV block,
    for a training layer that runs its attention over query tiles.

    Args:
        q: ``[b - a, Hq, D]``, the queries of local rows ``rows`` (``plan`` without cached tokens).
        block: this rank's keys and values, ``[plan.max_kv_block, Hkv, D]`` each (its local tokens
            in ``plan.q_layout`` order, zero rows after them); they are not differentiated here.
        grads: with autograd, where the backward adds the block's K and V gradients (fp32; over CP
            each rank's accumulators travel the ring with its block and come home); ``None``:
            no backward.
        scale, backend: as :func:`ring_attention`.

    Returns:
        ``out [b - a, Hq, D]`` in ``q.dtype``; its backward returns the gradient of ``q``.
    """
    if grads is None or not torch.is_grad_enabled():
        out, _ = ring_pass_kv(q, block, plan, ring, scale=scale, backend=backend, rows=rows)
        return out.to(q.dtype)
    return _RowAttention.apply(q, block, plan, ring, rows, grads, scale, backend)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, plan: ShardPlan, ring: Ring | None, *,
                   scale: float | None = None, backend: str | None = None) -> Tensor:
    """Differentiable CP attention (pass-KV) of this rank's new tokens, for training.

    Args:
        q ``[n_local, Hq, D]``, k/v ``[n_local, Hkv, D]``: this rank's shard in ``plan.q_layout``
            order (``plan`` without cached tokens).
        plan: the sharding plan; ring: the CP ring (``None`` when N = 1).
        scale: softmax scale (default ``1/sqrt(D)``); backend: forward and backward kernels
            (:mod:`~megacp.attention.kernels.partial`, :mod:`~megacp.attention.kernels.partial_backward`).

    Returns:
        ``out`` ``[n_local, Hq, D]`` in ``q.dtype``; its backward returns the gradients of q, k and v
        (exact in fp32 on the reference backend, fused kernels' precision on GPU).
    """
    if plan.has_cached_kv:
        raise ValueError("ring_attention (training) takes plans without cached tokens")
    if q.shape[0] != plan.num_local() or k.shape[0] != q.shape[0] or v.shape != k.shape:
        raise ValueError(f"q, k, v must hold this rank's {plan.num_local()} tokens; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return _RingAttention.apply(q, k, v, plan, ring, scale, backend)
