"""Decode steps replayed from a CUDA graph (gpt-fast style).

A :class:`BatchDecoder` holds, for the running batch of an engine (:mod:`megacp.generate.engine`)
on slots of one KV cache, static device buffers: the tokens fed ``[M]`` int64, their positions
``[M]`` int64, the tokens each request has on this CP rank ``[M]`` int32, each request's first cache
row ``[M]`` int64, and the rows the step writes and reads. One step computes everything from these
buffers with no host work and no host synchronisation: the CP layers (given a :class:`~megacp.layers.step.StaticDecodeStep`) write
the new keys/values with ``index_copy_`` at device indices and attend with lengths read from device
memory (:func:`~megacp.attention.decode.static_decode`; under CP = N the (out, LSE) of every rank
travel in one all-gather and merge exactly), the decoder's :class:`~megacp.generate.sampling.Sampler`
(static buffers too: each row's settings, seed, token index and token counts) draws the next input
token of every row, and the positions and lengths advance on the device. The step is warmed up on a side stream, then
captured once (NCCL collectives are captured with it; gloo ones cannot be) and replayed per token.

The batch's requests come and go: static rows up to a maximum batch, graphs captured once per
padded batch size and kind of sampling, rows moved on the device when the membership changes; the
log-probabilities its requests ask for are computed after the step from the step's logits (outside
the graph, only while a request of the batch asks). Models the static step does not run
(transformers modules, sliding windows, mixture of experts) decode in the same class with an eager
model step in its place: the same rows, membership changes and sampler buffers, no padding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.generate.sampling import GREEDY, Features, Sampler, draw_logprobs
from megacp.kv_cache import ShardedKVCache
from megacp.layers.settings import CPSettings
from megacp.layers.step import StaticDecodeStep, static_decode_step
from megacp.parallel.ring import Ring


def static_step(model: torch.nn.Module, params: StaticDecodeStep, cu_seqlens: Tensor, tokens: Tensor,
                positions: Tensor, held: Tensor, sampler: Sampler, live: Tensor | None = None) -> Tensor:
    """One static decode step of ``B`` rows from device state only (no host work): feed ``tokens
    [B]`` int64 at ``positions [B]`` int64 (``held [B]`` int32: tokens each row holds on this rank;
    ``cu_seqlens [B+1]`` int32 = ``arange``), draw each row's next token into ``tokens`` with
    ``sampler`` and advance ``positions`` and ``held``. Rows whose ``live [B]`` bool is false
    (padding) advance nothing and own no token: they write one row past their tokens and attend
    over ``held`` rows. Returns the fp32 logits ``[B, V]``."""
    cp_size, cp_rank = params.settings.cp_size, params.settings.cp_rank
    owned = positions.remainder(cp_size) == cp_rank  # round-robin decode placement
    if live is not None:
        owned &= live
    torch.add(params.starts, held, out=params.rows)
    torch.add(held, owned, out=params.used)
    logits = model(tokens, positions, cu_seqlens=cu_seqlens, inference_params=params).float()
    tokens.copy_(sampler(logits))
    held.add_(owned)
    positions.add_(1 if live is None else live)
    return logits


def capture_step(step: Callable[[], Tensor], state: Sequence[Tensor], device: torch.device, ring: Ring | None,
                 warmup: int, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """Warm ``step`` up ``warmup`` times on a side stream (restoring the tensors of ``state`` after
    each) and capture it in a CUDA graph (every CP rank of ``ring`` together; ``pool``: a memory
    pool shared with other graphs that never replay concurrently). Returns the graph and the
    step's output (a static buffer each replay rewrites); nothing advances."""
    saved = [t.clone() for t in state]

    def restore() -> None:
        for dst, src in zip(state, saved):
            dst.copy_(src)

    def barrier() -> None:
        if ring is not None and ring.size > 1:
            dist.barrier(group=ring.group)

    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
            restore()
    torch.cuda.current_stream(device).wait_stream(side)
    barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # NCCL's watchdog may query events
        out = step()
    barrier()
    return graph, out


def batch_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes a :class:`BatchDecoder` runs: powers of two below ``max_batch``, and
    ``max_batch`` (1, 2, 4, 8, 16, 32 for 32; 1, 2, 4, 6 for 6)."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


