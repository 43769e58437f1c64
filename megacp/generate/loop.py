"""The model runner under the request engine (:mod:`megacp.generate.engine`): a CP-swapped model's
(chunked) prefill of a batch of prompts and its eager batched decode step over slots of the
CP-sharded KV cache, the cache's sizing, and the automatic prefill chunk.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.attention.preconditions import agree, content_digest
from megacp.generate.sampling import SamplingParams
from megacp.kv_cache import ShardedKVCache, kv_cache_format
from megacp.kv_cache.storage import available_bytes, storage_bytes
from megacp.layers.settings import CPSettings
from megacp.layers.step import CPStep, HeadShape, begin_step
from megacp.placement import held_after

PREFILL_MEMORY_FRACTION = 0.1
"""Share of the free device memory (after the weights) that one prefill chunk's transient tensors
may take when no chunk is given on CUDA (:func:`auto_prefill_chunk`); the rest is the KV cache's."""

PREFILL_WIDTHS = (6, 4)
"""Transient elements per local token of a prefill chunk, in units of the query width ``Hq·D`` and
of the KV width ``Hkv·D``: the layer input and the residual sum, q (and its rotary temporaries),
the attention output, k and v. ``tests/unit/test_lean_prefill.py`` measures the per-token growth
below this bound (the MLP runs in fixed-size tiles and the logits are the last token's only)."""

MIN_AUTO_CHUNK = 4096
"""The automatic prefill chunk is never below this many tokens."""


def auto_prefill_chunk(free_bytes: int, *, num_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int,
                       cp_size: int = 1) -> int:
    """The prefill chunk (tokens) whose transient fits in ``PREFILL_MEMORY_FRACTION`` of
    ``free_bytes``: the largest power of two ``<= cp_size * free_bytes * PREFILL_MEMORY_FRACTION /
    (elem_bytes * (6 * num_heads * head_dim + 4 * num_kv_heads * head_dim))`` (see
    :data:`PREFILL_WIDTHS`; a CP rank holds ``chunk / cp_size`` of its tokens), at least
    :data:`MIN_AUTO_CHUNK`. Llama-3.1-8B's shape in bf16 with 125 GiB free: 56 KiB per token, 128K."""
    wq, wkv = PREFILL_WIDTHS
    per_token = elem_bytes * head_dim * (wq * num_heads + wkv * num_kv_heads)
    tokens = int(cp_size * free_bytes * PREFILL_MEMORY_FRACTION) // per_token
    return max(MIN_AUTO_CHUNK, 1 << max(tokens, 1).bit_length() - 1)


