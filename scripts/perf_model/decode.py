"""All-gather decode attention of one layer."""

from __future__ import annotations

from dataclasses import dataclass

from scripts.perf_model.hardware import Machine
from scripts.perf_model.shapes import AttnShape

DECODE_MERGE_KERNELS = 1
"""Small kernels after the decode all-gather: unpack views are free; ``merge_stack`` is one fused
Triton kernel on GPUs (four torch kernels — logsumexp, exp, multiply-sum, cast — without Triton)."""


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
