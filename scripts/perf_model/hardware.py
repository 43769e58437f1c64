"""What one GPU and its links achieve: attention kernel rates by call size, link latency and
bandwidth, and every constant of a machine (:class:`Machine`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import pairwise

from megacp.attention.strategy import Hardware
from scripts.perf_model.shapes import AttnShape


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
