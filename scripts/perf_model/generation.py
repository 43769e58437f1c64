"""Time to first token of a Llama-shaped model: CP attention of every layer, KV copies, linear
layers and TP all-reduces."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from megacp.models.config import ModelConfig
from scripts.perf_model.hardware import Machine
from scripts.perf_model.prefill import prefill_time
from scripts.perf_model.shapes import AttnShape, linear_flops_per_token

KV_COPY_PASSES = 2
"""Per layer of a full prefill, the KV cache write reads and writes the local K and V once (2 passes);
``build_kv_block`` hands them to the ring as they are (a prompt split evenly over the ranks has no
padding, so nothing is zero-filled or copied)."""


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
