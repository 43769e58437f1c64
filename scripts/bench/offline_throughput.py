#!/usr/bin/env python3
"""Offline batch throughput: the same requests through ``LLM.generate`` (one call), through
``python -m megacp.serve`` (every request sent at once over HTTP) and through transformers' batched
``generate``, on one random-weight model, in one run.

    python -m scripts.bench.offline_throughput --layers 16 --requests 256 --json out/offline.json
    python -m scripts.bench.offline_throughput --tiny --requests 8                   # a CPU check

Requests (``--seed``): ``--requests`` random prompts of ``--min-prompt``..``--max-prompt`` tokens, each
with ``--min-tokens``..``--max-tokens`` new tokens, greedy, stop tokens ignored. Model: the
Llama-3.1-8B shape with ``--layers`` layers (bf16 on CUDA), or with ``--tiny`` a 2-layer shape (fp32 on
CPU); saved once with a word-level tokenizer (:func:`scripts.bench.decode_kinds.save_random_model`).

* ``server``: ``megacp.serve`` with ``--max-num-seqs`` = the requests (continuous batching,
  chunked prefill by its own defaults), all requests streamed at once; its wall time runs from the
  first send to the last token (the server's start-up and its first request are not timed: one
  warm-up request runs first).
* ``llm``: ``megacp.LLM(dir).generate(prompts, params)`` after the server has exited (a 2-request
  warm-up call first); wall time of the call.
* ``hf``: ``LlamaForCausalLM.generate`` (SDPA, left padding) over batches of ``--hf-batch`` requests in
  order, each batch to its longest ``max_tokens`` (only the tokens a request asked for count); wall
  time of all batches.

Tokens/s = the requested new tokens of every request over the method's wall time. Printed and in the
JSON: each method's tokens/s, ``llm / server`` and ``llm / hf``, and how many requests the LLM and the
server answered with the same tokens (greedy over the same weights: all, up to ties in bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import torch

from scripts.bench import harness as bh
from scripts.bench.serve import free_port, run_streams, start_server, stream, wait_healthy

MODULE = "scripts.bench.offline_throughput"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a 2-layer shape on CPU (a check of the logic)")
    p.add_argument("--layers", type=int, default=16, help="layers of the Llama-3.1-8B shape")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=32, help="requests per transformers generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the server may take to come up")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.requests < 1 or args.hf_batch < 1 or not 1 <= args.min_prompt <= args.max_prompt or \
            not 1 <= args.min_tokens <= args.max_tokens:
        p.error("--requests and --hf-batch must be >= 1, and 1 <= --min-X <= --max-X for prompts and tokens")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device (use --tiny for a CPU check of the logic)")
    return args


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def requests_of(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The prompts and each request's new tokens."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    return prompts, [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.requests)]


def save(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """The random model (and tokenizer) in ``directory``; its HF config dict."""
    from scripts.bench.decode_hf import MODELS
    from scripts.bench.decode_kinds import TINY, save_random_model

    shape = dict(TINY[0]) if args.tiny else dict(MODELS["llama8b"], num_hidden_layers=args.layers)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], args.max_prompt + args.max_tokens + 8)
    torch.manual_seed(args.seed)
    device = torch.device("cpu" if args.tiny else "cuda")
    model, _ = save_random_model(shape, directory, torch.float32 if args.tiny else torch.bfloat16, device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return shape


def run_server(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], new: list[int]) -> tuple[float, list[list[int]]]:
    """Wall seconds of every request at once through ``megacp.serve``, and each request's tokens."""
    port, log = free_port(), model_dir.parent / "server.log"
    server_args = SimpleNamespace(served_model="bench", clients=len(prompts), tiny=args.tiny, server_args="",
                                  history=0, turns=0, turn_len=0, reply_len=0, prompt_len=args.max_prompt,
                                  max_tokens=args.max_tokens)
    proc = start_server(server_args, model_dir, port, log)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, args.timeout, log)
        run_streams(url, "bench", None, [prompts[0]], 4, time.perf_counter())  # warm-up
        async def everything() -> list[dict[str, Any]]:
            limits = httpx.Limits(max_connections=len(prompts) + 4)
            async with httpx.AsyncClient(timeout=None, limits=limits) as client:
                return list(await asyncio.gather(*(stream(client, url, "bench", p, n) for p, n in zip(prompts, new, strict=True))))

        start = time.perf_counter()
        results = asyncio.run(everything())
        return max(max(r["stamps"]) for r in results) - start, [r["ids"] for r in results]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_llm(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], new: list[int]) -> tuple[float, list[list[int]]]:
    """Wall seconds of one ``LLM.generate`` call over every request, and each request's tokens."""
    import megacp
    from megacp import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32" if args.tiny else "bfloat16")
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in new]
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync()
    seconds = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outputs]
    del llm
    megacp.shutdown()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds, tokens


def run_hf(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], new: list[int]) -> float:
    """Wall seconds of transformers' batched ``generate`` over every request (``--hf-batch`` at a time)."""
    from transformers import LlamaForCausalLM

    device = torch.device("cpu" if args.tiny else "cuda")
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32 if args.tiny else torch.bfloat16,
                                             attn_implementation="sdpa").to(device).eval()

    def batch(rows: list[int]) -> None:
        width = max(len(prompts[i]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):  # left padding
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        most = max(new[i] for i in rows)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=most, min_new_tokens=most,
                           do_sample=False, pad_token_id=0, eos_token_id=None)

    batch([0, 1][: len(prompts)])  # warm-up
    _sync()
    start = time.perf_counter()
    order = list(range(len(prompts)))
    for a in range(0, len(order), args.hf_batch):
        batch(order[a: a + args.hf_batch])
    _sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    info = bh.header(MODULE, argv, "cpu" if args.tiny else "cuda")
    print(json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        shape = save(args, model_dir)
        prompts, new = requests_of(args, shape["vocab_size"])
        total = sum(new)
        server_s, server_tokens = run_server(args, model_dir, prompts, new)
        llm_s, llm_tokens = run_llm(args, model_dir, prompts, new)
        hf_s = run_hf(args, model_dir, prompts, new)
    rows = [{"method": m, "seconds": round(s, 3), "tokens_per_s": round(total / s, 1)}
            for m, s in (("llm", llm_s), ("server", server_s), ("hf", hf_s))]
    rate = {r["method"]: r["tokens_per_s"] for r in rows}
    summary = {"requests": args.requests, "new_tokens": total, "prompt_tokens": sum(map(len, prompts)),
               "llm_over_server": round(rate["llm"] / rate["server"], 3), "llm_over_hf": round(rate["llm"] / rate["hf"], 3),
               "same_tokens_llm_server": sum(a == b for a, b in zip(llm_tokens, server_tokens, strict=True))}
    bh.print_table(None, rows, [("method", "method", "s"), ("seconds", "wall s", ".2f"), ("tokens_per_s", "tokens/s", ".1f")],
                   f"{args.requests} requests, {total} new tokens, {'tiny' if args.tiny else f'llama8b {args.layers} layers'}")
    print(json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**info, "results": rows, **summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
