"""Pass-KV ring prefill: queries stay, KV blocks travel around the CP ring.

Each rank starts with its KV block (per request: the cached tokens it holds, then its share of the
new tokens), padded to the plan's largest block so every hop has one size. For N-1 hops it posts
the asynchronous send of the block in hand to rank r+1 and the receive of the next block from r-1,
*then* computes the partial attention of its local queries over the block in hand (only the tiles
the causal structure leaves visible), and folds it into the running (out, LSE) state. Received
blocks alternate between two scratch buffers (double buffering, :meth:`Ring.rotate`), so the
transfer of hop s+1 overlaps the compute of hop s.

The loop is a sequence of (block source, tiles) steps over :meth:`Ring.rotate`; the training
backward (:mod:`megacp.attention.backward`) replays the same rotation and tiles while the K/V
gradient accumulators follow the blocks around the ring, as in Transformer Engine's p2p CP.
"""

from __future__ import annotations

from torch import Tensor

from megacp.attention.sharding import ShardPlan
from megacp.attention.tiles import run_tiles
from megacp.parallel.ring import Ring


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
    r = plan.rank
    if ring is None:
        return run_tiles(q, kv_block[0], kv_block[1], plan.tiles(r, r), None, scale=scale, backend=backend)
    state = None
    for step, block in ring.rotate(kv_block):  # block of rank r - step in hand
        tiles = plan.tiles(r, (r - step) % plan.cp_size)
        state = run_tiles(q, block[0], block[1], tiles, state, scale=scale, backend=backend)
    return state
