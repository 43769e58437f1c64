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

With an FP8 KV cache the block is an :class:`FP8KVBlock`: the cache's FP8 rows travel as bytes (half
of bf16's) and each rank dequantises the block in hand before its tiles.

The loop is a sequence of (block source, tiles) steps over :meth:`Ring.rotate`; the training
backward (:mod:`megacp.attention.training`) replays the same rotation and tiles while the K/V
gradient accumulators follow the blocks around the ring, as in Transformer Engine's p2p CP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from megacp.attention.merge import merge_into
from megacp.attention.tile_attention import run_tiles
from megacp.kv_cache import dequantize_fp8
from megacp.parallel.ring import Block, Ring, side_stream
from megacp.placement import ShardPlan

KVBlock = Tensor | tuple[Tensor, Tensor]
"""A rank's KV block: ``[2, L, Hkv, D]`` (keys ``[0]``, values ``[1]``), or the pair ``(k, v)`` of
``[L, Hkv, D]`` contiguous tensors when they already are the block (no copy; see
:func:`~megacp.attention.prefill.build_kv_block`)."""


@dataclass(frozen=True)
class FP8KVBlock:
    """A rank's KV block in an FP8 KV cache's format (:mod:`megacp.kv_cache`).

    Attributes:
        data: the block (:data:`KVBlock`) as ``float8_e4m3fn``, ``L`` rows in
            ``plan.kv_layout(rank)`` order.
        scales: ``[B, 2, Hkv]`` fp32 power-of-two scales of each request of the step (K then V),
            the same on every CP rank, so they need not travel with the block.
        owners: ``[N, L]`` int64, the request of each row of rank ``j``'s block (padding rows:
            any; their bytes are zero), :func:`~megacp.attention.prefill.block_owners`.
        dtype: the compute dtype the block in hand is dequantised to.
    """

    data: KVBlock
    scales: Tensor
    owners: Tensor
    dtype: torch.dtype

    def wire(self) -> Block:
        """The block as the ring passes it: ``uint8`` views of :attr:`data` (gloo has no float8)."""
        if isinstance(self.data, tuple):
            return self.data[0].view(torch.uint8), self.data[1].view(torch.uint8)
        return self.data.view(torch.uint8)

    def dequantize(self, block: Block, src: int, rows: int) -> tuple[Tensor, Tensor]:
        """Keys and values ``[rows, Hkv, D]`` in :attr:`dtype`: the first ``rows`` of ``block``,
        rank ``src``'s block as stored or received (``float8_e4m3fn`` or ``uint8``, stacked or a pair)."""
        scale = self.scales.index_select(0, self.owners[src, :rows])[:, :, :, None]  # [rows, 2, Hkv, 1]
        return (dequantize_fp8(block[0][:rows], scale[:, 0], self.dtype),
                dequantize_fp8(block[1][:rows], scale[:, 1], self.dtype))

SECOND_STREAM_MAX_ROWS = 16384
"""Pass-KV computes the received blocks on a second stream when a rank holds at most this many
query rows. Measured on 2×H200 (``scripts/diagnostics/prefill_breakdown.py``): at 16K tokens (8K rows per rank,
~16 waves of attention CTAs, not power-limited) filling step 0's tail saves ~3%; from 64K on the
GPUs run at their power cap, the filled tail only lowers the clock, and at 128K-256K the concurrent
kernels were 1-4% slower."""


def check_ring(plan: ShardPlan, ring: Ring | None) -> None:
    """Raise ``ValueError`` unless ``ring`` fits ``plan``: a ring of ``plan.cp_size`` ranks, or
    ``None`` for CP = 1 (a missing ring would otherwise compute only the own block's share)."""
    if plan.cp_size > 1 and ring is None:
        raise ValueError(f"CP size {plan.cp_size} needs a ring (process group)")
    if ring is not None and ring.size != plan.cp_size:
        raise ValueError(f"plan is for CP size {plan.cp_size} but the group has {ring.size} ranks")


def ring_pass_kv(
    q: Tensor,
    kv_block: KVBlock | FP8KVBlock,
    plan: ShardPlan,
    ring: Ring | None,
    *,
    scale: float | None = None,
    backend: str | None = None,
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
            or an :class:`FP8KVBlock` (its bytes travel; every block in hand is dequantised).
        plan: the step's sharding plan; ring: the CP ring (``None`` when N = 1).

    Returns:
        ``(out [n_local, Hq, D] q.dtype, lse [n_local, Hq] fp32)``.
    """
    check_ring(plan, ring)
    r, n = plan.rank, plan.cp_size
    own = plan.tiles(r, r)
    fp8 = kv_block if isinstance(kv_block, FP8KVBlock) else None

    def in_hand(block: Block, step: int) -> tuple[Tensor, Tensor]:
        """The block of rank ``r - step`` to compute on (an FP8 block: the rows this rank reads, dequantised)."""
        if fp8 is None:
            return block[0], block[1]
        src = (r - step) % n
        return fp8.dequantize(block, src, plan.kv_rows_read(r, src))

    wire: Block = fp8.wire() if fp8 is not None else kv_block  # type: ignore[assignment]  # not FP8: a KVBlock
    if ring is None:
        return run_tiles(q, *in_hand(wire, 0), own, None, scale=scale, backend=backend)
    state = ready = None
    if q.is_cuda:  # step 0 first: an isolated call waits for its first kernel's (slow) host-side launch
        ready = torch.cuda.Event()
        ready.record()  # the inputs are complete: the transfers and the second stream wait on this
        state = run_tiles(q, *in_hand(wire, 0), own, None, scale=scale, backend=backend)
    later = [t for s in range(1, n) for t in plan.tiles(r, (r - s) % n)]
    lo, hi = min((t.q0 for t in later), default=0), max((t.q1 for t in later), default=0)
    aux = side_stream(q.device, "pass_kv later steps") if q.is_cuda and q.shape[0] <= SECOND_STREAM_MAX_ROWS else None
    if aux is not None:
        main = torch.cuda.current_stream(q.device)
        assert ready is not None  # recorded above on CUDA
        aux.wait_event(ready)  # aux needs q, not step 0's results
    need = [plan.kv_rows_read(j, r) for j in range(n)]  # pushed to rank j (copy engine), no more
    rest = None
    # at step s the block of rank r - s is in hand
    for step, block in ring.rotate((wire[0], wire[1]), stream=aux, ready=ready, rows=need):
        if step == 0:
            if state is None:  # gloo: the transfers were posted first, step 0 overlaps them
                state = run_tiles(q, *in_hand(block, 0), own, None, scale=scale, backend=backend)
            continue
        tiles = plan.tiles(r, (r - step) % n)
        with torch.cuda.stream(aux) if aux is not None else contextlib.nullcontext():
            tiles = [dataclasses.replace(t, q0=t.q0 - lo, q1=t.q1 - lo) for t in tiles]
            if rest is not None and rest[0].dtype != torch.float32:  # a sum of partials is kept in fp32
                rest = (rest[0].float(), rest[1])
            rest = run_tiles(q[lo:hi], *in_hand(block, step), tiles, rest, scale=scale, backend=backend)
    if rest is not None and hi > lo:
        if aux is not None:
            main.wait_stream(aux)
            for t in rest:  # made on aux, read on main
                t.record_stream(main)
        assert state is not None  # step 0 ran
        merge_into(state[0][lo:hi], state[1][lo:hi], *rest)
    assert state is not None
    return state
