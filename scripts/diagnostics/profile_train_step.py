#!/usr/bin/env python3
"""Where a training step's GPU time goes: one profiled step of megacp's model and trainer and one of
the same model in Hugging Face transformers (the two methods of :mod:`scripts.bench.train_step`),
top kernels by GPU time, plus the wall time of the step.

    python -m scripts.diagnostics.profile_train_step --seq-len 8K --layers 4
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from scripts.bench import harness as bh
from scripts.bench import train_step as ts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=bh.parse_sizes, default=bh.parse_sizes("8K"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--methods", type=bh.parse_names, default=["megacp", "hf"])
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: profiling a training step needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("LOCAL_RANK", "0")
    ctx = bh.init("cuda", "bf16")
    cfg = ts.model_config(args.layers)
    ids = torch.randint(0, cfg.vocab_size, (args.seq_len[0],), device="cuda")
    for method in args.methods:
        step, holder = ts.megacp_step(ctx.state, cfg, ids) if method == "megacp" else ts.hf_step(cfg, ids)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3
        print(f"\n== {method}: wall {wall * 1e3:.1f} ms, GPU busy {gpu:.1f} ms (kernel time summed)")
        print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=70))
        del step, holder
        gc.collect()
        torch.cuda.empty_cache()
    bh.finish(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
