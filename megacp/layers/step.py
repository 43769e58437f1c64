"""The per-step CP context handed to a model as ``inference_params``.

A :class:`CPStep` says which tokens of the batch this rank computes, at which global positions,
and carries what every CP attention layer needs: the sharding plan, the CP ring, the KV cache and
its slots, and the strategies. The model never looks inside; it only passes it down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from megacp.attention.preconditions import agree
from megacp.attention.prefill import resolve_strategy, strategy_name
from megacp.attention.strategy import Choice
from megacp.kv_cache import ShardedKVCache
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan

DECODE_STRATEGIES = ("allgather",)


@dataclass
class CPStep:
    """One forward step of a batch of requests under CP.

    Attributes:
        plan: the step's sharding plan (same on every CP rank).
        ring: the CP ring (``None`` for CP = 1).
        cache, slots: the KV cache and each request's slot (``None`` for a cacheless prefill).
        strategy: prefill strategy, ``"auto"``, ``"pass_kv"`` or ``"pass_q"``.
        decode: decode strategy (``"allgather"``).
        backend: attention kernel backend override (see :mod:`megacp.attention.partial`).
        calibration_dir: where the ``auto`` strategy reads this host's calibration (``None``:
            ``~/.cache/megacp``).
    """

    plan: ShardPlan
    ring: Ring | None = None
    cache: ShardedKVCache | None = None
    slots: list[int] | None = None
    strategy: str = "auto"
    decode: str = "allgather"
    backend: str | None = None
    calibration_dir: str | None = None
    choice: Choice | str | None = field(default=None, init=False)
    agreed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.decode not in DECODE_STRATEGIES:
            raise ValueError(f"decode strategy {self.decode!r} is not one of {', '.join(DECODE_STRATEGIES)}")
        if (self.cache is None) != (self.slots is None):
            raise ValueError("CPStep needs both cache and slots, or neither")

    @classmethod
    def begin(cls, cache: ShardedKVCache, slots: Sequence[int], new_tokens: Sequence[int], ring: Ring | None, **kw) -> "CPStep":
        """Plan a cached step (checks capacity first; nothing is written on error)."""
        return cls(cache.plan(slots, new_tokens), ring, cache, list(slots), **kw)

    @property
    def replicated(self) -> bool:
        """Decode step: every request adds one token and every rank computes all of them."""
        return self.cache is not None and self.plan.is_decode

    def token_index(self) -> Tensor:
        """Indices into the packed new tokens of the tokens this rank computes."""
        if self.replicated:
            return torch.arange(self.plan.num_requests)
        return self.plan.local_index()

    def positions(self) -> Tensor:
        """Global positions of the tokens this rank computes (for RoPE)."""
        if self.replicated:
            return torch.tensor(self.plan.cached, dtype=torch.long)
        return self.plan.local_positions()

    def cu_seqlens(self) -> Tensor:
        """int32 ``[B+1]`` boundaries of the requests among this rank's tokens."""
        if self.replicated:
            return torch.arange(self.plan.num_requests + 1, dtype=torch.int32)
        return self.plan.local_cu_seqlens()

    def last_token_rows(self) -> list[int | None]:
        """For each request, the row of its last new token among this rank's tokens, or ``None``
        when another rank holds it."""
        if self.replicated:
            return list(range(self.plan.num_requests))
        rows, lay = [], self.plan.q_layout(self.plan.rank)
        for i, (p, t) in enumerate(zip(self.plan.cached, self.plan.new)):
            last = p + t - 1
            row, off = None, lay[i].offset
            for a, b in lay[i].ranges:
                if a <= last < b:
                    row = off + last - a
                off += b - a
            rows.append(row)
        return rows

    def prefill_strategy(self, num_heads: int, num_kv_heads: int, elem_bytes: int, device: torch.device) -> str:
        """The step's prefill strategy, resolved once (the same for every layer)."""
        if self.choice is None:
            self.choice = resolve_strategy(self.strategy, self.plan, num_heads, num_kv_heads, elem_bytes, device,
                                           self.ring.group if self.ring else None, cache_dir=self.calibration_dir)
        return strategy_name(self.choice)

    def agree(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None, backend: str | None,
              training: bool, local_error: str | None = None) -> None:
        """Check once per step (at the first layer's call) that every CP rank runs this step with the
        same plan, options, head shapes and dtypes (:func:`step_fields`, one small all-gather), and
        raise ``local_error`` (this rank's verdict on its inputs) on every rank: ``ValueError``."""
        if self.agreed:
            if local_error is not None:
                raise ValueError(local_error)
            return
        agree(self.ring, step_fields(self, q, k, v, scale=scale, backend=backend, training=training),
              device=q.device, what="CP attention step", local_error=local_error)
        self.agreed = True

    def commit(self) -> None:
        """Advance the KV cache bookkeeping once every layer has run."""
        if self.cache is not None:
            self.cache.commit(self.slots, self.plan)


