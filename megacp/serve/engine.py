"""The server's engine: the request engine (:class:`~megacp.generate.engine.EngineCore`: continuous
batching, chunked prefill, prefix reuse with LRU eviction, one step late token reads, the output
processor) stepped on rank 0 by a thread of its own, with a bounded queue in front of it, the steps'
events handed to each request's asyncio loop at once, heartbeats to the followers while idle, and
draining and failure handling. The followers run the steps rank 0 broadcasts
(:meth:`~megacp.generate.worker.Worker.follow`)."""

from __future__ import annotations

import asyncio
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from megacp.generate import engine as core
from megacp.generate.engine import EngineCore, Event
from megacp.generate.outputs import stop_string_check
from megacp.generate.worker import Work, Worker

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


@dataclass(eq=False)
class Request(core.Request):
    """One request of a client; its events go to ``events`` on the event loop ``loop``."""

    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, event: Event) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _deliver(events: list[tuple[core.Request, Event]]) -> None:
    for r, ev in events:
        assert isinstance(r, Request)
        r.events.put_nowait(ev)


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


class Engine(EngineCore):
    """The request engine on rank 0, stepped by a thread of its own, on a :class:`Worker`.

    Args:
        worker: rank 0's worker (its cache has ``max_num_seqs`` slots).
        tokenizer: for stop strings and streamed text (``None``: token ids only).
        max_queue: requests waiting at most before :class:`QueueFull`.
        prefix_reuse: reuse a finished request's cached tokens for a request that starts alike.
        max_batched_tokens: prefill tokens a step that decodes the running batch computes at most
            (:class:`~megacp.generate.engine.EngineCore`; 0: no limit).
    """

    def __init__(self, worker: Worker, tokenizer: Any, *, max_queue: int, prefix_reuse: bool = True,
                 max_batched_tokens: int = 0) -> None:
        super().__init__(worker, tokenizer, prefix_reuse=prefix_reuse, max_batched_tokens=max_batched_tokens,
                         feed_last=True)
        self.inbox: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.draining = False
        self._step_times: deque[tuple[float, bool]] = deque(maxlen=STEP_WINDOW)  # (seconds, prefilled)
        self._thread = threading.Thread(target=self._run, name="megacp-engine", daemon=True)
        self.failure: str | None = None
        """Why the step loop died (a collective failed: a CP rank died or froze past the timeout), else
        ``None``; ``/health`` then answers 503 and :attr:`on_failure` is called once."""
        self.on_failure: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def _open(self) -> list[Request]:
        """Every request not finished yet: running, prefilling, waiting or in the inbox."""
        reqs = [s.request for s in self.slots if s.request is not None] + [*self.waiting, *self.prefilling]
        while not self.inbox.empty():
            reqs.append(self.inbox.get_nowait())
        return [r for r in reqs if isinstance(r, Request) and not r.done]

    def _run(self) -> None:
        """The step loop; when it dies, every request still open gets the error and :attr:`on_failure`
        is called (the server then exits non-zero)."""
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - the engine thread must not die silently
            self.failure = public_error(err)
            self.draining = True
            for req in self._open():
                req.put(Event(None, "", error=self.failure))
            if self.on_failure is not None:
                self.on_failure()

    def submit(self, req: Request) -> None:
        """Queue ``req`` (raises :class:`Draining` or :class:`QueueFull`)."""
        if self.draining:
            raise Draining("the server is shutting down")
        stop_string_check(self.tokenizer, req.params)  # stop strings need a tokenizer: say so to the client
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
            if not self.busy:
                try:
                    self.add(self.inbox.get(timeout=IDLE_POLL_S))
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
                    self.add(self.inbox.get_nowait())
                except queue.Empty:
                    break
            try:
                start, chunks = time.perf_counter(), self.metrics["prefill_chunks"]
                self.deliver(self.step())  # a step with prompt chunks (each chunk counts; admission alone does not)
                self._step_times.append((time.perf_counter() - start, self.metrics["prefill_chunks"] > chunks))
            except Exception as err:  # noqa: BLE001  # a failed step fails its requests, not the server
                for s in self.slots:  # a prefilling request holds its slot too
                    if isinstance(s.request, Request) and not s.request.done:
                        s.request.put(Event(None, "", error=public_error(err)))
                self.reset(truncate=[(i, 0) for i in range(len(self.slots))])

    @staticmethod
    def deliver(events: list[tuple[core.Request, Event]]) -> None:
        """Hand a step's events to their requests' event loops, one call per loop."""
        loops: dict[asyncio.AbstractEventLoop, list[tuple[core.Request, Event]]] = {}
        for r, ev in events:
            assert isinstance(r, Request) and r.loop is not None
            loops.setdefault(r.loop, []).append((r, ev))
        for loop, batch in loops.items():
            loop.call_soon_threadsafe(_deliver, batch)
