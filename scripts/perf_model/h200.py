"""The constants measured on 2× H200 (one NVLink pair), extended to nodes of 8 with assumed
inter-node links; docs/GPU_FACTS.md holds the measurements they come from."""

from __future__ import annotations

from dataclasses import replace

from scripts.perf_model.hardware import Link, Machine, fit_kernel_rates
from scripts.perf_model.shapes import AttnShape

H200_ATTN = AttnShape(num_heads=32, num_kv_heads=8, head_dim=128, elem_bytes=2)
"""The shape of every attention benchmark (Llama-3-8B attention, bf16)."""

H200_CAUSAL_S = {16384: 3.5279359817504883e-3, 65536: 58.01448059082031e-3, 131072: 251.96176147460938e-3, 262144: 1102.9921875e-3}
"""One causal cuDNN call on one H200 (``single_cudnn`` of docs/results/prefill/h200x2_peers_cost_model_fit.json)."""

H200_BOUND_EFFICIENCY = {16384: 0.93, 65536: 1.00, 131072: 1.09, 262144: 1.12}
"""Zero-communication bound at CP2: one causal call over S/2 tokens plus one dense S/4 × S/2
block, cuDNN, timed alone on one H200 (docs/GPU_FACTS.md)."""

NVLINK_H200 = Link(latency_s=45e-6, bandwidth=312e9, hop_s=3e-6)
"""NV18 NVLink send/recv (docs/GPU_FACTS.md): 45 µs + B/370 GB/s fits 1 MiB (22 GB/s) … 256 MiB
(351 GB/s) one way; both directions at once 297 GB/s at 256 MiB ⇒ 312 GB/s for a ring step. Small-message
hop 3 µs (assumed; the CP2 all-gather of 8 KB is 17.8 µs in a CUDA graph)."""

IB_400G = Link(latency_s=20e-6, bandwidth=50e9, hop_s=10e-6)
"""400 Gb/s RDMA NIC per GPU = 50 GB/s per GPU (assumed latencies: 20 µs per transfer, 10 µs per
small-message hop)."""

IB_800G = Link(latency_s=20e-6, bandwidth=100e9, hop_s=10e-6)
"""The faster option: an 800 Gb/s NIC per GPU (100 GB/s per GPU), same latencies."""

H200 = Machine(
    name="H200 nodes (8 GPUs, NVLink), 400 Gb/s per GPU between nodes",
    kernels=fit_kernel_rates(H200_ATTN, H200_CAUSAL_S, H200_BOUND_EFFICIENCY),
    hbm_bandwidth=4.4e12,  # fitted to single-GPU decode 128K/1M, B = 1/8 (docs/GPU_FACTS.md: 4.3-4.7 TB/s)
    copy_bandwidth=3.5e12,  # a zero-fill and copy of a 256K-token KV block, 1.61 GB, in 0.458 ms
    # (megacp_build_kv_block of docs/results/prefill/h200x2_nccl_ring_copied_kv_block.json)
    intra=NVLINK_H200,
    inter=IB_400G,
    gpus_per_node=8,
    linear_flops=478e12,  # fitted to the CP=1 TTFT of the Llama-3-8B shape at 32K and 128K
    call_overhead_s=0.22e-3,  # fitted: residual of CP2 pass-KV over NCCL at 16K (validation.PREFILL_RUN;
    # the copy-engine ring of the same run: -0.07 ms, i.e. none)
    host_step_s=40e-6,  # assumed: ~5 launches and one batch_isend_irecv per ring step
    decode_floor_s=55e-6,  # fitted to single-GPU and CP2 decode (launch, barrier sync, kernel tail)
    small_kernel_s=3e-6,  # assumed: one tiny kernel inside a CUDA graph
    allgather_base_s=14.8e-6,  # docs/GPU_FACTS.md: 17.8 µs for the CP2 all-gather in a graph, minus one hop
)
"""The measured 2× H200 machine, extended to nodes of 8 with the assumed inter-node links."""

H200_FAST_NET = replace(H200, name="H200 nodes, 800 Gb/s per GPU between nodes", inter=IB_800G)
