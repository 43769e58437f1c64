"""The continuous-batching scheduler on rank 0: a bounded queue of requests, slots of the CP-sharded
KV cache that keep their tokens after a request ends (prefix reuse, LRU eviction), and a step loop:
newcomers are prefilled (only what their slot does not hold) and join the running batch, finished
or disconnected requests leave it, and every step decodes one token of each (a CUDA graph replay on
CUDA). A step's tokens are read while the next step runs (one step late): a request that finished
has run one more step, whose token is dropped (its last token's keys and values stay cached).
The log-probabilities a request asks for travel with its tokens (copied beside them, read with
them; nothing is copied for a batch in which no request asks).

Admission and chunked prefill (as vLLM's and SGLang's ``max_num_batched_tokens``): each step
gives every waiting request an idle slot while there is one, and prefills the prompt chunks of as
many of the admitted requests as fit ``max_batched_tokens`` tokens in all (oldest request first,
one forward for all of them, always at least one chunk) before the running batch's decode step. A
burst of arrivals thus costs the running streams one slow step per ``max_batched_tokens`` prompt
tokens, not one per arrival. A request admitted while others decode has its prompt split into
chunks of at most ``max_batched_tokens`` tokens, so each decode step waits for one step's budget
at most; one admitted while none decodes is prefilled whole in its first step (nobody waits for
it)."""

from __future__ import annotations

import asyncio
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from megacp.generate.graph import TokenReader
from megacp.generate.outputs import TextStream, stop_string_check
from megacp.generate.sampling import SamplingParams, logprob_dicts
from megacp.kv_cache import CacheCapacityError
from megacp.serve.worker import Admit, Work, Worker

HEARTBEAT_S = 30.0
"""An idle rank 0 broadcasts an empty step this often, so the followers' collective never times out."""


IDLE_POLL_S = 0.1
"""How often an idle rank 0 looks whether the server drains."""

STEP_WINDOW = 4096
"""Latest steps whose host times :meth:`Engine.status` summarises."""


class QueueFull(RuntimeError):
    """The waiting queue is at its limit (HTTP 429)."""


class Draining(RuntimeError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


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
    """One request; its events go to ``events`` on the event loop ``loop``."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)
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

    @property
    def leaves(self) -> bool:
        """Whether the request leaves the running batch (finished, or its client went away)."""
        return self.done or self.cancelled

    def put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _deliver(events: list[tuple[Request, Event]]) -> None:
    for r, ev in events:
        r.events.put_nowait(ev)


@dataclass
class Slot:
    tokens: list[int] = field(default_factory=list)
    """The tokens whose keys and values the slot holds."""
    request: Request | None = None
    used: float = -1.0


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


def step_summary(times: list[tuple[float, bool]]) -> dict[str, Any]:
    """Milliseconds the engine's latest steps took on the host (``times``: seconds and whether the
    step prefilled prompt tokens), for the decode-only steps and the steps with prompt chunks:
    ``{"decode": {"steps", "p50", "p99", "max"}, "prefill": {...}}`` (a kind without steps is left
    out). A step is asynchronous on a GPU: its time is the host's work plus its wait for the previous
    step's tokens."""
    out: dict[str, Any] = {}
    for kind, flag in (("decode", False), ("prefill", True)):
        ms = sorted(t * 1e3 for t, p in times if p == flag)
        if ms:
            p50, p99 = (round(ms[min(len(ms) - 1, int(q * len(ms)))], 3) for q in (0.5, 0.99))
            out[kind] = {"steps": len(ms), "p50": p50, "p99": p99, "max": round(ms[-1], 3)}
    return out


