"""Timing of one call, the same way in every benchmark.

* CUDA events on CUDA (``time.perf_counter`` on CPU), one event pair per call;
* a barrier (all-reduce + device synchronise, so every rank's host and device are idle) before
  each timed call of a collective method;
* the time of a call is the maximum over the ranks (all-reduce MAX of the per-call times), the
  reported time is the median of the calls; warm-up calls are never counted;
* the number of timed calls adapts to the call's length (``target_s``), the same on every rank.

Single-GPU baselines run on one rank alone (``collective=False``); the other ranks wait at the
next barrier.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from scripts.bench.harness.context import Ctx, all_max, barrier, sync


class Clock:
    """Milliseconds of GPU work between ``start()`` and ``stop()`` (wall time on CPU)."""

    def __init__(self, ctx: Ctx) -> None:
        self.cuda = ctx.cuda
        if self.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t0) * 1e3


@dataclass
class Timing:
    """One measurement, in milliseconds."""

    ms: float  # median over the timed calls (each the max over ranks)
    min_ms: float
    max_ms: float
    iters: int
    times_ms: list[float] = field(default_factory=list)
    loop_ms: float | None = None  # per call of back-to-back calls (``measure(loop_calls=)``)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["times_ms"] = [round(t, 4) for t in self.times_ms]
        return d


def measure(ctx: Ctx, fn: Callable[[], Any], *, collective: bool = True, warmup: int = 2,
            min_iters: int = 3, max_iters: int = 20, target_s: float = 2.0, loop_calls: int = 0) -> Timing:
    """Time ``fn`` (see the module docstring). ``collective=False``: only the calling rank runs it
    (no barrier, no reduction); the other ranks must not call this. ``loop_calls > 0`` also times
    that many back-to-back calls (:func:`measure_loop`, at most as many as the timed calls): how
    the call runs when the host queues it ahead, as layers of a model do."""
    clock = Clock(ctx)
    pre = (lambda: barrier(ctx)) if collective else (lambda: sync(ctx))
    est = 0.0
    for _ in range(max(warmup, 1)):
        pre()
        clock.start()
        fn()
        est = clock.stop()
    if collective:
        est = all_max(ctx, [est])[0]
    iters = int(min(max_iters, max(min_iters, math.floor(target_s * 1e3 / max(est, 1e-3)))))
    times = []
    for _ in range(iters):
        pre()
        clock.start()
        fn()
        times.append(clock.stop())
    if collective:
        times = all_max(ctx, times)
    loop = None
    if loop_calls > 0:
        loop = measure_loop(ctx, fn, calls=min(loop_calls, max(2, iters)), collective=collective)
    return Timing(statistics.median(times), min(times), max(times), iters, times, loop)


def measure_loop(ctx: Ctx, fn: Callable[[], Any], *, calls: int = 20, collective: bool = True) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls (no sync between them), max over ranks."""
    clock = Clock(ctx)
    fn()
    (barrier if collective else sync)(ctx)
    clock.start()
    for _ in range(calls):
        fn()
    ms = clock.stop() / calls
    return all_max(ctx, [ms])[0] if collective else ms


def capture_graph(ctx: Ctx, fn: Callable[[], Any], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up on a side stream, then capture one call into a CUDA graph (every rank together:
    NCCL collectives inside are captured, not run). Returns ``(graph, static output)``; replay with
    ``graph.replay()``. ``thread_local`` capture: NCCL's watchdog thread may query events meanwhile."""
    side = torch.cuda.Stream(device=ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    barrier(ctx)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = fn()
    barrier(ctx)
    return g, out


def attn_flops(seqlen: int, heads: int, head_dim: int, *, causal: bool = True) -> float:
    """FLOPs of one attention forward over one sequence: ``4·S²·H·D``, halved when causal."""
    f = 4.0 * seqlen * seqlen * heads * head_dim
    return f / 2 if causal else f


def window_ms(fn: Callable[[], Any], calls: int) -> float:
    """Rank-local: mean ms of ``calls`` back-to-back calls of ``fn`` (CUDA events on the current
    stream, no warm-up, no sync before; the caller arranges both)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls
