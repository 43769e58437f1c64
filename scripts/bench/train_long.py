#!/usr/bin/env python3
"""The longest sequence one GPU trains: megacp against DeepSpeed's long-sequence recipe (ALST), in
one run, on the same model shape, optimizer, sequence and device.

    python -m scripts.bench.train_long --layers 4 --seq-lens 256K,512K,1M --json out/train_long.json
    python -m scripts.bench.train_long --layers 32 --bf16-optimizer-states --seq-lens 128K,256K,384K --json out/32.json
    python -m scripts.bench.train_long --layers 32 --bf16-optimizer-states --methods alst --alst-search --seq-lens 128K,256K,384K
    python -m scripts.bench.train_long --tiny --device cpu --seq-lens 64,128     # a CPU check of the logic

The model has Llama-3.1-8B's shape (hidden 4096, 32 Q / 8 KV heads of 128, SwiGLU 14336, vocab
128256, untied head, RoPE theta 500000) with ``--layers`` layers (``--tiny``: a small shape), random
weights, bf16 on CUDA (fp32 on CPU), one packed sequence of random ids, torch AdamW (lr 1e-5),
gradient clipping 1.0. Both DeepSpeed configs share :func:`ds_config`: ZeRO ``--zero`` (megacp) or
3 (ALST) with ``offload_optimizer`` to pinned CPU memory, ``offload_param`` with
``--offload-param`` (megacp) / ``--alst-offload-param`` (ALST, on by default), and with
``--bf16-optimizer-states`` DeepSpeed's ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``
(which need DeepSpeed's CPU Adam in place of torch's AdamW, for both methods; the parent builds that
extension before any child runs, :func:`build_cpu_adam`, so no build time includes its compile).

* ``megacp``: ``build_model`` + ``swap_attention`` + ``load_config(..., training=True)`` + ``Trainer`` (as in
  ``scripts/bench/train_step.py``); the memory sections come from ``--megacp-config``, a preset of
  :data:`MEGACP_PRESETS` or a JSON file whose top-level sections replace the base config's. The
  memory plan runs from the config before the model is built (``plan_from_config``; a refusal ends
  the ladder as ``plan`` within seconds), and under ZeRO 3 the model is built partitioned
  (``build_for_training``: inside ``deepspeed.zero.Init``, initialised on the GPU).
* ``hf``: the same model as a user brings it — transformers' ``LlamaForCausalLM`` with
  ``attn_implementation="megacp"`` — through megacp's ``Trainer`` with the same memory sections
  (:mod:`megacp.integrations.hf_memory`: checkpointed layers with host-offloaded inputs, tiled MLPs, the
  tiled LM head + loss; :func:`hf_step`).
* ``alst``: Hugging Face ``LlamaForCausalLM`` (SDPA) under ``deepspeed.initialize`` (built inside
  ``deepspeed.zero.Init``), with each piece of the recipe switchable: ``LlamaMLP.forward`` through
  DeepSpeed's ``TiledMLP`` (``ceil(S / hidden)`` shards, its documented rule; ``--no-alst-tiled-mlp``),
  the LM head + loss through ``TiledFusedLogitsLoss`` over the base model's hidden states (shards of
  megacp's loss chunk, 8192 tokens; ``--no-alst-tiled-loss``: transformers' own loss), non-reentrant
  gradient checkpointing (``--no-alst-checkpointing``) whose layer inputs go to the host through
  DeepSpeed's ``CheckpointHiddenStatesOffload`` but the last ``--alst-keep-last`` K layers' (its
  ``keep_last_count``, DeepSpeed's default 1; 0: every input on the host; ``--no-alst-offload``: all
  stay on the GPU; on CPU DeepSpeed offloads nothing, which the row notes). Its knobs on DeepSpeed
  0.19.8 are these, ``--alst-offload-param`` and ``--bf16-optimizer-states`` (which it honours as
  megacp does: the row names the optimizer DeepSpeed built and its states' dtype); each row names its
  configuration (``alst_config``, :class:`AlstConfig`'s label, e.g. ``keep-last-8+offload-param``).

``--alst-search`` tries ALST's configurations at each length instead, each in its own child, and
keeps the fastest that runs: by default (:func:`search_configs`) the checkpointed inputs offloaded
all / all but the last L/4, L/2, 3L/4 of the L layers / none, each with ``offload_param`` on then off,
from the most GPU-frugal and host-hungry to the least (``--alst-search LABEL,...`` names others). A
configuration that failed at one length is not tried at longer ones, nor, after a GPU out-of-memory
("CUDA out of memory"), is any that holds at least as much on the GPU (as many kept inputs, parameters
on the GPU if its were). The length's row is the fastest configuration's, with every attempt
(``alst_tried``: its tokens/s or failure, peak GPU memory and host RSS) and the ones skipped
(``alst_skipped``); ALST's longest is the longest any configuration trained.

With ``--from-checkpoint DIR`` the megacp and hf methods load the model from a Hugging Face directory
of safetensors instead (the loaders of ``megacp.train --model DIR`` and ``--hf-native``: read on the
GPU, then partitioned by the Trainer under ZeRO 3), so ``build_s`` is the time to be ready to step from
a checkpoint on local disk; a directory without ``config.json`` first gets a random model of the shape,
written by the parent before any child (``checkpoint_write_s``).

Each (method, length) runs in a child process (``--child METHOD --child-seq S``), so that running
out of memory ends only that point; each method climbs ``--seq-lens`` and stops at its first
failure, recorded as ``oom`` (GPU), ``host-oom`` (killed by a signal), ``plan`` (megacp's plan
refused it) or ``error``; ``--concurrent`` (CPU checks only) climbs the methods' ladders side by
side. Per point: the build time, ``--steps`` step times after ``--warmup``, tokens/s of the median
timed step, the loss, peak GPU memory allocated / reserved over the child's whole run, the child's
peak host RSS (``os.wait4``), megacp's plan, ALST's configuration; then each method's longest
sequence, megacp / ALST tokens/s at equal lengths (and hf / megacp), and ALST's configuration at
each length it trained (``alst_configs``). The header records the command, GPU, host RAM and the
torch / DeepSpeed / transformers versions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from scripts.bench import harness as bh

MEGACP_PRESETS: dict[str, dict[str, Any]] = {
    "offload": {"activation_checkpointing": {"enabled": True, "offload": "cpu"}, "sequence_tiling": {"mlp": "auto"}},
    "auto": {"activation_checkpointing": {"enabled": True, "offload": "auto", "layers_per_checkpoint": "auto"},
             "sequence_tiling": {"mlp": "auto"}},
}
"""``--megacp-config`` presets: every layer input on the host (``offload``, the default), or as few
as the plan needs (``auto``: the rest stay on the GPU, and where the host cannot hold them the
layers are checkpointed in blocks of 2, 4 or 8, a second checkpoint level with fewer inputs); the
MLP tiled when the plan needs it."""

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
"""``--tiny``: the model shape of the CPU check."""

Step = Callable[[], float]


@dataclass(frozen=True)
class AlstConfig:
    """One configuration of the ALST peer: where its checkpointed layer inputs and its parameters wait.

    Attributes:
        keep_last: ``None``: every layer input stays on the GPU (no offload); ``K >= 0``: all go to the
            host but the last ``K`` layers' (``CheckpointHiddenStatesOffload(keep_last_count=K)``).
        offload_param: ZeRO 3's parameters on the host (``offload_param``).
    """

    keep_last: int | None
    offload_param: bool

    @property
    def label(self) -> str:
        """``offload-all`` / ``keep-last-K`` / ``no-offload``, then ``+offload-param`` when on."""
        inputs = ("no-offload" if self.keep_last is None else "offload-all" if self.keep_last == 0
                  else f"keep-last-{self.keep_last}")
        return inputs + ("+offload-param" if self.offload_param else "")

    @classmethod
    def parse(cls, label: str) -> AlstConfig:
        """The configuration of a :attr:`label`.

        Raises:
            ValueError: not a label.
        """
        inputs, _, param = label.strip().partition("+")
        keep = {"offload-all": 0, "no-offload": None}.get(inputs, -1)
        if keep == -1 and inputs.startswith("keep-last-") and inputs[len("keep-last-"):].isdigit():
            keep = int(inputs[len("keep-last-"):])
        if keep == -1 or param not in ("", "offload-param"):
            raise ValueError(f"{label!r} is not an ALST configuration: offload-all, keep-last-K or no-offload, "
                             "optionally followed by +offload-param")
        return cls(keep, param == "offload-param")

    @classmethod
    def of(cls, args: argparse.Namespace) -> AlstConfig:
        """The configuration the ``--alst-*`` flags set."""
        return cls(args.alst_keep_last if args.alst_offload else None, args.alst_offload_param)

    def argv(self) -> list[str]:
        """The flags that set this configuration in a child."""
        inputs = ["--no-alst-offload"] if self.keep_last is None else ["--alst-offload", "--alst-keep-last",
                                                                         str(self.keep_last)]
        return [*inputs, "--alst-offload-param" if self.offload_param else "--no-alst-offload-param"]

    def kept(self, layers: int) -> int:
        """Layer inputs of ``layers`` this configuration keeps on the GPU."""
        return layers if self.keep_last is None else min(self.keep_last, layers)

    def holds_as_much_gpu_as(self, other: AlstConfig, layers: int) -> bool:
        """Whether this configuration keeps at least what ``other`` keeps on the GPU (as many layer
        inputs, and the parameters there if ``other``'s are), so that it cannot fit where ``other``
        ran out of GPU memory."""
        return self.kept(layers) >= other.kept(layers) and (other.offload_param or not self.offload_param)


def search_configs(layers: int) -> list[AlstConfig]:
    """``--alst-search``'s configurations for a model of ``layers`` layers, from the most GPU-frugal
    and host-hungry to the least: the layer inputs offloaded all, all but the last L/4, L/2 and 3L/4
    (those between 0 and L, once each), none; each with ``offload_param`` on, then off."""
    keeps = sorted({k for k in (layers // 4, layers // 2, 3 * layers // 4) if 0 < k < layers})
    return [AlstConfig(keep, param) for keep in (0, *keeps, None) for param in (True, False)]


def model_config(args: argparse.Namespace) -> Any:
    """Llama-3.1-8B's shape (or :data:`TINY`) with ``args.layers`` layers, positions up to 4M."""
    from megacp.models import ModelConfig
    from scripts.bench.train_step import model_config as llama8b

    if args.tiny:
        return ModelConfig(architecture="llama", num_layers=args.layers, rms_norm_eps=1e-5, rope_theta=500000.0,
                           max_position_embeddings=1 << 22, tie_word_embeddings=False, **TINY)
    cfg = llama8b(args.layers)
    cfg.max_position_embeddings = 1 << 22
    return cfg


def ds_config(*, zero: int, offload_param: bool, bf16_states: bool, cuda: bool) -> dict[str, Any]:
    """The DeepSpeed config of one method: ZeRO ``zero`` with the optimizer states on pinned host
    memory, parameters too with ``offload_param``, bf16 on CUDA, and with ``bf16_states`` bf16 master
    weights, gradients and Adam moments (DeepSpeed's CPU Adam, which those need)."""
    offload = {"device": "cpu", "pin_memory": cuda}
    section: dict[str, Any] = {"stage": zero, "offload_optimizer": dict(offload)}
    if offload_param:
        section["offload_param"] = dict(offload)
    bf16: dict[str, Any] = {"enabled": cuda}
    if bf16_states:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": bf16, "zero_optimization": section, "zero_force_ds_cpu_optimizer": False,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "torch_adam": not bf16_states}},
            "steps_per_print": 10**9}