class BatchDecoder:
    """The static decode step of a running batch whose requests come and go, on up to
    ``max_batch`` slots of ``cache``.

    Every row has static device buffers: the token fed next ``[M]`` int64, its position ``[M]``
    int64, the tokens the row's request holds on this CP rank ``[M]`` int32, the row of its slot's
    first token ``[M]`` int64, whether it is live ``[M]`` bool, and its sampler row (settings, seed,
    token index, penalty counts; :meth:`Sampler.buffers`). The batch's ``n`` requests occupy rows
    ``0..n-1`` in the order :meth:`join` gives; a step runs the smallest of :func:`batch_sizes` that
    holds them, the rows past ``n`` being padding that writes one row of the ``scratch`` slot and
    advances nothing. A step is one CUDA graph per (size, sampler :data:`Features` of the batch),
    captured on first use (:meth:`capture_greedy` captures the greedy ones up front) and never
    again; without ``capture`` the same step runs eagerly. A membership change copies rows on the
    device (:meth:`leave`, then :meth:`join`), so the graphs stay valid.

    The host counts the steps each request ran (:attr:`fed`) and, for the static step, brings the
    cache's bookkeeping up to date when it leaves (:meth:`ShardedKVCache.advance_decoded`): every
    token fed keeps its keys and values (an eager ``forward`` keeps the bookkeeping as it goes).

    While a request of the batch asks for ``logprobs``, each step also leaves :attr:`logprobs`
    (:func:`~megacp.generate.sampling.draw_logprobs` of the step's logits, outside the graph).

    Args:
        model: a CP-swapped megacp ``CausalLM``.
        cache: the KV cache; each request slot needs one spare row on every rank (the step writes
            the row after a rank's tokens when another rank owns the token).
        scratch: a slot of ``cache`` no request uses, after every request slot (padding rows write
            its row 1); ``None``: no slot to spare, every batch must have one of :func:`batch_sizes`
            rows (with ``max_batch`` 1 nothing ever pads).
        settings: the CP settings (ring, kernel backend).
        device: where the buffers live.
        vocab: the logits' vocabulary size V.
        max_batch: rows M.
        capture: replay CUDA graphs (needs CUDA and, under CP, NCCL); every CP rank must make the
            same calls.
        warmup: eager steps before a capture (each undone).
        forward: ``None``: the static step above. Else the model step of models the static step
            does not run (transformers modules, sliding windows, mixture of experts):
            ``forward(slots, tokens [B] int64)`` feeds each request its next token and returns the
            logits ``[B, V]`` and keeps the cache's bookkeeping itself
            (:meth:`~megacp.generate.loop.Generator.decode_step`); the batch then never pads
            (every size up to ``max_batch`` runs as it is), nothing is captured, and the same
            sampler buffers draw the tokens.
    """

    def __init__(self, model: torch.nn.Module, cache: ShardedKVCache, scratch: int | None, settings: CPSettings,
                 device: torch.device, *, vocab: int, max_batch: int, capture: bool, warmup: int = 2,
                 forward: Callable[[list[int], Tensor], Tensor] | None = None) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the decoder runs on {device}")
        if capture and forward is not None:
            raise ValueError("an eager model step (forward) cannot be captured in a CUDA graph")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.cache, self.settings, self.device, self.forward = model, cache, settings, device, forward
        self.sizes = batch_sizes(max_batch) if forward is None else list(range(1, max_batch + 1))
        self.use_graph, self.warmup = capture, warmup
        self.pad_start = None if scratch is None else scratch * cache.capacity
        m = max_batch
        self.tokens = torch.zeros(m, dtype=torch.long, device=device)
        self.positions = torch.zeros(m, dtype=torch.long, device=device)
        self.held = torch.ones(m, dtype=torch.int32, device=device)
        self.starts = torch.full((m,), self.pad_start or 0, dtype=torch.long, device=device)
        self.live = torch.zeros(m, dtype=torch.bool, device=device)
        self.sampler = Sampler.buffers(m, vocab, device)
        self.slots: list[int] = []
        """The batch's slots, in row order."""
        self._rows: dict[int, int] = {}  # slot -> its row on the device
        self.fed: dict[int, int] = {}
        """Decode steps each slot's request ran since it joined."""
        self._features: dict[int, Features] = {}
        self._top: dict[int, int | None] = {}  # slot -> the top log-probabilities its request asks for
        self.logprobs: tuple[Tensor, Tensor, Tensor] | None = None
        """After a step while a request asks for log-probabilities: (chosen ``[size]`` fp32, top ids
        ``[size, K]`` int64, top log-probabilities ``[size, K]`` fp32) of every row, ``K`` the most
        any request of the batch asks; else ``None``."""
        self.features: Features = GREEDY
        """The sampler steps the batch needs: those of any of its requests."""
        self._steps: dict[int, tuple[StaticDecodeStep, Tensor]] = {}
        self._samplers: dict[tuple[int, Features], Sampler] = {}
        self.graphs: dict[tuple[int, Features], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        """Captured steps by (size, features), with their logits buffers."""
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_s = 0.0
        """Seconds spent warming up and capturing graphs so far."""
        self.logits: Tensor | None = None
        """``[size, V]`` fp32 logits of the latest step (a graph's static buffer when replayed)."""

    @property
    def size(self) -> int:
        """The padded batch size the next step runs (0: no request)."""
        n = len(self.slots)
        return next(b for b in self.sizes if b >= n) if n else 0

    def leave(self, slots: Sequence[int]) -> None:
        """Take the requests in ``slots`` out of the batch (their rows are reused at the next
        :meth:`join`), recording the tokens each fed in the cache's bookkeeping."""
        for s in slots:
            fed = self.fed.pop(s)
            if self.forward is None:  # an eager step keeps the bookkeeping itself
                self.cache.advance_decoded(s, fed)
            del self._features[s], self._rows[s], self._top[s]
        self.slots = [s for s in self.slots if s in self.fed]
        self.features = Features.union(self._features.values())

    def join(self, slots: Sequence[int], new: dict[int, tuple[Tensor, Sampler]]) -> None:
        """Make the batch ``slots`` in this row order (ascending: the flash decode kernel takes the
        rows' first cache rows as non-decreasing offsets): the batch's remaining requests and the
        newcomers of ``new`` (slot -> its next input token ``[1]`` int64 and its one-row sampler,
        after the draws so far), which start from the cache's bookkeeping of their slot."""
        missing = [s for s in slots if s not in self.fed and s not in new]
        if missing or set(self.fed) - set(slots) or len(set(slots)) != len(slots) or len(slots) > self.sizes[-1]:
            raise ValueError(f"a batch of slots {list(slots)} (at most {self.sizes[-1]}) is not the batch's "
                             f"{sorted(self.fed)} plus newcomers {sorted(new)}")
        n, dev = len(slots), self.device
        dst = torch.arange(n, device=dev)
        src = torch.tensor([self._rows.get(s, 0) for s in slots], dtype=torch.long, device=dev)
        for t in (self.tokens, self.positions, self.held, self.starts):
            t[:n] = t.index_select(0, src)
        self.sampler.put_rows(dst, self.sampler, src)
        self.live[:n], self.live[n:] = True, False
        self.tokens[n:], self.positions[n:], self.held[n:], self.starts[n:] = 0, 0, 1, self.pad_start or 0
        rows = [i for i, s in enumerate(slots) if s in new]
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=dev)
            joined = [slots[i] for i in rows]
            positions, held, starts = self.cache.decode_state(joined, dev)
            self.positions.index_copy_(0, index, positions)
            self.held.index_copy_(0, index, held)
            self.starts.index_copy_(0, index, starts)
            self.tokens.index_copy_(0, index, torch.cat([new[s][0].reshape(1) for s in joined]))
            zero = torch.zeros(1, dtype=torch.long, device=dev)
            for k, s in enumerate(joined):
                self.sampler.put_rows(index[k: k + 1], new[s][1], zero)
                self.fed[s], self._features[s], self._top[s] = 0, new[s][1].features, new[s][1].top_logprobs
        self.slots, self._rows = list(slots), {s: i for i, s in enumerate(slots)}
        self.features = Features.union(self._features.values())

    def _sampler(self, size: int, features: Features) -> Sampler:
        if (size, features) not in self._samplers:
            self._samplers[size, features] = self.sampler.view(size, features)
        return self._samplers[size, features]

    def _fns(self, size: int, features: Features) -> tuple[StaticDecodeStep, Tensor, Sampler]:
        if size not in self._steps:
            self._steps[size] = (static_decode_step(self.settings, self.cache, self.starts[:size]),
                                 torch.arange(size + 1, dtype=torch.int32, device=self.device))
        return (*self._steps[size], self._sampler(size, features))

    def _run(self, size: int, features: Features) -> Tensor:
        if self.forward is not None:
            logits = self.forward(self.slots, self.tokens[:size]).float()
            self.tokens[:size] = self._sampler(size, features)(logits)
            return logits
        params, cu, sampler = self._fns(size, features)
        return static_step(self.model, params, cu, self.tokens[:size], self.positions[:size], self.held[:size],
                           sampler, self.live[:size])

    def capture(self, size: int, features: Features) -> None:
        """Capture the step of ``size`` rows drawing with ``features`` (every CP rank together;
        nothing advances)."""
        start = time.perf_counter()
        self._fns(size, features)  # the step's own tensors, made on this stream
        state = [self.tokens, self.positions, self.held, *self.sampler.state()]
        self.graphs[size, features] = capture_step(lambda: self._run(size, features), state, self.device,
                                                   self.settings.ring, self.warmup, self._pool)
        self.capture_s += time.perf_counter() - start

    def capture_greedy(self) -> None:
        """Capture the greedy step of every size, largest first (their memory pool is shared)."""
        for size in reversed(self.sizes):
            self.capture(size, GREEDY)

    def step(self) -> Tensor:
        """One decode step of the batch (asynchronous on CUDA); returns the ``tokens`` buffer
        ``[M]``, row ``i`` now holding the next token of ``slots[i]`` (rows past the batch: padding),
        and sets :attr:`logprobs`."""
        size, features = self.size, self.features
        if not size:
            raise ValueError("the batch is empty")
        if size > len(self.slots) and self.pad_start is None:
            raise ValueError(f"a batch of {len(self.slots)} pads to {size} rows, and no scratch slot takes the padding")
        if not self.use_graph:
            logits = self._run(size, features)
        else:
            if (size, features) not in self.graphs:
                self.capture(size, features)
            graph, logits = self.graphs[size, features]
            graph.replay()
        self.logits = logits
        for s in self.slots:
            self.fed[s] += 1
        k = max((k for k in self._top.values() if k is not None), default=None)
        self.logprobs = None if k is None else draw_logprobs(logits, self.tokens[:size], k)
        return self.tokens


