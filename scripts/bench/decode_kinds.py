#!/usr/bin/env python3
"""Decode tokens/s of every kind of request through ``LLM.generate``, against greedy and against
Hugging Face transformers ``generate`` in its best configuration on the same random weights and
batch, one GPU.

    python -m scripts.bench.decode_kinds --models smollm2 --batches 1,8,32 --json out/decode_kinds_smollm2.json
    python -m scripts.bench.decode_kinds --models llama8b16 --batches 1,8,32 --json out/decode_kinds_llama8b16.json
    python -m scripts.bench.decode_kinds --tiny --batches 1,2 --new-tokens 4    # a CPU smoke run of a tiny shape

Kinds (:data:`KINDS`): ``greedy``; ``sampled`` (temperature 0.8, top-p 0.9, seed 1); ``top_k``
(temperature 0.8, top-k 50); ``min_p`` (temperature 0.8, min-p 0.05); ``repetition`` (repetition
penalty 1.1, greedy); ``presence_frequency`` (presence and frequency penalties 0.5, greedy; HF has
no such option: its peer applies OpenAI's rule in a ``LogitsProcessor``, :class:`OpenAIPenalties`);
``stop`` (greedy with a stop string that never occurs, so its check runs after every token);
``logprobs`` (greedy, the top-5 log-probabilities of every token; HF: ``output_logits`` and the
same log-softmax and top-k of each step's logits, inside its timing). Models: ``smollm2`` (the
SmolLM2-135M shape of :mod:`scripts.bench.decode_hf`, a 1K prompt) and ``llama8b16`` (the
Llama-3.1-8B shape with 16 layers, a 4K prompt); ``--tiny``: a 2-layer shape with a 32-token prompt
on CPU. HF's configuration (``--hf-cache``): ``compiled`` (default on CUDA: the static cache with
transformers' compiled decoding forward, its fastest in ``docs/PERFORMANCE.md``), ``static``
(uncompiled) or ``dynamic`` (default with ``--tiny``).

A random-weight ``LlamaForCausalLM`` (bf16 on CUDA; seeded) is saved with a word-level tokenizer
of its vocabulary to a temporary directory, which ``LLM`` loads (CUDA-graph decode on CUDA). Each
(model, batch, kind): one untimed run, then a timed one; megacp's rate is the first request's
``decode_tokens_per_s`` (tokens after the first per second; graph capture is not in it), HF's is
``(N - 1) / (T_N - T_1)`` with ``T_n`` the time of ``generate(max_new_tokens=n)`` at that batch,
exactly ``--new-tokens`` tokens each (no end-of-sequence stop). The table prints each kind's
ratio to megacp greedy and to HF's same kind. The check: megacp's first greedy token of every
prompt equals HF's, or the two are a near tie by HF's own logits (:func:`first_token_check`).
Writes ``--json`` through the harness.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from scripts.bench import harness as bh
from scripts.bench.decode_hf import MODELS as HF_SHAPES

MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "smollm2": (HF_SHAPES["smollm2"], 1024),
    "llama8b16": (dict(HF_SHAPES["llama8b"], num_hidden_layers=16), 4096),
}
"""Model name -> (Hugging Face ``config.json`` dict, prompt tokens)."""

TINY: tuple[dict[str, Any], int] = (dict(HF_SHAPES["smollm2"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                                         max_position_embeddings=1024), 32)

STOP = "abcdef abcdef abcdef abcdef abcdef"
"""The stop string of the ``stop`` kind: words of the vocabulary (transformers' criterion needs
them), token 1 five times in a row, which random weights do not produce."""

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5)
TOP_LOGPROBS = 5

TIE = 0.01
"""A first greedy token that differs from HF's passes the check where, by HF's logits of the prompt,
megacp's token scores within ``TIE`` × the largest absolute logit of HF's: a near tie (random weights
give many) that bf16 GEMMs of other shapes may break either way."""

KINDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "greedy": ({}, dict(do_sample=False)),
    "sampled": (dict(temperature=0.8, top_p=0.9, seed=1), dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=0)),
    "top_k": (dict(temperature=0.8, top_k=50, seed=1), dict(do_sample=True, temperature=0.8, top_k=50)),
    "min_p": (dict(temperature=0.8, min_p=0.05, seed=1), dict(do_sample=True, temperature=0.8, min_p=0.05, top_k=0)),
    "repetition": (dict(repetition_penalty=1.1), dict(do_sample=False, repetition_penalty=1.1)),
    "presence_frequency": (PENALTIES, dict(do_sample=False)),
    "stop": (dict(stop=[STOP]), dict(do_sample=False, stop_strings=[STOP])),
    "logprobs": (dict(logprobs=TOP_LOGPROBS), dict(do_sample=False, output_logits=True, return_dict_in_generate=True)),
}
"""Kind -> (megacp ``SamplingParams`` arguments, HF ``generate`` arguments)."""

HF_CACHES = ("compiled", "static", "dynamic")


class OpenAIPenalties:
    """A transformers ``LogitsProcessor`` of OpenAI's presence and frequency penalties (the HF peer
    of ``presence_frequency``): ``scores - frequency * count - presence * (count > 0)`` with
    ``count`` the times each token was generated after the ``prompt_len`` prompt tokens."""

    def __init__(self, prompt_len: int, presence_penalty: float, frequency_penalty: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence_penalty, frequency_penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        made = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, made, torch.ones_like(made, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {', '.join(MODELS)}")
    p.add_argument("--batches", default="1,8,32", help="batch sizes")
    p.add_argument("--hf-cache", choices=HF_CACHES, default=None,
                   help="transformers' configuration (default: compiled on CUDA, dynamic with --tiny)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {', '.join(KINDS)}")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--tiny", action="store_true", help="a tiny shape on CPU (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    args.model_list = ["tiny"] if args.tiny else bh.parse_names(args.models)
    args.kind_list = bh.parse_names(args.kinds)
    for what, names, known in (("--models", args.model_list, [*MODELS, "tiny"]), ("--kinds", args.kind_list, KINDS)):
        bad = [n for n in names if n not in known]
        if bad or not names:
            p.error(f"{what}: {', '.join(bad) or 'none given'}; choose from {', '.join(k for k in known if k != 'tiny')}")
    try:
        args.batch_list = bh.parse_sizes(args.batches)
    except ValueError as e:
        p.error(f"--batches: {e}")
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be >= 2, got {args.new_tokens}")
    args.hf_cache = args.hf_cache or ("dynamic" if args.tiny else "compiled")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA GPU here: this benchmark times CUDA-graph decode; --tiny runs a CPU smoke test")
    return args


def save_random_model(shape: dict[str, Any], directory: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """Save a seeded random ``LlamaForCausalLM`` of ``shape`` and a word-level tokenizer of its
    vocabulary (token ``i`` is the word ``t<i>``, token 1 ``abcdef``) to ``directory``; return (model in eval mode, tokenizer)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model("llama", **cfg)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    hf.save_pretrained(str(directory))
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    vocab["abcdef"] = vocab.pop("t1")  # HF's stop-string criterion encodes this word to read the vocabulary
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words)
    tok.save_pretrained(str(directory))
    return hf.eval(), tok


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_megacp(llm: Any, prompts: list[list[int]], new: int, kind: str) -> tuple[dict[str, Any], list[list[int]]]:
    """An untimed then a timed ``LLM.generate``; the first request's decode tokens/s and the tokens."""
    from megacp import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True, **KINDS[kind][0])
    for _ in range(2):
        outs = llm.generate(prompts, params)
    report = llm.last_report
    if len(outs[0].token_ids) != new:
        raise RuntimeError(f"megacp returned {len(outs[0].token_ids)} tokens, expected {new}")
    return {"tok_s": outs[0].decode_tokens_per_s, "batch_tok_s": report["decode_tokens_per_s"],
            "decode": report["decode"]}, [o.token_ids for o in outs]