def megacp_config(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """megacp's DeepSpeed config: :func:`ds_config` with ``--megacp-config``'s sections over it.

    Raises:
        ValueError: the file cannot be read or is not a JSON object.
    """
    config = ds_config(zero=args.zero, offload_param=args.offload_param, bf16_states=args.bf16_optimizer_states,
                       cuda=cuda)
    name = args.megacp_config
    if name in MEGACP_PRESETS:
        return {**config, **MEGACP_PRESETS[name]}
    try:
        with open(name, encoding="utf-8") as f:
            extra = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--megacp-config {name!r} is neither a preset ({', '.join(MEGACP_PRESETS)}) "
                         f"nor a readable JSON file: {err}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--megacp-config {name!r}: expected a JSON object, got {type(extra).__name__}")
    return {**config, **extra}


def alst_config(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """The ALST peer's DeepSpeed config: ZeRO 3, optimizer (and by default parameters) on the host."""
    return ds_config(zero=3, offload_param=args.alst_offload_param, bf16_states=args.bf16_optimizer_states, cuda=cuda)


def megacp_step(args: argparse.Namespace, cfg: Any, state: Any, seq: int) -> tuple[Step, Any, dict[str, Any]]:
    """megacp's step at ``seq`` tokens, its engine, and what the row notes (the plan).

    Raises:
        MemoryPlanError: the Trainer's plan refuses the step.
    """
    import megacp
    from megacp.config import load_config
    from megacp.families import PlanShape
    from megacp.families.base import all_layers_dense
    from megacp.models import build_model
    from megacp.train.data import PackedSequence
    from megacp.train.engine import Trainer
    from megacp.train.setup import build_for_training, plan_from_config

    config = load_config(megacp_config(args, state.device.type == "cuda"), training=True)
    settings = config.training
    assert settings is not None  # built with training=True
    dense = all_layers_dense(cfg)  # megacp's torch layers: dense ones tile their MLP and their attention
    shape = PlanShape(cfg, dense_mlp=dense, tiled_attention=dense)
    plan_from_config(shape, settings, state, seq_len=seq, micro_batch=1)  # refused before the build
    if args.from_checkpoint:  # as megacp.train --model DIR loads it (ZeRO 3: the Trainer partitions it)
        model = loaded_for_training(args.from_checkpoint, state, settings.dtype, transformers=False)
    else:
        model = build_for_training(lambda device: build_model(cfg, dtype=settings.dtype, device=device, backend="torch"),
                                   config, state)  # ZeRO 3: built partitioned, initialised on the GPU
        megacp.swap_attention(model, state, strategy="pass_kv")
    trainer = Trainer(model.train(), config, state)
    plan = trainer.prepare(seq)  # the plan and the attention kernels' plans, before the timed steps
    ids = torch.randint(0, cfg.vocab_size, (seq,), device=state.device)
    batch = PackedSequence(ids, torch.tensor([0, seq], dtype=torch.int32))

    def step() -> float:
        return trainer.step(iter([batch])).loss
    return step, trainer.engine, {"dtype": str(settings.dtype).replace("torch.", ""),
                                  "plan": plan.describe() if plan else None}


def loaded_for_training(directory: str, state: Any, dtype: torch.dtype, *, transformers: bool) -> torch.nn.Module:
    """The model of the Hugging Face ``directory`` loaded by its family's ``load_for_training``, the
    loader of ``megacp.train --model DIR`` (``transformers``: as ``--hf-native``, transformers'
    modules with ``attn_implementation="megacp"``; else megacp's own model, CP-swapped, pass-KV)."""
    from megacp.families import family_for
    from megacp.layers.settings import CPSettings

    family = family_for(directory, transformers=transformers)
    return family.load_for_training(state, dtype=dtype, settings=CPSettings.from_state(state, prefill="pass_kv"),
                                    backend="auto" if transformers else "torch").module.train()


def checkpoint_mismatch(args: argparse.Namespace) -> str | None:
    """Why the ``--from-checkpoint`` directory cannot stand for the benchmark's model (the memory
    plan and the ids are made from ``--layers`` / ``--tiny``), or ``None``: it has no ``config.json``
    yet (the parent writes it) or its sizes are the shape's."""
    from scripts.bench.train_step import hf_shape

    path = os.path.join(args.from_checkpoint, "config.json")
    if os.path.exists(args.from_checkpoint) and not os.path.isdir(args.from_checkpoint):
        return "not a directory"
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        return f"config.json is not readable JSON ({err})"
    want = hf_shape(model_config(args))
    keys = [k for k in want if k not in ("rope_theta", "rms_norm_eps", "max_position_embeddings")]
    diff = [f"{k} {saved.get(k)!r} (the shape's: {want[k]!r})" for k in keys if saved.get(k) != want[k]]
    return f"its config.json is not the benchmark's model: {', '.join(diff)}" if diff else None


def write_checkpoint(args: argparse.Namespace, directory: str) -> float:
    """Write a seeded random ``LlamaForCausalLM`` of the benchmark's shape (bf16 on CUDA, fp32 on
    CPU; safetensors) and a word-level tokenizer to ``directory`` for ``--from-checkpoint``; seconds."""
    from pathlib import Path

    from scripts.bench.decode_kinds import save_random_model
    from scripts.bench.train_step import hf_shape

    shape = hf_shape(model_config(args))
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, _ = save_random_model(shape, Path(directory), torch.bfloat16 if cuda else torch.float32,
                                 torch.device(args.device))
    del model
    if cuda:
        torch.cuda.empty_cache()
    return round(time.perf_counter() - t0, 1)


def hf_step(args: argparse.Namespace, cfg: Any, state: Any, seq: int) -> tuple[Step, Any, dict[str, Any]]:
    """A user's own Hugging Face model through megacp's trainer at ``seq`` tokens: transformers'
    ``LlamaForCausalLM`` with ``attn_implementation="megacp"``, the memory sections of megacp's config
    applied to it (:mod:`megacp.integrations.hf_memory`: fused norms, checkpointed layers, tiled MLPs,
    ``"auto"`` values chosen by the same memory plan as megacp's own model's, from the model's config
    before it is built) and the tiled LM head + loss.

    Raises:
        MemoryPlanError: the plan refuses the step.
    """
    from transformers import LlamaForCausalLM

    from megacp.config import load_config
    from megacp.families import PlanShape
    from megacp.integrations.hf_memory import plan_config, training_loss
    from megacp.train.data import PackedSequence
    from megacp.train.engine import Trainer
    from megacp.train.setup import build_for_training, plan_from_config
    from scripts.bench.train_step import hf_config

    config = load_config(megacp_config(args, state.device.type == "cuda"), training=True)
    settings = config.training
    assert settings is not None  # built with training=True
    hf = hf_config(cfg, "megacp")
    plan_cfg = plan_config(hf)
    assert plan_cfg is not None  # a Llama
    shape = PlanShape(plan_cfg, dense_mlp=True, norm_apart=True, tiled_attention=True)  # transformers' Llama layers
    plan_from_config(shape, settings, state, seq_len=seq, micro_batch=1)  # refused before the build

    def build(device: torch.device) -> torch.nn.Module:
        with torch.device(device):
            model = LlamaForCausalLM(hf)
        return model if settings.zero_stage == 3 else model.to(settings.dtype)  # ZeRO 3: the config's dtype

    if args.from_checkpoint:  # as megacp.train --hf-native --model DIR loads it
        model = loaded_for_training(args.from_checkpoint, state, settings.dtype, transformers=True)
    else:
        model = build_for_training(build, config, state)  # ZeRO 3: built partitioned on the GPU
    loss = training_loss(model)
    trainer = Trainer(model.train(), config, state, loss=loss)
    plan = trainer.prepare(seq)  # the plan and the attention kernels' plans, before the timed steps
    ids = torch.randint(0, cfg.vocab_size, (seq,), device=state.device)
    batch = PackedSequence(ids, torch.tensor([0, seq], dtype=torch.int32))

    def step() -> float:
        return trainer.step(iter([batch])).loss
    return step, trainer.engine, {"dtype": str(settings.dtype).replace("torch.", ""), "loss_fn": loss.__name__,
                                  "plan": plan.describe() if plan else None}


def alst_step(args: argparse.Namespace, cfg: Any, state: Any, seq: int) -> tuple[Step, Any, dict[str, Any]]:
    """The ALST recipe's step at ``seq`` tokens, its engine, and what the row notes (the pieces on,
    the configuration, the optimizer DeepSpeed built)."""
    import torch.nn.functional as F
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from megacp.models.lm_head import DEFAULT_CHUNK_TOKENS
    from megacp.train.setup import deepspeed_for
    from scripts.bench.train_step import hf_config

    deepspeed = deepspeed_for(state)  # as megacp's Trainer: no shared-memory op build on CPU

    cuda = state.device.type == "cuda"
    if args.alst_tiled_mlp:
        mlp_shards = math.ceil(seq / cfg.hidden_size)

        def tiled_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            def mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
                return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return TiledMLP.apply(mlp, self, x, mlp_shards, [self.down_proj.weight, self.gate_proj.weight,
                                                             self.up_proj.weight])
        modeling_llama.LlamaMLP.forward = tiled_mlp_forward  # this child's class, before the model is built
    config = alst_config(args, cuda)
    with deepspeed.zero.Init(config_dict_or_path=config):  # parameters in the config's dtype, partitioned
        model = LlamaForCausalLM(hf_config(cfg, "sdpa"))
    if args.alst_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model.train(), model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=state.device)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device=state.device)], dim=1)
    loss_shards = math.ceil(seq / DEFAULT_CHUNK_TOKENS)
    optimizer = engine.basic_optimizer  # bf16 states: DeepSpeed's CPU Adam keeping its moments in bf16
    bf16_states = engine.bf16_optimizer_states() and not getattr(optimizer, "fp32_optimizer_states", True)
    notes: dict[str, Any] = {"dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                             "alst_config": AlstConfig.of(args).label,
                             "alst_optimizer": f"{type(optimizer).__name__} ({'bf16' if bf16_states else 'fp32'} states)",
                             "alst_mlp_shards": mlp_shards if args.alst_tiled_mlp else None,
                             "alst_loss_shards": loss_shards if args.alst_tiled_loss else None}
    if args.alst_offload and not cuda:
        notes["note"] = "activation offload: DeepSpeed offloads nothing on CPU (no accelerator streams)"

    def loss_sum(lm: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = lm.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1), ignore_index=-100, reduction="sum")

    def step() -> float:
        module = engine.module
        offload = (CheckpointHiddenStatesOffload(use_pin_memory=cuda, use_streams=cuda, keep_last_count=args.alst_keep_last)
                   if args.alst_offload else None)
        with offload if offload is not None else nullcontext():
            if args.alst_tiled_loss:
                hidden = module.model(input_ids=ids).last_hidden_state
                loss = TiledFusedLogitsLoss.apply(loss_sum, module, hidden, labels, None, loss_shards,
                                                  [module.lm_head.weight], "sum") / (seq - 1)
            else:
                loss = module(input_ids=ids, labels=ids).loss
            engine.backward(loss)
        if offload is not None:
            notes["alst_offloaded_gib"] = round(offload.stats.offloaded_bytes / 2**30, 2)
        engine.step()
        return float(loss)
    return step, engine, notes


