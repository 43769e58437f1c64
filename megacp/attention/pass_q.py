"""Pass-Q ring prefill: KV stays, query blocks travel around the CP ring.

Better than pass-KV when most of the context is already cached (T ≪ T+P): a query block is
smaller than the KV it would otherwise have to meet. Each rank computes the partial attention of
every visiting query block over its own KV block (cache + new), keeping the partial (out, LSE) of
each origin. The partials end on the wrong ranks, so one All2All returns them to the queries' owners,
which merge the N partials exactly. Query transfers overlap compute as in pass-KV; the final All2All
cannot (it needs every partial).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megacp.attention.blocks import FP8KVBlock, KVBlock, check_ring
from megacp.attention.kernels.merge import merge_stack, pack_states, unpack_states
from megacp.attention.kernels.tile_attention import run_tiles
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan, Tile


def ring_pass_q(
    q: Tensor,
    kv_block: KVBlock | FP8KVBlock,
    plan: ShardPlan,
    ring: Ring | None,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention of this rank's queries over every rank's KV block, moving queries.

    On CUDA, the partial over the own KV block (step 0) is queued before the rotation starts, which
    waits on an event recorded before it (as in :func:`~megacp.attention.pass_kv.ring_pass_kv`: an
    isolated call waits for its first kernel's host-side launch). Every partial is packed straight
    into its row range of the All2All's send buffer. Over the copy engine a push carries only the
    origin's own query rows (no padding).

    Args:
        q: ``[n_local, Hq, D]`` local queries in ``plan.q_layout(rank)`` order.
        kv_block: this rank's keys/values in ``plan.kv_layout(rank)`` order, stacked ``[2, L, Hkv, D]``
            or a pair (``L >= `` its block length; it never travels, so it needs no padding), or an
            :class:`FP8KVBlock` of it (dequantised a key tile at a time, inside the tiles).

    Returns:
        ``(out [n_local, Hq, D] q.dtype, lse [n_local, Hq] fp32)``.
    """
    check_ring(plan, ring)
    n, r = plan.cp_size, plan.rank

    def partial(q_rows: Tensor, tiles: Sequence[Tile]) -> tuple[Tensor, Tensor]:
        """``tiles`` of ``q_rows`` over this rank's KV block: ``(out in q.dtype, lse fp32)``."""
        if isinstance(kv_block, FP8KVBlock):
            out, lse = kv_block.attend(q_rows, kv_block.data, r, tiles, None, scale=scale, backend=backend)
            return out.to(q.dtype), lse
        return run_tiles(q_rows, kv_block[0], kv_block[1], tiles, None, scale=scale, backend=backend)

    if n == 1:
        return partial(q, plan.tiles(r, r))
    hq, d = q.shape[1], q.shape[2]
    # [N origins of the queries, max_local rows, packed (out, lse) bytes]; rows past an origin's
    # count are never read
    send = torch.empty((n, plan.max_local, hq * d * q.element_size() + hq * 4), dtype=torch.uint8, device=q.device)

    def attend(origin: int, q_rows: Tensor) -> None:
        """Partial attention of ``origin``'s query rows over this rank's KV block, packed into ``send[origin]``."""
        out, lse = partial(q_rows, plan.tiles(origin, r))
        pack_states(out, lse, into=send[origin, : q_rows.shape[0]])

    padded = q
    if q.shape[0] != plan.max_local or not q.is_contiguous():  # every hop carries one size
        padded = q.new_zeros((plan.max_local, hq, d))
        padded[: q.shape[0]] = q
    ready = None
    if q.is_cuda:  # step 0 first; the transfers wait on ``ready``, not on it
        ready = torch.cuda.Event()
        ready.record()
        attend(r, q)
    assert ring is not None  # check_ring: a ring for n > 1
    for step, q_block in ring.rotate(padded, ready=ready, rows=[q.shape[0]] * n):  # queries of rank r - step
        if step == 0:
            if ready is None:  # gloo: the transfers were posted first, step 0 overlaps them
                attend(r, q)
            continue
        origin = (r - step) % n
        attend(origin, q_block[: plan.num_local(origin)])  # type: ignore[arg-type]  # one tensor rotates
    received = ring.all_to_all(send)  # [N holders of KV, max_local, bytes]: partials of my queries
    outs, lses = unpack_states(received[:, : q.shape[0]], hq, d, q.dtype)
    return merge_stack(outs, lses)