class Generator:
    """The model runner over a CP-swapped model: prefill and eager decode steps on a KV cache.

    Args:
        model: a megacp ``CausalLM`` whose attention was swapped (:func:`megacp.swap_attention`).
        settings: the CP settings (ring, prefill strategy, kernel backend, load balance,
            calibration; :meth:`CPSettings.from_state`).
        num_layers, num_heads, num_kv_heads, head_dim: attention shape on this rank (heads of this
            TP rank): the cache's shape and the ``auto`` prefill rule's inputs.
        prefill_chunk: split prompts into chunks of this many tokens (chunked prefill); 0 = on
            CUDA the chunk :func:`auto_prefill_chunk` picks from the free device memory when the
            generator is made (the smallest over the CP group), elsewhere the whole prompt.
        kv_cache_dtype: the KV cache's storage: ``"auto"`` (``dtype``) or ``"fp8_e4m3"``
            (:mod:`megacp.kv_cache`; the ``auto`` prefill rule then weighs 1-byte keys and values).
        cuda_graphs: engines replay the static step from :class:`~megacp.generate.graph.BatchDecoder`'s
            CUDA graphs (one per padded batch size and kind of sampling, replayed per token, no host
            synchronisation per token; needs a CUDA device and, under CP, NCCL; the model must run
            the static step).
        static_step: the model runs the static decode step (megacp's own dense models without a
            sliding window): engines decode with :class:`~megacp.generate.graph.BatchDecoder`,
            from CUDA graphs with ``cuda_graphs``, else running the same step eagerly; ``False``:
            eager steps (:meth:`decode_step`); ``None``: as ``cuda_graphs``.
    """

    def __init__(self, model: torch.nn.Module, *, settings: CPSettings, num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype, prefill_chunk: int = 0,
                 kv_cache_dtype: str = "auto", cuda_graphs: bool = False, static_step: bool | None = None) -> None:
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = automatic), got {prefill_chunk}")
        self.kv_cache_dtype = kv_cache_format(kv_cache_dtype, dtype)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this model runs on {device}")
        if cuda_graphs and static_step is False:
            raise ValueError("cuda_graphs=True replays the static decode step, which static_step=False turns off")
        self.model, self.settings, self.device, self.dtype = model, settings, device, dtype
        self.shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        kv_bytes = 1 if self.kv_cache_dtype == "fp8_e4m3" else torch.empty((), dtype=dtype).element_size()
        self.heads = HeadShape(num_heads, num_kv_heads, kv_bytes)
        self.cp_size, self.cp_rank = settings.cp_size, settings.cp_rank
        self.prefill_chunk = prefill_chunk or self._auto_chunk()
        self.cuda_graphs = cuda_graphs
        self.static_step = cuda_graphs if static_step is None else static_step

    def _auto_chunk(self) -> int:
        """The automatic prefill chunk on CUDA (0 = whole prompts elsewhere), the same on every CP rank."""
        if self.device.type != "cuda":
            return 0
        chunk = auto_prefill_chunk(available_bytes(self.device), num_heads=self.heads.num_heads,
                                   num_kv_heads=self.heads.num_kv_heads,
                                   head_dim=self.shape["head_dim"], elem_bytes=self.dtype.itemsize,
                                   cp_size=self.cp_size)
        if self.settings.ring is not None and self.cp_size > 1:
            least = torch.tensor([chunk], dtype=torch.long, device=self.device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.settings.ring.group)
            chunk = int(least.item())
        return chunk

    @classmethod
    def for_model(cls, model: torch.nn.Module, config: Any, settings: CPSettings, *, device: torch.device,
                  dtype: torch.dtype, tp_size: int = 1, prefill_chunk: int = 0, kv_cache_dtype: str = "auto",
                  cuda_graphs: bool = False, static_step: bool | None = None) -> "Generator":
        """The generator of a swapped megacp model of :class:`~megacp.models.config.ModelConfig`
        ``config`` whose heads are split over ``tp_size`` TP ranks."""
        return cls(model, settings=settings, num_layers=config.num_layers, num_heads=config.num_heads // tp_size,
                   num_kv_heads=config.num_kv_heads // tp_size, head_dim=config.head_dim, device=device, dtype=dtype,
                   prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype, cuda_graphs=cuda_graphs,
                   static_step=static_step)

    def new_cache(self, max_requests: int, capacity: int) -> ShardedKVCache:
        """A KV cache of ``max_requests`` slots holding ``capacity`` tokens each on this rank.

        Raises:
            ValueError: on every CP rank, before allocating, when the cache is larger than the
                memory its device has available on some rank
                (:func:`~megacp.kv_cache.storage.available_bytes`), naming both.
        """
        need = storage_bytes(**self.shape, max_requests=max_requests, capacity=capacity, dtype=self.dtype,
                             kv_cache_dtype=self.kv_cache_dtype)
        limit = available_bytes(self.device)
        error = None if need <= limit else (
            f"the KV cache of {max_requests} slots x {capacity} rows per CP rank needs {need} bytes "
            f"({need / 2**30:.1f} GiB) on {self.device}, more than the {limit} bytes ({limit / 2**30:.1f} GiB) "
            "available there: lower the request slots (--max-num-seqs, LLM(max_num_seqs=...), max_sessions) or the "
            "tokens per request (--max-model-len, max_session_tokens)")
        agree(self.settings.ring, [], device=self.device, what="the KV cache", local_error=error)
        return ShardedKVCache(**self.shape, max_requests=max_requests, capacity=capacity, cp_size=self.cp_size,
                              cp_rank=self.cp_rank, dtype=self.dtype, device=self.device,
                              load_balance=self.settings.load_balance, kv_cache_dtype=self.kv_cache_dtype)

    def cache_rows(self, lengths: Sequence[int], max_tokens: int) -> int:
        """Rows per request slot of a cache for prompts of ``lengths`` and ``max_tokens`` new tokens
        each: the rows the most loaded CP rank holds after the prefill chunks and the decode steps
        (:meth:`steps`), plus the spare row a static decode step writes."""
        held = (held_after([0] * self.cp_size, 0, self.steps(n, max_tokens), self.cp_size,
                           load_balance=self.settings.load_balance) for n in set(lengths))
        return max((max(h) for h in held), default=1) + 1

    def batch_cache(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[ShardedKVCache, list[int]]:
        """A cache just large enough for ``prompts`` and ``max_tokens`` new tokens each
        (:meth:`cache_rows`), and their slots."""
        cache = self.new_cache(max(1, len(prompts)), self.cache_rows([len(p) for p in prompts], max_tokens))
        return cache, [cache.allocate() for _ in prompts]

    def steps(self, pending: int, max_tokens: int, chunk: int = 0) -> list[int]:
        """New-token counts of the steps that prefill ``pending`` tokens (in chunks of ``chunk``
        tokens, at most :attr:`prefill_chunk`; 0: :attr:`prefill_chunk`) and then decode up to
        ``max_tokens`` tokens (the last one sampled is not fed back)."""
        chunk = min(c for c in (chunk, self.prefill_chunk, pending) if c > 0) if pending else 1
        return [min(chunk, pending - a) for a in range(0, pending, chunk)] + [1] * (max_tokens - 1)

    def _begin(self, cache: ShardedKVCache, slots: Sequence[int], new_tokens: Sequence[int]) -> CPStep:
        return begin_step(self.settings, cache, slots, new_tokens, heads=self.heads, device=self.device)

    def _forward(self, step: CPStep, ids: Tensor) -> Tensor:
        """Run the model on this rank's share of the packed new tokens ``ids``; return the fp32
        logits ``[B, V]`` of each request's last new token, identical on every CP rank (which agree on
        ``ids`` at the first layer: :attr:`~megacp.layers.step.CPStep.token_digest`)."""
        step.token_digest = content_digest(ids)
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
        dist.all_reduce(full, group=self.settings.ring.group if self.settings.ring else None)  # each row has exactly one owner
        return full

    def decode_step(self, cache: ShardedKVCache, slots: Sequence[int], tokens: Tensor) -> Tensor:
        """One batched decode step: feed ``tokens [B]`` (int64, one per request, at each request's
        next position) to the requests in ``slots``; return their next-token logits ``[B, V]`` fp32."""
        step = self._begin(cache, slots, [1] * len(slots))
        return self._forward(step, tokens)

    def prefill(self, cache: ShardedKVCache, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                progress: bool = False, sampling: Sequence[SamplingParams] | None = None) -> tuple[Tensor, list[str]]:
        """(Chunked) prefill of ``prompts[i]`` on top of what ``slots[i]`` holds; returns the logits
        ``[B, V]`` fp32 after each prompt's last token and the strategy of every step. ``sampling``:
        the requests' settings, which the CP ranks check they share in each step."""
        from tqdm import tqdm

        chunk = self.prefill_chunk or max(len(p) for p in prompts)
        done = [0] * len(prompts)
        last: list[Tensor | None] = [None] * len(prompts)
        strategies = []
        bar = tqdm(total=sum(len(p) for p in prompts), unit="tok", desc=f"prefill CP={self.cp_size}", disable=not progress)
        layers = list(getattr(self.model, "layers", [])) if progress else []
        moved = [0, 0]  # tokens prefilled before this step, tokens of this step

        def advance(index: int) -> None:  # the bar moves as each decoder layer is through (host order)
            bar.update(moved[0] + moved[1] * (index + 1) // len(layers) - bar.n)

        hooks = [layer.register_forward_hook(lambda *_, i=i: advance(i)) for i, layer in enumerate(layers)]
        try:
            while todo := [i for i, p in enumerate(prompts) if done[i] < len(p)]:  # each request advances <= chunk
                new = [min(chunk, len(prompts[i]) - done[i]) for i in todo]
                moved[1] = sum(new)
                step = self._begin(cache, [slots[i] for i in todo], new)
                step.sampling = None if sampling is None else list(sampling)
                ids = torch.tensor([t for i, k in zip(todo, new) for t in prompts[i][done[i]: done[i] + k]])
                logits = self._forward(step, ids)
                strategies.append(step.strategy)
                for row, (i, k) in enumerate(zip(todo, new)):
                    done[i] += k
                    last[i] = logits[row]
                moved[0] += moved[1]
                bar.update(moved[0] - bar.n)
        finally:
            for hook in hooks:
                hook.remove()
            bar.close()
        return torch.stack([t for t in last if t is not None]), strategies  # every prompt has a token
