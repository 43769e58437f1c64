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

What makes steps differ, from the same run (``diagnosis`` in the JSON, one line per step printed):

* the step's attention work: documents do not cross sequence boundaries, so a sequence's attention
  costs ``sum(piece_len ** 2)``; ``attention_work`` is that over ``seq_len ** 2`` (1: one document
  fills the sequence), per step for both feeds. A least-squares fit of the memory feed's step times,
  ``fixed_s + per_work_s x attention_work`` (its ``r2``: the share of the step-time variance the work
  explains), gives each feed's ``adjusted_spread``: the max / median of step time over fitted time.
* ``new_plan_lengths``: per step, the padded cuDNN tile lengths no earlier step of the process ran
  (a plan the warm-up missed is built in the first step that needs it);
* ``memory_fixed_work``: the memory feed repeating its heaviest sequence (no work variation: the
  spread of the system alone);
* ``memory_gc_unfrozen``: the memory feed under Python's automatic garbage collector with nothing
  frozen (the main ``memory`` row runs as ``megacp.train`` does: set-up frozen,
  :class:`megacp.train.collector.GarbageCollection`); ``memory_gc_off``: no collection at all while
  training (``--gc-every`` larger than the run);
* per step of every memory run: seconds in garbage collections and full collections during the step
  (``gc.callbacks``), and on a GPU the CUDA caching allocator's ``cudaMalloc`` calls and allocation
  retries (``num_device_alloc`` / ``num_alloc_retries`` deltas).

Every memory step is timed by :meth:`megacp.train.engine.Trainer.step`: from after the previous
step's ``torch.cuda.synchronize()`` to after its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from megacp.attention.kernels.plans import plan_length
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


def attention_work(group: Sequence[PackedSequence], seq_len: int) -> float:
    """A step's attention work: ``sum(piece_len ** 2) / seq_len ** 2`` over the document pieces of its
    micro-batches, averaged over their packed sequences (1: every sequence one document)."""
    pieces = [torch.diff(s.cu_seqlens.cpu()).double() for s in group]
    sequences = sum(s.input_ids.numel() for s in group) / seq_len
    return float(sum(float((p * p).sum()) for p in pieces)) / (seq_len * seq_len * sequences)


def fit_work(seconds: list[float], work: list[float]) -> dict:
    """Least squares ``seconds ~ fixed_s + per_work_s * work`` (``per_work_s`` at least 0: more work
    never makes a step faster); ``r2``: the share of the variance of ``seconds`` it explains (0 when
    ``work`` does not vary)."""
    mean_w, mean_s = statistics.fmean(work), statistics.fmean(seconds)
    var_w = sum((w - mean_w) ** 2 for w in work)
    slope = max(0.0, sum((w - mean_w) * (t - mean_s) for w, t in zip(work, seconds)) / var_w) if var_w > 0 else 0.0
    fixed = mean_s - slope * mean_w
    total = sum((t - mean_s) ** 2 for t in seconds)
    residual = sum((t - fixed - slope * w) ** 2 for w, t in zip(work, seconds))
    return {"fixed_s": fixed, "per_work_s": slope, "r2": 1 - residual / total if total > 0 else 0.0}


def adjusted_spread(seconds: list[float], work: list[float], fit: dict) -> float:
    """max / median of each step's time over the time ``fit`` predicts for its work."""
    ratios = [t / (fit["fixed_s"] + fit["per_work_s"] * w) for t, w in zip(seconds, work)]
    return max(ratios) / statistics.median(ratios)


