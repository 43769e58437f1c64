"""One engine step, the same on every CP rank (:class:`Work`: from the server's rank 0, broadcast
on a CPU group, or made alike by every rank of an offline engine), which :meth:`Worker.run`
executes: retire requests that left the running batch, cut slots back to a reused prefix, prefill the step's prompt chunks (one forward for all of them) and draw
the first token of each request whose prompt is then complete, then run one decode step of the
running batch (a CUDA graph replay on CUDA: :class:`~megacp.generate.graph.BatchDecoder`), with the
log-probabilities of the tokens whose requests ask for them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.generate.graph import BatchDecoder
from megacp.generate.loop import Generator
from megacp.generate.sampling import Sampler, SamplingParams, logprob_dicts
from megacp.kv_cache import ShardedKVCache


@dataclass
class Admit:
    """A chunk of a request's prompt prefilled this step: its slot, the chunk's tokens (the slot
    holds the prompt's tokens before them), the request's settings, (with a repetition penalty)
    its whole prompt, and whether the chunk ends the prompt (``last``: the request then draws its
    first token and joins the running batch, whose ``Work.batch`` lists it)."""

    slot: int
    tokens: list[int]
    params: SamplingParams
    context: list[int] | None = None
    last: bool = True


@dataclass
class Work:
    """A step: cut slots back to a prefix (prefix reuse, eviction), prefill the prompt chunks of
    ``admit``, set the running batch to ``batch`` (its slots in row order; ``None``: unchanged; a
    request whose last chunk ran always changes it) and decode one token of each; ``stop`` ends
    the followers' loop."""

    truncate: list[tuple[int, int]] = field(default_factory=list)
    admit: list[Admit] = field(default_factory=list)
    batch: list[int] | None = None
    stop: bool = False


@dataclass
class StepOutput:
    """What a step returns: the first token of each request whose last chunk ran (in ``admit``
    order), the running batch's next tokens (a device tensor ``[>= B]`` int64, row ``i`` for
    ``batch[i]``, written asynchronously on CUDA; ``None`` when the batch is empty) and the
    prefill steps' strategies; with log-probabilities asked, those of each first token
    (``{token: logprob}`` of :func:`~megacp.generate.sampling.logprob_dicts`; ``None`` for a
    request that did not ask) and, while a request of the batch asks, those of the batch's tokens
    (device tensors of :func:`~megacp.generate.sampling.draw_logprobs`, rows as ``tokens``)."""

    first: list[int]
    tokens: Tensor | None
    strategies: list[str]
    first_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    logprobs: tuple[Tensor, Tensor, Tensor] | None = None


class Worker:
    """Executes :class:`Work` on this rank's cache, which it owns (every slot allocated once, for
    good; an engine on this rank schedules on the cache's slot table, :attr:`EngineCore.table
    <megacp.generate.engine.EngineCore.table>`).

    Args:
        gen: the generator.
        num_slots: request slots (the running batch's size at most).
        capacity: tokens one request may hold on this rank (the cache keeps one row more: the
            static step writes the row after a rank's tokens).
        vocab: the logits' vocabulary size.
        static: decode the running batch with the static step (megacp's own dense models; with
            more than one slot an extra scratch slot takes its padding rows), else with eager
            model steps (:meth:`Generator.decode_step`); either way in one
            :class:`~megacp.generate.graph.BatchDecoder`, whose sampler buffers draw the tokens.
        capture: replay CUDA graphs (with ``static``; when ``shared``, the greedy ones are captured
            here, else each graph on its first use).
        shared: rank 0's work is broadcast to the other ranks (:meth:`share`; a server's followers
            run what rank 0 schedules); ``False``: every rank schedules the same work itself.
    """

    def __init__(self, gen: Generator, num_slots: int, capacity: int, *, vocab: int, static: bool,
                 capture: bool, shared: bool = True) -> None:
        self.gen = gen
        scratch = static and num_slots > 1  # one row never pads
        self.cache: ShardedKVCache = gen.new_cache(num_slots + (1 if scratch else 0), capacity + 1)
        self.slots = [self.cache.allocate() for _ in range(num_slots)]
        self.group = None if not shared or dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.shared = shared
        self.progress = False
        """Show a progress bar of the prefill forwards (an offline caller's rank 0)."""
        cache = self.cache
        self.decoder = BatchDecoder(gen.model, cache, cache.allocate() if scratch else None, gen.settings, gen.device,
                                    vocab=vocab, max_batch=num_slots, capture=capture,
                                    forward=None if static else lambda slots, tokens: gen.decode_step(cache, slots, tokens))
        if capture and shared:  # a server's first requests find them ready
            with torch.inference_mode():
                self.decoder.capture_greedy()
        self.decode_mode = "cuda_graph" if static and capture else "static_eager" if static else "eager"
        """How the running batch decodes: ``cuda_graph``, ``static_eager`` (the graph's step, run
        eagerly) or ``eager`` (eager model steps)."""

    def share(self, work: Work | None) -> Work:
        """Rank 0's ``work`` on every rank (``work`` itself when not :attr:`shared`)."""
        box = [work]
        if self.shared and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        assert box[0] is not None
        return box[0]

    @torch.inference_mode()
    def run(self, work: Work) -> StepOutput:
        """Execute ``work``; the decode step is queued, not waited for."""
        if work.batch is not None:
            self.decoder.leave([s for s in self.decoder.slots if s not in work.batch])
        for slot, length in work.truncate:
            self.cache.truncate(slot, length)
        new: dict[int, tuple[Tensor, Sampler]] = {}
        strategies: list[str] = []
        if work.admit:
            logits, strategies = self.gen.prefill(self.cache, [a.slot for a in work.admit], [a.tokens for a in work.admit],
                                                  progress=self.progress, sampling=[a.params for a in work.admit])
            for row, a in enumerate(work.admit):
                if not a.last:  # the prompt goes on in a later step: no token yet
                    continue
                sampler = Sampler([a.params], logits.shape[-1], logits.device,
                                  context=None if a.context is None else [a.context])
                new[a.slot] = (sampler(logits[row: row + 1]), sampler)
        first = torch.cat([t for t, _ in new.values()]).tolist() if new else []
        first_logprobs = [None if s.logprobs is None else
                          logprob_dicts([tok], s.logprobs[0].tolist(), s.logprobs[1].tolist(), s.logprobs[2].tolist(),
                                        [s.top_logprobs])[0]
                          for tok, (_, s) in zip(first, new.values())]
        if work.batch is not None:
            self.decoder.join(work.batch, {s: v for s, v in new.items() if s in work.batch})
        tokens = self.decoder.step() if self.decoder.slots else None
        return StepOutput(first, tokens, strategies, first_logprobs,
                          None if tokens is None else self.decoder.logprobs)

    def follow(self) -> None:
        """The loop of a rank other than 0: run rank 0's steps until it says stop."""
        while not (work := self.share(None)).stop:
            self.run(work)
