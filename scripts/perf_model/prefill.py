"""Ring prefill (pass-KV, pass-Q) of one attention layer: kernel calls from megacp's own plan,
the memory work around them, the ring's transfers, in lockstep steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from megacp.attention.strategy import choose_strategy
from megacp.placement import ShardPlan, Tile, shard_ranges
from scripts.perf_model.hardware import Machine
from scripts.perf_model.shapes import AttnShape

# HBM bytes per output element (one query row × head × head-dim value) of the memory-bound work
# around the kernels (e = bytes per element of the activations).
MERGE_INTO_PASSES = 5
"""Passes of ``e`` bytes charged per element of every ``merge_into`` (online merge of a partial
into a running state). On GPUs ``merge_into`` is the fused Triton kernel: it reads the running
output and the partial and writes the running output once (3 passes, plus the fp32 LSEs); the
torch path (no Triton) is ``merge_states`` and two copies. The model charges 5, the count its
validation runs were fitted with, so it overstates the merge's HBM time slightly."""


def _split_merge_bytes(e: int) -> int:
    """``partial_attention`` splits a bottom-right causal tile with ``Lq < Lk`` into a dense and a
    causal call and merges them with ``merge_states`` in fp32, then casts back: 3e + 40 bytes."""
    return 3 * e + 40


def _merge_stack_bytes(n: int, e: int) -> int:
    """Bytes charged per output element of ``merge_stack`` of N partials, counted as its torch path
    runs: ``outs * w`` reads N×e and writes N×4 (fp32), the sum reads N×4 and writes 4, the cast
    reads 4 and writes e. On GPUs it is one fused Triton kernel (reads N×e, writes e), so this
    overstates pass-Q's final merge."""
    return n * (e + 8) + 8 + e


@dataclass(frozen=True)
class RingPlan:
    """Host-side facts of one ring prefill: ``tiles[step][rank]`` are the kernel tiles the rank
    runs at that step; message sizes in tokens."""

    tiles: tuple[tuple[tuple[Tile, ...], ...], ...]
    rows: tuple[int, ...]
    max_local: int
    max_kv_block: int


@lru_cache(maxsize=32)
def ring_plan(new: tuple[int, ...], cached: tuple[int, ...], cp: int, strategy: str) -> RingPlan:
    """Tiles of every step and rank from :class:`~megacp.placement.ShardPlan` (cached
    tokens are taken to come from one earlier prefill, so rank j holds its load-balanced share).

    Pass-KV: at step s rank r runs its queries over rank (r−s)'s KV block. Pass-Q: rank r runs the
    queries of rank (r−s) over its own KV block.
    """
    prefix = [[sum(b - a for a, b in shard_ranges(0, p, cp, j)) for p in cached] for j in range(cp)]
    plan = ShardPlan(list(cached), list(new), cp, 0, prefix_counts=prefix)
    pairs = (lambda r, s: (r, (r - s) % cp)) if strategy == "pass_kv" else (lambda r, s: ((r - s) % cp, r))
    tiles = tuple(tuple(tuple(plan.tiles(*pairs(r, s))) for r in range(cp)) for s in range(cp))
    return RingPlan(tiles, tuple(plan.num_local(r) for r in range(cp)), plan.max_local, plan.max_kv_block)


@dataclass(frozen=True)
class PrefillCost:
    """Predicted ring prefill of one attention layer; the parts add up to ``total_s``.

    Attributes:
        compute_s: attention kernels on the critical path (slowest rank of each step).
        memory_s: HBM-bound work on the critical path (merges, packing, copies).
        exposed_comm_s: ring transfers not hidden behind compute, plus pass-Q's All2All.
        overhead_s: the fixed call cost and steps bounded by the host.
        hide_bandwidth: per-GPU link bandwidth (bytes/s) at which every ring transfer just hides
            behind its step's work (latency ignored; 0 without transfers).
    """

    strategy: str
    cp: int
    total_s: float
    compute_s: float
    memory_s: float
    exposed_comm_s: float
    overhead_s: float
    hide_bandwidth: float


def _tile_cost(m: Machine, shape: AttnShape, t: Tile) -> tuple[float, float]:
    """(kernel seconds, HBM seconds) of one tile as ``partial_attention`` runs it."""
    lq, lk, k = t.q1 - t.q0, t.k1 - t.k0, m.kernels
    if not t.causal:
        return k.call_s(shape.pair_flops * lq * lk, causal=False), 0.0
    if lq >= lk:  # the first lq - lk queries see nothing: a square causal call on the rest
        return k.call_s(shape.causal_flops(lk), causal=True), 0.0
    kernel = k.call_s(shape.pair_flops * lq * (lk - lq), causal=False) + k.call_s(shape.causal_flops(lq), causal=True)
    elems = lq * shape.num_heads * shape.head_dim
    return kernel, elems * _split_merge_bytes(shape.elem_bytes) / m.copy_bandwidth