def step_fields(step: CPStep | None, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None, backend: str | None,
                training: bool) -> list[tuple[str, object]]:
    """What every CP rank of a step must agree on (``step=None``: this rank could not build its step;
    the step's fields are then ``None``). Local token counts are not among them: they differ by rank."""
    plan = step.plan if step is not None else None
    return [
        ("CP size", plan.cp_size if plan else None),
        ("new tokens per request", plan.new if plan else None),
        ("cached tokens per request", plan.cached if plan else None),
        ("cached tokens held by each rank", plan.prefix_counts if plan else None),
        ("load_balance", plan.load_balance if plan else None),
        ("KV cache", step.cache is not None if step else None),
        ("prefill strategy", step.strategy if step else None),
        ("decode strategy", step.decode if step else None),
        ("attention backend", backend),
        ("softmax_scale", scale),
        ("autograd (training)", training),
        ("q heads and head dim", tuple(q.shape[1:])),
        ("k heads and head dim", tuple(k.shape[1:])),
        ("v heads and head dim", tuple(v.shape[1:])),
        ("dtypes of q, k, v", (str(q.dtype), str(k.dtype), str(v.dtype))),
    ]


@dataclass
class StaticDecodeStep:
    """A decode step whose per-request state lives in device tensors (the ``inference_params`` of
    a step a CUDA graph replays): every request adds one token, every rank computes all of them.

    Attributes:
        cache: the KV cache; ring: the CP ring (``None`` for CP = 1).
        rows: ``[B]`` int64, row of :meth:`ShardedKVCache.flat_kv` each request's new key and value
            go to: the row after this rank's tokens of the request (a rank that does not own the
            token under round-robin placement writes there too; no read covers that row, and the
            next owned token overwrites it).
        starts: ``[B]`` int64, row of each request's first token.
        used: ``[B]`` int32, rows each request attends over on this rank (its tokens including
            the new one when this rank owns it).
    """

    cache: ShardedKVCache
    ring: Ring | None
    rows: Tensor
    starts: Tensor
    used: Tensor
    agreed: bool = field(default=False, init=False)

    def agree(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None, local_error: str | None) -> None:
        """At the first layer's first call (eager, before any capture): every CP rank runs the same
        batch, cache capacity, head shapes and dtypes (one small all-gather); afterwards only
        ``local_error`` is raised, on this rank."""
        if self.agreed:
            if local_error is not None:
                raise ValueError(local_error)
            return
        fields = [("static decode batch", int(self.rows.shape[0])), ("KV cache capacity", self.cache.capacity),
                  ("softmax_scale", scale), ("q heads and head dim", tuple(q.shape[1:])),
                  ("k heads and head dim", tuple(k.shape[1:])), ("dtypes of q, k, v", (str(q.dtype), str(k.dtype), str(v.dtype)))]
        agree(self.ring, fields, device=q.device, what="CP static decode step", local_error=local_error)
        self.agreed = True
