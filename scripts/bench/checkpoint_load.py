#!/usr/bin/env python3
"""Loading a Hugging Face safetensors checkpoint: megacp's loader (``megacp.checkpoint.load.load_model``,
what ``LLM`` and ``megacp.train --model DIR`` read weights with) against transformers'
``from_pretrained``, and the finiteness check megacp runs on every weight
(``megacp.checkpoint.values.all_finite``, a sum first) against ``isfinite(t).all()``, in one run.

    python -m scripts.bench.checkpoint_load --layers 2 --json out/load.json     # 2 layers of the 8B shape
    python -m scripts.bench.checkpoint_load --tiny                              # a CPU check

The model: a seeded random ``LlamaForCausalLM`` of the Llama-3.1-8B shape with ``--layers`` layers
(``--tiny``: :data:`scripts.bench.train_long.TINY`), bf16, written once to ``--dir`` (a temporary
directory by default; not timed). Each method runs ``--repeats`` times after one untimed run (the
page cache then holds the file for all of them); the median is reported. On the CPU,
``from_pretrained`` keeps the file's memory map (its weights are read when first used) while
megacp's loader copies every weight into the model; with ``--device cuda`` both copy to the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from scripts.bench import harness as bh

MODULE = "scripts.bench.checkpoint_load"


def median_s(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed call."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    from megacp.checkpoint.load import load_model
    from megacp.checkpoint.values import all_finite
    from scripts.bench.decode_kinds import save_random_model
    from scripts.bench.train_long import model_config
    from scripts.bench.train_step import hf_shape

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2, help="layers of the Llama-3.1-8B shape")
    p.add_argument("--tiny", action="store_true", help="a small shape (a CPU check)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the loaded weights go")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temporary directory)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.layers < 1 or args.repeats < 1:
        p.error("--layers and --repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    device, dtype = torch.device(args.device), torch.bfloat16
    info = bh.header(MODULE, argv, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.dir or tmp)
        torch.manual_seed(0)
        model, _ = save_random_model(hf_shape(model_config(args)), directory, dtype, torch.device("cpu"))
        tensors = [t.detach() for t in model.state_dict().values()]
        info["checkpoint_bytes"] = sum(t.numel() * t.element_size() for t in tensors)

        def megacp_load() -> None:
            load_model(str(directory), dtype=dtype, device=device, backend="torch")

        def hf_load() -> None:
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device)

        rows = [{"method": name, "s": round(median_s(fn, args.repeats, device), 4)} for name, fn in (
            ("megacp load_model", megacp_load), ("transformers from_pretrained", hf_load),
            ("all_finite (sum first)", lambda: all(all_finite(t) for t in tensors)),
            ("isfinite(t).all()", lambda: all(bool(torch.isfinite(t).all()) for t in tensors)))]
    by = {r["method"]: r["s"] for r in rows}
    ratios = {"megacp_over_transformers": round(by["megacp load_model"] / by["transformers from_pretrained"], 3),
              "isfinite_over_all_finite": round(by["isfinite(t).all()"] / by["all_finite (sum first)"], 2)}
    print(json.dumps(info))
    bh.print_table(None, rows, [("method", "method", "s"), ("s", "seconds", ".3f")],
                   f"{info['checkpoint_bytes'] / 2**30:.2f} GiB checkpoint, weights to {args.device}, {torch.get_num_threads()} threads")
    print(json.dumps(ratios))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**info, "results": rows, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
