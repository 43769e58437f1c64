#!/usr/bin/env python3
"""End-to-end training steps on one GPU: megacp's model and trainer against the same model in
Hugging Face transformers (SDPA attention), both under DeepSpeed with one config, in one run.

    python -m scripts.bench.train_step --seq-lens 8K,16K,32K --layers 4 --json out/train_step.json

The model has Llama-3-8B's layer shape (hidden 4096, 32 Q / 8 KV heads of 128, SwiGLU 14336, vocab
128256, untied head) with ``--layers`` layers and random weights, bf16, batch one packed sequence.
megacp: :func:`megacp.models.build_model` (torch layers), CP attention swapped in, one
:class:`megacp.train.engine.Trainer` step (``shard_batch`` + the chunked ``lm_loss``, DeepSpeed
engine with megacp's mpu). Hugging Face: ``LlamaForCausalLM(attn_implementation="sdpa")``, its own
loss, ``deepspeed.initialize`` with the same config (bf16, ZeRO 1, torch AdamW, clipping 1.0).

Reported per sequence length: median step time of ``--steps`` timed steps (after ``--warmup``),
tokens/s, MFU (model FLOPs ``6·N·T`` plus causal attention ``3 · L · 2·T²·NH·D`` over the bf16 dense
peak ``--peak-tflops``), peak memory.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

import megacp
from megacp.models import ModelConfig, build_model
from megacp.train.data import PackedSequence
from megacp.train.engine import Trainer
from scripts.bench import harness as bh

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "torch_adam": True}},
    "steps_per_print": 1_000_000,
}


def model_config(layers: int) -> ModelConfig:
    """Llama-3-8B's layer shape with ``layers`` layers."""
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False)


def model_flops(cfg: ModelConfig, params: int, tokens: int) -> float:
    """FLOPs of one training step: ``6·N·T`` plus causal attention (forward ``2·T²·NH·D`` per layer, x3)."""
    return 6.0 * params * tokens + 3 * cfg.num_layers * 2.0 * tokens * tokens * cfg.num_heads * cfg.head_dim


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> tuple[float, float]:
    """Median seconds per step and the peak memory (GiB) of the timed steps."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def megacp_step(state: megacp.ParallelState, cfg: ModelConfig, ids: torch.Tensor) -> tuple[Callable[[], None], Trainer]:
    model = build_model(cfg, dtype=torch.bfloat16, device=state.device, backend="torch")
    megacp.swap_attention(model, state, strategy="pass_kv")
    model.train()
    trainer = Trainer(model, DS_CONFIG, state)
    seq = PackedSequence(ids, torch.tensor([0, ids.numel()], dtype=torch.int32))

    def step() -> None:
        trainer.step(iter([seq]))
    return step, trainer


def hf_shape(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face Llama config values of ``cfg``'s shape (untied head)."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=False)


def hf_config(cfg: ModelConfig, attn_implementation: str) -> Any:
    """Hugging Face's ``LlamaConfig`` of ``cfg``'s shape (:func:`hf_shape`)."""
    from transformers import LlamaConfig

    return LlamaConfig(**hf_shape(cfg), attn_implementation=attn_implementation)


def hf_model(cfg: ModelConfig, attn_implementation: str) -> torch.nn.Module:
    """Hugging Face's ``LlamaForCausalLM`` of ``cfg``'s shape (random weights, bf16, on the GPU)."""
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_config(cfg, attn_implementation)).to(torch.bfloat16)
    return model.train()


def hf_megacp_step(state: megacp.ParallelState, cfg: ModelConfig, ids: torch.Tensor) -> tuple[Callable[[], None], Trainer]:
    """The same Hugging Face model with ``attn_implementation="megacp"``, trained by megacp's Trainer
    (the ``--hf-native`` path: the tiled LM head + loss of :mod:`megacp.integrations.hf_memory`)."""
    from megacp.integrations.hf_memory import training_loss

    model = hf_model(cfg, "megacp")
    trainer = Trainer(model, DS_CONFIG, state, loss=training_loss(model))
    seq = PackedSequence(ids, torch.tensor([0, ids.numel()], dtype=torch.int32))

    def step() -> None:
        trainer.step(iter([seq]))
    return step, trainer


def hf_step(cfg: ModelConfig, ids: torch.Tensor) -> tuple[Callable[[], None], object]:
    import deepspeed

    model = hf_model(cfg, "sdpa")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(DS_CONFIG))
    batch = ids.unsqueeze(0)

    def step() -> None:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
    return step, engine


def measure(ctx: bh.Ctx, cfg: ModelConfig, method: str, ids: torch.Tensor, args: argparse.Namespace) -> dict:
    """One method at one length: build, time, and destroy its DeepSpeed engine (whatever happens)."""
    if method == "megacp":
        step, holder = megacp_step(ctx.state, cfg, ids)
    elif method == "hf_megacp":
        step, holder = hf_megacp_step(ctx.state, cfg, ids)
    else:
        step, holder = hf_step(cfg, ids)
    engine = holder if method == "hf" else holder.engine
    try:
        params = sum(x.numel() for x in engine.module.parameters())
        sec, peak = time_steps(step, args.warmup, args.steps)
    finally:
        engine.destroy()
    s = ids.numel()
    return {"method": method, "seqlen": s, "layers": cfg.num_layers, "params": params, "step_s": sec,
            "tokens_per_s": s / sec, "mfu": model_flops(cfg, params, s) / sec / (args.peak_tflops * 1e12),
            "peak_gib": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-lens", type=bh.parse_sizes, default=bh.parse_sizes("8K,16K,32K"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--methods", type=bh.parse_names, default=["megacp", "hf"], help="megacp, hf (SDPA), hf_megacp (the HF model with attn_implementation='megacp')")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the GPU (H200: 989)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the training-step benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.layers < 1 or args.steps < 1 or set(args.methods) - {"megacp", "hf", "hf_megacp"}:
        print("error: --layers and --steps must be >= 1, --methods a subset of megacp,hf,hf_megacp", file=sys.stderr)
        return 2
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it even in a world of one
    ctx = bh.init("cuda", "bf16")
    cfg = model_config(args.layers)
    rep = bh.Report(ctx, args.json, {**bh.env_info(ctx), "kind": "train_step", "argv": sys.argv,
                                     "model": cfg.__dict__, "deepspeed_config": DS_CONFIG})
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    for method in args.methods:
        for s in args.seq_lens:
            ids = torch.randint(0, cfg.vocab_size, (s,), generator=g, device="cuda")
            try:
                row = measure(ctx, cfg, method, ids, args)
                rep.result(row)
                rows.append(row)
            except Exception as exc:  # noqa: BLE001 - a method that cannot run is recorded, the rest go on
                rep.error(method, exc, seqlen=s)
            gc.collect()  # the last engine (model, optimizer) is gone before the next one is built
            torch.cuda.empty_cache()
    by = {(r["method"], r["seqlen"]): r for r in rows}
    for r in rows:
        hf = by.get(("hf", r["seqlen"]))
        r["vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"] if hf else None
    bh.print_table(ctx, rows, [("method", "method", "s"), ("seqlen", "S", "d"), ("step_s", "step s", ".3f"),
                               ("tokens_per_s", "tokens/s", ".0f"), ("mfu", "MFU", ".3f"),
                               ("peak_gib", "peak GiB", ".1f"), ("vs_hf", "vs HF", ".3f")],
                   f"training step, {cfg.num_layers} layers of Llama-3-8B shape, one H200")
    rep.data["results"] = rows
    rep.save()
    bh.finish(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