class GcClock:
    """Time spent in Python's garbage collections and the full (generation 2) ones, counted through
    ``gc.callbacks`` between :meth:`read` calls. A context manager: registered inside the block."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2

    def read(self) -> tuple[float, int]:
        """``(seconds, full collections)`` since the last read."""
        out, self.seconds, self.full = (self.seconds, self.full), 0.0, 0
        return out

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on)


ALLOCATOR_COUNTS = ("num_device_alloc", "num_alloc_retries")
"""CUDA caching-allocator counters recorded per step: ``cudaMalloc`` calls and retries after
freeing the cache (each a device synchronisation)."""


def allocator_counts(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTS}


def new_plan_lengths(group: Sequence[PackedSequence], seen: set[int]) -> int:
    """How many padded cuDNN tile lengths (:func:`~megacp.attention.kernels.plans.plan_length` of the
    document pieces, CP 1) of ``group`` are not in ``seen`` yet (added to it): the kernel plans a
    step would build if nothing had warmed them."""
    lengths = {plan_length(int(n)) for s in group for n in torch.diff(s.cu_seqlens.cpu())}
    new = lengths - seen
    seen |= lengths
    return len(new)


def time_steps(trainer: Any, groups: Sequence[Sequence[PackedSequence]], device: torch.device, seq_len: int,
               warmup: int, seen: set[int]) -> dict:
    """Train one step per group of ``groups`` (a step's micro-batches); the stats of the steps after
    the first ``warmup``, with each step's attention work, new plan lengths (``seen``: the lengths
    of the trainer's earlier steps), garbage-collection time and full collections, and allocator
    counter deltas."""
    rows = []
    with GcClock() as clock:
        for group in groups:
            before = allocator_counts(device)
            clock.read()
            result = trainer.step(iter(group))
            gc_s, full = clock.read()
            after = allocator_counts(device)
            rows.append({"s": result.seconds, "work": attention_work(group, seq_len), "gc_s": gc_s, "gc_full": full,
                         "new_lengths": new_plan_lengths(group, seen), **{key: after[key] - before[key] for key in after}})
    rows = rows[warmup:]
    out = step_stats([r["s"] for r in rows], sum(s.input_ids.numel() for s in groups[0]))
    out["attention_work"] = [r["work"] for r in rows]
    out["new_plan_lengths"] = [r["new_lengths"] for r in rows]
    for key in ("gc_s", "gc_full", *ALLOCATOR_COUNTS):
        if key in rows[0]:
            out[key] = [r[key] for r in rows]
    return out


def run_cli(args: argparse.Namespace, work: Path, config: Path) -> tuple[dict, float]:
    """``python -m megacp.train`` without a launcher; its steady steps' stats and its wall time."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    metrics = work / "metrics.jsonl"
    command = [sys.executable, "-m", "megacp.train", "--deepspeed_config", str(config), "--model", str(work / "model"),
               "--corpus", str(work / "corpus.jsonl"), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--metrics", str(metrics), "--token-cache", str(work / "tokens"), "--gc-every", str(args.gc_every)]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    print(proc.stdout.strip(), flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: megacp.train exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][args.warmup:]
    return step_stats([r["seconds"] for r in rows], rows[0]["tokens"]), wall


def run_memory(ctx: bh.Ctx, args: argparse.Namespace, work: Path, config_path: Path) -> tuple[dict, dict]:
    """The same model and config trained in this process on the same sequences held in memory (the
    ``memory`` row, garbage collection as ``megacp.train``'s default), then the diagnosis variants
    of the module docstring on the same trainer (``--diagnose-steps`` steps each)."""
    from megacp.checkpoint.front import load_on_mesh
    from megacp.config import load_config
    from megacp.layers.settings import CPSettings
    from megacp.train.cli import silence_harmless_warnings
    from megacp.train.collector import GarbageCollection
    from megacp.train.engine import Trainer
    from megacp.train.token_cache import build_token_cache

    silence_harmless_warnings()
    config = load_config(config_path, training=True)
    settings = config.training
    assert settings is not None  # built with training=True
    cp = CPSettings.from_state(ctx.state, prefill="pass_kv")
    loaded = load_on_mesh(str(work / "model"), ctx.state, dtype=settings.dtype, settings=cp)
    model = loaded.model.train()
    eos = int(loaded.config.eos_token_ids[0])
    cache = build_token_cache(resolve_corpus([work / "corpus.jsonl"]), loaded.tokenizer, eos_id=eos,
                              root=work / "tokens")
    assert cache.reused, "the token cache of the megacp.train run was not found"
    micro_batch = int(config.deepspeed.get("train_micro_batch_size_per_gpu", 1))
    accumulation = int(config.deepspeed.get("gradient_accumulation_steps", 1))
    batches = CorpusBatches([], None, eos_id=eos, seq_len=args.seq_len, micro_batch=micro_batch, dp_size=1, dp_rank=0,
                            documents=cache.stream())
    sequences = [PackedSequence(b.input_ids.to(ctx.device), b.cu_seqlens.to(ctx.device))
                 for b in islice(batches, args.steps * accumulation)]
    groups = [sequences[i: i + accumulation] for i in range(0, len(sequences), accumulation)]
    trainer = Trainer(model, config, ctx.state, cp=cp)
    seen: set[int] = set()
    few, warm = groups[: args.diagnose_steps], 1  # the trainer is warm after the main run
    heaviest = max(groups[args.warmup:], key=lambda g: attention_work(g, args.seq_len))
    variants = {}
    try:
        with GarbageCollection():
            memory = time_steps(trainer, groups, ctx.device, args.seq_len, args.warmup, seen)
        variants["memory_gc_unfrozen"] = time_steps(trainer, few, ctx.device, args.seq_len, warm, seen)
        with GarbageCollection(every=len(few) + 1):
            variants["memory_gc_off"] = time_steps(trainer, few, ctx.device, args.seq_len, warm, seen)
        with GarbageCollection():
            variants["memory_fixed_work"] = time_steps(trainer, [heaviest] * len(few), ctx.device, args.seq_len, warm,
                                                       seen)
    finally:
        trainer.engine.destroy()
    return memory, variants


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-len", type=lambda t: bh.parse_sizes(t)[0], default=16384)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    p.add_argument("--diagnose-steps", type=int, default=16,
                   help="steps of each diagnosis variant (its first left out), at most --steps")
    p.add_argument("--gc-every", type=int, default=0, help="megacp.train's --gc-every for the corpus run")
    p.add_argument("--tiny", action="store_true", help="CPU, fp32, a 2-layer model, 128 tokens, 6 steps (3 per variant)")
    p.add_argument("--workdir", default=None, help="keep the model, corpus and token cache here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.steps, args.warmup, args.diagnose_steps = 128, 6, 1, 3
    elif not torch.cuda.is_available():
        print("error: the feed benchmark times a GPU's training steps; --tiny runs it on CPU", file=sys.stderr)
        return 2
    if args.steps <= args.warmup or args.seq_len < 2 or not 2 <= args.diagnose_steps <= args.steps or args.gc_every < 0:
        print("error: --steps must exceed --warmup, --diagnose-steps be 2 .. --steps, --seq-len >= 2 and "
              "--gc-every >= 0", file=sys.stderr)
        return 2
    shape = dict(TINY if args.tiny else SMOLLM2_135M, max_position_embeddings=max(8192, args.seq_len))
    config = ROOT / "configs" / ("train_cpu_cp1.json" if args.tiny else "train_cp1.json")
    begin = time.perf_counter()
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
                                         "diagnose_steps": args.diagnose_steps, "gc_every": args.gc_every,
                                         "config": str(config.relative_to(ROOT))})
        memory, variants = run_memory(ctx, args, work, config)
    corpus["attention_work"] = memory["attention_work"]  # the same sequences in the same order
    fit = fit_work(memory["step_s"], memory["attention_work"])
    for row in (corpus, memory, *variants.values()):
        row["adjusted_spread"] = adjusted_spread(row["step_s"], row["attention_work"], fit)
    rows = [{"feed": "corpus", **corpus, "wall_s": wall}, {"feed": "memory", **memory}]
    ratio = corpus["tokens_per_s"] / memory["tokens_per_s"]
    summary = {"ratio": ratio, "spread": corpus["spread"], "adjusted_spread": corpus["adjusted_spread"],
               "meets_target": ratio >= TARGET_RATIO and corpus["spread"] < TARGET_SPREAD}
    for row in rows:
        rep.result(row)
    variant_rows = [{"feed": name, **row} for name, row in variants.items()]
    rep.data["diagnosis"] = {"work_fit": fit, "variants": variant_rows}
    rep.data["summary"] = summary
    _print_steps(corpus, memory)
    bh.print_table(ctx, rows + variant_rows,
                   [("feed", "fed from", "s"), ("steps", "steps", "d"), ("median_s", "median s", ".4f"),
                    ("max_s", "max s", ".4f"), ("spread", "max/median", ".3f"), ("adjusted_spread", "adjusted", ".3f"),
                    ("tokens_per_s", "tokens/s", ".0f")],
                   f"megacp.train at {args.seq_len} tokens against its step fed from memory (adjusted: step time over "
                   "the time its attention work predicts)")
    print(f"step time ~ {fit['fixed_s']:.4f} s + {fit['per_work_s']:.4f} s x attention work (r2 {fit['r2']:.3f}, "
          "memory feed)", flush=True)
    print(f"corpus / memory tokens/s {ratio:.3f} (target >= {TARGET_RATIO}), spread {corpus['spread']:.3f} "
          f"(target < {TARGET_SPREAD}; adjusted for the attention work {corpus['adjusted_spread']:.3f}): "
          f"{'met' if summary['meets_target'] else 'NOT met'}; {time.perf_counter() - begin:.0f} s in all", flush=True)
    rep.save()
    bh.finish(ctx)
    return 0


def _print_steps(corpus: dict, memory: dict) -> None:
    """One line per steady step: its attention work, both feeds' seconds, the memory step's
    garbage-collection time and full collections, and its allocator counter deltas."""
    print("\nsteady steps: attention work (1: one document per sequence), padded tile lengths no earlier step ran, "
          "seconds fed from the corpus and from memory, the memory step's GC ms / full collections / cudaMalloc "
          "calls / alloc retries")
    for i, (w, c, m) in enumerate(zip(memory["attention_work"], corpus["step_s"], memory["step_s"])):
        extra = " ".join(f"{memory[k][i]}" for k in ALLOCATOR_COUNTS if k in memory)
        print(f"  {i:3d}  work {w:.3f}  new lengths {memory['new_plan_lengths'][i]}  corpus {c:.4f}  memory {m:.4f}  "
              f"gc {1e3 * memory['gc_s'][i]:6.1f} ms {memory['gc_full'][i]} {extra}".rstrip())


if __name__ == "__main__":
    sys.exit(main())