def child(args: argparse.Namespace) -> int:
    """One (method, length) point in a world of one; prints ``RESULT {json}``."""
    import socket

    with socket.socket() as sock:  # DeepSpeed's engine joins a process group: a free port for it
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

    state = megacp.initialize(backend="nccl" if args.device == "cuda" else "gloo")
    cfg, seq, cuda = model_config(args), args.child_seq, args.device == "cuda"
    row: dict[str, Any] = {"method": args.child, "seq": seq}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        step, engine, notes = {"megacp": megacp_step, "hf": hf_step, "alst": alst_step}[args.child](args, cfg, state, seq)
    except MemoryPlanError as err:
        bh.print_result({**row, "error": "plan", "message": str(err)})
        return 0
    row["build_s"] = round(time.perf_counter() - t0, 1)
    times, loss = [], math.nan
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    row.update(step_s=[round(x, 3) for x in times], tokens_per_s=round(seq / sec, 1), loss=loss,
               peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None, **notes)
    bh.print_result(row)
    engine.destroy()
    return 0


MODULE = "scripts.bench.train_long"
METHODS = ("megacp", "hf", "alst")


def run_point(argv: list[str], method: str, seq: int, alst: AlstConfig | None = None) -> dict[str, Any]:
    """Run one child (ALST's in configuration ``alst`` when given); its ``RESULT`` row (or the failure,
    which names ``alst``) with its peak host RSS and wall time."""
    row: dict[str, Any] = {"method": method, "seq": seq}
    if alst is not None:
        row["alst_config"] = alst.label
    extra = alst.argv() if alst is not None else []
    return bh.run_child(MODULE, [*argv, *extra, "--child", method, "--child-seq", str(seq)], row)