def _step_work(m: Machine, shape: AttnShape, tiles: Sequence[Tile], rows: int, fresh: bool) -> tuple[float, float]:
    """(kernel s, HBM s) of one rank's tiles in one step; ``fresh``: they start a new state
    (``run_tiles(acc=None)``), else each is charged one merge into a running state.

    ``ring_pass_kv`` folds steps ``>= 1`` into a second state over the rows they touch (step 1
    starts it) and merges that into step 0's state once at the end: N − 1 merges per row, the count
    charged here as one per step ``>= 1``."""
    kernel = memory = 0.0
    out_row = shape.q_bytes(1)
    for t in tiles:
        kt, mt = _tile_cost(m, shape, t)
        kernel += kt
        memory += mt
        if not fresh:
            memory += MERGE_INTO_PASSES * (t.q1 - t.q0) * out_row / m.copy_bandwidth
    if fresh and not (len(tiles) == 1 and tiles[0].q1 - tiles[0].q0 == rows):
        # empty_state zero-fills the rows, each tile's output is copied in
        memory += (rows + 2 * sum(t.q1 - t.q0 for t in tiles)) * out_row / m.copy_bandwidth
    return kernel, memory


def _all_to_all_s(m: Machine, piece: float, cp: int, tp: int) -> float:
    """One All2All of ``piece`` bytes to each of the other cp−1 ranks; in-node and inter-node
    peers are served concurrently by NVLink and the NIC."""
    in_node = min(cp, max(1, m.gpus_per_node // tp)) - 1
    out_node = cp - 1 - in_node
    link = m.link(cp * tp)
    return link.latency_s + max(in_node * piece / m.intra.bandwidth, out_node * piece / m.inter.bandwidth)


def prefill_time(
    m: Machine,
    shape: AttnShape,
    new_tokens: int | Sequence[int],
    cached_tokens: int | Sequence[int] = 0,
    *,
    cp: int,
    tp: int = 1,
    strategy: str = "pass_kv",
) -> PrefillCost:
    """Predicted time of one CP prefill attention call (one layer) on ``cp`` ranks of ``tp`` GPUs.

    Args:
        shape: attention shape of one GPU (heads divided by TP, see :meth:`AttnShape.of`).
        new_tokens, cached_tokens: T and P per request (one int = one request).
        strategy: ``"pass_kv"``, ``"pass_q"`` or ``"auto"`` (the paper's rule through
            :func:`~megacp.attention.strategy.choose_strategy` with :meth:`Machine.hardware`).
    """
    new = (new_tokens,) if isinstance(new_tokens, int) else tuple(new_tokens)
    cached = (cached_tokens,) * len(new) if isinstance(cached_tokens, int) else tuple(cached_tokens)
    if strategy == "auto":
        hw = m.hardware(shape, sum(new), sum(cached), cp, tp)
        strategy = choose_strategy(sum(new), sum(cached), num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                   cp_size=cp, elem_bytes=shape.elem_bytes, hw=hw).strategy
    if strategy not in ("pass_kv", "pass_q"):
        raise ValueError(f"strategy {strategy!r} is not one of pass_kv, pass_q, auto")
    plan = ring_plan(new, cached, cp, strategy)
    link = m.link(cp * tp)
    if strategy == "pass_kv":
        hop_bytes = shape.kv_bytes(plan.max_kv_block)
    else:
        hop_bytes = shape.q_bytes(plan.max_local)
    compute = memory = exposed = overhead = hide = 0.0
    for step, per_rank in enumerate(plan.tiles):
        work = []
        for r, tiles in enumerate(per_rank):
            rows = plan.rows[(r - step) % cp] if strategy == "pass_q" else plan.rows[r]
            kt, mt = _step_work(m, shape, tiles, rows, fresh=step == 0 or strategy == "pass_q")
            if strategy == "pass_q" and cp > 1:  # pack_states into the send buffer (charged twice: see below)
                mt += (2 * shape.q_bytes(rows) + 2 * shape.state_bytes(plan.max_local)) / m.copy_bandwidth
            work.append((kt + mt, kt, mt))
        gpu, kt, mt = max(work)
        comm = link.transfer_s(hop_bytes) if step + 1 < cp else 0.0
        if comm:
            hide = max(hide, hop_bytes / gpu if gpu > 0 else math.inf)
        host = m.host_step_s if cp > 1 else 0.0
        compute, memory = compute + kt, memory + mt
        exposed += max(0.0, comm - gpu)
        overhead += max(0.0, host - max(gpu, comm))
    if cp * tp > m.gpus_per_node:  # the ring leaves the node: NCCL transport
        overhead += m.call_overhead_s
    if strategy == "pass_q" and cp > 1:
        # Charged: a zero-filled, padded copy of the queries, a stack of the N padded partials, the
        # All2All's copy of the own slice and merge_stack: the passes the validation run was fitted
        # with. ring_pass_q pads the queries only when the shard is ragged, packs each partial
        # straight into its rows of the All2All send buffer and merges the received views with
        # merge_stack (fused on GPUs), so these passes overstate its memory time a little.
        piece = shape.state_bytes(plan.max_local)
        elems = plan.max_local * shape.num_heads * shape.head_dim
        copies = 3 * shape.q_bytes(plan.max_local) + 2 * cp * piece + 2 * piece
        memory += (copies + elems * _merge_stack_bytes(cp, shape.elem_bytes)) / m.copy_bandwidth
        exposed += _all_to_all_s(m, piece, cp, tp)
    total = compute + memory + exposed + overhead
    return PrefillCost(strategy, cp, total, compute, memory, exposed, overhead, hide)
