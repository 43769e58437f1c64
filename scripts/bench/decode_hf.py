#!/usr/bin/env python3
"""Decode tokens/s and TTFT of megacp at CP = 1 (eager decode and CUDA-graph decode) against
Hugging Face transformers ``generate`` on the same random weights, one GPU.

    python -m scripts.bench.decode_hf --model smollm2 --json out/decode_hf_smollm2.json
    python -m scripts.bench.decode_hf --model llama8b --json out/decode_hf_llama8b.json

Models (random weights, bf16): ``smollm2`` (SmolLM2-135M shape: hidden 576, 30 layers, 9 Q / 3 KV
heads, head dim 64, vocab 49152, tied embeddings, context 8K) and ``llama8b`` (Llama-3.1-8B shape:
32 layers, 32 Q / 8 KV heads, head dim 128, vocab 128256, context 128K). megacp builds the model
with a seed; its weights are copied into a ``LlamaForCausalLM`` through megacp's megacp-to-HF name
mapping (:func:`megacp.checkpoint.hf.megacp_to_hf`).

Batch 1, a random prompt of each ``--lengths`` (capped to the context minus ``--new-tokens``),
greedy, exactly ``--new-tokens`` tokens (HF: ``min_new_tokens = max_new_tokens``, megacp: no stop
tokens). Methods:

* ``megacp_eager`` / ``megacp_graph``: :class:`megacp.generate.Generator` with ``cuda_graphs``
  off / on; TTFT and decode tokens/s from the run's report (graph capture excluded: a warm-up run
  on the same cache captures it first).
* ``hf_dynamic``: ``generate`` with its default dynamic cache.
* ``hf_static``: ``cache_implementation="static"``, ``disable_compile=True``.
* ``hf_static_compiled``: ``cache_implementation="static"`` as transformers 5 runs it by default on
  CUDA: the decoding forward compiled (``CompileConfig``: inductor, ``mode="reduce-overhead"``).

HF TTFT = time of ``generate(max_new_tokens=1)``; HF decode tokens/s = ``(N - 1) / (T_N - T_1)``.
Every method runs once untimed per length first (compilation and capture are not timed; their
time is recorded as ``warmup_s``). The check: the first generated token of every method equals
``hf_dynamic``'s, and the tokens shared with it are printed. Writes ``--json`` through the harness.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch

from scripts.bench import harness as bh

MODELS: dict[str, dict[str, Any]] = {
    "smollm2": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5),
    "llama8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
                    rope_theta=500000.0, rms_norm_eps=1e-5,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192)),
}
"""Hugging Face ``config.json`` dicts of the benchmark's model shapes."""

