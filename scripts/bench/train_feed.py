#!/usr/bin/env python3
"""Is ``python -m megacp.train`` fed? Its per-step tokens/s on a corpus against the same model's
training step fed from memory, in one run.

    python -m scripts.bench.train_feed --json out/train_feed.json        # one GPU: SmolLM2-135M shape, 16K
    python -m scripts.bench.train_feed --tiny --json /tmp/train_feed.json  # CPU smoke test

1. A random-weight ``LlamaForCausalLM`` of SmolLM2-135M's shape (30 layers, hidden 576, 9 Q / 3 KV
   heads of 64, MLP 1536, vocabulary 49152, tied embeddings) is saved with a word-level tokenizer
   (:func:`scripts.bench.decode_kinds.save_random_model`), and a corpus of documents of random
   words is written (documents of 1/4 to 2 sequences, so packing cuts and joins them).
2. ``corpus``: ``python -m megacp.train`` runs as a user runs it, without a launcher (CP 1,
   ``configs/train_cp1.json``: bf16, ZeRO 1; ``--tiny``: ``configs/train_cpu_cp1.json``) for
   ``--steps`` steps; its ``--metrics`` rows give each step's seconds. The corpus is tokenised into
   the token cache before the first step.
3. ``memory``: in this process the same model is loaded as ``megacp.train`` loads it and trained by
   :class:`megacp.train.engine.Trainer` with the same config, on the same packed sequences (read
   from the token cache into memory beforehand): the step with no data loading at all.

The first ``--warmup`` steps of each are left out. Reported: tokens/s (tokens over the median
step time), the step-time spread (max / median), and ``corpus / memory`` tokens/s (target: at
least 0.90 with a spread under 1.2 on one H200 at 16K tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch

from megacp.train.data import CorpusBatches, PackedSequence, resolve_corpus
from scripts.bench import harness as bh
from scripts.bench.decode_kinds import save_random_model

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY = dict(SMOLLM2_135M, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TARGET_RATIO, TARGET_SPREAD = 0.90, 1.2
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def write_corpus(path: Path, vocab: int, tokens: int, seq_len: int, seed: int) -> None:
    """A JSONL corpus of about ``tokens`` words ``t<id>`` (one token each; ids 3 .. vocab - 1), in
    documents of ``seq_len / 4`` to ``2 * seq_len`` words."""
    g = torch.Generator().manual_seed(seed)
    with path.open("w", encoding="utf-8") as f:
        written = 0
        while written < tokens:
            n = int(torch.randint(seq_len // 4, 2 * seq_len, (1,), generator=g))
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids)}) + "\n")
            written += n


def step_stats(seconds: list[float], tokens: int) -> dict:
    """tokens/s over the median step, the spread max / median, and the times themselves."""
    median = statistics.median(seconds)
    return {"steps": len(seconds), "median_s": median, "max_s": max(seconds), "spread": max(seconds) / median,
            "tokens_per_s": tokens / median, "step_s": seconds}


def run_cli(args: argparse.Namespace, work: Path, config: Path) -> tuple[dict, float]:
    """``python -m megacp.train`` without a launcher; its steady steps' stats and its wall time."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    metrics = work / "metrics.jsonl"
    command = [sys.executable, "-m", "megacp.train", "--deepspeed_config", str(config), "--model", str(work / "model"),
               "--corpus", str(work / "corpus.jsonl"), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--metrics", str(metrics), "--token-cache", str(work / "tokens")]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    print(proc.stdout.strip(), flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: megacp.train exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][args.warmup:]
    return step_stats([r["seconds"] for r in rows], rows[0]["tokens"]), wall


def run_memory(ctx: bh.Ctx, args: argparse.Namespace, work: Path, config_path: Path) -> dict:
    """The same model and config trained in this process on the same sequences held in memory."""
    from megacp.checkpoint.front import load_on_mesh
    from megacp.config import load_config
    from megacp.layers.settings import CPSettings
    from megacp.train.cli import silence_harmless_warnings
    from megacp.train.engine import Trainer, read_settings
    from megacp.train.token_cache import build_token_cache

    silence_harmless_warnings()
    config = load_config(config_path)
    settings = read_settings(config.deepspeed)
    cp = CPSettings.from_state(ctx.state, prefill="pass_kv")
    loaded = load_on_mesh(str(work / "model"), ctx.state, dtype=settings.dtype, settings=cp)
    model = loaded.model.train()
    eos = int(loaded.config.eos_token_ids[0])
    cache = build_token_cache(resolve_corpus([work / "corpus.jsonl"]), loaded.tokenizer, eos_id=eos,
                              root=work / "tokens")
    assert cache.reused, "the token cache of the megacp.train run was not found"
    batches = CorpusBatches([], None, eos_id=eos, seq_len=args.seq_len, micro_batch=1, dp_size=1, dp_rank=0,
                            documents=cache.stream())
    sequences = [PackedSequence(b.input_ids.to(ctx.device), b.cu_seqlens.to(ctx.device))
                 for b in islice(batches, args.steps)]
    trainer = Trainer(model, config.deepspeed, ctx.state, settings, cp=cp)
    seconds = []
    try:
        for seq in sequences:
            result = trainer.step(iter([seq]))
            seconds.append(result.seconds)
    finally:
        trainer.engine.destroy()
    return step_stats(seconds[args.warmup:], args.seq_len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-len", type=lambda t: bh.parse_sizes(t)[0], default=16384)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    p.add_argument("--tiny", action="store_true", help="CPU, fp32, a 2-layer model, 128 tokens, 6 steps")
    p.add_argument("--workdir", default=None, help="keep the model, corpus and token cache here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.steps, args.warmup = 128, 6, 1
    elif not torch.cuda.is_available():
        print("error: the feed benchmark times a GPU's training steps; --tiny runs it on CPU", file=sys.stderr)
        return 2
    if args.steps <= args.warmup or args.seq_len < 2:
        print("error: --steps must exceed --warmup and --seq-len be >= 2", file=sys.stderr)
        return 2
    shape = dict(TINY if args.tiny else SMOLLM2_135M, max_position_embeddings=max(8192, args.seq_len))
    config = ROOT / "configs" / ("train_cpu_cp1.json" if args.tiny else "train_cp1.json")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        dtype = torch.float32 if args.tiny else torch.bfloat16
        save_random_model(shape, work / "model", dtype, torch.device("cpu"))
        write_corpus(work / "corpus.jsonl", shape["vocab_size"], (args.steps + 2) * args.seq_len, args.seq_len, args.seed)
        corpus, wall = run_cli(args, work, config)
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it even in a world of one
        ctx = bh.init("cpu" if args.tiny else "cuda", "fp32" if args.tiny else "bf16")
        rep = bh.Report(ctx, args.json, {**bh.env_info(ctx), "kind": "train_feed", "argv": sys.argv, "model": shape,
                                         "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
                                         "config": str(config.relative_to(ROOT))})
        memory = run_memory(ctx, args, work, config)
    rows = [{"feed": "corpus", **corpus, "wall_s": wall}, {"feed": "memory", **memory}]
    ratio = corpus["tokens_per_s"] / memory["tokens_per_s"]
    summary = {"ratio": ratio, "spread": corpus["spread"],
               "meets_target": ratio >= TARGET_RATIO and corpus["spread"] < TARGET_SPREAD}
    for row in rows:
        rep.result(row)
    rep.data["summary"] = summary
    bh.print_table(ctx, rows, [("feed", "fed from", "s"), ("steps", "steps", "d"), ("median_s", "median s", ".4f"),
                               ("max_s", "max s", ".4f"), ("spread", "max/median", ".3f"),
                               ("tokens_per_s", "tokens/s", ".0f")],
                   f"megacp.train at {args.seq_len} tokens against its step fed from memory")
    print(f"corpus / memory tokens/s {ratio:.3f} (target >= {TARGET_RATIO}), spread {corpus['spread']:.3f} "
          f"(target < {TARGET_SPREAD}): {'met' if summary['meets_target'] else 'NOT met'}", flush=True)
    rep.save()
    bh.finish(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
