"""The static decode step (what a CUDA graph replays) over a fixed batch, for the tests that hold
it against eager decode."""

from __future__ import annotations

from typing import Sequence

import torch


def fixed_batch(model: torch.nn.Module, cache, slots: Sequence[int], settings, device: torch.device,  # type: ignore[no-untyped-def]
                tokens: torch.Tensor, vocab: int, *, capture: bool = False):
    """A :class:`~megacp.generate.graph.BatchDecoder` whose batch is exactly the requests of
    ``slots`` (ascending), drawing greedily, fed ``tokens [B]`` int64 next; each
    :meth:`~megacp.generate.graph.BatchDecoder.step` leaves its logits in ``logits`` and
    ``leave(slots)`` brings the cache's bookkeeping up to date."""
    from megacp.generate.graph import BatchDecoder
    from megacp.generate.sampling import Sampler, SamplingParams

    dec = BatchDecoder(model, cache, None, settings, device, vocab=vocab, max_batch=len(slots), capture=capture)
    dec.join(list(slots), {s: (tokens[i: i + 1], Sampler([SamplingParams()], vocab, device))
                           for i, s in enumerate(slots)})
    return dec
