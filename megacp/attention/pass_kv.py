"""Pass-KV ring prefill: queries stay, KV blocks travel around the CP ring.

Each rank starts with its KV block (per request: the cached tokens it holds, then its share of the
new tokens), padded to the plan's largest block so every hop has one size. For N-1 hops it posts
the asynchronous send of the block in hand to rank r+1 and the receive of the next block from r-1,
*then* computes the partial attention of its local queries over the block in hand (only the tiles
the causal structure leaves visible), and folds it into the running (out, LSE) state. Two buffers
alternate (double buffering), so the transfer of hop s+1 overlaps the compute of hop s.

The loop is written as a sequence of (block source, tiles) steps over a ring object so that the
backward pass (dK/dV travelling the ring in the opposite direction, as in Transformer Engine's p2p CP)
can reuse the same step list and ring.
"""

from __future__ import annotations

from torch import Tensor

from megacp.attention.sharding import ShardPlan
from megacp.attention.tiles import run_tiles
from megacp.parallel.ring import Ring


def pass_kv_sources(plan: ShardPlan) -> list[int]:
    """Rank whose KV block is in hand at each of the N steps (own block first)."""
    return [(plan.rank - step) % plan.cp_size for step in range(plan.cp_size)]


def ring_pass_kv(
    q: Tensor,
    kv_block: Tensor,
    plan: ShardPlan,
    ring: Ring | None,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention of this rank's queries over every rank's KV block.

    Args:
        q: ``[n_local, Hq, D]`` local queries in ``plan.q_layout(rank)`` order.
        kv_block: ``[2, plan.max_kv_block, Hkv, D]`` this rank's keys (``[0]``) and values (``[1]``)
            in ``plan.kv_layout(rank)`` order, padded at the end.
        plan: the step's sharding plan; ring: the CP ring (``None`` when N = 1).

    Returns:
        ``(out [n_local, Hq, D] q.dtype, lse [n_local, Hq] fp32)``.
    """
    cur = kv_block
    nxt = kv_block.new_empty(kv_block.shape) if plan.cp_size > 1 else None
    state = None
    sources = pass_kv_sources(plan)
    for step, src in enumerate(sources):
        works = ring.start(cur, nxt) if step + 1 < len(sources) else None
        state = run_tiles(q, cur[0], cur[1], plan.tiles(plan.rank, src), state, scale=scale, backend=backend)
        if works is not None:
            Ring.wait(works)
            cur, nxt = nxt, cur
    return state
