"""Pass-KV ring prefill: queries stay, KV blocks travel around the CP ring.

Each rank starts with its KV block (per request: the cached tokens it holds, then its share of the
new tokens), padded to the plan's largest block so every hop has one size. For N-1 hops it posts
the asynchronous send of the block in hand to rank r+1 and the receive of the next block from r-1,
*then* computes the partial attention of its local queries over the block in hand (only the tiles
the causal structure leaves visible), and folds it into the running (out, LSE) state. Received
blocks alternate between two buffers (double buffering, :meth:`Ring.rotate`: scratch tensors over
NCCL, window slots over the copy engine), so the transfer of hop s+1 overlaps the compute of hop s.
On CUDA, step 0's compute is queued before the rotation starts and, for short shards, the received
blocks' compute runs on a second stream beside it (see :func:`ring_pass_kv`).

With an FP8 KV cache the block is an :class:`~megacp.attention.blocks.FP8KVBlock`: the cache's FP8
rows travel as bytes (half of bf16's) and each rank dequantises the block in hand one key tile at a
time, inside its tiles (:mod:`megacp.attention.blocks`).

The loop is a sequence of (block source, tiles) steps over :meth:`Ring.rotate`; the training
backward (:mod:`megacp.attention.training`) replays the same rotation and tiles while the K/V
gradient accumulators follow the blocks around the ring, as in Transformer Engine's p2p CP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch
from torch import Tensor

from megacp.attention.blocks import FP8KVBlock, KVBlock, check_ring
from megacp.attention.kernels.merge import merge_into
from megacp.attention.kernels.tile_attention import run_tiles
from megacp.parallel.ring import Block, Ring, side_stream
from megacp.placement import ShardPlan, Tile

SECOND_STREAM_MAX_ROWS = 16384
"""Pass-KV computes the received blocks on a second stream when a rank holds at most this many
query rows. Measured on 2×H200 (``scripts/diagnostics/prefill_breakdown.py``): at 16K tokens (8K rows per rank,
~16 waves of attention CTAs, not power-limited) filling step 0's tail saves ~3%; from 64K on the
GPUs run at their power cap, the filled tail only lowers the clock, and at 128K-256K the concurrent
kernels were 1-4% slower."""


def ring_pass_kv(
    q: Tensor,
    kv_block: KVBlock | FP8KVBlock,
    plan: ShardPlan,
    ring: Ring | None,
    *,
    scale: float | None = None,
    backend: str | None = None,
    rows: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention of this rank's queries over every rank's KV block.

    Step 0 (the own block) starts the running state; steps ``>= 1`` run into a second state over
    the span of query rows they touch, merged into step 0's at the end. Each partial is rounded
    once to ``q.dtype`` (by the kernel, as in single-GPU attention); the second state is kept in
    fp32 from its second partial on, and the final merge computes in fp32 and rounds once, so the
    bf16 error does not grow with the CP size (``tests/distributed/test_numerics.py``).

    On CUDA, step 0's kernels are queued before anything else, and the transfers wait on an event
    recorded before them rather than on the stream (``Ring.rotate(ready=)``): the host-side launch
    of one cuDNN call takes ~0.1 ms, which an isolated call pays before its first kernel starts
    (H200, ``scripts/diagnostics/profile_prefill.py``). With at most :data:`SECOND_STREAM_MAX_ROWS` local rows
    steps ``>= 1`` run on a second compute stream: the received blocks do not depend on step 0, so
    their kernels fill the SMs that step 0's attention kernel leaves idle at its tail (with one
    stream, the next kernel starts only after the last CTA of the previous one ends). Over the copy
    engine, the push to rank ``j`` carries only the rows ``j`` reads (:meth:`ShardPlan.kv_rows_read`:
    a later rank reads only the first chunk of an earlier rank's block).

    Args:
        q: ``[n_local, Hq, D]`` local queries in ``plan.q_layout(rank)`` order.
        kv_block: this rank's keys (``[0]``) and values (``[1]``), ``plan.max_kv_block`` rows in
            ``plan.kv_layout(rank)`` order (padded at the end), stacked or as a pair (:data:`KVBlock`),
            or an :class:`FP8KVBlock` (its bytes travel; the block in hand is dequantised a key
            tile at a time).
        plan: the step's sharding plan; ring: the CP ring (``None`` when N = 1).
        rows: ``q`` holds only the local query rows ``[a, b)`` (a query tile: every rank rotates the
            whole blocks once per tile, with as many tiles on every rank); ``None``: all of them.

    Returns:
        ``(out [n_local, Hq, D] q.dtype, lse [n_local, Hq] fp32)`` (``b - a`` rows with ``rows``).
    """
    check_ring(plan, ring)
    r, n = plan.rank, plan.cp_size
    own = plan.tiles(r, r, rows)

    def attend(q_rows: Tensor, block: Block, step: int, tiles: Sequence[Tile],
               acc: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        return _attend(q_rows, kv_block, block, (r - step) % n, tiles, acc, scale=scale, backend=backend)

    wire: Block = kv_block.wire() if isinstance(kv_block, FP8KVBlock) else kv_block
    if ring is None:
        out, lse = attend(q, wire, 0, own, None)
        return out.to(q.dtype), lse
    state = ready = None
    if q.is_cuda:  # step 0 first: an isolated call waits for its first kernel's (slow) host-side launch
        ready = torch.cuda.Event()
        ready.record()  # the inputs are complete: the transfers and the second stream wait on this
        state = attend(q, wire, 0, own, None)
    later = [t for s in range(1, n) for t in plan.tiles(r, (r - s) % n, rows)]
    lo, hi = min((t.q0 for t in later), default=0), max((t.q1 for t in later), default=0)
    aux = _second_stream(q, ready)
    need = [plan.kv_rows_read(j, r) for j in range(n)]  # pushed to rank j (copy engine), no more
    rest = None
    # at step s the block of rank r - s is in hand
    for step, block in ring.rotate((wire[0], wire[1]), stream=aux, ready=ready, rows=need):
        if step == 0:
            if state is None:  # gloo: the transfers were posted first, step 0 overlaps them
                state = attend(q, block, 0, own, None)
            continue
        tiles = plan.tiles(r, (r - step) % n, rows)
        with torch.cuda.stream(aux) if aux is not None else contextlib.nullcontext():
            tiles = [dataclasses.replace(t, q0=t.q0 - lo, q1=t.q1 - lo) for t in tiles]
            if rest is not None and rest[0].dtype != torch.float32:  # a sum of partials is kept in fp32
                rest = (rest[0].float(), rest[1])
            rest = attend(q[lo:hi], block, step, tiles, rest)
    assert state is not None  # step 0 ran
    if rest is not None and hi > lo:
        _merge_later(state, rest, lo, hi, aux)
    return state[0].to(q.dtype), state[1]


def _attend(q: Tensor, kv_block: KVBlock | FP8KVBlock, block: Block, src: int, tiles: Sequence[Tile],
            acc: tuple[Tensor, Tensor] | None, *, scale: float | None, backend: str | None) -> tuple[Tensor, Tensor]:
    """``tiles`` of ``q`` ``[Lq, Hq, D]`` over ``block``, rank ``src``'s block in hand (in the form of
    ``kv_block``, or an FP8 block's bytes as they travel), folded into the running state ``acc``."""
    if isinstance(kv_block, FP8KVBlock):
        return kv_block.attend(q, block, src, tiles, acc, scale=scale, backend=backend)
    return run_tiles(q, block[0], block[1], tiles, acc, scale=scale, backend=backend)


def _second_stream(q: Tensor, ready: torch.cuda.Event | None) -> torch.cuda.Stream | None:
    """The stream steps ``>= 1`` run on: for CUDA queries of at most :data:`SECOND_STREAM_MAX_ROWS`
    rows a side stream that waits on ``ready`` (the inputs are complete; it needs ``q``, not step
    0's results), else ``None`` (the current stream)."""
    if not q.is_cuda or q.shape[0] > SECOND_STREAM_MAX_ROWS:
        return None
    aux = side_stream(q.device, "pass_kv later steps")
    assert ready is not None  # recorded on CUDA before step 0
    aux.wait_event(ready)
    return aux


def _merge_later(state: tuple[Tensor, Tensor], rest: tuple[Tensor, Tensor], lo: int, hi: int,
                 aux: torch.cuda.Stream | None) -> None:
    """Fold the state of steps ``>= 1`` (query rows ``[lo, hi)``, made on ``aux`` when given) into
    step 0's ``state`` ``(out [n_local, Hq, D], lse [n_local, Hq] fp32)``, in place."""
    if aux is not None:
        main = torch.cuda.current_stream(aux.device)
        main.wait_stream(aux)
        for t in rest:  # made on aux, read on main
            t.record_stream(main)
    merge_into(state[0][lo:hi], state[1][lo:hi], *rest)
