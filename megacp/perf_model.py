"""Analytical cost model of megacp's CP prefill, decode and generation, calibrated on 2× H200.

Units everywhere: seconds (``_s``), bytes, FLOPs, FLOP/s and bytes/s. ``docs/SCALING.md`` explains
the model, its assumptions, its validation against the measured 2-GPU numbers and the projections;
``scripts/perf_model_report.py`` prints them.

What is modelled (one CP rank = ``tp`` GPUs of one node; attention heads split over TP):

* **Ring prefill** (pass-KV, pass-Q). The sharding plan and tile planner of
  :mod:`megacp.attention` give, for every ring step and every rank, the kernel calls the rank makes
  (step 0: one causal call over its 2 local chunks; other steps: one dense S/(2N)×S/N block for a
  full prefill). A call of F FLOPs costs ``launch + F / C(F, kind)``: the achieved attention FLOP/s
  ``C`` of one GPU depends on the kind (causal/dense) and size of the call (:class:`KernelRates`,
  fitted to the single-GPU measurements). Merges, state packing and copies cost their HBM bytes.
  Steps run in lockstep: a step lasts ``max(slowest rank's kernels + memory work, the hop's
  transfer, the host's time to issue it)``. Pass-Q adds the stack, the All2All of the partial
  outputs and the final merge, none of which overlaps.
* **All-gather decode**: the KV bytes each rank reads at HBM bandwidth, a fixed per-call floor,
  one all-gather of the packed (out, LSE) (a ring collective: one small-message hop latency per
  rank) and the merge.
* **Generation TTFT** of a Llama-shaped model: per layer the CP attention above plus the KV-block
  and cache copies, plus the linear layers (FLOPs at a lumped achieved rate that also absorbs the
  elementwise work, fitted to the CP=1 TTFT) and, with TP, two all-reduces per layer.

What is not modelled: SM contention between NCCL kernels and attention kernels, clock changes when
more GPUs share a node's power and cooling, congestion of a shared inter-node fabric, and
per-layer host work of the CP layer (visible at 32K, see the validation).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import pairwise
from pathlib import Path

from megacp.attention.strategy import Hardware, choose_strategy
from megacp.models.config import ModelConfig
from megacp.placement import ShardPlan, Tile, shard_ranges

KiB, MiB = 2**10, 2**20

# HBM bytes per output element (one query row × head × head-dim value) of the memory-bound work,
# counted from the code in megacp/attention (e = bytes per element of the activations).
MERGE_INTO_PASSES = 5
"""``merge_into``: ``mul_`` reads and writes the running output, ``addcmul_`` reads it and the
partial and writes it: 5 passes of ``e`` bytes."""


def _split_merge_bytes(e: int) -> int:
    """``partial_attention`` splits a bottom-right causal tile with ``Lq < Lk`` into a dense and a
    causal call and merges them with ``merge_states`` in fp32, then casts back: 3e + 40 bytes."""
    return 3 * e + 40


def _merge_stack_bytes(n: int, e: int) -> int:
    """``merge_stack`` of N partials: ``outs * w`` reads N×e and writes N×4 (fp32), the sum reads
    N×4 and writes 4, the cast reads 4 and writes e."""
    return n * (e + 8) + 8 + e


KV_COPY_PASSES = 2
"""Per layer of a full prefill, the KV cache write reads and writes the local K and V once (2 passes);
``build_kv_block`` hands them to the ring as they are (a prompt split evenly over the ranks has no
padding). Before the fourth session it also zero-filled and copied them (5 passes in all; the first
sessions' TTFT runs, docs/results/ttft_h200x2.json, were made then; ttft_h200x2_s5.json is the
fifth session's)."""

DECODE_MERGE_KERNELS = 1
"""Small kernels after the decode all-gather: unpack views are free; ``merge_stack`` is one fused
Triton kernel on GPUs (four torch kernels — logsumexp, exp, multiply-sum, cast — without Triton)."""


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class AttnShape:
    """Attention shape on one GPU: query heads NH, KV heads NKV, head dim D, bytes per element e."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int = 2

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int = 1, elem_bytes: int = 2) -> AttnShape:
        """Heads of one of ``tp`` tensor-parallel GPUs (KV heads are replicated when TP > NKV)."""
        if cfg.num_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
            raise ValueError(f"TP={tp} does not divide {cfg.num_heads} query / {cfg.num_kv_heads} KV heads")
        return cls(cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), int(cfg.head_dim), elem_bytes)

    @property
    def pair_flops(self) -> int:
        """FLOPs of one visible (query, key) pair over all heads: QKᵀ and PV, 2 each: 4·NH·D."""
        return 4 * self.num_heads * self.head_dim

    def causal_flops(self, tokens: int) -> float:
        """FLOPs of causal attention over ``tokens`` (the benchmarks' 2·S²·NH·D convention)."""
        return self.pair_flops * tokens * tokens / 2

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of K and V of ``tokens`` tokens."""
        return 2 * tokens * self.num_kv_heads * self.head_dim * self.elem_bytes

    def q_bytes(self, tokens: int) -> int:
        """Bytes of the queries (or the outputs) of ``tokens`` tokens."""
        return tokens * self.num_heads * self.head_dim * self.elem_bytes

    def state_bytes(self, tokens: int) -> int:
        """Bytes of packed (out, fp32 LSE) states of ``tokens`` tokens (``pack_states``)."""
        return tokens * self.num_heads * (self.head_dim * self.elem_bytes + 4)


LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=1 << 20)
"""The Llama-3-8B shape of ``scripts/bench_generate.py`` (32 layers, 32 Q / 8 KV heads, D = 128)."""

LLAMA3_405B = ModelConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126,
                          num_heads=128, num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=1 << 20)
"""Llama3-405B: 126 layers, 128 Q / 8 KV heads, D = 128, FFN 53248."""

PAPER_405B_TTFT_S = {131072: 3.8, 1048576: 77.0}
"""The paper's measured prefill of Llama3-405B on 16 nodes × 8 H100 (CP16 × TP8), in seconds."""


def linear_flops_per_token(cfg: ModelConfig) -> float:
    """FLOPs of the linear layers of all layers for one token (QKV, output projection, SwiGLU)."""
    h, d = cfg.hidden_size, int(cfg.head_dim)
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    return 2.0 * per_layer * cfg.num_layers


# --------------------------------------------------------------------------- hardware


def _saturation(flops: float, half_flops: float) -> float:
    return flops / (flops + half_flops)


@dataclass(frozen=True)
class KernelRates:
    """Achieved attention FLOP/s of one GPU by kind and size of the kernel call.

    ``causal`` and ``dense`` are ``(FLOPs of one call, FLOP/s)`` points in ascending FLOPs. Between
    points the rate is interpolated linearly in log FLOPs; above the largest it stays constant;
    below the smallest it falls off as the saturating ``F / (F + half_flops)`` (a fixed per-call
    cost of ``half_flops / rate``), scaled to meet the smallest point.
    """

    causal: tuple[tuple[float, float], ...]
    dense: tuple[tuple[float, float], ...]
    half_flops: float
    launch_s: float

    def rate(self, flops: float, causal: bool) -> float:
        """FLOP/s of one call of ``flops`` FLOPs."""
        pts = self.causal if causal else self.dense
        (f0, r0), (fl, rl) = pts[0], pts[-1]
        if flops <= f0:
            return r0 * _saturation(flops, self.half_flops) / _saturation(f0, self.half_flops)
        if flops >= fl:
            return rl
        for (fa, ra), (fb, rb) in pairwise(pts):
            if flops <= fb:
                w = math.log(flops / fa) / math.log(fb / fa)
                return ra + w * (rb - ra)
        raise AssertionError("unreachable: flops inside the table")

    def call_s(self, flops: float, causal: bool) -> float:
        """Seconds of one kernel call (0 for an empty call)."""
        return 0.0 if flops <= 0 else self.launch_s + flops / self.rate(flops, causal)


def fit_kernel_rates(
    shape: AttnShape,
    causal_s: Mapping[int, float],
    bound_efficiency: Mapping[int, float],
    *,
    cp: int = 2,
    launch_s: float = 5e-6,
    rounds: int = 8,
) -> KernelRates:
    """Kernel rates from single-GPU causal times and the zero-communication bound of the ring.

    Args:
        shape: the attention shape of the measurements.
        causal_s: sequence length → seconds of one causal call on one GPU.
        bound_efficiency: sequence length → ``T1 / (cp · T_bound)`` where ``T_bound`` is one causal
            call over S/cp tokens plus one dense S/(2cp) × S/cp block, timed alone (no ring).
        cp: the CP size of the bound.

    The dense block of the bound is what is left of ``T_bound`` after the causal call; the causal
    call at S/cp may lie below the measured lengths, so the fall-off ``half_flops`` (fitted to the
    two smallest dense blocks) and the dense points are solved together by a few fixed-point rounds.
    """
    causal = tuple(sorted((shape.causal_flops(s), shape.causal_flops(s) / (t - launch_s)) for s, t in causal_s.items()))
    lengths = sorted(bound_efficiency)
    rates = KernelRates(causal, causal, half_flops=0.0, launch_s=launch_s)
    for _ in range(rounds):
        dense = []
        for s in lengths:
            t_bound = causal_s[s] / (cp * bound_efficiency[s])
            t_dense = t_bound - rates.call_s(shape.causal_flops(s // cp), causal=True)
            flops = shape.pair_flops * (s // (2 * cp)) * (s // cp)
            dense.append((float(flops), flops / (t_dense - launch_s)))
        (fa, ra), (fb, rb) = dense[0], dense[1]
        # rate = r_inf · F / (F + F½) through both points: ra/rb = fa (fb + F½) / (fb (fa + F½))
        k = ra / rb
        half = max(0.0, fb * fa * (k - 1) / (fa - k * fb))
        rates = KernelRates(causal, tuple(dense), half_flops=half, launch_s=launch_s)
    return rates


@dataclass(frozen=True)
class Link:
    """One GPU's path to a peer: a transfer of B bytes takes ``latency_s + B / bandwidth``; one step
    of a small-message collective (NCCL's low-latency protocol) costs ``hop_s``."""

    latency_s: float
    bandwidth: float
    hop_s: float

    def transfer_s(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """A cluster of nodes of ``gpus_per_node`` GPUs and every constant of the model.

    Attributes:
        kernels: attention kernel rates of one GPU.
        hbm_bandwidth: HBM bandwidth one GPU's decode attention kernel achieves (bytes/s).
        copy_bandwidth: HBM bandwidth of PyTorch's copy and elementwise kernels (merges, packing,
            KV copies), lower than a tuned streaming kernel's (bytes/s).
        intra: GPU↔GPU inside a node with both directions busy (a ring step).
        inter: one GPU's share of the inter-node network (bytes/s per GPU).
        linear_flops: lumped achieved FLOP/s of a model's linear layers and elementwise work.
        call_overhead_s: fixed cost of one CP ring prefill call over NCCL (a ring that spans
            nodes): host planning and launch, rank skew, NCCL start-up. Rings inside a node use the
            copy-engine transport, which measured no such residual.
        host_step_s: host time to issue one ring step (~5 kernel launches and a
            ``batch_isend_irecv``); a step never takes less.
        decode_floor_s: fixed cost of one decode attention call (launch, sync, kernel tail).
        small_kernel_s: one small elementwise kernel (decode merge).
        allgather_base_s: all-gather cost beyond its per-hop latencies.
    """

    name: str
    kernels: KernelRates
    hbm_bandwidth: float
    copy_bandwidth: float
    intra: Link
    inter: Link
    gpus_per_node: int
    linear_flops: float
    call_overhead_s: float
    host_step_s: float
    decode_floor_s: float
    small_kernel_s: float
    allgather_base_s: float

    def link(self, gpus: int) -> Link:
        """The slowest hop of a ring over ``gpus`` consecutive GPUs."""
        return self.intra if gpus <= self.gpus_per_node else self.inter

    def comm_free(self) -> Machine:
        """The same GPUs with free communication and no fixed overheads (the comm-free bound)."""
        free = Link(0.0, math.inf, 0.0)
        return replace(self, name=f"{self.name}, comm-free", intra=free, inter=free, call_overhead_s=0.0,
                       host_step_s=0.0, allgather_base_s=0.0)

    def hardware(self, shape: AttnShape, new_tokens: int, cached_tokens: int, cp: int, tp: int = 1) -> Hardware:
        """C and BW for the paper's strategy rule (:func:`~megacp.attention.strategy.choose_strategy`),
        per GPU: the dense rate of one ring step's work (T/N queries over (T+P)/N keys) and the
        ring's link bandwidth."""
        block = shape.pair_flops * -(-new_tokens // cp) * -(-(new_tokens + cached_tokens) // cp)
        return Hardware(self.kernels.rate(block, causal=False), self.link(cp * tp).bandwidth, "perf_model")


# --------------------------------------------------------------------------- measured on 2× H200

H200_ATTN = AttnShape(num_heads=32, num_kv_heads=8, head_dim=128, elem_bytes=2)
"""The shape of every attention benchmark (Llama-3-8B attention, bf16)."""

H200_CAUSAL_S = {16384: 3.5279359817504883e-3, 65536: 58.01448059082031e-3, 131072: 251.96176147460938e-3, 262144: 1102.9921875e-3}
"""One causal cuDNN call on one H200 (docs/results/prefill_h200x2_s3_run3.json, ``single_cudnn``)."""

H200_BOUND_EFFICIENCY = {16384: 0.93, 65536: 1.00, 131072: 1.09, 262144: 1.12}
"""Zero-communication bound at CP2 (issue 3): one causal call over S/2 tokens plus one dense
S/4 × S/2 block, cuDNN, timed alone on one H200."""

NVLINK_H200 = Link(latency_s=45e-6, bandwidth=312e9, hop_s=3e-6)
"""NV18 NVLink send/recv (../shared/GPU_NOTES.md): 45 µs + B/370 GB/s fits 1 MiB (22 GB/s) … 256 MiB (351 GB/s)
one way; both directions at once 297 GB/s at 256 MiB ⇒ 312 GB/s for a ring step. Small-message
hop 3 µs (assumed; the CP2 all-gather of 8 KB is 17.8 µs in a CUDA graph)."""

IB_400G = Link(latency_s=20e-6, bandwidth=50e9, hop_s=10e-6)
"""400 Gb/s RDMA NIC per GPU = 50 GB/s per GPU (assumed latencies: 20 µs per transfer, 10 µs per
small-message hop)."""

IB_800G = Link(latency_s=20e-6, bandwidth=100e9, hop_s=10e-6)
"""The faster option: an 800 Gb/s NIC per GPU (100 GB/s per GPU), same latencies."""

H200 = Machine(
    name="H200 nodes (8 GPUs, NVLink), 400 Gb/s per GPU between nodes",
    kernels=fit_kernel_rates(H200_ATTN, H200_CAUSAL_S, H200_BOUND_EFFICIENCY),
    hbm_bandwidth=4.4e12,  # fitted to single-GPU decode 128K/1M, B = 1/8 (../shared/GPU_NOTES.md: 4.3-4.7 TB/s)
    copy_bandwidth=3.5e12,  # build_kv_block at 256K: 1.61 GB zero-fill + copies in 0.458 ms
    intra=NVLINK_H200,
    inter=IB_400G,
    gpus_per_node=8,
    linear_flops=478e12,  # fitted to the CP=1 TTFT of the Llama-3-8B shape at 32K and 128K
    call_overhead_s=0.22e-3,  # fitted: residual of CP2 pass-KV over NCCL at 16K (prefill_h200x2_s3_run3.json;
    # the copy-engine ring of the same run: -0.07 ms, i.e. none)
    host_step_s=40e-6,  # assumed: ~5 launches and one batch_isend_irecv per ring step
    decode_floor_s=55e-6,  # fitted to single-GPU and CP2 decode (launch, barrier sync, kernel tail)
    small_kernel_s=3e-6,  # assumed: one tiny kernel inside a CUDA graph
    allgather_base_s=14.8e-6,  # ../shared/GPU_NOTES.md: 17.8 µs for the CP2 all-gather in a graph, minus one hop
)
"""The measured 2× H200 machine, extended to nodes of 8 with the assumed inter-node links."""

H200_FAST_NET = replace(H200, name="H200 nodes, 800 Gb/s per GPU between nodes", inter=IB_800G)


# --------------------------------------------------------------------------- prefill


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
    (``run_tiles(acc=None)``), else each is merged into the running state."""
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
            if strategy == "pass_q" and cp > 1:  # pack_states, then pad to max_local
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
        # pass-Q as validated (prefill_h200x2_s3_run3.json): the zero-padded query buffer (zero-fill,
        # copy), the stack of the N padded partials, All2All's copy of the own slice, merge_stack.
        # Since the fifth session an evenly split prompt skips the padded copy and partials are packed
        # straight into the send buffer: these passes overstate today's pass-Q a little.
        piece = shape.state_bytes(plan.max_local)
        elems = plan.max_local * shape.num_heads * shape.head_dim
        copies = 3 * shape.q_bytes(plan.max_local) + 2 * cp * piece + 2 * piece
        memory += (copies + elems * _merge_stack_bytes(cp, shape.elem_bytes)) / m.copy_bandwidth
        exposed += _all_to_all_s(m, piece, cp, tp)
    total = compute + memory + exposed + overhead
    return PrefillCost(strategy, cp, total, compute, memory, exposed, overhead, hide)


# --------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class DecodeCost:
    """Predicted all-gather decode attention of one layer; the parts add up to ``total_s``."""

    cp: int
    total_s: float
    kv_read_s: float
    collective_s: float
    merge_s: float
    floor_s: float


def allgather_s(m: Machine, piece: float, cp: int, tp: int = 1) -> float:
    """A ring all-gather of ``piece`` bytes per rank: cp−1 hops on the ring's slowest link."""
    if cp == 1:
        return 0.0
    link = m.link(cp * tp)
    return m.allgather_base_s + (cp - 1) * (link.hop_s + piece / link.bandwidth)


def decode_time(m: Machine, shape: AttnShape, kv_len: int, batch: int = 1, *, cp: int, tp: int = 1) -> DecodeCost:
    """Predicted time of one all-gather decode attention call: ``batch`` requests of ``kv_len``
    cached tokens each, sharded over ``cp`` ranks (each holds at most ⌈kv_len / cp⌉)."""
    read = batch * shape.kv_bytes(-(-kv_len // cp)) / m.hbm_bandwidth
    collective = allgather_s(m, batch * shape.state_bytes(1), cp, tp)
    merge = 0.0
    if cp > 1:
        merge = DECODE_MERGE_KERNELS * m.small_kernel_s + 2 * cp * batch * shape.state_bytes(1) / m.copy_bandwidth
    return DecodeCost(cp, m.decode_floor_s + read + collective + merge, read, collective, merge, m.decode_floor_s)


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class TTFTCost:
    """Predicted prefill of a whole model (time to first token); the parts add up to ``total_s``."""

    cp: int
    tp: int
    strategy: str
    total_s: float
    attention_s: float
    linear_s: float
    kv_copy_s: float
    tp_comm_s: float


def ttft(m: Machine, cfg: ModelConfig, prompt: int, *, cp: int, tp: int = 1, strategy: str = "pass_kv") -> TTFTCost:
    """Predicted TTFT of one ``prompt``-token request (full prefill, bf16) on ``cp`` ranks × ``tp`` GPUs.

    Linear layers run ⌈prompt/cp⌉ tokens per rank split over TP; with TP > 1 every layer adds two
    all-reduces of the hidden states over NVLink (``2(tp−1)/tp`` of the bytes at the link's
    bandwidth, not overlapped).
    """
    shape = AttnShape.of(cfg, tp)
    local = -(-prompt // cp)
    att = prefill_time(m, shape, prompt, cp=cp, tp=tp, strategy=strategy)
    layers = cfg.num_layers
    linear = local * linear_flops_per_token(cfg) / tp / m.linear_flops
    kv_copy = layers * KV_COPY_PASSES * shape.kv_bytes(local) / m.copy_bandwidth
    tp_comm = 0.0
    if tp > 1:
        hidden = local * cfg.hidden_size * shape.elem_bytes
        tp_comm = layers * 2 * m.intra.transfer_s(2 * (tp - 1) / tp * hidden)
    attention = layers * att.total_s
    return TTFTCost(cp, tp, att.strategy, attention + linear + kv_copy + tp_comm, attention, linear, kv_copy, tp_comm)


def fit_linear_flops(m: Machine, cfg: ModelConfig, cp1_ttft_s: Mapping[int, float]) -> float:
    """The lumped linear-layer FLOP/s that best explains CP=1 TTFTs (least squares in seconds on
    what is left after attention and KV copies)."""
    num = den = 0.0
    rest = replace(m, linear_flops=math.inf)
    for prompt, measured in cp1_ttft_s.items():
        left = measured - ttft(rest, cfg, prompt, cp=1).total_s
        work = prompt * linear_flops_per_token(cfg)
        num, den = num + work * work, den + work * left
    return num / den


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Check:
    """One measured number next to the model's prediction.

    ``role`` is ``"fit"`` where the number calibrated a constant of the model, ``"pred"`` where it
    did not (a prediction)."""

    name: str
    measured_s: float
    predicted_s: float
    role: str

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted − measured) / measured."""
        return self.predicted_s / self.measured_s - 1.0


_RING_NAMES = {"pass_kv": "pass-KV", "pass_q": "pass-Q"}


def _label(tokens: int) -> str:
    return f"{tokens // MiB}M" if tokens % MiB == 0 else f"{tokens // KiB}K"


def validate(m: Machine, results_dir: str | Path) -> list[Check]:
    """The model against the recorded 2-GPU runs in ``results_dir`` (``prefill_h200x2_s3_run3.json``,
    ``decode_h200x2.json``, ``ttft_h200x2_s5.json``)."""
    root = Path(results_dir)
    pre = json.loads((root / "prefill_h200x2_s3_run3.json").read_text())
    dec = json.loads((root / "decode_h200x2.json").read_text())
    gen = json.loads((root / "ttft_h200x2_s5.json").read_text())
    meta = pre["meta"]
    shape = AttnShape(meta["heads"], meta["kv_heads"], meta["head_dim"], 2)
    n = meta["cp_size"]
    checks: list[Check] = []
    by = {(r["seqlen"], r["method"]): r["ms"] * 1e-3 for r in pre["results"]}
    for s in meta["seqlens"]:
        one = prefill_time(m, shape, s, cp=1).total_s
        checks.append(Check(f"prefill 1 GPU {_label(s)}", by[s, "single_cudnn"], one, "fit"))
        for strat, role in (("pass_kv", "fit" if s == min(meta["seqlens"]) else "pred"), ("pass_q", "pred")):
            pred = prefill_time(m, shape, s, cp=n, strategy=strat).total_s
            checks.append(Check(f"prefill {_RING_NAMES[strat]} {_label(s)} CP{n}", by[s, f"megacp_{strat}"], pred, role))
    dmeta = dec["meta"]
    dshape = AttnShape(dmeta["heads"], dmeta["kv_heads"], dmeta["head_dim"], 2)
    dby = {(r["batch"], r["kv_len"], r["method"]): r["ms"] * 1e-3 for r in dec["results"]}
    for b in dmeta["batches"]:
        for kv in dmeta["lengths"]:
            for cp, method, what in ((1, "single_cudnn", "1 GPU"), (dmeta["cp_size"], "megacp_cudnn_graph", f"CP{dmeta['cp_size']} graph")):
                pred = decode_time(m, dshape, kv, b, cp=cp).total_s
                checks.append(Check(f"decode {what} B={b} {_label(kv)}", dby[b, kv, method], pred, "fit"))
    for row in gen:
        s = row["seqlen"]
        for cp, role in ((1, "fit"), (2, "pred")):
            pred = ttft(m, LLAMA3_8B, s, cp=cp).total_s
            checks.append(Check(f"TTFT Llama-3-8B CP{cp} {_label(s)}", row[f"cp{cp}_ttft_s"], pred, role))
    return checks
