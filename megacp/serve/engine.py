"""The continuous-batching scheduler on rank 0: a bounded queue of requests, slots of the CP-sharded
KV cache that keep their tokens after a request ends (prefix reuse, LRU eviction), and a step loop:
newcomers are prefilled (only what their slot does not hold) and join the running batch, finished
or disconnected requests leave it, and every step decodes one token of each (a CUDA graph replay on
CUDA). A step's tokens are read while the next step runs (one step late): a request that finished
has run one more step, whose token is dropped (its last token's keys and values stay cached)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from megacp.generate.graph import TokenReader
from megacp.generate.outputs import TextStream, stop_string_check
from megacp.generate.sampling import SamplingParams
from megacp.kv_cache import CacheCapacityError
from megacp.serve.worker import Admit, Work, Worker

HEARTBEAT_S = 30.0
"""An idle rank 0 broadcasts an empty step this often, so the followers' collective never times out."""


IDLE_POLL_S = 0.1
"""How often an idle rank 0 looks whether the server drains."""


class QueueFull(RuntimeError):
    """The waiting queue is at its limit (HTTP 429)."""


class Draining(RuntimeError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class Event:
    """What a request's stream receives: a token and its new text, then the last event with
    ``finish_reason`` set (or ``error``)."""

    token: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None


@dataclass
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
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """The scheduler and step loop (rank 0), on a :class:`Worker`.

    Args:
        worker: rank 0's worker (its cache has ``max_num_seqs`` slots).
        tokenizer: for stop strings and streamed text (``None``: token ids only).
        max_queue: requests waiting at most before :class:`QueueFull`.
        prefix_reuse: reuse a finished request's cached tokens for a request that starts alike.
    """

    def __init__(self, worker: Worker, tokenizer: Any, *, max_queue: int, prefix_reuse: bool = True) -> None:
        self.worker, self.tokenizer, self.prefix_reuse = worker, tokenizer, prefix_reuse
        self.slots = [Slot() for _ in worker.slots]
        self.inbox: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.waiting: deque[Request] = deque()
        self.draining = False
        self.metrics: dict[str, Any] = dict(requests=0, steps=0, prompt_tokens=0, prefilled_tokens=0,
                                            cached_tokens=0, generated_tokens=0, prefill_strategies={},
                                            decode=worker.decode_mode)
        self.batch: list[Request] = []
        """The running batch, row by row (as the latest step ran it)."""
        self._reader = TokenReader(len(worker.slots), worker.gen.device)
        self._pending: tuple[int, list[Request]] | None = None  # the latest step's reader buffer and rows
        self._outbox: list[tuple[Request, Event]] = []  # a step's events, handed to the event loop at once
        self._thread = threading.Thread(target=self._loop, name="megacp-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

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
                    waiting=len(self.waiting) + self.inbox.qsize(), cuda_graphs=len(graphs))

    # ------------------------------------------------------------------ the step loop
    def _loop(self) -> None:
        last = time.monotonic()  # of the latest broadcast
        while True:
            if not self.batch and not self.waiting:
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
                self._step()
            except Exception as err:  # noqa: BLE001  # a failed step fails its requests, not the server
                for s in self.slots:
                    if s.request is not None and not s.request.done:
                        s.request.put(Event(None, "", error=f"{type(err).__name__}: {err}"))
                    s.request, s.tokens = None, []
                self.batch, self._pending, self._outbox = [], None, []
                self.worker.run(self.worker.share(Work(truncate=[(i, 0) for i in range(len(self.slots))], batch=[])))

    def _admit(self, req: Request, work: Work) -> bool:
        """Give ``req`` an idle slot (the one holding the longest prefix of its prompt, else the
        least recently used) and add its prefill to ``work``; ``False`` when none is idle."""
        idle = [i for i, s in enumerate(self.slots) if s.request is None]
        if not idle:
            return False
        cache = self.worker.cache

        def reuse(i: int) -> int:
            return min(common_prefix(self.slots[i].tokens, req.prompt), len(req.prompt) - 1) if self.prefix_reuse else 0

        i = max(idle, key=lambda i: (reuse(i), -self.slots[i].used))
        keep = reuse(i)
        steps = self.worker.gen.steps(len(req.prompt) - keep, req.params.max_tokens) + [1]  # the last token is fed too
        cache.truncate(i, keep)
        try:
            cache.check_room(i, steps, spare=1)
        except CacheCapacityError:  # the reused prefix's placement leaves too little room: prefill cold
            keep = 0
            cache.truncate(i, 0)
        work.truncate.append((i, keep))
        p = req.params
        work.admit.append(Admit(i, req.prompt[keep:], p, req.prompt if p.repetition_penalty != 1.0 else None))
        slot = self.slots[i]
        slot.tokens, slot.request, slot.used, req.slot, req.cached = req.prompt[:], req, time.monotonic(), i, keep
        m = self.metrics
        m["requests"] += 1
        m["prompt_tokens"] += len(req.prompt)
        m["cached_tokens"] += keep
        m["prefilled_tokens"] += len(req.prompt) - keep
        return True

    def _step(self) -> None:
        """Retire the requests that left, admit waiting ones, run the step; emit the admitted
        requests' first tokens and the previous step's tokens (read while this one runs)."""
        work = Work()
        leaving = [r for r in self.batch if r.leaves]
        admitted: list[Request] = []
        while self.waiting:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                continue
            if not self._admit(req, work):
                break
            admitted.append(self.waiting.popleft())
        batch = sorted([r for r in self.batch if not r.leaves] + admitted, key=lambda r: r.slot)
        if leaving or admitted:
            work.batch = [r.slot for r in batch]
        out = self.worker.run(self.worker.share(work))
        for r in leaving:  # the slot keeps the tokens whose keys and values were written
            slot = self.slots[r.slot]
            slot.tokens = (r.prompt + r.tokens)[: self.worker.cache.length(r.slot)]
            slot.request, slot.used = None, time.monotonic()
        self.batch = batch
        for s in out.strategies:
            self.metrics["prefill_strategies"][s] = self.metrics["prefill_strategies"].get(s, 0) + 1
        self.metrics["steps"] += 1
        current = None
        if out.tokens is not None:
            current = 1 - self._pending[0] if self._pending is not None else 0
            self._reader.put(current, out.tokens)
        for r, tok in zip(admitted, out.first):
            self._emit(r, tok)
        if self._pending is not None:
            index, rows = self._pending
            for r, tok in zip(rows, self._reader.get(index)):
                if not r.leaves:
                    self._emit(r, tok)
        self._pending = None if current is None else (current, batch)
        loops: dict[asyncio.AbstractEventLoop, list[tuple[Request, Event]]] = {}
        for r, ev in self._outbox:
            loops.setdefault(r.loop, []).append((r, ev))
        for loop, events in loops.items():
            loop.call_soon_threadsafe(_deliver, events)
        self._outbox = []

    def _emit(self, r: Request, tok: int) -> None:
        r.tokens.append(tok)
        self.metrics["generated_tokens"] += 1
        p = r.params
        done = ("stop" if tok in p.stop_token_ids or (r.stopped is not None and r.stopped(r.tokens))
                else "length" if len(r.tokens) >= p.max_tokens else None)
        text = r.stream.piece(r.tokens, done is not None) if r.stream is not None else ""
        r.done = done is not None
        self._outbox.append((r, Event(tok, text, done)))
