"""The request loop over a CP-swapped model: (chunked) prefill, then decode steps over the
CP-sharded KV cache, with TTFT, decode rate and peak memory measured."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.generate.sampling import SamplingParams, sample


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    report: dict[str, Any] = field(default_factory=dict)


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
        next_tok = sample(torch.stack(last_logits), params, gen)
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
            next_tok = sample(logits, params, gen)
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
