"""Training: the backward pass of pass-KV ring attention (gradients of K/V travel the ring).

Forward is :func:`~megacp.attention.pass_kv.ring_pass_kv`; it keeps this rank's queries, its KV
block and the merged ``(out, lse)``. Backward replays the same rotation (:meth:`Ring.rotate`) and
the same per-step tiles: at step ``s`` a rank holds the KV block of rank ``r - s`` together with the
gradient accumulator of that block (filled by the ranks that held it before), adds its own tile
gradients, and passes the accumulator on; after N steps every accumulator is back at its owner,
as in Transformer Engine's p2p CP. The query gradient stays local.

Per tile, with the *final* ``out`` and ``lse`` of the queries (natural log, fp32):
``P = exp(q·kᵀ·scale − lse)``, ``dV = Pᵀ·dO``, ``dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ out))``,
``dQ = dS·K·scale``, ``dK = dSᵀ·Q·scale`` (GQA: dK, dV summed over the query heads of a group).
The tile gradients are computed exactly in fp32 on any device (a fused GPU backward kernel is not
wired yet); gradients of the replicated weights are reduced over DP×CP by the training engine
(DeepSpeed through :class:`megacp.parallel.mpu.DeepSpeedMPU`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megacp.attention.merge import finite_or_zero
from megacp.attention.partial import heads_first, hidden_by_causal_mask
from megacp.attention.pass_kv import KVBlock, ring_pass_kv
from megacp.attention.prefill import build_kv_block
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan


def partial_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    *, causal: bool, scale: float | None = None, block_q: int = 256,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one tile's share of attention: ``q``/``out``/``dout`` ``[Lq,Hq,D]``,
    ``lse`` ``[Lq,Hq]`` (the queries' final, merged values), ``k``/``v`` ``[Lk,Hkv,D]``; ``causal``
    is bottom-right aligned as in :func:`~megacp.attention.partial.partial_attention`.

    Returns fp32 ``(dq [Lq,Hq,D], dk [Lk,Hkv,D], dv [Lk,Hkv,D])``. Memory: ``Hq × block_q × Lk`` scores.
    """
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g, offset = hq // hkv, lk - lq
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dq = torch.zeros(lq, hq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(hkv, lk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(hkv, lk, d, dtype=torch.float32, device=q.device)
    kf, vf = heads_first(k, hkv), heads_first(v, hkv)  # [Hkv,1,Lk,D]
    for i0 in range(0, lq, block_q):
        i1 = min(i0 + block_q, lq)
        k_end = min(lk, i1 + offset) if causal else lk
        if k_end <= 0:
            continue
        qb, ob, dob = (heads_first(x[i0:i1], hkv) for x in (q, out, dout))  # [Hkv,G,bq,D]
        lb = finite_or_zero(lse[i0:i1].reshape(i1 - i0, hkv, g).permute(1, 2, 0))  # [Hkv,G,bq]
        scores = (qb @ kf[:, :, :k_end].transpose(-1, -2)) * scale  # [Hkv,G,bq,k_end]
        if causal:
            scores = scores.masked_fill(hidden_by_causal_mask(i0, i1, 0, k_end, offset, q.device), float("-inf"))
        p = torch.exp(scores - lb.unsqueeze(-1))
        dv[:, :k_end] += (p.transpose(-1, -2) @ dob).sum(dim=1)
        ds = p * (dob @ vf[:, :, :k_end].transpose(-1, -2) - (dob * ob).sum(-1, keepdim=True))
        dq[i0:i1] = ((ds @ kf[:, :, :k_end]) * scale).permute(2, 0, 1, 3).reshape(i1 - i0, hq, d)
        dk[:, :k_end] += (ds.transpose(-1, -2) @ qb).sum(dim=1) * scale
    return dq, dk.permute(1, 0, 2), dv.permute(1, 0, 2)


def _tile_grads(q: Tensor, block: KVBlock, out: Tensor, lse: Tensor, dout: Tensor, tiles: list,
                dq: Tensor, scale: float | None) -> Tensor:
    """Add the tiles' query gradients into ``dq``; return the fp32 gradient of ``block`` ``[2,M,Hkv,D]``."""
    dkv = torch.zeros((2, *block[0].shape), dtype=torch.float32, device=q.device)
    for t in tiles:
        rows = slice(t.q0, t.q1)
        gq, gk, gv = partial_attention_backward(
            q[rows], block[0][t.k0:t.k1], block[1][t.k0:t.k1], out[rows], lse[rows], dout[rows],
            causal=t.causal, scale=scale,
        )
        dq[rows] += gq
        dkv[0, t.k0:t.k1] += gk
        dkv[1, t.k0:t.k1] += gv
    return dkv


class _RingAttention(torch.autograd.Function):
    """Differentiable pass-KV ring prefill of new tokens (no KV cache)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: ShardPlan, ring: Ring | None,
                scale: float | None, backend: str | None) -> Tensor:
        block = build_kv_block(plan, k, v)
        out, lse = ring_pass_kv(q, block, plan, ring, scale=scale, backend=backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, block[0], block[1], out, lse)
        ctx.plan, ctx.ring, ctx.scale = plan, ring, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        q, bk, bv, out, lse = ctx.saved_tensors
        block = (bk, bv)
        plan, ring, scale = ctx.plan, ctx.ring, ctx.scale
        r, n = plan.rank, plan.cp_size
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if ring is None or n == 1:
            home = _tile_grads(q, block, out, lse, dout, plan.tiles(r, r), dq, scale)
        else:
            recv, pending = None, None
            for step, held in ring.rotate(block):  # held: KV block of rank r - step
                acc = _tile_grads(q, held, out, lse, dout, plan.tiles(r, (r - step) % n), dq, scale)
                if pending is not None:
                    Ring.wait(pending)
                    acc += recv  # what the ranks that held this block before have added
                recv = torch.empty_like(acc)
                pending = ring.start(acc, recv, tag=1)  # on to the next holder; the last hop goes home
            Ring.wait(pending)
            home = recv
        m = q.shape[0]
        return dq.to(q.dtype), home[0, :m].to(q.dtype), home[1, :m].to(q.dtype), None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, plan: ShardPlan, ring: Ring | None, *,
                   scale: float | None = None, backend: str | None = None) -> Tensor:
    """Differentiable CP prefill (pass-KV) of this rank's new tokens, for training.

    Args:
        q ``[n_local, Hq, D]``, k/v ``[n_local, Hkv, D]``: this rank's shard in ``plan.q_layout``
        order (``plan`` without cached tokens). Returns ``out`` ``[n_local, Hq, D]``; its backward
        returns exact gradients for q, k and v.
    """
    if plan.has_cached_kv:
        raise ValueError("ring_attention (training) takes plans without cached tokens")
    if q.shape[0] != plan.num_local() or k.shape[0] != q.shape[0] or v.shape != k.shape:
        raise ValueError(f"q, k, v must hold this rank's {plan.num_local()} tokens; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return _RingAttention.apply(q, k, v, plan, ring, scale, backend)
