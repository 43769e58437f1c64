"""Pass-Q ring prefill: KV stays, query blocks travel around the CP ring.

Better than pass-KV when most of the context is already cached (T ≪ T+P): a query block is
smaller than the KV it would otherwise have to meet. Each rank computes the partial attention of
every visiting query block over its own KV block (cache + new), keeping the partial (out, LSE) of
each origin. The partials end on the wrong ranks, so one All2All returns them to the queries' owners,
which merge the N partials exactly. Query transfers overlap compute as in pass-KV; the final All2All
cannot (it needs every partial).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megacp.attention.merge import merge_stack, pack_states, unpack_states
from megacp.attention.pass_kv import KVBlock
from megacp.attention.sharding import ShardPlan
from megacp.attention.tiles import run_tiles
from megacp.parallel.ring import Ring


def ring_pass_q(
    q: Tensor,
    kv_block: KVBlock,
    plan: ShardPlan,
    ring: Ring | None,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention of this rank's queries over every rank's KV block, moving queries.

    Args:
        q: ``[n_local, Hq, D]`` local queries in ``plan.q_layout(rank)`` order.
        kv_block: this rank's keys/values in ``plan.kv_layout(rank)`` order, stacked ``[2, L, Hkv, D]``
            or a pair (``L >= `` its block length; it never travels, so it needs no padding).

    Returns:
        ``(out [n_local, Hq, D] q.dtype, lse [n_local, Hq] fp32)``.
    """
    n, r = plan.cp_size, plan.rank
    if n == 1:
        return run_tiles(q, kv_block[0], kv_block[1], plan.tiles(r, r), None, scale=scale, backend=backend)
    hq, d = q.shape[1], q.shape[2]
    padded = q.new_zeros((plan.max_local, hq, d))
    padded[: q.shape[0]] = q
    partials: list[Tensor | None] = [None] * n  # packed (out, lse) of each origin's queries
    for step, q_block in ring.rotate(padded):  # queries of rank r - step in hand
        origin = (r - step) % n
        rows = plan.num_local(origin)
        out, lse = run_tiles(q_block[:rows], kv_block[0], kv_block[1], plan.tiles(origin, r), None,
                             scale=scale, backend=backend)
        partials[origin] = torch.nn.functional.pad(pack_states(out, lse), (0, 0, 0, plan.max_local - rows))
    received = ring.all_to_all(torch.stack(partials))  # [N origins-of-KV, max_local, bytes]
    outs, lses = unpack_states(received[:, : q.shape[0]], hq, d, q.dtype)
    return merge_stack(outs, lses)
