#!/usr/bin/env python3
"""The longest prompt one GPU serves: at each length of a ladder, time to first token, peak GPU
memory and decode tokens/s of megacp's ``Generator`` and of Hugging Face ``generate``, in one run,
on the same model shape and device.

    python -m scripts.bench.long_prompt --model llama8b --layers 32 --lengths 128K,256K,512K,768K --json out/long_prompt.json
    python -m scripts.bench.long_prompt --model llama8b --layers 32 --lengths 1M --methods megacp --json out/long_1m.json
    python -m scripts.bench.long_prompt --model llama8b --layers 32 --lengths 1M,1536K,1800K --methods megacp --kv-cache-dtype fp8_e4m3
    python -m scripts.bench.long_prompt --tiny --device cpu --lengths 64,128     # a CPU check of the logic

Models (random weights, bf16 on CUDA, fp32 on CPU): the shapes of :mod:`scripts.bench.decode_hf`
(``llama8b``: Llama-3.1-8B, ``smollm2``) with ``--layers`` layers and a context of the longest
length; ``--tiny``: a 2-layer shape of width 64. One request: a random prompt of each length,
``--new-tokens`` greedy tokens (no stop token).

* ``megacp``: ``build_model`` + ``swap_attention`` + :class:`megacp.generate.Generator` at CP = 1
  with ``--prefill-chunk`` (0: the automatic chunk, picked from the free GPU memory;
  :func:`megacp.generate.loop.auto_prefill_chunk`) and CUDA-graph decode on CUDA; TTFT and decode
  tokens/s from the run's report (a 1K-token request runs first, untimed).
* ``hf``: ``LlamaForCausalLM`` (SDPA) ``generate`` with its dynamic cache; a streamer stamps each
  token: TTFT = first new token, decode tokens/s = ``(N - 1) / (t_N - t_1)`` (a 1K-token request
  runs first, untimed).

Each (method, length) runs in a child process (``--child METHOD --child-len L``), so running out of
memory ends that point only; each method climbs ``--lengths`` and stops at its first failure
(``oom``, ``host-oom``, ``error``). Per point: TTFT, decode tokens/s, peak GPU memory allocated and
reserved over the child's run, the weights and the KV cache the request needs in GiB (megacp: its
cache), so ``transient_gib`` = peak allocated - weights - cache is what the prefill itself took;
megacp's prefill chunk; the child's peak host RSS. Then each method's longest length and megacp / HF
TTFT at equal lengths. megacp's points also give the prefill's model TFLOP/s (the decoder layers'
linear ``2·params·S`` plus causal attention ``2·S²·Hq·D`` per layer, over the TTFT) and the cache's own
capacity: the GPU memory free after the weights over the cache's bytes per token
(``capacity_tokens``; a prompt near it leaves nothing for the prefill's transients). Writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from scripts.bench import harness as bh
from scripts.bench.decode_hf import MODELS as HF_SHAPES

MODULE = "scripts.bench.long_prompt"
METHODS = ("megacp", "hf")
TINY: dict[str, Any] = dict(HF_SHAPES["smollm2"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
"""``--tiny``: the model shape of the CPU check."""

WARMUP_TOKENS = 1024
"""Prompt tokens of the untimed request each child runs first (kernels, graphs, allocator)."""


def shape_of(args: argparse.Namespace) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of the run's model: ``--model``'s shape with
    ``--layers`` layers and a context that holds the longest prompt and its new tokens."""
    base = TINY if args.tiny else dict(HF_SHAPES[args.model], num_hidden_layers=args.layers)
    return dict(base, max_position_embeddings=max(max(args.lengths), WARMUP_TOKENS) + args.new_tokens)


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def _memory(cuda: bool) -> dict[str, Any]:
    """Peak GPU memory of this process so far (``None`` on CPU)."""
    return {"peak_alloc_gib": _gib(torch.cuda.max_memory_allocated()) if cuda else None,
            "peak_reserved_gib": _gib(torch.cuda.max_memory_reserved()) if cuda else None}


