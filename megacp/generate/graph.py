"""Decode steps replayed from a CUDA graph (gpt-fast style).

A :class:`GraphDecoder` holds, for a fixed batch of B requests on slots of one KV cache, static
device buffers: the tokens fed ``[B]`` int64, their positions ``[B]`` int64, the tokens each request
has on this CP rank ``[B]`` int32, each request's first cache row ``[B]`` int64, and the rows the
step writes and reads. One step computes everything from these buffers with no host work and no
host synchronisation: the CP layers (given a :class:`~megacp.layers.step.StaticDecodeStep`) write
the new keys/values with ``index_copy_`` at device indices and attend with lengths read from device
memory (:func:`~megacp.attention.decode.static_decode`; under CP = N the (out, LSE) of every rank
travel in one all-gather and merge exactly), the decoder's :class:`~megacp.generate.sampling.Sampler`
(static buffers too: each row's settings, seed, token index and token counts) draws the next input
token of every row, and the positions and lengths advance on the device. The step is warmed up on a side stream, then
captured once (NCCL collectives are captured with it; gloo ones cannot be) and replayed per token.

A request that finishes while others go on keeps running in its row (padding: the batch keeps its
size, the graph is never re-captured); its extra tokens are dropped and its cache rows past the
tokens the host counts are never read. :meth:`GraphDecoder.finish` brings the cache's host
bookkeeping up to date with the tokens each request kept.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.generate.sampling import Sampler
from megacp.kv_cache import ShardedKVCache
from megacp.layers.settings import CPSettings
from megacp.layers.step import static_decode_step


class GraphDecoder:
    """The static decode step of a batch of ``len(slots)`` requests on ``cache``.

    Args:
        model: a CP-swapped megacp ``CausalLM``.
        cache, slots: the KV cache and each request's slot (in batch order).
        settings: the CP settings (ring, kernel backend).
        device: where the buffers live.
        sampler: the batch's sampler; the decoder draws with a copy of its own
            (:meth:`load` refills it).
        capture: capture the step in a CUDA graph (needs CUDA and, under CP, NCCL); ``False`` runs
            the same step eagerly each time.
        warmup: eager steps on a side stream before the capture (each undone: the buffers are
            restored and only the spare row after each request's tokens is written).
    """

    def __init__(self, model: torch.nn.Module, cache: ShardedKVCache, slots: Sequence[int], settings: CPSettings,
                 device: torch.device, sampler: Sampler, *, capture: bool = True, warmup: int = 2) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the decoder runs on {device}")
        self.model, self.cache, self.slots, self.device = model, cache, list(slots), device
        self.sampler = sampler.clone()
        self.ring, self.cp_size, self.cp_rank = settings.ring, settings.cp_size, settings.cp_rank
        b = len(self.slots)
        self.tokens = torch.zeros(b, dtype=torch.long, device=device)
        self.positions, self.held, starts = cache.decode_state(self.slots, device)
        self.cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.params = static_decode_step(settings, cache, starts)
        self.logits: Tensor | None = None
        """``[B, V]`` fp32 logits of the latest step (a static buffer under a graph)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph, self.warmup = capture, warmup

    def _step(self) -> Tensor:
        owned = self.positions.remainder(self.cp_size) == self.cp_rank  # round-robin decode placement
        torch.add(self.params.starts, self.held, out=self.params.rows)
        torch.add(self.held, owned, out=self.params.used)
        logits = self.model(self.tokens, self.positions, cu_seqlens=self.cu_seqlens,
                            inference_params=self.params).float()
        self.tokens.copy_(self.sampler(logits))  # and sampler.logprobs: the capture's tensors under a graph
        self.held.add_(owned)
        self.positions.add_(1)
        return logits

    def load(self, tokens: Tensor, sampler: Sampler) -> None:
        """Start from the cache's bookkeeping of every slot, feeding ``tokens [B]`` int64 next and
        drawing on from ``sampler``'s state (of this decoder's sampler's kind)."""
        self.sampler.load(sampler)
        positions, held, _ = self.cache.decode_state(self.slots, self.device)
        self.positions.copy_(positions)
        self.held.copy_(held)
        self.tokens.copy_(tokens)

    def _barrier(self) -> None:
        if self.ring is not None and self.ring.size > 1:
            dist.barrier(group=self.ring.group)

    def capture(self) -> None:
        """Warm the step up on a side stream (undoing each step) and capture it (every CP rank
        together); nothing advances."""
        state = [self.tokens, self.positions, self.held, *self.sampler.state()]
        saved = [t.clone() for t in state]

        def restore() -> None:
            for dst, src in zip(state, saved):
                dst.copy_(src)

        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._step()
                restore()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog may query events
            self.logits = self._step()
        self._barrier()
        self.graph = graph

    def step(self) -> Tensor:
        """One decode step (asynchronous on CUDA); returns the ``tokens`` buffer, now holding each
        request's next token. The first call under ``capture`` warms up and captures."""
        if not self.use_graph:
            self.logits = self._step()
            return self.tokens
        if self.graph is None:
            self.capture()
        assert self.graph is not None  # captured above
        self.graph.replay()
        return self.tokens

    def finish(self, fed: Sequence[int]) -> None:
        """Host bookkeeping once the run is over: request ``i`` kept ``fed[i]`` decode steps (the
        tokens fed back into the model; the steps it ran after finishing are dropped)."""
        for slot, count in zip(self.slots, fed):
            self.cache.advance_decoded(slot, count)


class TokenReader:
    """Two sets of host buffers that a step's tokens ``[B]`` int64 (and any other outputs of the
    step, e.g. the sampler's log-probabilities) are copied into without blocking (pinned memory and
    an event each on CUDA; a plain copy elsewhere): the host reads one set while the next step runs."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.bufs = [[torch.empty(batch, dtype=torch.long, pin_memory=self.cuda)] for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []

    def put(self, i: int, tokens: Tensor, *extra: Tensor) -> None:
        """Start copying ``tokens`` and ``extra`` into buffer set ``i`` (after the work queued so
        far); the buffers of ``extra`` are allocated at their first use and reused while the shapes
        stay the same."""
        bufs = self.bufs[i]
        if [(b.shape, b.dtype) for b in bufs[1:]] != [(t.shape, t.dtype) for t in extra]:
            bufs[1:] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in extra]
        for dst, src in zip(bufs, (tokens, *extra)):
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