METHODS = ("megacp_eager", "megacp_graph", "hf_dynamic", "hf_static", "hf_static_compiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--lengths", default="1K,8K,32K", help="prompt tokens (K/M suffixes), capped to the context")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {', '.join(METHODS)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    try:
        args.length_list = bh.parse_sizes(args.lengths)
    except ValueError as e:
        p.error(f"--lengths: {e}")
    args.method_list = bh.parse_names(args.methods)
    bad = [m for m in args.method_list if m not in METHODS]
    if bad or not args.method_list:
        p.error(f"--methods: {', '.join(bad) or 'none given'}; choose from {', '.join(METHODS)}")
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be >= 2, got {args.new_tokens}")
    return args


def model_lengths(name: str, lengths: list[int], new_tokens: int) -> list[int]:
    """``lengths`` capped to the model's context minus ``new_tokens``, without repeats."""
    cap = MODELS[name]["max_position_embeddings"] - new_tokens
    return list(dict.fromkeys(min(s, cap) for s in lengths))


def hf_copy(model: torch.nn.Module, cfg: Any, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` holding ``model``'s weights (megacp names mapped to HF's, tensor by
    tensor), in eval mode."""
    import transformers

    from megacp.checkpoint.hf import config_to_hf, megacp_to_hf

    hf_cfg = config_to_hf(cfg)
    hf_cfg.pop("architectures")
    config = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    params = dict(hf.named_parameters())
    state = model.state_dict()
    copied = set()
    with torch.no_grad():
        for name, tensor in megacp_to_hf(cfg, state.__getitem__, [n for n in state if not n.endswith("_extra_state")]):
            params[name].copy_(tensor)
            copied.add(name)
    missing = set(params) - copied - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise RuntimeError(f"HF parameters not set from megacp: {sorted(missing)[:5]}")
    return hf.eval()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``fn()`` (device synchronised before and after) and its result."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def run_megacp(gen: Any, prompt: list[int], new: int, vocab: int) -> tuple[dict, list[int], float]:
    """Warm-up run then timed run on one engine (same cache and slot: the graph is captured once).
    Returns (report, tokens, warm-up seconds)."""
    from megacp.generate import SamplingParams
    from megacp.generate.engine import Request, offline_engine

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    engine = offline_engine(gen, [len(prompt)], new, vocab=vocab, max_num_seqs=1)
    seconds, reports, reqs = [], [], []
    for _ in range(2):
        req = Request(list(prompt), params)
        t, report = timed(lambda: engine.run([req]))  # noqa: B023 - called at once
        seconds.append(t)
        reports.append(report)
        reqs.append(req)
    return reports[1], reqs[1].tokens, seconds[0]


def run_hf(hf: torch.nn.Module, prompt: list[int], new: int, method: str) -> tuple[dict, list[int], float]:
    """TTFT (``max_new_tokens=1``) and decode tokens/s of ``generate`` with ``method``'s cache."""
    ids = torch.tensor([prompt], device=hf.device)
    kw: dict[str, Any] = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if method != "hf_dynamic":
        kw["cache_implementation"] = "static"
        kw["disable_compile"] = method == "hf_static"

    def gen(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    warm = timed(lambda: gen(new))[0] + timed(lambda: gen(1))[0]
    t1, _ = timed(lambda: gen(1))
    tn, out = timed(lambda: gen(new))
    tokens = out[0, len(prompt):].tolist()
    if len(tokens) != new:
        raise RuntimeError(f"generate returned {len(tokens)} tokens, expected {new}")
    return {"ttft_s": round(t1, 4), "decode_tokens_per_s": round((new - 1) / (tn - t1), 2)}, tokens, warm


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" or not torch.cuda.is_available():
        where = "--device cpu" if args.device == "cpu" else "no CUDA GPU here"
        print(f"decode_hf: {where}: this benchmark times CUDA decode (CUDA graphs, torch.compile); run it on a GPU",
              file=sys.stderr)
        return 2
    import megacp
    from megacp.checkpoint.hf import config_from_hf
    from megacp.generate import Generator
    from megacp.layers.settings import CPSettings
    from megacp.models import build_model

    ctx = bh.init("cuda", "bfloat16")
    dev, dtype = ctx.device, torch.bfloat16
    cfg = config_from_hf(MODELS[args.model])
    lengths = model_lengths(args.model, args.length_list, args.new_tokens)
    rep = bh.Report(ctx, args.json, {**bh.env_info(ctx), "kind": "decode_vs_hf", "model": args.model,
                                     "model_config": MODELS[args.model], "new_tokens": args.new_tokens,
                                     "lengths": lengths, "argv": sys.argv})
    import transformers

    rep.note("transformers", transformers.__version__)
    torch.manual_seed(args.seed)
    model = build_model(cfg, dtype=dtype, device=dev, backend="torch")
    hf = hf_copy(model, cfg, dtype, dev) if any(m.startswith("hf_") for m in args.method_list) else None
    megacp.swap_attention(model, ctx.state)
    settings = CPSettings.from_state(ctx.state)
    gens = {"megacp_eager": Generator.for_model(model, cfg, settings, device=dev, dtype=dtype, cuda_graphs=False),
            "megacp_graph": Generator.for_model(model, cfg, settings, device=dev, dtype=dtype, cuda_graphs=True)}
    g = torch.Generator().manual_seed(args.seed + 1)
    failed = False
    for s in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (s,), generator=g).tolist()
        row: dict[str, Any] = {"prompt_tokens": s}
        tokens: dict[str, list[int]] = {}
        for m in args.method_list:
            try:
                if m.startswith("megacp"):
                    res, toks, warm = run_megacp(gens[m], prompt, args.new_tokens, cfg.vocab_size)
                    if m == "megacp_graph" and res.get("decode") != "cuda_graph":
                        raise RuntimeError(f"the run decoded {res.get('decode')!r}, not from a CUDA graph")
                else:
                    res, toks, warm = run_hf(hf, prompt, args.new_tokens, m)
            except Exception as exc:  # noqa: BLE001 - one method's failure must not hide the others
                rep.error(m, exc, prompt_tokens=s)
                failed = True
                continue
            tokens[m] = toks
            row[f"{m}_ttft_s"] = res["ttft_s"]
            row[f"{m}_tok_s"] = res["decode_tokens_per_s"]
            row[f"{m}_warmup_s"] = round(warm, 2)
            ctx.log(f"  {s:>6} {m:<20} TTFT {res['ttft_s']:.4f} s  decode {res['decode_tokens_per_s']} tok/s")
        ref = tokens.get("hf_dynamic") or next(iter(tokens.values()), None)
        for m, toks in tokens.items():
            same = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
            ok = toks[0] == ref[0]
            failed |= not ok
            rep.check({"prompt_tokens": s, "method": m, "first_token_equal": ok, "equal_prefix": same})
            ctx.log(f"  check {s:>6} {m:<20} first token {'ok' if ok else 'FAIL'}, {same}/{len(ref)} tokens equal")
        hf_best = max((row.get(f"{m}_tok_s") or 0 for m in METHODS if m.startswith("hf_")), default=0)
        for m in ("megacp_eager", "megacp_graph"):
            if row.get(f"{m}_tok_s") and hf_best:
                row[f"{m}_vs_hf_best"] = round(row[f"{m}_tok_s"] / hf_best, 3)
        rep.result(row)
        torch.cuda.empty_cache()
    cols = [("prompt_tokens", "prompt", "d")]
    cols += [(f"{m}_tok_s", f"{m} tok/s", ".1f") for m in METHODS if m in args.method_list]
    cols += [(f"{m}_vs_hf_best", f"{m}/HF best", ".2f") for m in ("megacp_eager", "megacp_graph")]
    bh.print_table(ctx, rep.data["results"], cols, f"Decode tokens/s, batch 1, {args.new_tokens} new tokens, "
                                                    f"{args.model} shape, bf16, {torch.cuda.get_device_name(dev)}")
    bh.print_table(ctx, rep.data["results"], [("prompt_tokens", "prompt", "d")] +
                   [(f"{m}_ttft_s", f"{m} TTFT s", ".4f") for m in METHODS if m in args.method_list], "TTFT")
    checked = bool(rep.data["checks"])
    rep.print_summary("first-token", checked=checked, failed=failed, where=("prompt_tokens",))
    bh.finish(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
