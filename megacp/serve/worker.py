"""One engine step, the same on every CP rank: :class:`Work` is broadcast from rank 0 (on a CPU
group) and :meth:`Worker.run` executes it over the generator's prefill and decode steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.generate.loop import Generator
from megacp.kv_cache import ShardedKVCache


@dataclass
class Work:
    """A step: cut slots back to a prefix (prefix reuse, eviction), prefill new tokens of admitted
    requests, feed one token to each decoding slot; ``stop`` ends the followers' loop."""

    truncate: list[tuple[int, int]] = field(default_factory=list)
    prefill: list[tuple[int, list[int]]] = field(default_factory=list)
    decode: list[tuple[int, int]] = field(default_factory=list)
    stop: bool = False


class Worker:
    """Executes :class:`Work` on this rank's cache (every slot allocated once, for good)."""

    def __init__(self, gen: Generator, num_slots: int, capacity: int) -> None:
        self.gen = gen
        self.cache: ShardedKVCache = gen.new_cache(num_slots, capacity)
        self.slots = [self.cache.allocate() for _ in range(num_slots)]
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def share(self, work: Work | None) -> Work:
        """Rank 0's ``work`` on every rank."""
        box = [work]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        assert box[0] is not None
        return box[0]

    @torch.inference_mode()
    def run(self, work: Work) -> tuple[Tensor | None, Tensor | None, list[str]]:
        """The fp32 logits ``[P, V]`` after each prefilled request and ``[D, V]`` of each decoded
        one (``None`` when there are none), and the prefill steps' strategies."""
        for slot, length in work.truncate:
            self.cache.truncate(slot, length)
        pre = dec = None
        strategies: list[str] = []
        if work.prefill:
            pre, strategies = self.gen.prefill(self.cache, [s for s, _ in work.prefill], [t for _, t in work.prefill])
        if work.decode:
            tokens = torch.tensor([t for _, t in work.decode], dtype=torch.long, device=self.gen.device)
            dec = self.gen.decode_step(self.cache, [s for s, _ in work.decode], tokens)
        return pre, dec, strategies

    def follow(self) -> None:
        """The loop of a rank other than 0: run rank 0's steps until it says stop."""
        while not (work := self.share(None)).stop:
            self.run(work)