def megacp_point(shape: dict[str, Any], length: int, args: argparse.Namespace, ctx: bh.Ctx) -> dict[str, Any]:
    """TTFT, decode rate and memory of one ``length``-token request through megacp's Generator."""
    import megacp
    from megacp.checkpoint.hf import config_from_hf
    from megacp.generate import Generator, SamplingParams
    from megacp.generate.engine import generate
    from megacp.layers.settings import CPSettings
    from megacp.models import build_model

    cfg = config_from_hf(shape)
    model = build_model(cfg, dtype=ctx.dtype, device=ctx.device, backend="torch")
    settings = CPSettings.from_state(ctx.state)
    megacp.swap_attention(model, settings)
    elem = 1 if args.kv_cache_dtype == "fp8_e4m3" else torch.empty((), dtype=ctx.dtype).element_size()
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    free = torch.cuda.mem_get_info()[0] if ctx.cuda else None  # after the weights, before the cache
    gen = Generator.for_model(model, cfg, settings, device=ctx.device, dtype=ctx.dtype, prefill_chunk=args.prefill_chunk,
                              kv_cache_dtype=args.kv_cache_dtype, cuda_graphs=ctx.cuda)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    generate(gen, [torch.randint(0, cfg.vocab_size, (min(WARMUP_TOKENS, length),), generator=g).tolist()], params,
             vocab=cfg.vocab_size)
    prompt = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    result = generate(gen, [prompt], params, vocab=cfg.vocab_size)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = gen.cache_rows([length], args.new_tokens) * per_token
    linear = 2 * length * sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers."))
    attention = 2 * length * length * cfg.num_heads * cfg.head_dim * cfg.num_layers  # causal QK^T and PV
    return {"ttft_s": result.report["ttft_s"], "prefill_tflops": round((linear + attention) / result.report["ttft_s"] / 1e12, 1),
            "capacity_tokens": None if free is None else free // per_token, "decode_tokens_per_s": result.report["decode_tokens_per_s"],
            "decode": result.report["decode"], "prefill_chunk": gen.prefill_chunk or length,
            "prefill_steps": len(result.report["prefill_strategy"]), "weights_gib": _gib(weights),
            "kv_cache_gib": _gib(cache)}


def hf_point(shape: dict[str, Any], length: int, args: argparse.Namespace, ctx: bh.Ctx) -> dict[str, Any]:
    """TTFT, decode rate and memory of one ``length``-token request through Hugging Face ``generate``."""
    import transformers
    from transformers.generation.streamers import BaseStreamer

    config = transformers.AutoConfig.for_model("llama", **{k: v for k, v in shape.items()
                                                            if k not in ("architectures", "model_type")})
    with torch.device(ctx.device):
        hf = transformers.LlamaForCausalLM._from_config(config, dtype=ctx.dtype, attn_implementation="sdpa").eval()

    class Stamps(BaseStreamer):
        """Times of the new tokens (``put`` gets the prompt first, then each new token)."""

        def __init__(self) -> None:
            self.calls: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            if ctx.cuda:
                torch.cuda.synchronize()
            self.calls.append(time.perf_counter())

        def end(self) -> None:
            return None

    def run(n: int) -> tuple[float, list[float]]:
        ids = torch.randint(0, config.vocab_size, (1, n), generator=g).to(ctx.device)
        stamps = Stamps()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                              streamer=stamps)
        return t0, stamps.calls[1:]

    g = torch.Generator().manual_seed(1)
    run(min(WARMUP_TOKENS, length))
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0, times = run(length)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    elem = torch.empty((), dtype=ctx.dtype).element_size()
    cache = 2 * config.num_hidden_layers * (length + args.new_tokens) * config.num_key_value_heads * config.head_dim * elem
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return {"ttft_s": round(times[0] - t0, 4), "decode_tokens_per_s": None if rate is None else round(rate, 2),
            "decode": "eager", "weights_gib": _gib(weights), "kv_cache_gib": _gib(cache)}