def run_hf(hf: Any, tok: Any, prompts: list[list[int]], new: int, kind: str,
           cache: str) -> tuple[dict[str, Any], list[list[int]]]:
    """Decode tokens/s ``(N - 1) / (T_N - T_1)`` of ``generate`` with ``cache`` (:data:`HF_CACHES`)
    at this batch."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts, device=hf.device)
    kw: dict[str, Any] = dict(KINDS[kind][1], pad_token_id=0, eos_token_id=None)
    if cache != "dynamic":
        kw.update(cache_implementation="static", disable_compile=cache == "static")
    if "stop_strings" in kw:
        kw["tokenizer"] = tok
    if kind == "presence_frequency":
        kw["logits_processor"] = LogitsProcessorList([OpenAIPenalties(ids.shape[1], **PENALTIES)])

    def timed(n: int) -> tuple[float, torch.Tensor]:
        torch.manual_seed(1)
        _sync(hf.device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **kw)
            if kind == "logprobs":  # what megacp returns: the top tokens' log-probabilities, on the host
                top = torch.stack(out.logits, 1).float().log_softmax(-1).topk(TOP_LOGPROBS, dim=-1)
                top.values.tolist(), top.indices.tolist()
                out = out.sequences
        _sync(hf.device)
        return time.perf_counter() - t, out

    timed(new)
    t1, _ = timed(1)
    tn, out = timed(new)
    return {"tok_s": round((new - 1) / (tn - t1), 2)}, out[:, ids.shape[1]:].tolist()


def first_token_check(hf: Any, prompts: list[list[int]], ours: list[int], theirs: list[int]) -> dict[str, Any]:
    """The first greedy tokens of megacp (``ours``) and HF (``theirs``) per prompt: ``equal`` (all
    equal), ``differing`` (how many differ), ``near_ties`` (how many of those are within :data:`TIE`
    by HF's logits of that prompt's last position) and ``ok`` (every difference a near tie)."""
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    ties = 0
    for i in differ:
        with torch.inference_mode():
            logits = hf(torch.tensor([prompts[i]], device=hf.device)).logits[0, -1].float()
        ties += bool(logits[theirs[i]] - logits[ours[i]] <= TIE * logits.abs().max())
    return {"first_greedy_token_equal": not differ, "differing": len(differ), "near_ties": ties,
            "ok": ties == len(differ)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megacp import LLM

    device = "cpu" if args.tiny else "cuda"
    ctx = bh.init(device, "float32" if args.tiny else "bfloat16")
    dev, dtype = ctx.device, ctx.dtype
    import transformers

    rep = bh.Report(ctx, args.json, {**bh.env_info(ctx), "kind": "decode_kinds", "models": args.model_list,
                                     "batches": args.batch_list, "kinds": args.kind_list,
                                     "new_tokens": args.new_tokens, "hf_cache": args.hf_cache, "argv": sys.argv})
    rep.note("transformers", transformers.__version__)
    failed = False
    for name in args.model_list:
        shape, length = TINY if name == "tiny" else MODELS[name]
        with tempfile.TemporaryDirectory(prefix="decode_kinds_") as tmp:
            torch.manual_seed(args.seed)
            hf, tok = save_random_model(shape, Path(tmp), dtype, dev)
            llm = LLM(tmp, dtype=dtype, state=ctx.state)
            if args.no_hf:
                del hf
                hf = None
            g = torch.Generator().manual_seed(args.seed + 1)
            for b in args.batch_list:
                prompts = [torch.randint(0, shape["vocab_size"], (length,), generator=g).tolist() for _ in range(b)]
                rows: dict[str, dict[str, Any]] = {}
                for kind in args.kind_list:
                    row: dict[str, Any] = {"model": name, "batch": b, "prompt_tokens": length, "request": kind}
                    try:
                        ours, tokens = run_megacp(llm, prompts, args.new_tokens, kind)
                        row.update({f"megacp_{k}": v for k, v in ours.items()})
                        if hf is not None:
                            theirs, hf_tokens = run_hf(hf, tok, prompts, args.new_tokens, kind, args.hf_cache)
                            row["hf_tok_s"] = theirs["tok_s"]
                            if kind == "greedy":
                                check = first_token_check(hf, prompts, [t[0] for t in tokens], [t[0] for t in hf_tokens])
                                failed |= not check["ok"]
                                rep.check({"model": name, "batch": b, **check})
                    except Exception as exc:  # noqa: BLE001 - one kind's failure must not hide the others
                        rep.error(kind, exc, model=name, batch=b)
                        failed = True
                        continue
                    rows[kind] = row
                    ctx.log(f"  {name} batch {b} {kind:<10} megacp {row['megacp_tok_s']} tok/s "
                            f"({row['megacp_decode']})  HF {row.get('hf_tok_s')} tok/s")
                greedy = rows.get("greedy", {}).get("megacp_tok_s")
                for row in rows.values():
                    if greedy and row["megacp_tok_s"]:
                        row["vs_greedy"] = round(row["megacp_tok_s"] / greedy, 3)
                    if row.get("hf_tok_s") and row["megacp_tok_s"]:
                        row["vs_hf"] = round(row["megacp_tok_s"] / row["hf_tok_s"], 3)
                    rep.result(row)
            del llm, hf
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    cols = [("model", "model", "s"), ("batch", "batch", "d"), ("request", "request", "s"),
            ("megacp_tok_s", "megacp tok/s", ".1f"), ("vs_greedy", "/greedy", ".2f"), ("hf_tok_s", "HF tok/s", ".1f"),
            ("vs_hf", "/HF", ".2f"), ("megacp_decode", "decode", "s")]
    bh.print_table(ctx, rep.data["results"], cols, f"Decode tokens/s of the first request, {args.new_tokens} new "
                                                   f"tokens, {str(dtype).replace('torch.', '')}, {dev}")
    rep.print_summary("first-greedy-token", checked=bool(rep.data["checks"]), failed=failed, where=("model", "batch"))
    bh.finish(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
