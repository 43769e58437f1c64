"""The request loop over a CP-swapped model: (chunked) prefill, then batched decode steps over the
CP-sharded KV cache, with TTFT and decode rate measured per request.

:meth:`Generator.start` runs a batch of requests on slots of a cache the caller owns (a session
keeps its slot between turns); :meth:`Generator.generate` is the one-shot form that builds a cache
for the batch and frees it. :meth:`Generator.decode_step` is one batched decode step from tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.attention.preconditions import content_digest
from megacp.generate.graph import GraphDecoder, TokenReader
from megacp.generate.sampling import Sampler, SamplingParams, logprob_dicts
from megacp.kv_cache import CacheCapacityError, ShardedKVCache, kv_cache_format
from megacp.layers.settings import CPSettings
from megacp.layers.step import CPStep, HeadShape, begin_step
from megacp.placement import held_after


def batch_params(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per request of a batch of ``n``: ``params`` for all, or a list of ``n``.

    Raises:
        ValueError: a list of another length, or anything but :class:`SamplingParams` (a dict, say).
    """
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (dict, str)) or not hasattr(params, "__iter__"):
        raise ValueError(f"sampling must be a SamplingParams or a list of them, got a {type(params).__name__}"
                         + (": pass SamplingParams(**that_dict)" if isinstance(params, dict) else ""))
    rows = list(params)
    bad = next((type(r).__name__ for r in rows if not isinstance(r, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling must be a SamplingParams or a list of them, got a list holding a {bad}")
    if len(rows) != n:
        raise ValueError(f"{len(rows)} SamplingParams for {n} prompts; give one for all or one per prompt")
    return rows


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


StopCheckFactory = Callable[[SamplingParams], "Callable[[list[int]], bool] | None"]
"""Makes the stop-string check of one request (stateful: called with its tokens after each token)."""


@dataclass
class GenerationResult:
    """A batch's outcome, per request: generated ids, why it ended (``"stop"``: a stop token or
    string; ``"length"``: ``max_tokens``), time to first token (s) and decode rate (tokens/s after
    the first; ``None`` for a single token), plus the batch report; with ``logprobs`` asked, per
    generated token ``{token: logprob}`` of the chosen token and the top tokens
    (:func:`~megacp.generate.sampling.logprob_dicts`; ``None`` for a request that did not ask)."""

    tokens: list[list[int]]
    finish_reasons: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float | None] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)


class Generator:
    """The request loop over a CP-swapped model.

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
        cuda_graphs: decode with :class:`~megacp.generate.graph.GraphDecoder` (a CUDA graph per
            batch and kind of sampling, replayed per token, no host synchronisation per token;
            needs a CUDA device and, under CP, NCCL). Runs whose cache lacks the one spare row per
            request the static step writes decode eagerly; the run's report says which
            (``"decode"``).
    """

    def __init__(self, model: torch.nn.Module, *, settings: CPSettings, num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype, prefill_chunk: int = 0,
                 kv_cache_dtype: str = "auto", cuda_graphs: bool = False) -> None:
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = automatic), got {prefill_chunk}")
        self.kv_cache_dtype = kv_cache_format(kv_cache_dtype, dtype)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this model runs on {device}")
        self.model, self.settings, self.device, self.dtype = model, settings, device, dtype
        self.shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        kv_bytes = 1 if self.kv_cache_dtype == "fp8_e4m3" else torch.empty((), dtype=dtype).element_size()
        self.heads = HeadShape(num_heads, num_kv_heads, kv_bytes)
        self.cp_size, self.cp_rank = settings.cp_size, settings.cp_rank
        self.prefill_chunk = prefill_chunk or self._auto_chunk()
        self.cuda_graphs = cuda_graphs
        self._graph: GraphDecoder | None = None

    def _auto_chunk(self) -> int:
        """The automatic prefill chunk on CUDA (0 = whole prompts elsewhere), the same on every CP rank."""
        if self.device.type != "cuda":
            return 0
        free = torch.cuda.mem_get_info(self.device)[0]
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        chunk = auto_prefill_chunk(free, num_heads=self.heads.num_heads, num_kv_heads=self.heads.num_kv_heads,
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
                  cuda_graphs: bool = False) -> "Generator":
        """The generator of a swapped megacp model of :class:`~megacp.models.config.ModelConfig`
        ``config`` whose heads are split over ``tp_size`` TP ranks."""
        return cls(model, settings=settings, num_layers=config.num_layers, num_heads=config.num_heads // tp_size,
                   num_kv_heads=config.num_kv_heads // tp_size, head_dim=config.head_dim, device=device, dtype=dtype,
                   prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype, cuda_graphs=cuda_graphs)

    def new_cache(self, max_requests: int, capacity: int) -> ShardedKVCache:
        """A KV cache of ``max_requests`` slots holding ``capacity`` tokens each on this rank."""
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

    def graph_decoder(self, cache: ShardedKVCache, slots: Sequence[int], sampler: Sampler) -> GraphDecoder:
        """The captured decode step of ``slots`` on ``cache`` drawing with ``sampler``'s kind: the
        latest one when it was made for the same cache, slots and kind of sampler (a session's
        turns, a benchmark's repeats), else a new one (the previous graph is released first). Off
        CUDA the same static step runs eagerly."""
        g = self._graph
        if g is None or g.cache is not cache or g.slots != list(slots) or g.sampler.kind != sampler.kind:
            self._graph = None
            g = self._graph = GraphDecoder(self.model, cache, slots, self.settings, self.device, sampler,
                                           capture=self.device.type == "cuda")
        return g

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

    def start(self, cache: ShardedKVCache, slots: Sequence[int], prompts: Sequence[Sequence[int]],
              params: SamplingParams | Sequence[SamplingParams], *, context: Sequence[Sequence[int]] | None = None,
              stop_check: StopCheckFactory | None = None, progress: bool = False) -> Run:
        """A :class:`Run` of ``prompts`` (new tokens) on ``slots`` of ``cache`` (which the caller
        owns and frees) with ``params`` (one for all requests or one each). ``context[i]``: every
        token of request ``i`` so far (default: its prompt), for the repetition penalty;
        ``stop_check(params[i])``: a fresh check of request ``i``'s generated tokens, called with
        them after each token, whether they end in a stop string (``None``: none). Every CP rank
        must drive the run alike."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = batch_params(params, len(prompts))
        return Run(self, cache, list(slots), prompts, rows, context or prompts, stop_check, progress)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_token: Any = None,
                 progress: bool = False) -> GenerationResult:
        """Generate for a batch of prompts of any lengths in a cache of their own.

        ``on_token(i, token)`` is called for every generated token; ``progress`` shows a prefill
        progress bar (tokens prefilled; one update per chunk with ``prefill_chunk``).
        """
        cache, slots = self.batch_cache(prompts, max(p.max_tokens for p in batch_params(params, len(prompts))))
        run = self.start(cache, slots, prompts, params, progress=progress)
        for i, tok in run:
            if on_token is not None:
                on_token(i, tok)
        return run.result()


class Run:
    """A batch of requests in flight; iterate it for ``(request index, token)`` as tokens are
    generated (each decode step's tokens together), then read :meth:`result`."""

    def __init__(self, gen: Generator, cache: ShardedKVCache, slots: list[int], prompts: Sequence[Sequence[int]],
                 params: list[SamplingParams], context: Sequence[Sequence[int]],
                 stop_check: StopCheckFactory | None, progress: bool) -> None:
        self.gen, self.cache, self.slots, self.prompts, self.params = gen, cache, slots, prompts, params
        self.context, self.progress = context, progress
        self.stop_checks = [None if stop_check is None else stop_check(p) for p in params]
        self.max_tokens = max(p.max_tokens for p in params)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.logprobs: list[list[dict[int, float]] | None] = [None if p.logprobs is None else [] for p in params]
        self.finish: list[str | None] = [None] * len(prompts)
        self.first_at = [0.0] * len(prompts)
        self.last_at = [0.0] * len(prompts)
        self.ttft = 0.0
        self.strategies: list[str] = []
        self.decode_s = 0.0
        self.decode_mode = "eager"
        self.capture_s = 0.0

    def _finished(self, i: int) -> str | None:
        return self.params[i].finish_reason(self.tokens[i], self.stop_checks[i])

    @torch.inference_mode()
    def __iter__(self) -> Iterator[tuple[int, int]]:
        gen = self.gen
        sync = torch.cuda.synchronize if gen.device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        logits, self.strategies = gen.prefill(self.cache, self.slots, self.prompts, self.progress, self.params)
        sampler = Sampler(self.params, logits.shape[-1], logits.device, self.context)
        next_tok = sampler(logits)
        sync()
        self.ttft = time.perf_counter() - t0
        if self._graph_decode_fits():
            yield from self._graph_steps(next_tok, sampler)
            return
        active = list(range(len(self.prompts)))
        while True:
            now = time.perf_counter()
            toks = next_tok.tolist()
            lps = self._logprobs(active, toks, [t.tolist() for t in sampler.logprobs or ()])
            for i, tok, lp in zip(active, toks, lps):
                self._emit(i, tok, now, lp)
                yield i, tok
            keep = [row for row, i in enumerate(active) if self.finish[i] is None]
            if not keep:
                break
            t1 = time.perf_counter()
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long, device=next_tok.device)
                next_tok, sampler = next_tok[index], sampler.select(index)
                active = [active[row] for row in keep]
            logits = gen.decode_step(self.cache, [self.slots[i] for i in active], next_tok)
            next_tok = sampler(logits)
            sync()
            self.decode_s += time.perf_counter() - t1

    def _graph_decode_fits(self) -> bool:
        """Whether this run decodes from the generator's CUDA graph: more than one token and one
        spare cache row per request on every rank (the static step writes it; every row runs
        until the longest ``max_tokens``)."""
        if not (self.gen.cuda_graphs and self.max_tokens > 1):
            return False
        try:
            for s in self.slots:
                self.cache.check_room(s, [1] * (self.max_tokens - 1), spare=1)
        except CacheCapacityError:
            return False
        return True

    def _logprobs(self, rows: Sequence[int], toks: list[int], lists: list[list]) -> list[dict[int, float] | None]:
        """Per sampler row (request ``rows[b]``) the ``{token: logprob}`` of a draw whose
        :attr:`Sampler.logprobs` were read as ``lists`` (empty: no row asked)."""
        if not lists:
            return [None] * len(rows)
        chosen, top_ids, top_values = lists
        return logprob_dicts(toks, chosen, top_ids, top_values, [self.params[i].logprobs for i in rows])

    def _emit(self, i: int, tok: int, now: float, logprobs: dict[int, float] | None = None) -> None:
        if not self.tokens[i]:
            self.first_at[i] = now
        self.tokens[i].append(tok)
        lps = self.logprobs[i]
        if lps is not None and logprobs is not None:
            lps.append(logprobs)
        self.last_at[i] = now
        self.finish[i] = self._finished(i)

    def _graph_steps(self, first: Tensor, sampler: Sampler) -> Iterator[tuple[int, int]]:
        """Decode from the CUDA graph: each step is replayed before the previous step's tokens
        (copied to pinned memory without blocking) are read, so stop conditions act one step
        late and a finished request's extra token is dropped; no step runs past ``max_tokens``.
        The log-probabilities a row asks for travel with its tokens (computed in the step, copied
        alongside, read one step late)."""
        gen, b = self.gen, len(self.slots)
        t0 = time.perf_counter()
        dec = gen.graph_decoder(self.cache, self.slots, sampler)
        dec.load(first, sampler)
        if dec.use_graph and dec.graph is None:  # warm up and capture before the first token is out
            dec.capture()
        self.decode_mode, self.capture_s = "cuda_graph", time.perf_counter() - t0
        reader = TokenReader(b, gen.device)
        steps, prev = 0, None
        try:
            now = time.perf_counter()
            rows, toks = list(range(b)), first.tolist()
            for i, tok, lp in zip(rows, toks, self._logprobs(rows, toks, [t.tolist() for t in sampler.logprobs or ()])):
                self._emit(i, tok, now, lp)
                yield i, tok
            t1 = time.perf_counter()
            while True:
                cur = None
                if steps < self.max_tokens - 1 and any(f is None for f in self.finish):
                    cur = steps % 2
                    reader.put(cur, dec.step(), *(dec.sampler.logprobs or ()))
                    steps += 1
                if prev is not None:
                    toks = reader.get(prev)
                    now = time.perf_counter()
                    for i, tok, lp in zip(rows, toks, self._logprobs(rows, toks, reader.extra(prev))):
                        if self.finish[i] is None:
                            self._emit(i, tok, now, lp)
                            yield i, tok
                if cur is None:
                    break
                prev = cur
            self.decode_s += time.perf_counter() - t1
        finally:
            dec.finish([max(0, len(t) - 1) for t in self.tokens])

    def result(self) -> GenerationResult:
        """The outcome once the iteration is over."""
        if any(f is None for f in self.finish):
            raise RuntimeError("the run is not finished; iterate it to the end first")
        rates = [(len(o) - 1) / (b - a) if len(o) > 1 and b > a else None
                 for o, a, b in zip(self.tokens, self.first_at, self.last_at)]
        generated = sum(len(o) for o in self.tokens)
        decoded = generated - len(self.tokens)
        report = {
            "cp_size": self.gen.cp_size,
            "prompt_tokens": [len(p) for p in self.prompts],
            "prefill_strategy": self.strategies,
            "ttft_s": round(self.ttft, 4),
            "decode_tokens": decoded,
            "decode_tokens_per_s": round(decoded / self.decode_s, 2) if decoded and self.decode_s > 0 else None,
            "decode": self.decode_mode,
        }
        if self.decode_mode == "cuda_graph":
            report["graph_capture_s"] = round(self.capture_s, 4)
        return GenerationResult(self.tokens, [str(f) for f in self.finish], [self.ttft] * len(self.tokens),
                                rates, report, self.logprobs)