def child(args: argparse.Namespace) -> int:
    """One (method, length) point in a world of one; prints ``RESULT {json}``."""
    ctx = bh.init(args.device, None)
    torch.manual_seed(0)
    row: dict[str, Any] = {"method": args.child, "length": args.child_len}
    point = megacp_point if args.child == "megacp" else hf_point
    row.update(point(shape_of(args), args.child_len, args, ctx))
    row.update(_memory(ctx.cuda))
    if row["peak_alloc_gib"] is not None:
        row["transient_gib"] = round(row["peak_alloc_gib"] - row["weights_gib"] - row["kv_cache_gib"], 2)
    bh.print_result(row)
    bh.finish(ctx)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(HF_SHAPES), default="llama8b")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--lengths", type=bh.parse_sizes, default=bh.parse_sizes("64K,128K,256K,512K,768K"))
    p.add_argument("--methods", type=bh.parse_names, default=list(METHODS))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=0, help="megacp's prefill chunk (0: automatic)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="megacp's KV cache storage (auto: the model's dtype)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small model shape (CPU checks)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--child-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.methods or set(args.methods) - set(METHODS):
        p.error(f"--methods: got {','.join(args.methods)!r}; a subset of {','.join(METHODS)}")
    if args.layers < 1 or args.new_tokens < 2 or args.prefill_chunk < 0 or min(args.lengths, default=0) < 1:
        p.error("--layers must be >= 1, --new-tokens >= 2, --prefill-chunk >= 0 and --lengths at least 1 each")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (use --device cpu --tiny for a check of the logic)")
    return args


COLUMNS = [("method", "method", "s"), ("length", "prompt", "d"), ("ttft_s", "TTFT s", ".2f"),
           ("prefill_tflops", "prefill TFLOP/s", ".0f"), ("capacity_tokens", "cache capacity", "d"),
           ("decode_tokens_per_s", "decode tok/s", ".1f"), ("peak_alloc_gib", "GPU alloc GiB", ".1f"),
           ("peak_reserved_gib", "GPU reserved GiB", ".1f"), ("kv_cache_gib", "KV GiB", ".1f"),
           ("transient_gib", "transient GiB", ".1f"), ("prefill_chunk", "chunk", "d"),
           ("host_rss_gib", "host RSS GiB", ".1f"), ("error", "failure", "s")]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child(args)
    info = bh.header(MODULE, argv, args.device)
    print(json.dumps(info), flush=True)
    rows = [row for m in args.methods for row in bh.climb(
        lambda n, m=m: bh.run_child(MODULE, [*argv, "--child", m, "--child-len", str(n)], {"method": m, "length": n}),
        args.lengths)]
    ok = {(r["method"], r["length"]): r for r in rows if "error" not in r}
    longest = {m: max((n for (mm, n) in ok if mm == m), default=0) for m in args.methods}
    ratios = {n: round(ok[("megacp", n)]["ttft_s"] / ok[("hf", n)]["ttft_s"], 3)
              for (m, n) in ok if m == "megacp" and ("hf", n) in ok}
    bh.print_table(None, rows, COLUMNS, f"one request, {args.new_tokens} new tokens, {'tiny' if args.tiny else args.model} "
                                        f"shape, {shape_of(args)['num_hidden_layers']} layers")
    print("longest: " + ", ".join(f"{m} {bh.size_label(n) if n else 'none'}" for m, n in longest.items()))
    capacity = next((r["capacity_tokens"] for r in rows if r.get("capacity_tokens")), None)
    of_capacity = round(longest.get("megacp", 0) / capacity, 3) if capacity else None
    if of_capacity is not None:
        print(f"megacp's longest prompt is {of_capacity:.3f} of its cache's capacity ({capacity:,} tokens)")
    if ratios:
        print("megacp / HF TTFT: " + ", ".join(f"{bh.size_label(n)} {r:.3f}" for n, r in ratios.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**info, "results": rows, "longest": longest, "megacp_longest_of_capacity": of_capacity,
                       "megacp_over_hf_ttft": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