class AlstSearch:
    """``--alst-search``: ALST's ``configs`` at each length of its ladder (each in a child), the
    fastest that runs kept (the module docstring says which are skipped).

    Args:
        argv: the parent's command line, passed on to each child; layers: the model's layers.
    """

    ATTEMPT = ("alst_config", "tokens_per_s", "error", "message", "peak_alloc_gib", "peak_reserved_gib", "host_rss_gib",
               "alst_offloaded_gib")
    """What ``alst_tried`` keeps of each attempt's row."""

    def __init__(self, argv: list[str], configs: list[AlstConfig], layers: int) -> None:
        self.argv, self.configs, self.layers = argv, configs, layers
        self.failed: dict[AlstConfig, dict[str, Any]] = {}  # each configuration's first failure

    def skips(self, config: AlstConfig) -> bool:
        """Whether ``config`` cannot fit where a configuration already failed."""
        return config in self.failed or any(
            "CUDA out of memory" in row.get("message", "") and config.holds_as_much_gpu_as(other, self.layers)
            for other, row in self.failed.items())

    def __call__(self, seq: int) -> dict[str, Any]:
        """The row of the fastest configuration that trains ``seq`` tokens (or the failure)."""
        ran: list[dict[str, Any]] = []
        tried: list[dict[str, Any]] = []
        skipped = []
        for config in self.configs:
            if self.skips(config):
                skipped.append(config.label)
                continue
            row = run_point(self.argv, "alst", seq, config)
            tried.append({k: row[k] for k in self.ATTEMPT if k in row})
            print(json.dumps(tried[-1]), flush=True)
            if "error" in row:
                self.failed[config] = row
            else:
                ran.append(row)
        search = {"alst_tried": tried, "alst_skipped": skipped}
        if ran:
            return {**max(ran, key=lambda r: r["tokens_per_s"]), **search}
        kinds = "+".join(sorted({t["error"] for t in tried})) or "skipped"
        return {"method": "alst", "seq": seq, "error": kinds,
                "message": f"none of ALST's configurations trained {seq} tokens ({len(tried)} tried)", **search}


