"""The request engine: one scheduler and one output processor for every way requests run.

:class:`EngineCore` runs requests on the slots of a :class:`~megacp.generate.worker.Worker`'s
CP-sharded KV cache: :meth:`LLM.generate <megacp.generate.llm.LLM.generate>`, ``LLM.stream``,
sessions, ``python -m megacp.generate`` and the server (:class:`megacp.serve.engine.Engine`, which
adds the HTTP queue, a thread and streaming to asyncio clients) all step it.

Scheduling (continuous batching, as vLLM's and SGLang's): each step gives waiting requests idle
slots (the slot holding the longest prefix of the prompt when prefix reuse is on, else the least
recently used), prefills the prompt chunks of as many admitted requests as fit
``max_batched_tokens`` tokens in all (oldest first, one forward for all of them, always at least
one chunk), then runs one decode step of the running batch (a CUDA graph replay on CUDA). A
request whose prompt is complete draws its first token and joins the batch; a finished one leaves
it and frees its slot for the next waiting request. A request admitted while others decode has its
prompt split into chunks of at most ``max_batched_tokens`` tokens, so each decode step waits for one
step's budget at most; one admitted while none decodes is prefilled whole (in the generator's own
chunks).

A step's tokens are read while the next step runs (one step late): a request that ends on a stop
token or string has run one more step, whose token is dropped (its last token's keys and values
stay cached); one that reaches ``max_tokens`` leaves before that step unless ``feed_last``. Output processing (one place
for all callers): each token is appended to its request with its log-probabilities, the finish rule
(:meth:`SamplingParams.finish_reason`) and the stop-string check run, and the text piece it adds is
cut (:class:`~megacp.generate.outputs.TextStream`); each becomes an :class:`Event`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megacp.generate.graph import TokenReader
from megacp.generate.loop import Generator
from megacp.generate.outputs import GenerationResult, TextStream, stop_string_check
from megacp.generate.sampling import SamplingParams, batch_params, logprob_dicts
from megacp.generate.worker import Admit, Work, Worker
from megacp.kv_cache import CacheCapacityError, SlotState, SlotTable


@dataclass
class Event:
    """What a request's stream receives: a token and its new text, then the last event with
    ``finish_reason`` set (or ``error``); with ``logprobs`` asked, the token's ``{token: logprob}``
    (the chosen token first, then the most likely ones: :func:`~megacp.generate.sampling.logprob_dicts`)."""

    token: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: dict[int, float] | None = None


@dataclass(eq=False)
class Request:
    """One request and its outcome so far.

    Attributes:
        prompt: the tokens to prefill (on top of what a ``pin`` slot holds).
        params: its settings (stop tokens included: :func:`~megacp.generate.outputs.with_eos`).
        context: every token of the request so far, for the repetition penalty (default: ``prompt``).
        pin: run on this slot, on top of the tokens it holds (a session's slot); ``None``: any idle slot.
        tokens: the generated tokens.
        logprobs: per generated token ``{token: logprob}`` when ``params.logprobs`` asks, else ``None``.
        finish_reason: ``"stop"`` or ``"length"`` once finished.
        cached: prompt tokens whose keys and values were reused from an earlier request.
        submitted_at, first_at, last_at: ``time.perf_counter()`` of its submission, first and latest token.
    """

    prompt: list[int]
    params: SamplingParams
    context: list[int] | None = None
    pin: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    cached: int = 0
    cancelled: bool = False
    done: bool = False
    slot: int = -1
    prefilled: int = 0
    """Prompt tokens the slot holds (the reused prefix, then the chunks run)."""
    chunk: int = 0
    """Tokens per prefill chunk (0: the generator's own chunk: the whole prompt, or ``--prefill-chunk``)."""
    stream: TextStream | None = None
    stopped: Callable[[list[int]], bool] | None = None
    submitted_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0

    @property
    def leaves(self) -> bool:
        """Whether the request leaves the running batch (finished, or its client went away)."""
        return self.done or self.cancelled

    @property
    def ttft_s(self) -> float:
        """Seconds from its submission to its first token."""
        return self.first_at - self.submitted_at

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first per second (``None`` for a single token)."""
        n = len(self.tokens)
        return (n - 1) / (self.last_at - self.first_at) if n > 1 and self.last_at > self.first_at else None


@dataclass
class Slot:
    tokens: list[int] = field(default_factory=list)
    """The tokens whose keys and values the slot holds (prefix reuse)."""
    request: Request | None = None
    used: int = -1
    """The step that last gave it up or took it (least recently used first)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, found by comparing slices (C loops:
    the whole of the shorter first, then a bisection), not token by token in Python."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the prefix is at most hi
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class EngineCore:
    """The scheduler, step loop and output processor over a :class:`Worker`.

    Every rank of a CP group steps an engine: the server's rank 0 alone, its work broadcast
    (``Worker(shared=True)``); offline callers (``LLM``, sessions) on every rank alike, each rank
    scheduling the same steps from the same tokens.

    The engine schedules on the slot table of the worker's cache (:attr:`table`: allocation is the
    worker's, once for good; the engine cuts slots back and checks their room) and never touches
    the device storage; sessions ask the engine about their slot (:meth:`held`,
    :meth:`check_room`, :meth:`snapshot`, :meth:`restore`, :meth:`truncate`).

    Args:
        worker: the worker (its cache's slots are the engine's).
        tokenizer: for stop strings and streamed text (``None``: token ids only).
        prefix_reuse: reuse a finished request's cached tokens for a request that starts alike.
        max_batched_tokens: prefill tokens a step that decodes the running batch computes at most,
            over all the newcomers it prefills (chunked prefill; 0: no limit, newcomers are
            prefilled whole, all in the step that admits them).
        feed_last: a request that reaches ``max_tokens`` runs one more step, which writes its last
            token's keys and values (a later request that continues it reuses every token; a
            server's); ``False``: it leaves the batch with its last token in flight (one step
            less; the caller prefills that token with what follows, as a session does).
    """

    def __init__(self, worker: Worker, tokenizer: Any, *, prefix_reuse: bool = True,
                 max_batched_tokens: int = 0, feed_last: bool = False) -> None:
        if max_batched_tokens < 0:
            raise ValueError(f"max_batched_tokens must be >= 0 (0 = no limit), got {max_batched_tokens}")
        self.worker, self.tokenizer, self.prefix_reuse = worker, tokenizer, prefix_reuse
        self.table: SlotTable = worker.cache.table
        """The slot table the engine schedules on (the worker's steps plan and commit on it too)."""
        self.feed_last = feed_last
        self.max_batched_tokens = max_batched_tokens
        self.slots = [Slot() for _ in worker.slots]
        self.waiting: deque[Request] = deque()
        self.metrics: dict[str, Any] = dict(requests=0, steps=0, prompt_tokens=0, prefilled_tokens=0,
                                            cached_tokens=0, generated_tokens=0, prefill_strategies={},
                                            prefill_steps=0, prefill_chunks=0, chunked_requests=0,
                                            max_prefill_beside_decode=0, max_num_batched_tokens=max_batched_tokens,
                                            decode=worker.decode_mode)
        """Counters: ``prefill_steps`` (steps that ran prompt chunks, one forward each),
        ``prefill_chunks`` (prompt chunks run; a prompt prefilled whole is one), ``chunked_requests``
        (requests whose prompt was split), ``max_prefill_beside_decode`` (the most prefill tokens of
        a step that also decoded running requests)."""
        self.batch: list[Request] = []
        """The running batch, row by row (as the latest step ran it)."""
        self.prefilling: list[Request] = []
        """Requests holding a slot whose prompt is not prefilled yet, oldest first."""
        self.last_strategies: list[str] = []
        """The prefill strategies of the latest step (one per forward)."""
        self._reader = TokenReader(len(worker.slots), worker.gen.device)
        self._pending: tuple[int, list[Request]] | None = None  # the latest step's reader buffer and rows
        self._outbox: list[tuple[Request, Event]] = []
        self._clock = 0

    # ------------------------------------------------------------------ requests
    def add(self, req: Request) -> None:
        """Queue ``req`` (its stop-string check and text stream are made here).

        Raises:
            ValueError: stop strings without a tokenizer.
        """
        req.stopped = stop_string_check(self.tokenizer, req.params)
        req.stream = TextStream(self.tokenizer, req.params.stop) if self.tokenizer is not None else None
        req.logprobs = None if req.params.logprobs is None else []
        req.submitted_at = time.perf_counter()
        self.waiting.append(req)

    @property
    def busy(self) -> bool:
        """Whether a request waits, prefills or runs, or a step's tokens are unread."""
        return bool(self.waiting or self.prefilling or self.batch or self._pending is not None)

    # ------------------------------------------------------------------ one step
    def _admit(self, req: Request, work: Work, decoding: bool) -> bool:
        """Give ``req`` an idle slot (its ``pin`` slot, keeping what it holds; else the one holding
        the longest prefix of its prompt, else the least recently used, cut back to that prefix in
        ``work``) and queue its prefill (in chunks of ``max_batched_tokens`` when requests are
        ``decoding``); ``False`` when no slot is idle."""
        idle = [i for i, s in enumerate(self.slots) if s.request is None]
        if req.pin is not None:
            idle = [req.pin] if req.pin in idle else []
        if not idle:
            return False
        req.chunk = self.max_batched_tokens if decoding else 0
        if req.pin is not None:
            i, keep = req.pin, 0
        else:
            reuse = {i: min(common_prefix(self.slots[i].tokens, req.prompt), len(req.prompt) - 1)
                     if self.prefix_reuse else 0 for i in idle}
            i = max(idle, key=lambda i: (reuse[i], -self.slots[i].used))
            keep = reuse[i]
            self.table.truncate(i, keep)
            try:
                self.check_room(i, len(req.prompt) - keep, req.params.max_tokens, req.chunk)
            except CacheCapacityError:  # the reused prefix's placement leaves too little room: prefill cold
                keep = 0
                self.table.truncate(i, 0)
            work.truncate.append((i, keep))
        slot = self.slots[i]
        slot.tokens, slot.request, slot.used = req.prompt[:], req, self._clock
        req.slot, req.cached, req.prefilled = i, keep, keep
        self.prefilling.append(req)
        m = self.metrics
        m["requests"] += 1
        m["prompt_tokens"] += len(req.prompt)
        m["cached_tokens"] += keep
        m["prefilled_tokens"] += len(req.prompt) - keep
        return True

    def _chunks(self, work: Work, decoding: bool) -> list[Request]:
        """Add this step's prompt chunks to ``work``, the next chunk of every admitted request while
        they fit (oldest request first; with requests ``decoding``, at most ``max_batched_tokens``
        tokens in all, but always one chunk); return the requests whose prompt they complete."""
        budget = self.max_batched_tokens if decoding and self.max_batched_tokens else None
        used, joined = 0, []
        for r in self.prefilling:
            left = len(r.prompt) - r.prefilled
            n = min(r.chunk, left) if r.chunk else left
            if budget is not None and used and used + n > budget:
                break
            p, last = r.params, n == left
            context = (r.context or r.prompt) if p.repetition_penalty != 1.0 and last else None
            work.admit.append(Admit(r.slot, r.prompt[r.prefilled: r.prefilled + n], p, context, last))
            used += n
            self.metrics["prefill_chunks"] += 1
            if r.prefilled == r.cached and not last:
                self.metrics["chunked_requests"] += 1
            r.prefilled += n
            if last:
                joined.append(r)
        if used:
            self.metrics["prefill_steps"] += 1
        if decoding:
            self.metrics["max_prefill_beside_decode"] = max(self.metrics["max_prefill_beside_decode"], used)
        self.prefilling = [r for r in self.prefilling if r not in joined]
        return joined

    def step(self) -> list[tuple[Request, Event]]:
        """Retire the requests that left (or whose token in flight is their last), admit waiting
        ones, run the step (prompt chunks, then one decode step of the running batch); return the
        events of the first tokens of the requests whose prompt is complete and of the previous
        step's tokens (read while this one runs)."""
        self._clock += 1
        work = Work()
        # every request of the batch has one token in flight (the previous step decoded it)
        leaving = [r for r in self.batch
                   if r.leaves or (not self.feed_last and len(r.tokens) + 1 >= r.params.max_tokens)]
        decoding = len(leaving) < len(self.batch)
        for r in [r for r in self.prefilling if r.cancelled]:  # gone mid-prefill: the slot keeps its chunks
            self.prefilling.remove(r)
            self._release(r)
        while self.waiting:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                continue
            if not self._admit(req, work, decoding):
                break
            self.waiting.popleft()
        admitted = self._chunks(work, decoding)
        batch = sorted([r for r in self.batch if r not in leaving] + [r for r in admitted if r.params.max_tokens > 1],
                       key=lambda r: r.slot)
        if leaving or admitted:
            work.batch = [r.slot for r in batch]
        out = self.worker.run(self.worker.share(work))
        for r in leaving:
            self._release(r)
        self.batch = batch
        self.last_strategies = out.strategies
        for s in out.strategies:
            self.metrics["prefill_strategies"][s] = self.metrics["prefill_strategies"].get(s, 0) + 1
        self.metrics["steps"] += 1
        current = None
        if out.tokens is not None:
            current = 1 - self._pending[0] if self._pending is not None else 0
            self._reader.put(current, out.tokens, *(out.logprobs or ()))
        for r, tok, lp in zip(admitted, out.first, out.first_logprobs):
            self._emit(r, tok, lp)
        for r in admitted:
            if r.params.max_tokens <= 1:  # never joined the batch
                self._release(r)
        if self._pending is not None:
            index, rows = self._pending
            toks, extra = self._reader.get(index), self._reader.extra(index)
            lps: list[dict[int, float] | None] = [None] * len(rows)
            if extra:  # a request of the step's batch asked for log-probabilities
                chosen, top_ids, top_values = extra
                lps = logprob_dicts(toks, chosen, top_ids, top_values, [r.params.logprobs for r in rows])
            for r, tok, lp in zip(rows, toks, lps):
                if not r.leaves:
                    self._emit(r, tok, lp)
        self._pending = None if current is None else (current, batch)
        events, self._outbox = self._outbox, []
        return events

    def _release(self, r: Request) -> None:
        """Free ``r``'s slot; it keeps the tokens whose keys and values were written."""
        slot = self.slots[r.slot]
        if slot.request is not r:
            return
        slot.tokens = [] if r.pin is not None else (r.prompt + r.tokens)[: self.table.length(r.slot)]
        slot.request, slot.used = None, self._clock

    def _emit(self, r: Request, tok: int, logprobs: dict[int, float] | None = None) -> None:
        """The output processor: ``tok`` (and its ``logprobs``) joins ``r``'s tokens; finish rule,
        stop strings, text piece; queue its :class:`Event`."""
        now = time.perf_counter()
        if not r.tokens:
            r.first_at = now
        r.tokens.append(tok)
        r.last_at = now
        if r.logprobs is not None and logprobs is not None:
            r.logprobs.append(logprobs)
        self.metrics["generated_tokens"] += 1
        r.finish_reason = r.params.finish_reason(r.tokens, r.stopped)
        text = r.stream.piece(r.tokens, r.finish_reason is not None) if r.stream is not None else ""
        r.done = r.finish_reason is not None
        self._outbox.append((r, Event(tok, text, r.finish_reason, logprobs=logprobs)))

    # ------------------------------------------------------------------ a slot's bookkeeping (sessions)
    def held(self, slot: int) -> int:
        """Tokens whose keys and values ``slot`` holds."""
        return self.table.length(slot)

    def check_room(self, slot: int, pending: int, max_tokens: int, chunk: int = 0) -> None:
        """Raise :class:`~megacp.kv_cache.CacheCapacityError` unless ``slot`` can take a request
        that prefills ``pending`` tokens on top of what it holds (in chunks of ``chunk`` tokens; 0:
        the generator's own) and generates up to ``max_tokens`` (with :attr:`feed_last`, one more
        step), with the spare row a static decode step writes past a rank's tokens."""
        steps = self.worker.gen.steps(pending, max_tokens, chunk)
        self.table.check_room(slot, steps + [1] if self.feed_last else steps, spare=1)

    def snapshot(self, slot: int) -> SlotState:
        """``slot``'s bookkeeping, for :meth:`restore` after a request that failed part-way."""
        return self.table.snapshot(slot)

    def restore(self, slot: int, state: SlotState) -> None:
        """Put back ``slot``'s bookkeeping as :meth:`snapshot` returned it."""
        self.table.restore(slot, state)

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first ``length`` tokens ``slot`` holds (an engine whose every rank schedules
        alike: a server's rank 0 cuts slots back through the steps' :class:`Work`)."""
        self.table.truncate(slot, length)

    def reset(self, truncate: Sequence[tuple[int, int]] = ()) -> None:
        """Drop every request (queued, prefilling, running) and unread tokens; the decoder leaves
        its batch (the cache's bookkeeping is brought up to date), then ``truncate`` cuts slots back
        (slot, length). Host work only: a failed or interrupted step leaves the engine usable."""
        self.batch, self.prefilling, self._pending, self._outbox = [], [], None, []
        self.waiting.clear()
        for s in self.slots:
            s.request, s.tokens = None, []
        self.worker.run(self.worker.share(Work(truncate=list(truncate), batch=[])))

    # ------------------------------------------------------------------ offline batches
    def run(self, requests: Sequence[Request], on_event: Callable[[int, Request, Event], None] | None = None,
            progress: bool = False) -> dict[str, Any]:
        """Run ``requests`` to the end (this engine's only requests: an offline caller's), calling
        ``on_event(i, requests[i], event)`` for each event; return the batch report: CP size,
        prompt tokens, the strategy of every prefill forward, ``ttft_s`` (the latest first token's
        time from submission), decoded tokens (after each request's first) and their rate over the
        time from the earliest first token to the latest token, the decode loop (``"cuda_graph"``:
        the static step replayed from CUDA graphs; ``"static_eager"``: the same step run eagerly;
        ``"eager"``: eager model steps in the same :class:`~megacp.generate.graph.BatchDecoder`)
        and, with graphs captured, the seconds spent capturing them in this run. ``progress`` shows a prefill
        progress bar. An exception part-way (``on_event`` raising, ``KeyboardInterrupt``) leaves no
        request behind (:meth:`reset`) and propagates."""
        if self.busy:
            raise RuntimeError("the engine still runs other requests")
        index = {id(r): i for i, r in enumerate(requests)}
        strategies: list[str] = []
        capture = getattr(self.worker.decoder, "capture_s", 0.0)
        self.worker.progress = progress
        try:
            for r in requests:
                self.add(r)
            while self.busy:
                for r, ev in self.step():
                    if on_event is not None and id(r) in index:
                        on_event(index[id(r)], r, ev)
                strategies += self.last_strategies
        except BaseException:
            self.reset()
            raise
        finally:
            self.worker.progress = False
        decoded = sum(len(r.tokens) for r in requests) - len(requests)
        start, end = min(r.first_at for r in requests), max(r.last_at for r in requests)
        report: dict[str, Any] = {
            "cp_size": self.worker.gen.cp_size,
            "prompt_tokens": [len(r.prompt) for r in requests],
            "prefill_strategy": strategies,
            "ttft_s": round(max(r.ttft_s for r in requests), 4),
            "decode_tokens": decoded,
            "decode_tokens_per_s": round(decoded / (end - start), 2) if decoded and end > start else None,
            "decode": self.worker.decode_mode,
        }
        if self.worker.decode_mode == "cuda_graph":
            report["graph_capture_s"] = round(getattr(self.worker.decoder, "capture_s", 0.0) - capture, 4)
        return report


def token_events(on_token: Callable[[int, int], None] | None) -> Callable[[int, Request, Event], None] | None:
    """``on_token(i, token)`` (every generated token of request ``i``) as a :meth:`EngineCore.run` event callback."""
    if on_token is None:
        return None

    def on_event(i: int, r: Request, ev: Event) -> None:
        if ev.token is not None:
            on_token(i, ev.token)

    return on_event


def offline_slots(lengths: Sequence[int], max_num_seqs: int) -> int:
    """Slots of an offline engine for a batch of ``len(lengths)`` prompts: one each, at most ``max_num_seqs``."""
    return max(1, min(len(lengths), max_num_seqs))


def decode_mode(gen: Generator) -> str:
    """How ``gen``'s engines decode (:attr:`Worker.decode_mode`): ``"cuda_graph"`` (the static step
    replayed from CUDA graphs: ``gen.static_step`` and ``gen.cuda_graphs``, which only a CUDA
    generator takes), ``"static_eager"`` (the same step run eagerly) or ``"eager"`` (eager model steps)."""
    if not gen.static_step:
        return "eager"
    return "cuda_graph" if gen.cuda_graphs else "static_eager"


def decoder_worker(gen: Generator, num_slots: int, capacity: int, *, vocab: int, shared: bool = False) -> Worker:
    """A :class:`Worker` of ``num_slots`` slots of ``capacity`` tokens per rank, decoding as
    :func:`decode_mode` says; ``shared``: rank 0's work is broadcast (a server), else every rank
    runs alike."""
    mode = decode_mode(gen)
    return Worker(gen, num_slots, capacity, vocab=vocab, static=mode != "eager", capture=mode == "cuda_graph",
                  shared=shared)


def offline_fits(engine: EngineCore, lengths: Sequence[int], max_tokens: int, *, max_num_seqs: int) -> bool:
    """Whether ``engine`` (an :func:`offline_engine`) decodes as its generator now says and has the
    slots and rows of a batch of prompts of ``lengths`` generating up to ``max_tokens`` each (then
    its CUDA graphs are reused)."""
    worker = engine.worker
    return (worker.decode_mode == decode_mode(worker.gen) and len(engine.slots) == offline_slots(lengths, max_num_seqs)
            and engine.table.capacity >= worker.gen.cache_rows(lengths, max_tokens))


def offline_engine(gen: Generator, lengths: Sequence[int], max_tokens: int, *, vocab: int,
                   max_num_seqs: int, tokenizer: Any = None) -> EngineCore:
    """An engine for an offline batch of prompts of ``lengths`` generating up to ``max_tokens``
    each: :func:`offline_slots` slots, each just large enough for the longest request
    (:meth:`Generator.cache_rows`), decoding as :func:`decoder_worker` says. Every rank schedules
    alike (no broadcast); no prefix reuse."""
    worker = decoder_worker(gen, offline_slots(lengths, max_num_seqs), gen.cache_rows(lengths, max_tokens) - 1,
                            vocab=vocab)
    return EngineCore(worker, tokenizer, prefix_reuse=False)


def generate(gen: Generator, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], *,
             vocab: int, progress: bool = False) -> GenerationResult:
    """Generate for token-id ``prompts`` (``params``: one for all or one per prompt, already
    holding their stop tokens) in an engine of their own, every prompt at once, decoded as
    :func:`decoder_worker` says."""
    rows = batch_params(params, len(prompts))
    engine = offline_engine(gen, [len(p) for p in prompts], max(p.max_tokens for p in rows), vocab=vocab,
                            max_num_seqs=len(prompts))
    requests = [Request(list(p), r) for p, r in zip(prompts, rows)]
    report = engine.run(requests, progress=progress)
    return result_of(requests, report)


def result_of(requests: Sequence[Request], report: dict[str, Any]) -> GenerationResult:
    """The :class:`GenerationResult` of finished ``requests``."""
    return GenerationResult([r.tokens for r in requests], [str(r.finish_reason) for r in requests],
                            [r.ttft_s for r in requests], [r.decode_tokens_per_s for r in requests], report,
                            [r.logprobs for r in requests])
