#!/usr/bin/env python3
"""Microseconds per draw of :class:`megacp.generate.sampling.Sampler` alone, per request kind, on
random fp32 logits, one GPU: each kind's draw next to the greedy one (an argmax).

    python -m scripts.bench.sampler_kinds                        # batches 1,8,32; vocabularies 49152,128256
    python -m scripts.bench.sampler_kinds --tiny                 # a CPU smoke run (eager, a small vocabulary)

Kinds: those of :data:`scripts.bench.decode_kinds.KINDS` that reach the sampler (``stop`` is a host
check; it is left out), plus ``temperature`` (temperature 0.8 alone: the draw with no filter) and
``mixed`` (the batch's rows cycle through the other kinds: every step of the draw runs, each row
using its own). Each (vocabulary, batch, kind): ``--draws`` draws captured one after another in
one CUDA graph (as the draw sits in the decode step's graph), warmed up, then the graph replayed
``--replays`` times between CUDA events; the figure is the time per draw. The logits are
``randn * --scale`` (a spread like a trained model's; the top-p nucleus grows as it shrinks).
Prints a table (µs per draw and the ratio to greedy's) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from megacp.generate.sampling import Sampler, SamplingParams
from scripts.bench.decode_kinds import KINDS

KIND_PARAMS: dict[str, dict[str, Any]] = {
    "greedy": {}, "temperature": dict(temperature=0.8, seed=1),
    **{k: v for k, (v, _) in KINDS.items() if k not in ("greedy", "stop")},
}
"""Kind -> ``SamplingParams`` arguments (``mixed`` cycles through them row by row)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32", help="batch sizes")
    p.add_argument("--vocabs", default="49152,128256", help="vocabulary sizes")
    p.add_argument("--kinds", default=",".join([*KIND_PARAMS, "mixed"]),
                   help=f"subset of {', '.join([*KIND_PARAMS, 'mixed'])}")
    p.add_argument("--draws", type=int, default=20, help="draws per captured graph")
    p.add_argument("--replays", type=int, default=50, help="timed replays of the graph")
    p.add_argument("--scale", type=float, default=4.0, help="logits = randn * scale")
    p.add_argument("--tiny", action="store_true", help="CPU, eager, vocabulary 512 (a smoke run)")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    try:
        args.batch_list = [int(x) for x in args.batches.split(",")]
        args.vocab_list = [512] if args.tiny else [int(x) for x in args.vocabs.split(",")]
    except ValueError as e:
        p.error(f"--batches / --vocabs: integers separated by commas ({e})")
    args.kind_list = [k for k in args.kinds.split(",") if k]
    bad = [k for k in args.kind_list if k not in KIND_PARAMS and k != "mixed"]
    if bad or not args.kind_list:
        p.error(f"--kinds: {', '.join(bad) or 'none given'}; choose from {', '.join([*KIND_PARAMS, 'mixed'])}")
    if min(args.batch_list + args.vocab_list) < 1 or args.draws < 1 or args.replays < 1:
        p.error("--batches, --vocabs, --draws and --replays must be >= 1")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA GPU here: this benchmark times graph-captured draws; --tiny runs a CPU smoke test")
    return args


def params_of(kind: str, batch: int) -> list[SamplingParams]:
    """The batch's rows of ``kind`` (``mixed``: the other kinds in turn), each with its own seed."""
    names = [k for k in KIND_PARAMS if k != "greedy"] if kind == "mixed" else [kind]
    return [SamplingParams(**{**KIND_PARAMS[names[i % len(names)]], "seed": i}) for i in range(batch)]


def time_draw(sampler: Sampler, logits: torch.Tensor, draws: int, replays: int) -> float:
    """Microseconds per draw: ``draws`` draws in one CUDA graph replayed ``replays`` times (CPU:
    eager draws timed on the host)."""
    if logits.device.type != "cuda":
        sampler(logits)
        t = time.perf_counter()
        for _ in range(draws * replays):
            sampler(logits)
        return (time.perf_counter() - t) / (draws * replays) * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            sampler(logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(draws):
            sampler(logits)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (draws * replays)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    rows: list[dict[str, Any]] = []
    print(f"Sampler draw, µs per draw ({device}{'' if args.tiny else ': ' + torch.cuda.get_device_name()}; "
          f"{args.draws} draws per graph x {args.replays} replays; logits randn * {args.scale})")
    print(f"{'vocab':>7} {'batch':>5} {'kind':<19} {'us/draw':>9} {'/greedy':>8}")
    for vocab in args.vocab_list:
        for batch in args.batch_list:
            g = torch.Generator().manual_seed(vocab + batch)
            logits = (torch.randn(batch, vocab, generator=g) * args.scale).to(device)
            greedy = None
            for kind in (["greedy"] if "greedy" not in args.kind_list else []) + args.kind_list:
                params = params_of(kind, batch)
                us = time_draw(Sampler(params, vocab, device, context=[[0, 1, 2]] * batch), logits, args.draws,
                               args.replays)
                greedy = us if kind == "greedy" else greedy
                if kind not in args.kind_list:
                    continue
                row = {"vocab": vocab, "batch": batch, "kind": kind, "us_per_draw": round(us, 2),
                       "vs_greedy": round(us / greedy, 2) if greedy else None}
                rows.append(row)
                print(f"{vocab:>7} {batch:>5} {kind:<19} {us:>9.1f} {row['vs_greedy']:>8}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "argv": sys.argv, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
