"""Analytical cost model of megacp's CP prefill, decode and generation, calibrated on 2× H200.

Units everywhere: seconds (``_s``), bytes, FLOPs, FLOP/s and bytes/s. ``docs/SCALING.md`` explains
the model, its assumptions, its validation against the measured 2-GPU numbers and the projections;
``python -m scripts.perf_model.report`` prints them.

What is modelled (one CP rank = ``tp`` GPUs of one node; attention heads split over TP):

* **Ring prefill** (pass-KV, pass-Q; :mod:`~.prefill`). megacp's own sharding plan and tile planner
  (:mod:`megacp.placement`) give, for every ring step and every rank, the kernel calls the rank
  makes (step 0: one causal call over its 2 local chunks; other steps: one dense S/(2N)×S/N block
  for a full prefill). A call of F FLOPs costs ``launch + F / C(F, kind)``: the achieved attention
  FLOP/s ``C`` of one GPU depends on the kind (causal/dense) and size of the call
  (:class:`~.hardware.KernelRates`, fitted to the single-GPU measurements). Merges, state packing
  and copies cost their HBM bytes. Steps run in lockstep: a step lasts ``max(slowest rank's
  kernels + memory work, the hop's transfer, the host's time to issue it)``. Pass-Q adds the
  All2All of the partial outputs and the final merge, neither of which overlaps.
* **All-gather decode** (:mod:`~.decode`): the KV bytes each rank reads at HBM bandwidth, a fixed
  per-call floor, one all-gather of the packed (out, LSE) (a ring collective: one small-message hop
  latency per rank) and the merge.
* **Generation TTFT** of a Llama-shaped model (:mod:`~.generation`): per layer the CP attention
  above plus the KV cache write, plus the linear layers (FLOPs at a lumped achieved rate that also
  absorbs the elementwise work, fitted to the CP=1 TTFT) and, with TP, two all-reduces per layer.

The constants (:mod:`~.h200`) come from the runs in ``docs/results/`` and the facts in
``docs/GPU_FACTS.md``; :func:`~.validation.validate` compares the model with those runs.

What is not modelled: SM contention between NCCL kernels and attention kernels, clock changes when
more GPUs share a node's power and cooling, congestion of a shared inter-node fabric, and
per-layer host work of the CP layer (visible at 32K, see the validation).
"""

from scripts.perf_model.decode import DecodeCost, allgather_s, decode_time
from scripts.perf_model.generation import TTFTCost, fit_linear_flops, ttft
from scripts.perf_model.h200 import (
    H200,
    H200_ATTN,
    H200_BOUND_EFFICIENCY,
    H200_CAUSAL_S,
    H200_FAST_NET,
    IB_400G,
    IB_800G,
    NVLINK_H200,
)
from scripts.perf_model.hardware import KernelRates, Link, Machine, fit_kernel_rates
from scripts.perf_model.prefill import PrefillCost, RingPlan, prefill_time, ring_plan
from scripts.perf_model.shapes import LLAMA3_8B, LLAMA3_405B, PAPER_405B_TTFT_S, AttnShape, linear_flops_per_token
from scripts.perf_model.validation import Check, validate

__all__ = [
    "H200", "H200_ATTN", "H200_BOUND_EFFICIENCY", "H200_CAUSAL_S", "H200_FAST_NET", "IB_400G", "IB_800G", "LLAMA3_405B",
    "LLAMA3_8B", "NVLINK_H200", "PAPER_405B_TTFT_S", "AttnShape", "Check", "DecodeCost", "KernelRates", "Link",
    "Machine", "PrefillCost", "RingPlan", "TTFTCost", "allgather_s", "decode_time", "fit_kernel_rates",
    "fit_linear_flops", "linear_flops_per_token", "prefill_time", "ring_plan", "ttft", "validate",
]