class TokenReader:
    """Two sets of host buffers that a step's tokens ``[B]`` int64 (and any other outputs of the
    step, e.g. the sampler's log-probabilities) are copied into without blocking (pinned memory and
    an event each on CUDA; a plain copy elsewhere): the host reads one set while the next step runs."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.bufs = [[torch.empty(batch, dtype=torch.long, pin_memory=self.cuda)] for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []

    def put(self, i: int, tokens: Tensor, *extra: Tensor) -> None:
        """Start copying ``tokens [b <= B]`` and ``extra`` into buffer set ``i`` (after the work
        queued so far; token rows past ``b`` keep older values); the buffers of ``extra`` are
        allocated at their first use and reused while the shapes stay the same."""
        bufs = self.bufs[i]
        if [(b.shape, b.dtype) for b in bufs[1:]] != [(t.shape, t.dtype) for t in extra]:
            bufs[1:] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in extra]
        bufs[0][: tokens.shape[0]].copy_(tokens, non_blocking=self.cuda)
        for dst, src in zip(bufs[1:], extra):
            dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            self.events[i].record()

    def get(self, i: int) -> list[int]:
        """Buffer set ``i``'s tokens once their copy is done (:meth:`extra` then holds the rest)."""
        if self.cuda:
            self.events[i].synchronize()
        return self.bufs[i][0].tolist()

    def extra(self, i: int) -> list[list]:
        """The other tensors of set ``i`` as lists (call after :meth:`get` of the same set)."""
        return [b.tolist() for b in self.bufs[i][1:]]