def parse_args(argv: list[str]) -> argparse.Namespace:
    bool_flag = argparse.BooleanOptionalAction
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-lens", type=bh.parse_sizes, default=bh.parse_sizes("64K,128K,256K,512K,1M"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--methods", type=bh.parse_names, default=["megacp", "hf", "alst"],
                   help="megacp: megacp's own model; hf: transformers' Llama (attn_implementation='megacp') through "
                        "megacp's trainer; alst: DeepSpeed's recipe")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small model shape (CPU checks)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=3, help="megacp's ZeRO stage")
    p.add_argument("--offload-param", action="store_true", help="megacp: ZeRO 3 parameters on the host")
    p.add_argument("--bf16-optimizer-states", action="store_true",
                   help="bf16 master weights, gradients and Adam moments (DeepSpeed's CPU Adam), both methods")
    p.add_argument("--megacp-config", default="offload",
                   help=f"a preset ({', '.join(MEGACP_PRESETS)}) or a JSON file of DeepSpeed config sections")
    p.add_argument("--alst-offload-param", action=bool_flag, default=True)
    p.add_argument("--alst-tiled-mlp", action=bool_flag, default=True)
    p.add_argument("--alst-tiled-loss", action=bool_flag, default=True)
    p.add_argument("--alst-checkpointing", action=bool_flag, default=True)
    p.add_argument("--alst-offload", action=bool_flag, default=True, help="checkpointed layer inputs on the host")
    p.add_argument("--alst-keep-last", type=int, default=1, metavar="K",
                   help="with --alst-offload: the last K layers' inputs stay on the GPU (DeepSpeed's keep_last_count; "
                        "0: every input on the host)")
    p.add_argument("--alst-search", nargs="?", const="", default=None, metavar="LABEL,...",
                   help="at each length, try ALST's configurations (by default offload-all, keep-last-L/4, L/2, 3L/4 and "
                        "no-offload, each +offload-param then without) and keep the fastest that runs; the --alst-offload, "
                        "--alst-keep-last and --alst-offload-param flags then set nothing")
    p.add_argument("--concurrent", action="store_true", help="CPU checks: the methods' ladders side by side")
    p.add_argument("--from-checkpoint", metavar="DIR", default=None,
                   help="megacp and hf: load the model from this Hugging Face directory as megacp.train --model DIR "
                        "does (the build time then includes reading it); a directory without config.json first "
                        "gets a random model of the shape, written before any child runs")
    p.add_argument("--json", default=None)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if set(args.methods) - set(METHODS) or not args.methods:
        p.error(f"--methods: got {','.join(args.methods)!r}; a subset of {','.join(METHODS)}")
    if args.layers < 1 or args.steps < 1 or args.warmup < 0 or min(args.seq_lens, default=0) < 2:
        p.error("--layers and --steps must be >= 1, --warmup >= 0, --seq-lens at least 2 each")
    if args.offload_param and args.zero != 3:
        p.error(f"--offload-param needs --zero 3 (got --zero {args.zero})")
    if args.alst_offload and not args.alst_checkpointing:
        p.error("--alst-offload offloads the checkpointed inputs: it needs --alst-checkpointing")
    if args.alst_keep_last < 0:
        p.error(f"--alst-keep-last must be >= 0 (got {args.alst_keep_last})")
    if args.alst_search is not None:
        try:
            args.alst_configs = ([AlstConfig.parse(label) for label in bh.parse_names(args.alst_search)]
                                 if args.alst_search else search_configs(args.layers))
        except ValueError as err:
            p.error(f"--alst-search: {err}")
        if "alst" not in args.methods:
            p.error("--alst-search searches ALST's configurations: it needs alst in --methods")
        if not args.alst_checkpointing and any(c.keep_last is not None for c in args.alst_configs):
            p.error("--alst-search: configurations that offload checkpointed inputs need --alst-checkpointing")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (use --device cpu --tiny for a check of the logic)")
    if args.concurrent and args.device == "cuda":
        p.error("--concurrent would put both methods on one GPU at once: it is for --device cpu")
    if args.bf16_optimizer_states and args.device == "cpu":
        p.error("--bf16-optimizer-states needs bf16 training on CUDA")
    if args.from_checkpoint and "alst" in args.methods:
        p.error("--from-checkpoint loads megacp's and the hf method's models; ALST builds its own (drop alst from --methods)")
    if args.from_checkpoint and (problem := checkpoint_mismatch(args)):
        p.error(f"--from-checkpoint {args.from_checkpoint}: {problem}")
    if {"megacp", "hf"} & set(args.methods):
        from megacp.config import load_config

        try:  # a config megacp refuses: one line before any child runs
            load_config(megacp_config(args, args.device == "cuda"), training=True)
        except ValueError as err:
            p.error(str(err))
    return args


