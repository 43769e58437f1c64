"""Profile one megacp pass-KV prefill on 2 GPUs (torch.profiler): where the time goes.

    torchrun --nproc_per_node 2 scripts/profile_prefill.py --seqlen 16384 --out prof

Prints, per rank, the wall time of the call, the summed GPU time of the attention kernels, the
merge kernels and the NCCL kernels, and how much of the NCCL time overlapped attention kernels.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import megacp
from megacp.attention import ShardPlan, build_kv_block, cp_prefill
from megacp.parallel.ring import Ring


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--strategy", default="pass_kv")
    p.add_argument("--out", default=None, help="write a chrome trace per rank with this prefix")
    args = p.parse_args()
    state = megacp.initialize()
    dev, r = state.device, state.rank_in("cp")
    ring = Ring(state.group("cp"))
    plan = ShardPlan([0], [args.seqlen], ring.size, r)
    g = torch.Generator(device=dev).manual_seed(0)
    n = plan.num_local()
    q = torch.randn(n, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(n, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
    block = build_kv_block(plan, k, torch.randn_like(k))
    for _ in range(5):
        cp_prefill(q, block, plan, ring, strategy=args.strategy)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        cp_prefill(q, block, plan, ring, strategy=args.strategy)
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1000 / 5
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            cp_prefill(q, block, plan, ring, strategy=args.strategy)
        torch.cuda.synchronize()
    if args.out:
        prof.export_chrome_trace(f"{args.out}_rank{state.rank}.json")
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    def kind(name: str) -> str:
        if "nccl" in name.lower():
            return "nccl"
        if "fmha" in name.lower() or "cudnn" in name.lower() or "flash" in name.lower() or "sm90" in name.lower():
            return "attention"
        return "other (merge, copies)"

    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        spans.setdefault(kind(e.name), []).append((e.time_range.start, e.time_range.end))
    total = {k: sum(b - a for a, b in v) / 5 for k, v in spans.items()}
    att = sorted(spans.get("attention", []))
    overlap = 0.0
    for a, b in spans.get("nccl", []):
        for c, d in att:
            overlap += max(0.0, min(b, d) - max(a, c))
    lines = [f"rank {state.rank} S={args.seqlen} {args.strategy}: wall {wall_us:.0f} us per call; GPU time (us) " +
             ", ".join(f"{k} {v:.0f}" for k, v in sorted(total.items())) +
             f"; NCCL overlapped with attention {overlap / 5:.0f} us"]
    top = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (lines, top))
    if state.rank == 0:
        for ls, _ in out:
            print("\n".join(ls))
        print(out[0][1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
