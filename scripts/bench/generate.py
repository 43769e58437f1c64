"""Time to first token of a Llama-3-8B-shaped model (random bf16 weights): CP=2 against CP=1,
measured in one run on the same GPUs.

    torchrun --nproc_per_node 2 -m scripts.bench.generate --seqlens 32768,65536,131072
    deepspeed --num_gpus 2 --module scripts.bench.generate --deepspeed_config configs/cp2.json --seqlens 65536

Both ranks run the CP=2 prefill (pass-KV ring, sharded KV cache) of the same prompt and the first
token; then rank 0 alone runs the same model at CP=1. Prints TTFT of each, the ratio CP2/CP1
(ideal 0.5) and writes ``--json`` (``meta``: the environment and the megacp sources digest,
``results``: one row per prompt length).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import torch.distributed as dist

import megacp
from megacp.generate import Generator, SamplingParams
from megacp.generate.engine import generate
from megacp.launch import add_launcher_args
from megacp.layers.settings import CPSettings
from megacp.models import build_model
from scripts.bench import harness as bh
from scripts.perf_model import LLAMA3_8B


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="32768,131072")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--json", default=None)
    add_launcher_args(p)
    args = p.parse_args()
    state = megacp.initialize(args.deepspeed_config)
    dev, rank = state.device, state.rank
    cfg = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16, device=dev, backend="torch")
    settings = CPSettings.from_state(state, prefill=args.strategy)
    megacp.swap_attention(model, settings)
    cp2 = Generator.for_model(model, cfg, settings, device=dev, dtype=torch.bfloat16)
    cp1 = Generator.for_model(model, cfg, settings.replace(ring=None), device=dev, dtype=torch.bfloat16)
    one = SamplingParams(max_new_tokens=1)
    g = torch.Generator().manual_seed(1)
    ctx = bh.Ctx(state, torch.bfloat16)
    rep = bh.Report(ctx, args.json, {**bh.env_info(ctx), "kind": "ttft", "model": "Llama-3-8B shape, random weights",
                                     "layers": args.layers, "strategy": args.strategy, "argv": sys.argv})
    warm = torch.randint(0, cfg.vocab_size, (4096,), generator=g).tolist()
    generate(cp2, [warm], one, vocab=cfg.vocab_size)
    if rank == 0:
        generate(cp1, [warm], one, vocab=cfg.vocab_size)
    dist.barrier()
    for s in (int(x) for x in args.seqlens.split(",")):
        prompt = torch.randint(0, cfg.vocab_size, (s,), generator=g).tolist()
        dist.barrier()
        torch.cuda.reset_peak_memory_stats(dev)  # the CP=2 call's own peak (rank 0 ran CP=1 before)
        r2 = generate(cp2, [prompt], one, vocab=cfg.vocab_size)
        dist.barrier()
        row = {"seqlen": s, "cp2_ttft_s": r2.report["ttft_s"], "strategy": r2.report["prefill_strategy"],
               "peak_mem_gb": round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)}
        if rank == 0:
            torch.cuda.empty_cache()
            r1 = generate(cp1, [prompt], one, vocab=cfg.vocab_size)
            row["cp1_ttft_s"] = r1.report["ttft_s"]
            row["ratio"] = round(row["cp2_ttft_s"] / row["cp1_ttft_s"], 3)
            row["same_first_token"] = r1.tokens == r2.tokens
            print(json.dumps(row), flush=True)
            rep.result(row)
        dist.barrier()
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"TTFT, Llama-3-8B shape ({args.layers} layers), bf16, {torch.cuda.get_device_name(dev)}")
        print(f"{'seqlen':>8} {'CP1 s':>8} {'CP2 s':>8} {'CP2/CP1':>8}  strategy")
        for r in rep.data["results"]:
            print(f"{r['seqlen']:>8} {r['cp1_ttft_s']:>8.3f} {r['cp2_ttft_s']:>8.3f} {r['ratio']:>8.3f}  {r['strategy']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