def public_error(err: BaseException) -> str:
    """An exception as a client may see it: its type and first line, without source paths or peer
    addresses (gloo and NCCL name their source files and the peer's address and port)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = re.sub(r"\[?[\w./-]+\.(?:cc|cpp|cu|h|hpp|py):\d+\]?", "", text)
    text = re.sub(r"\[?\d{1,3}(?:\.\d{1,3}){3}\]?:\d+|\[[0-9a-f:]+\]:\d+", "a peer", text)
    return f"{type(err).__name__}: {' '.join(text.split())}".rstrip(": ")


class Engine:
    """The scheduler and step loop (rank 0), on a :class:`Worker`.

    Args:
        worker: rank 0's worker (its cache has ``max_num_seqs`` slots).
        tokenizer: for stop strings and streamed text (``None``: token ids only).
        max_queue: requests waiting at most before :class:`QueueFull`.
        prefix_reuse: reuse a finished request's cached tokens for a request that starts alike.
        max_batched_tokens: prefill tokens a step that decodes the running batch computes at most,
            over all the newcomers it prefills (chunked prefill; 0: no limit, newcomers are
            prefilled whole, all in the step that admits them).
    """

    def __init__(self, worker: Worker, tokenizer: Any, *, max_queue: int, prefix_reuse: bool = True,
                 max_batched_tokens: int = 0) -> None:
        if max_batched_tokens < 0:
            raise ValueError(f"max_batched_tokens must be >= 0 (0 = no limit), got {max_batched_tokens}")
        self.worker, self.tokenizer, self.prefix_reuse = worker, tokenizer, prefix_reuse
        self.max_batched_tokens = max_batched_tokens
        self.slots = [Slot() for _ in worker.slots]
        self.inbox: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.waiting: deque[Request] = deque()
        self.draining = False
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
        self._reader = TokenReader(len(worker.slots), worker.gen.device)
        self._pending: tuple[int, list[Request]] | None = None  # the latest step's reader buffer and rows
        self._outbox: list[tuple[Request, Event]] = []  # a step's events, handed to the event loop at once
        self._step_times: deque[tuple[float, bool]] = deque(maxlen=STEP_WINDOW)  # (seconds, prefilled)
        self._thread = threading.Thread(target=self._run, name="megacp-engine", daemon=True)
        self.failure: str | None = None
        """Why the step loop died (a collective failed: a CP rank died or froze past the timeout), else
        ``None``; ``/health`` then answers 503 and :attr:`on_failure` is called once."""
        self.on_failure: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        """The step loop; when it dies, every request still open gets the error and :attr:`on_failure`
        is called (the server then exits non-zero)."""
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - the engine thread must not die silently
            self.failure = public_error(err)
            self.draining = True
            stranded = [s.request for s in self.slots if s.request is not None] + [*self.waiting, *self.prefilling]
            while not self.inbox.empty():
                stranded.append(self.inbox.get_nowait())
            for req in stranded:
                if not req.done:
                    req.put(Event(None, "", error=self.failure))
            if self.on_failure is not None:
                self.on_failure()

    def submit(self, req: Request) -> None:
        """Queue ``req`` (raises :class:`Draining` or :class:`QueueFull`)."""
        if self.draining:
            raise Draining("the server is shutting down")
        req.stopped = stop_string_check(self.tokenizer, req.params)
        req.stream = TextStream(self.tokenizer, req.params.stop) if self.tokenizer is not None else None
        try:
            self.inbox.put_nowait(req)
        except queue.Full:
            raise QueueFull(f"the queue holds {self.inbox.maxsize} waiting requests; retry later") from None

    def drain(self) -> None:
        """Stop taking requests, finish the running and queued ones, stop the followers."""
        self.draining = True
        self._thread.join()

    def status(self) -> dict[str, Any]:
        """The counters, the running and waiting requests, and the CUDA graphs captured."""
        graphs = getattr(self.worker.decoder, "graphs", {})
        return dict(self.metrics, running=sum(s.request is not None for s in self.slots),
                    prefilling=len(self.prefilling), waiting=len(self.waiting) + self.inbox.qsize(),
                    cuda_graphs=len(graphs), step_ms=step_summary(list(self._step_times)))

    # ------------------------------------------------------------------ the step loop
    def _loop(self) -> None:
        last = time.monotonic()  # of the latest broadcast
        while True:
            if not self.batch and not self.waiting and not self.prefilling:
                try:
                    self.waiting.append(self.inbox.get(timeout=IDLE_POLL_S))
                except queue.Empty:
                    if self.draining and self.inbox.empty():
                        self.worker.share(Work(stop=True))
                        return
                    if time.monotonic() - last > HEARTBEAT_S:
                        self.worker.run(self.worker.share(Work()))
                        last = time.monotonic()
                    continue
            last = time.monotonic()
            while True:
                try:
                    self.waiting.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            try:
                start, chunks = time.perf_counter(), self.metrics["prefill_chunks"]
                self._step()  # a step with prompt chunks (each chunk counts; admission alone does not)
                self._step_times.append((time.perf_counter() - start, self.metrics["prefill_chunks"] > chunks))
            except Exception as err:  # noqa: BLE001  # a failed step fails its requests, not the server
                for s in self.slots:
                    if s.request is not None and not s.request.done:
                        s.request.put(Event(None, "", error=public_error(err)))
                    s.request, s.tokens = None, []
                self.batch, self.prefilling, self._pending, self._outbox = [], [], None, []
                self.worker.run(self.worker.share(Work(truncate=[(i, 0) for i in range(len(self.slots))], batch=[])))

    def _admit(self, req: Request, work: Work, decoding: bool) -> bool:
        """Give ``req`` an idle slot (the one holding the longest prefix of its prompt, else the
        least recently used), cut the slot back to that prefix in ``work`` and queue the request's
        prefill (in chunks of ``max_batched_tokens`` when requests are ``decoding``); ``False``
        when no slot is idle."""
        idle = [i for i, s in enumerate(self.slots) if s.request is None]
        if not idle:
            return False
        cache, gen = self.worker.cache, self.worker.gen
        reuse = {i: min(common_prefix(self.slots[i].tokens, req.prompt), len(req.prompt) - 1) if self.prefix_reuse
                 else 0 for i in idle}
        i = max(idle, key=lambda i: (reuse[i], -self.slots[i].used))
        keep = reuse[i]
        req.chunk = self.max_batched_tokens if decoding else 0
        cache.truncate(i, keep)
        try:  # the last token is fed too
            cache.check_room(i, gen.steps(len(req.prompt) - keep, req.params.max_tokens, req.chunk) + [1], spare=1)
        except CacheCapacityError:  # the reused prefix's placement leaves too little room: prefill cold
            keep = 0
            cache.truncate(i, 0)
        work.truncate.append((i, keep))
        slot = self.slots[i]
        slot.tokens, slot.request, slot.used = req.prompt[:], req, time.monotonic()
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
            work.admit.append(Admit(r.slot, r.prompt[r.prefilled: r.prefilled + n], p,
                                    r.prompt if p.repetition_penalty != 1.0 and last else None, last))
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

    def _step(self) -> None:
        """Retire the requests that left, admit waiting ones, run the step (prompt chunks, then one
        decode step of the running batch); emit the first tokens of the requests whose prompt is
        complete and the previous step's tokens (read while this one runs)."""
        work = Work()
        leaving = [r for r in self.batch if r.leaves]
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
        batch = sorted([r for r in self.batch if not r.leaves] + admitted, key=lambda r: r.slot)
        if leaving or admitted:
            work.batch = [r.slot for r in batch]
        out = self.worker.run(self.worker.share(work))
        for r in leaving:
            self._release(r)
        self.batch = batch
        for s in out.strategies:
            self.metrics["prefill_strategies"][s] = self.metrics["prefill_strategies"].get(s, 0) + 1
        self.metrics["steps"] += 1
        current = None
        if out.tokens is not None:
            current = 1 - self._pending[0] if self._pending is not None else 0
            self._reader.put(current, out.tokens, *(out.logprobs or ()))
        for r, tok, lp in zip(admitted, out.first, out.first_logprobs):
            self._emit(r, tok, lp)
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
        loops: dict[asyncio.AbstractEventLoop, list[tuple[Request, Event]]] = {}
        for r, ev in self._outbox:
            loops.setdefault(r.loop, []).append((r, ev))
        for loop, events in loops.items():
            loop.call_soon_threadsafe(_deliver, events)
        self._outbox = []

    def _release(self, r: Request) -> None:
        """Free ``r``'s slot; it keeps the tokens whose keys and values were written."""
        slot = self.slots[r.slot]
        slot.tokens = (r.prompt + r.tokens)[: self.worker.cache.length(r.slot)]
        slot.request, slot.used = None, time.monotonic()

    def _emit(self, r: Request, tok: int, logprobs: dict[int, float] | None = None) -> None:
        r.tokens.append(tok)
        self.metrics["generated_tokens"] += 1
        p = r.params
        done = p.finish_reason(r.tokens, r.stopped)
        text = r.stream.piece(r.tokens, done is not None) if r.stream is not None else ""
        r.done = done is not None
        self._outbox.append((r, Event(tok, text, done, logprobs=logprobs)))
