#!/usr/bin/env python3
"""The longest sequence one GPU trains: megacp against DeepSpeed's long-sequence recipe (ALST), in
one run, on the same model shape, optimizer, ZeRO placement, sequence and device.

    python -m scripts.bench.train_long --layers 4 --seq-lens 256K,512K,1M --json out/train_long.json
    python -m scripts.bench.train_long --tiny --device cpu --seq-lens 64,128     # a CPU check of the logic

The model has Llama-3.1-8B's shape (hidden 4096, 32 Q / 8 KV heads of 128, SwiGLU 14336, vocab
128256, untied head) with ``--layers`` layers (``--tiny``: a small shape), random weights, bf16 on
CUDA, one packed sequence of random ids, torch AdamW (lr 1e-5), gradient clipping 1.0, and one
DeepSpeed ZeRO placement for both (``--zero``, ``--offload-optimizer``, ``--offload-param``).

* ``megacp``: :func:`megacp.models.build_model` + CP attention + :class:`megacp.train.engine.Trainer`
  with ``"activation_checkpointing": {"enabled": true, "offload": --megacp-offload}`` and
  ``"sequence_tiling": {"mlp": --megacp-mlp-tile}`` (its memory plan must accept the step).
* ``alst``: Hugging Face ``LlamaForCausalLM`` (SDPA) under ``deepspeed.initialize``, its
  ``LlamaMLP.forward`` through DeepSpeed's ``TiledMLP`` (``ceil(S / hidden)`` shards, the recipe's
  rule), the loss through ``TiledFusedLogitsLoss`` over the base model's hidden states (8192-token
  shards), non-reentrant gradient checkpointing with DeepSpeed's ``CheckpointHiddenStatesOffload``
  (``--no-alst-offload`` keeps the checkpoints on the GPU).

Each (method, length) runs in a child process, so that running out of memory ends only that point;
each method climbs the ladder of ``--seq-lens`` and stops at its first failure. Reported per point:
the step times, tokens/s of the fastest timed step, peak GPU memory allocated / reserved, the
child's peak host RSS, and megacp's plan; then each method's longest sequence and megacp / ALST
tokens/s at equal lengths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)


def model_config(args: argparse.Namespace) -> Any:
    from megacp.models import ModelConfig
    from scripts.bench.train_step import model_config as llama8b

    if args.tiny:
        return ModelConfig(architecture="llama", num_layers=args.layers, rms_norm_eps=1e-5, rope_theta=500000.0,
                           max_position_embeddings=1 << 22, tie_word_embeddings=False, **TINY)
    cfg = llama8b(args.layers)
    cfg.max_position_embeddings = 1 << 22
    return cfg


def ds_config(args: argparse.Namespace, cuda: bool) -> dict:
    """The DeepSpeed config both methods train with (megacp adds its memory sections)."""
    zero: dict[str, Any] = {"stage": args.zero}
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if args.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": cuda}, "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "torch_adam": True}},
            "steps_per_print": 10**9}


def megacp_trainer(args: argparse.Namespace, cfg: Any, state: Any, seq: int) -> tuple[Any, Any, str | None]:
    import megacp
    from megacp.models import build_model
    from megacp.train.data import PackedSequence
    from megacp.train.engine import Trainer, read_settings

    config = ds_config(args, state.device.type == "cuda")
    config["activation_checkpointing"] = {"enabled": True, "offload": args.megacp_offload}
    config["sequence_tiling"] = {"mlp": args.megacp_mlp_tile if args.megacp_mlp_tile == "auto" else int(args.megacp_mlp_tile)}
    settings = read_settings(config)
    model = build_model(cfg, dtype=settings.dtype, device="cpu" if args.zero == 3 else state.device, backend="torch")
    megacp.swap_attention(model, state, strategy="pass_kv")
    trainer = Trainer(model.train(), config, state, settings)
    plan = trainer.plan_memory(seq)  # MemoryPlanError: the plan refuses the step
    ids = torch.randint(0, cfg.vocab_size, (seq,), device=state.device)
    batch = PackedSequence(ids, torch.tensor([0, seq], dtype=torch.int32))

    def step() -> float:
        return trainer.step(iter([batch])).loss
    return step, trainer.engine, plan.describe() if plan else None


def alst_trainer(args: argparse.Namespace, cfg: Any, state: Any, seq: int) -> tuple[Any, Any, str | None]:
    import deepspeed
    import torch.nn.functional as F
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    cuda = state.device.type == "cuda"
    mlp_shards = max(1, math.ceil(seq / cfg.hidden_size))

    def tiled_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        def mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp, self, x, mlp_shards, params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    hcfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                       rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                       tie_word_embeddings=False, attn_implementation="sdpa")
    config = ds_config(args, cuda)
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.zero == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(hcfg).to(dtype)
    else:
        with state.device:
            model = LlamaForCausalLM(hcfg).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=state.device)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device=state.device)], dim=1)
    loss_shards = max(1, math.ceil(seq / 8192))
    vocab = cfg.vocab_size

    def loss_fn(self: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, vocab), y.view(-1), ignore_index=-100, reduction="sum")

    def step() -> float:
        module = engine.module
        offload = CheckpointHiddenStatesOffload(use_pin_memory=cuda, use_streams=cuda) if args.alst_offload else None
        with offload if offload is not None else _null():
            hidden = module.model(input_ids=ids).last_hidden_state
            total = TiledFusedLogitsLoss.apply(loss_fn, module, hidden, labels, None, loss_shards,
                                               [module.lm_head.weight], "sum")
            loss = total / (seq - 1)
            engine.backward(loss)
        engine.step()
        return float(loss)
    return step, engine, None


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def child(args: argparse.Namespace) -> int:
    """One (method, length) point; prints ``RESULT {json}``."""
    import socket

    with socket.socket() as sock:  # a world of one on a free port, as DeepSpeed's engine needs
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(1)
    import megacp
    from megacp.train.memory import MemoryPlanError

    state = megacp.initialize()
    cfg = model_config(args)
    seq = args.child_seq
    cuda = state.device.type == "cuda"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        build = megacp_trainer if args.child_method == "megacp" else alst_trainer
        step, engine, plan = build(args, cfg, state, seq)
    except MemoryPlanError as err:
        print("RESULT " + json.dumps({"method": args.child_method, "seq": seq, "error": f"plan: {err}"}), flush=True)
        return 0
    init_s = time.perf_counter() - t0
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
            if i == args.warmup:
                torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        losses.append(step())
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    out = {"method": args.child_method, "seq": seq, "layers": cfg.num_layers, "init_s": round(init_s, 1),
           "step_s": [round(x, 2) for x in times], "tokens_per_s": round(seq / min(times), 1), "loss": losses[-1],
           "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
           "host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1), "plan": plan}
    print("RESULT " + json.dumps(out), flush=True)
    engine.destroy()
    return 0


def point(args: argparse.Namespace, argv: list[str], method: str, seq: int) -> dict:
    cmd = [sys.executable, "-m", "scripts.bench.train_long", *argv, "--child-method", method, "--child-seq", str(seq)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if found:
        row = json.loads(found[-1])
    else:
        tail = [line for line in proc.stderr.splitlines() if line.strip()]
        oom = "out of memory" in proc.stderr.lower()
        row = {"method": method, "seq": seq, "error": ("out of memory: " if oom else "") + (tail[-1][:400] if tail else f"exit {proc.returncode}")}
    row["wall_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    from scripts.bench import harness as bh

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-lens", type=bh.parse_sizes, default=bh.parse_sizes("256K,512K,1M"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--methods", type=bh.parse_names, default=["megacp", "alst"])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small model shape (CPU checks)")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--offload-param", action="store_true", help="ZeRO 3 only")
    p.add_argument("--megacp-offload", choices=("none", "cpu", "auto"), default="cpu")
    p.add_argument("--megacp-mlp-tile", default="8192", help="tokens per MLP tile, 0, or auto")
    p.add_argument("--alst-offload", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--child-method", help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_method:
        return child(args)
    if set(args.methods) - {"megacp", "alst"} or args.layers < 1 or args.steps < 1:
        p.error("--methods is a subset of megacp,alst; --layers and --steps >= 1")
    if args.offload_param and args.zero != 3:
        p.error("--offload-param needs --zero 3")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (use --device cpu --tiny for a check of the logic)")
    header = {"argv": sys.argv, "host": platform.node(), "host_ram_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__}
    for name in ("deepspeed", "transformers"):
        try:
            header[name] = __import__(name).__version__
        except ImportError:
            header[name] = None
    print(json.dumps(header), flush=True)
    rows = []
    for method in args.methods:
        for seq in args.seq_lens:
            row = point(args, argv, method, seq)
            rows.append(row)
            if "error" in row:
                break
    ok = {(r["method"], r["seq"]): r for r in rows if "error" not in r}
    summary = {m: max((s for (mm, s) in ok if mm == m), default=0) for m in args.methods}
    ratios = {s: ok[("megacp", s)]["tokens_per_s"] / ok[("alst", s)]["tokens_per_s"]
              for (m, s) in ok if m == "megacp" and ("alst", s) in ok}
    print(json.dumps({"longest": summary, "megacp_over_alst_tokens_per_s": ratios}), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**header, "results": rows, "longest": summary, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