COLUMNS = [("method", "method", "s"), ("seq", "S", "d"), ("step", "step s", ".2f"), ("tokens_per_s", "tokens/s", ".0f"),
           ("peak_alloc_gib", "GPU alloc GiB", ".1f"), ("peak_reserved_gib", "GPU reserved GiB", ".1f"),
           ("host_rss_gib", "host RSS GiB", ".1f"), ("loss", "loss", ".4f"), ("alst_config", "ALST configuration", "s"),
           ("error", "failure", "s")]


def build_cpu_adam() -> float:
    """Seconds to build (or load) DeepSpeed's CPU Adam extension, which ``--bf16-optimizer-states``
    needs: a JIT compile on a machine's first use (and after DeepSpeed's sources change), which the
    first child to build an optimizer would otherwise pay inside its build time."""
    from deepspeed.accelerator import get_accelerator

    t0 = time.perf_counter()
    get_accelerator().create_op_builder("CPUAdamBuilder").load()  # what DeepSpeedCPUAdam loads
    return round(time.perf_counter() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child(args)
    info = bh.header(MODULE, argv, args.device)
    if args.bf16_optimizer_states:  # built once here, so no method's build time includes its JIT compile
        info["cpu_adam_build_s"] = build_cpu_adam()
    if args.from_checkpoint and not os.path.isfile(os.path.join(args.from_checkpoint, "config.json")):
        info["checkpoint_write_s"] = write_checkpoint(args, args.from_checkpoint)
    print(json.dumps(info), flush=True)
    points: dict[str, Callable[[int], dict[str, Any]]] = {m: (lambda s, m=m: run_point(argv, m, s)) for m in args.methods}
    if "alst" in args.methods:
        points["alst"] = (AlstSearch(argv, args.alst_configs, args.layers) if args.alst_search is not None else
                          lambda s: run_point(argv, "alst", s, AlstConfig.of(args)))
    if args.concurrent:
        with ThreadPoolExecutor(len(args.methods)) as pool:
            ladders = list(pool.map(lambda m: bh.climb(points[m], args.seq_lens), args.methods))
    else:
        ladders = [bh.climb(points[m], args.seq_lens) for m in args.methods]
    rows = [row for rows_of_method in ladders for row in rows_of_method]
    ok = {(r["method"], r["seq"]): r for r in rows if "error" not in r}
    longest = {m: max((s for (mm, s) in ok if mm == m), default=0) for m in args.methods}
    ratios = {f"{m}/alst": {s: round(ok[(m, s)]["tokens_per_s"] / ok[("alst", s)]["tokens_per_s"], 3)
                            for (mm, s) in ok if mm == m and ("alst", s) in ok} for m in ("megacp", "hf")}
    ratios["hf/megacp"] = {s: round(ok[("hf", s)]["tokens_per_s"] / ok[("megacp", s)]["tokens_per_s"], 3)
                           for (m, s) in ok if m == "hf" and ("megacp", s) in ok}
    ratios = {k: v for k, v in ratios.items() if v}
    alst_configs = {s: r["alst_config"] for (m, s), r in ok.items() if m == "alst"}
    table = [{**r, "step": statistics.median(r["step_s"]) if "step_s" in r else None} for r in rows]
    bh.print_table(None, table, COLUMNS, f"training steps, {args.layers} layers, one sequence per step")
    print("longest: " + ", ".join(f"{m} {bh.size_label(s) if s else 'none'}" for m, s in longest.items()))
    for name, by_seq in ratios.items():
        print(f"{name} tokens/s: " + ", ".join(f"{bh.size_label(s)} {r:.3f}" for s, r in by_seq.items()))
    if alst_configs:
        print("alst configuration: " + ", ".join(f"{bh.size_label(s)} {c}" for s, c in alst_configs.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**info, "results": rows, "longest": longest, "tokens_per_s_ratios": ratios,
                       "alst_configs": alst_configs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
