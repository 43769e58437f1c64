#!/usr/bin/env python3
"""Profile megacp prefill on 2 GPUs (torch.profiler): the GPU timeline of one call, per rank.

    torchrun --nproc_per_node 2 -m scripts.diagnostics.profile_prefill --seqlen 64K [--transport copy_engine] [--loop 4] [--out prof]

Times five back-to-back calls with CUDA events, then profiles three isolated calls (a device sync
and a barrier before each, as ``scripts/bench/prefill.py`` times them) and prints, per rank, every GPU
activity (kernel, memcpy, memset) of the middle call in start order: offset from the call's first
activity (µs), duration (µs), CUDA stream and a short name. This shows whether a transfer (NCCL
kernel or copy-engine memcpy) runs beside the attention kernels or waits for them. The header says
how long the host took to issue the call and how late after the call began on the host its first
GPU activity started (host-side latency that an isolated call pays in full). ``--out`` also keeps
the chrome trace of each rank. ``--loop K`` profiles K back-to-back calls instead (one sync and
barrier before the first) and prints the GPU activities of calls 1..K-1 on one time axis, the offset
from call 1's first activity, so a call waiting for the previous one (or for the other rank) shows
as a gap.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function


import megacp
from megacp.attention import build_kv_block, cp_prefill, partial_attention
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan
from scripts.bench import harness as bh

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def short(name: str) -> str:
    """A readable label for a kernel or memcpy name."""
    low = name.lower()
    for key, label in (("nccl", "nccl"), ("fmha", "attention"), ("cudnn", "attention"), ("flash", "attention"),
                       ("merge", "merge"), ("memcpy", "")):
        if key in low:
            return f"{label} {name[:60]}".strip() if label else name[:70]
    return name[:70]


def call_timeline(trace: dict, call: str, origin: float | None = None
                  ) -> tuple[float, float, float, list[tuple[float, float, int, str]]]:
    """The CPU range ``call`` (a ``record_function``): its duration (µs), the offset of its first GPU
    activity from its start (µs), that activity's trace timestamp (µs), and (start µs, duration µs,
    stream, name) of the GPU activities launched inside it, matched to their launches by correlation
    id; start is the offset from ``origin`` (a trace timestamp; default the first of them)."""
    events = trace["traceEvents"]
    spans = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == call]
    if not spans:
        raise RuntimeError(f"no annotation {call!r} in the trace")
    t0, t1 = spans[0]["ts"], spans[0]["ts"] + spans[0]["dur"]
    launched = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and t0 <= e["ts"] <= t1
                and "correlation" in e.get("args", {})}
    acts = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES
                   and e.get("args", {}).get("correlation") in launched), key=lambda e: e["ts"])
    start = acts[0]["ts"] if acts else t0
    base = start if origin is None else origin
    rows = [(e["ts"] - base, e["dur"], e.get("args", {}).get("stream", -1), e["name"]) for e in acts]
    return t1 - t0, start - t0, start, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", default="16K")
    p.add_argument("--strategy", default="pass_kv", choices=("pass_kv", "pass_q", "single"),
                   help="single: every rank runs single-GPU cuDNN attention over the whole sequence")
    p.add_argument("--transport", default=None, help="ring transport (auto | nccl | copy_engine)")
    p.add_argument("--loop", type=int, default=0, help="profile this many back-to-back calls (>= 2)")
    p.add_argument("--out", default=None, help="also write each rank's chrome trace to <out>_rank<r>.json")
    args = p.parse_args()
    if args.loop == 1 or args.loop < 0:
        p.error("--loop needs at least 2 calls (call 0 starts the loop, the others are printed)")
    state = megacp.initialize()
    dev, r = state.device, state.rank_in("cp")
    ring = Ring(state.group("cp"), transport=args.transport)
    seqlen = bh.parse_sizes(args.seqlen)[0]
    plan = ShardPlan([0], [seqlen], ring.size, r)
    g = torch.Generator(device=dev).manual_seed(0)
    n = seqlen if args.strategy == "single" else plan.num_local()
    q = torch.randn(n, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(n, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    block = build_kv_block(plan, k, v) if args.strategy != "single" else None

    def call() -> None:
        if block is None:
            partial_attention(q, k, v, causal=True, backend="cudnn")
        else:
            cp_prefill(q, block, plan, ring, strategy=args.strategy)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        call()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1000 / 5
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.loop or 3):
            if not args.loop:
                torch.cuda.synchronize()
                dist.barrier()
            with record_function(f"call{i}"):
                call()
        torch.cuda.synchronize()
    path = f"{args.out}_rank{state.rank}.json" if args.out else tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    if not args.out:
        os.unlink(path)
    host_us, first_us, origin, rows = call_timeline(trace, "call1")
    head = (f"rank {state.rank} S={bh.size_label(seqlen)} {args.strategy} transport={ring.transport}: "
            f"{wall_us:.0f} us per call back to back; ")
    if args.loop:
        lines = [head + f"{args.loop} back-to-back calls (profiled), GPU activities of calls 1..{args.loop - 1} "
                 "from call 1's first one:"]
        for i in range(1, args.loop):
            _, _, _, rows = call_timeline(trace, f"call{i}", origin)
            lines.append(f"  call {i}:  {'start us':>10} {'dur us':>9} {'stream':>6}  name")
            lines += [f"  {'':8}{t:10.1f} {d:9.1f} {s:>6}  {short(nm)}" for t, d, s, nm in rows]
    else:
        lines = [head + f"one isolated call (profiled): host issued it in {host_us:.0f} us, its first GPU "
                 f"activity began {first_us:.0f} us after the call began; GPU activities:",
                 f"  {'start us':>10} {'dur us':>9} {'stream':>6}  name"]
        lines += [f"  {t:10.1f} {d:9.1f} {s:>6}  {short(nm)}" for t, d, s, nm in rows]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, lines)
    if state.rank == 0:
        for ls in out:
            print("\n".join(ls), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
