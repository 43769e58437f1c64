"""The step kinds a model's CP attention layers run, and the one planner that picks them.

A step is the ``inference_params`` handed down a model for one forward pass: it says which tokens
of the batch this rank computes, at which global positions, and each kind runs its own attention
(:meth:`CPStep.attend`), owning its KV cache reads and writes:

==================  ==========================================================================
:class:`PrefillStep`  cacheless inference prefill: pass-KV or pass-Q ring over the new tokens
:class:`TrainStep`    the differentiable pass-KV ring (:mod:`megacp.attention.training`)
:class:`CachedStep`   a prefill chunk over a CP-sharded cache: writes the chunk, rings over
                      cached prefix + chunk
:class:`DecodeStep`   every request adds one token, replicated on every CP rank: all-gather decode
:class:`StaticDecodeStep`  a decode step whose lengths and cache rows live in device tensors
                      (replayed from a CUDA graph)
==================  ==========================================================================

:func:`plan_step` (and :func:`begin_step`, :func:`cacheless_step`, :func:`static_decode_step`) is
the only place that picks a kind and resolves the ``"auto"`` prefill strategy. Before any other
collective, the CP ranks agree on a step (plan, kind, options, head shapes, dtypes, a digest of the
new token ids and the sampling settings the caller set, and each rank's verdict on its inputs): once
per step, at its first layer; a mismatch is one ``ValueError`` on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Sequence

import torch
from torch import Tensor

from megacp.attention.blocks import FP8KVBlock, KVBlock, block_owners, build_kv_block
from megacp.attention.decode import allgather_decode, static_decode
from megacp.attention.kernels import fp8_decode_kernel
from megacp.attention.preconditions import agree, check_inputs
from megacp.attention.prefill import cp_prefill, resolve_strategy, strategy_name
from megacp.attention.strategy import Choice
from megacp.attention.training import ring_attention
from megacp.kv_cache import AmaxReduce, ShardedKVCache
from megacp.layers.settings import CPSettings
from megacp.placement import ShardPlan


class AttentionLayer(Protocol):
    """What a step needs of the layer it attends for: the 0-based index of its KV cache rows
    (:class:`~megacp.layers.cp_attention.CPDotProductAttention`, or any adapter)."""

    @property
    def layer_index(self) -> int: ...


@dataclass(frozen=True)
class HeadShape:
    """What the ``auto`` prefill rule needs of a model's attention on this rank: query heads, KV
    heads and bytes per K/V element."""

    num_heads: int
    num_kv_heads: int
    elem_bytes: int


def step_fields(step: "CPStep | None", q: Tensor, k: Tensor, v: Tensor, *, scale: float | None) -> list[tuple[str, object]]:
    """What every CP rank of a step must agree on (``step=None``: this rank could not build its step;
    the step's fields are then ``None``). Local token counts are not among them: they differ by rank."""
    plan = step.plan if step is not None else None
    return [
        ("CP size", plan.cp_size if plan else None),
        ("new tokens per request", plan.new if plan else None),
        ("cached tokens per request", plan.cached if plan else None),
        ("cached tokens held by each rank", plan.prefix_counts if plan else None),
        ("load_balance", plan.load_balance if plan else None),
        ("KV cache", step.cached if step else None),
        ("KV cache dtype", step.cache_format if step else None),
        ("prefill strategy", step.settings.prefill if step else None),
        ("decode strategy", step.settings.decode if step else None),
        ("attention backend", step.settings.backend if step else None),
        ("softmax_scale", scale),
        ("autograd (training)", step.training if step else None),
        ("q heads and head dim", tuple(q.shape[1:])),
        ("k heads and head dim", tuple(k.shape[1:])),
        ("v heads and head dim", tuple(v.shape[1:])),
        ("dtypes of q, k, v", (str(q.dtype), str(k.dtype), str(v.dtype))),
        ("new token ids (digest)", step.token_digest if step else None),
        ("sampling seeds and parameters", step.sampling if step else None),
    ]


@dataclass
class CPStep(ABC):
    """One forward step of a batch under CP (the common part of every kind).

    Attributes:
        settings: the ring and options (:class:`~megacp.layers.settings.CPSettings`).
        plan: the step's sharding plan (the same on every CP rank).
        token_digest, sampling: what the caller's ranks must also agree on (see each).
    """

    settings: CPSettings
    plan: ShardPlan
    agreed: bool = field(default=False, init=False)
    token_digest: Tensor | None = field(default=None, init=False)
    """:func:`~megacp.attention.preconditions.content_digest` of the step's packed new token ids (the
    same on every CP rank), set by the caller before the forward; compared in :meth:`agree`."""
    sampling: object = field(default=None, init=False)
    """The requests' sampling settings, seeds included (set by the generation loop for its prefill
    steps; ``None`` otherwise), which every CP rank must share; compared in :meth:`agree`."""

    cached: ClassVar[bool] = False
    """Whether the step reads and writes a KV cache."""
    training: ClassVar[bool] = False
    """Whether the step's attention is differentiable."""
    replicated: ClassVar[bool] = False
    """Whether every rank computes every request's (one) new token (decode)."""

    @property
    def strategy(self) -> str:
        """The prefill algorithm this step runs (``"pass_kv"``, ``"pass_q"``) or, for a decode step,
        ``"allgather_decode"``."""
        return "pass_kv"

    # ------------------------------------------------------------------ the model's bookkeeping
    def token_index(self) -> Tensor:
        """Indices into the packed new tokens of the tokens this rank computes."""
        return self.plan.local_index()

    def positions(self) -> Tensor:
        """Global positions of the tokens this rank computes (for RoPE)."""
        return self.plan.local_positions()

    def cu_seqlens(self) -> Tensor:
        """int32 ``[B+1]`` boundaries of the requests among this rank's tokens."""
        return self.plan.local_cu_seqlens()

    def last_token_rows(self) -> list[int | None]:
        """For each request, the row of its last new token among this rank's tokens, or ``None``
        when another rank holds it."""
        rows: list[int | None] = []
        lay = self.plan.q_layout(self.plan.rank)
        for i, (p, t) in enumerate(zip(self.plan.cached, self.plan.new)):
            last, row, off = p + t - 1, None, lay[i].offset
            for a, b in lay[i].ranges:
                if a <= last < b:
                    row = off + last - a
                off += b - a
            rows.append(row)
        return rows

    def commit(self) -> None:
        """Advance the KV cache bookkeeping once every layer has run (nothing without a cache)."""
        return None

    @property
    def cache_format(self) -> str | None:
        """The storage of the step's KV cache (``"auto"`` or ``"fp8_e4m3"``), ``None`` without one."""
        cache: ShardedKVCache | None = getattr(self, "cache", None)  # the cached kinds' field
        return cache.kv_cache_dtype if cache is not None else None

    def amax_over_ranks(self) -> AmaxReduce | None:
        """The elementwise max over the CP ranks an FP8 cache's first write takes (one all-gather),
        ``None`` at CP = 1."""
        ring = self.settings.ring
        if ring is None or ring.size == 1:
            return None
        return lambda t: ring.all_gather(t).amax(0)

    # ------------------------------------------------------------------ attention
    def attend(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
               window: int | None = None) -> Tensor:
        """Causal attention of this rank's queries for ``layer``.

        Args:
            layer: the calling CP layer (its ``layer_index`` addresses the cache).
            q: ``[n, Hq, D]``; k, v: ``[n, Hkv, D]`` (this rank's new tokens, thd).
            scale: softmax scale (``None``: ``D ** -0.5``).
            window: the layer's sliding window (a query at position ``x`` sees keys at
                ``x - window + 1 .. x``; ``None``: full causal).

        Returns:
            ``[n, Hq, D]`` in ``q.dtype``.
        """
        local_error = check_inputs(q, k, v, "CP attention") or self.input_error(q, k, v) or self.window_error(window)
        self.agree(q, k, v, scale=scale, local_error=local_error)
        return self._attention(layer, q, k, v, scale, window)

    def window_error(self, window: int | None) -> str | None:
        """Why this step cannot run a sliding ``window``, or ``None`` (the same verdict on every rank:
        it reads the plan only)."""
        if window is not None and window < 1:
            return f"a sliding window must hold at least 1 key, got {window}"
        return None

    def input_error(self, q: Tensor, k: Tensor, v: Tensor) -> str | None:
        """What this rank's inputs lack for the step (found before any collective), or ``None``."""
        if torch.is_grad_enabled() and not self.training and any(x.requires_grad for x in (q, k, v)):
            if self.cached:
                return ("the CP layer computes gradients only without a KV cache (training); run cached prefill and "
                        "decode under torch.no_grad() or torch.inference_mode()")
            return (f"a {type(self).__name__} runs without autograd; train through a TrainStep "
                    "(megacp.models.loss.lm_loss), or run inference under torch.no_grad() / torch.inference_mode()")
        if self.replicated and q.shape[0] != self.plan.num_requests:
            return (f"a decode step of {self.plan.num_requests} requests needs one query token each on every CP rank; "
                    f"got {q.shape[0]}")
        if not self.replicated and q.shape[0] != self.plan.num_local():
            return f"CP rank {self.plan.rank} got {q.shape[0]} tokens but the step's plan gives it {self.plan.num_local()}"
        return None

    @abstractmethod
    def _attention(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
                   window: int | None) -> Tensor:
        """The kind's attention over inputs every rank agreed on (:meth:`attend` checks first)."""

    def agree(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None, local_error: str | None = None) -> None:
        """Check once per step (at the first layer's call) that every CP rank runs this step with the
        same plan, kind, options, head shapes, dtypes, new token ids and sampling settings
        (:func:`step_fields`, one small all-gather of a few int64), and raise ``local_error`` (this
        rank's verdict on its inputs) on every rank: ``ValueError``."""
        if self.agreed:
            if local_error is not None:
                raise ValueError(local_error)
            return
        agree(self.settings.ring, step_fields(self, q, k, v, scale=scale), device=q.device, what="CP attention step",
              local_error=local_error)
        self.agreed = True


@dataclass
class PrefillStep(CPStep):
    """Cacheless inference prefill: the ring (pass-KV or pass-Q, resolved by the planner) over the
    new tokens of every request."""

    choice: Choice | str = "pass_kv"

    @property
    def strategy(self) -> str:
        return strategy_name(self.choice)

    def _attention(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
                   window: int | None) -> Tensor:
        block = build_kv_block(self.plan, k, v)
        return cp_prefill(q, block, self.plan.with_window(window), self.settings.ring, strategy=self.strategy, scale=scale,
                          backend=self.settings.backend)


@dataclass
class TrainStep(CPStep):
    """Training: the differentiable pass-KV ring (K/V gradients travel back around the ring)."""

    training: ClassVar[bool] = True

    def _attention(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
                   window: int | None) -> Tensor:
        return ring_attention(q, k, v, self.plan.with_window(window), self.settings.ring, scale=scale, backend=self.settings.backend)


@dataclass
class CachedStep(PrefillStep):
    """A prefill chunk on top of a CP-sharded KV cache: each layer writes this rank's new keys and
    values into ``cache`` at ``slots``, then rings over each request's cached prefix and the chunk.

    With one request the KV block is a view of the request's cache rows (they hold the cached
    tokens, then the chunk just written: the block's layout), so a chunk late in a long prompt
    copies nothing of the prefix; a batch of requests copies each one's rows into one block."""

    cache: ShardedKVCache = field(kw_only=True)
    slots: list[int] = field(kw_only=True)
    cached: ClassVar[bool] = True
    owners: Tensor | None = field(default=None, init=False, repr=False)
    """An FP8 cache's :func:`~megacp.attention.blocks.block_owners` of the plan, on the device
    (made at the first layer)."""

    def _attention(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
                   window: int | None) -> Tensor:
        cache, slots, index, plan = self.cache, self.slots, layer.layer_index, self.plan
        k_stored, v_stored = cache.write(index, slots, plan, k, v, amax_reduce=self.amax_over_ranks())
        prefix = plan.prefix_counts[plan.rank]
        if cache.quantized:  # the FP8 rows travel; each rank dequantises the block in hand a key tile at a time
            stored: KVBlock = (cache.stored_kv(index, slots[0], plan.max_kv_block) if len(slots) == 1 else
                               build_kv_block(plan, k_stored, v_stored, lambda i: cache.stored_kv(index, slots[i], prefix[i])))
            if self.owners is None:
                self.owners = block_owners(plan).to(k.device)
            block: KVBlock | FP8KVBlock = FP8KVBlock(stored, cache.step_scales(index, slots), self.owners, k.dtype,
                                                     cache.fp8_tile_rows)
        elif len(slots) == 1:  # rows past this rank's tokens (the block's padding) are never read
            block = cache.kv(index, slots[0], plan.max_kv_block)
        else:
            block = build_kv_block(plan, k_stored, v_stored, lambda i: cache.kv(index, slots[i], prefix[i]))
        return cp_prefill(q, block, plan.with_window(window), self.settings.ring, strategy=self.strategy, scale=scale,
                          backend=self.settings.backend)

    def commit(self) -> None:
        self.cache.commit(self.slots, self.plan)


@dataclass
class DecodeStep(CPStep):
    """Every request adds one token, computed on every CP rank: the token's owner (round-robin
    placement) writes it into the cache, each rank attends over its shard, (out, LSE) are
    all-gathered and merged."""

    cache: ShardedKVCache = field(kw_only=True)
    slots: list[int] = field(kw_only=True)
    cached: ClassVar[bool] = True
    replicated: ClassVar[bool] = True
    rows: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False)
    """Over an FP8 cache read as stored: each request's first row ``[B]`` int64 and rows it
    attends over ``[B]`` int32 on this rank, on the device (made at the first layer)."""

    @property
    def strategy(self) -> str:
        return "allgather_decode"

    def token_index(self) -> Tensor:
        return torch.arange(self.plan.num_requests)

    def positions(self) -> Tensor:
        return torch.tensor(self.plan.cached, dtype=torch.long)

    def cu_seqlens(self) -> Tensor:
        return torch.arange(self.plan.num_requests + 1, dtype=torch.int32)

    def last_token_rows(self) -> list[int | None]:
        return list(range(self.plan.num_requests))

    def _attention(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
                   window: int | None) -> Tensor:
        plan, index = self.plan, layer.layer_index
        owned = plan.local_index().to(k.device)
        self.cache.write(index, self.slots, plan, k[owned], v[owned], amax_reduce=self.amax_over_ranks())
        lens = [plan.prefix_counts[plan.rank][i] + lay.num_new for i, lay in enumerate(plan.q_layout(plan.rank))]
        windowed = plan.with_window(window).window is not None
        if self.cache.quantized and not windowed and fp8_decode_kernel.available(q, self.cache.k):  # read as stored
            if self.rows is None:
                c = self.cache.capacity
                self.rows = (torch.tensor([s * c for s in self.slots], dtype=torch.long).to(q.device),
                             torch.tensor(lens, dtype=torch.int32).to(q.device))
            starts, used = self.rows
            kf, vf, scales = self.cache.stored_rows(index, starts)
            return static_decode(q, kf, vf, starts, used, self.cache.capacity, self.settings.ring, scale=scale,
                                 fp8_scales=scales)
        kv = self.cache.decode_kv(index, self.slots, lens)
        if windowed:
            assert window is not None
            kv = self._in_window(kv, lens, window)
        return allgather_decode(q, kv, self.settings.ring, scale=scale, backend=self.settings.backend)

    def _in_window(self, kv: tuple[Tensor, Tensor] | list[tuple[Tensor, Tensor]], lens: Sequence[int],
                   window: int) -> list[tuple[Tensor, Tensor]]:
        """Each request's keys and values on this rank, less those before the new token's window
        (positions ``<= p - window`` for the token at position ``p``): this rank's positions of a
        request rise, so the visible keys are the last ones (views, no copy)."""
        plan, pairs = self.plan, list(zip(kv[0], kv[1])) if isinstance(kv, tuple) else kv
        runs = plan.prefix_runs(plan.rank)
        assert runs is not None  # the cache's plans carry the histories
        out = []
        for i, n in enumerate(lens):
            edge = plan.cached[i] - window  # keys at positions <= edge are outside the window
            first = sum(min(b, edge + 1) - a for a, b in runs[i] if a <= edge)
            k_i, v_i = pairs[i]
            out.append((k_i[first:n], v_i[first:n]))
        return out

    def commit(self) -> None:
        self.cache.commit(self.slots, self.plan)


@dataclass
class StaticDecodeStep(CPStep):
    """A decode step whose per-request state lives in device tensors (the ``inference_params`` of a
    step a CUDA graph replays): every request adds one token, every rank computes all of them.

    Attributes:
        cache: the KV cache.
        rows: ``[B]`` int64, row of :meth:`ShardedKVCache.flat_kv` each request's new key and value
            go to: the row after this rank's tokens of the request (a rank that does not own the
            token under round-robin placement writes there too; no read covers that row, and the
            next owned token overwrites it).
        starts: ``[B]`` int64, row of each request's first token.
        used: ``[B]`` int32, rows each request attends over on this rank (its tokens including
            the new one when this rank owns it).

    ``plan`` is a placeholder (the host does not plan the replayed steps); the model's bookkeeping
    (positions, rows) is the graph's own.
    """

    cache: ShardedKVCache = field(kw_only=True)
    rows: Tensor = field(kw_only=True)
    starts: Tensor = field(kw_only=True)
    used: Tensor = field(kw_only=True)
    cached: ClassVar[bool] = True
    replicated: ClassVar[bool] = True

    @property
    def strategy(self) -> str:
        return "allgather_decode"

    def input_error(self, q: Tensor, k: Tensor, v: Tensor) -> str | None:
        b, shape = self.rows.shape[0], tuple(self.cache.k.shape[3:])
        if q.shape[0] != b or k.dtype != self.cache.dtype or tuple(k.shape[1:]) != shape:
            return (f"a static decode step of {b} requests needs q [{b}, Hq, D] and k/v [{b}, "
                    f"{', '.join(map(str, shape))}] {self.cache.dtype}; got q {tuple(q.shape)}, "
                    f"k {tuple(k.shape)} {k.dtype}")
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            return "a static decode step runs without autograd (torch.inference_mode())"
        return None

    def agree(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None, local_error: str | None = None) -> None:
        """At the first layer's first call (eager, before any capture): every CP rank runs the same
        batch, cache capacity, head shapes and dtypes (one small all-gather); afterwards only
        ``local_error`` is raised, on this rank."""
        if self.agreed:
            if local_error is not None:
                raise ValueError(local_error)
            return
        fields = [("static decode batch", int(self.rows.shape[0])), ("KV cache capacity", self.cache.capacity),
                  ("KV cache dtype", self.cache.kv_cache_dtype),
                  ("softmax_scale", scale), ("q heads and head dim", tuple(q.shape[1:])),
                  ("k heads and head dim", tuple(k.shape[1:])), ("dtypes of q, k, v", (str(q.dtype), str(k.dtype), str(v.dtype)))]
        agree(self.settings.ring, fields, device=q.device, what="CP static decode step", local_error=local_error)
        self.agreed = True

    def window_error(self, window: int | None) -> str | None:
        if window is not None:
            return (f"a static (CUDA-graph) decode step has no sliding window (got {window}); decode windowed models "
                    "with eager steps")
        return None

    def _attention(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
                   window: int | None) -> Tensor:
        self.cache.write_rows(layer.layer_index, self.rows, k, v)
        if self.cache.quantized and fp8_decode_kernel.available(q, self.cache.k):  # the FP8 rows are read as stored
            kf, vf, scales = self.cache.stored_rows(layer.layer_index, self.starts)
            return static_decode(q, kf, vf, self.starts, self.used, self.cache.capacity, self.settings.ring,
                                 scale=scale, fp8_scales=scales)
        kf, vf, starts = self.cache.static_rows(layer.layer_index, self.starts)
        return static_decode(q, kf, vf, starts, self.used, self.cache.capacity, self.settings.ring, scale=scale)


# ---------------------------------------------------------------------- the planner
def plan_step(settings: CPSettings, plan: ShardPlan, *, heads: HeadShape | None = None, device: torch.device | None = None,
              cache: ShardedKVCache | None = None, slots: Sequence[int] | None = None, training: bool = False) -> CPStep:
    """The step that runs ``plan``: the one place that picks a step kind and resolves ``"auto"``.

    Args:
        settings: the CP settings (their ring must be the plan's CP group).
        plan: the step's sharding plan (the same on every CP rank).
        heads, device: the model's attention on this rank (needed when ``settings.prefill`` is
            ``"auto"`` and the step prefills: the paper's rule weighs KV against Q bytes).
        cache, slots: the KV cache and each request's slot (a cached step), or neither.
        training: the differentiable ring (no cache).

    Returns:
        a :class:`TrainStep`, :class:`DecodeStep` (cached, every request one new token),
        :class:`CachedStep` or :class:`PrefillStep`. Resolving ``"auto"`` is collective over the
        CP group (its ranks agree on the calibration): every rank plans every step.
    """
    if (cache is None) != (slots is None):
        raise ValueError("a step needs both a KV cache and its slots, or neither")
    if training:
        if cache is not None:
            raise ValueError("a training step runs without a KV cache")
        return TrainStep(settings, plan)
    if cache is not None and slots is not None and plan.is_decode:
        return DecodeStep(settings, plan, cache=cache, slots=list(slots))
    choice: Choice | str = settings.prefill
    if choice == "auto":
        if heads is None or device is None:
            raise ValueError("the auto prefill strategy needs the attention's head shape and device to plan a step")
        group = settings.ring.group if settings.ring is not None else None
        choice = resolve_strategy("auto", plan, heads.num_heads, heads.num_kv_heads, heads.elem_bytes, device, group,
                                  cache_dir=settings.calibration_dir)
    if cache is not None and slots is not None:
        return CachedStep(settings, plan, choice, cache=cache, slots=list(slots))
    return PrefillStep(settings, plan, choice)


def begin_step(settings: CPSettings, cache: ShardedKVCache, slots: Sequence[int], new_tokens: Sequence[int], *,
               heads: HeadShape | None = None, device: torch.device | None = None) -> CPStep:
    """Plan a cached step adding ``new_tokens[i]`` tokens to the request in ``slots[i]`` (checks the
    cache's room first: nothing is written on error)."""
    return plan_step(settings, cache.plan(slots, new_tokens), heads=heads, device=device, cache=cache, slots=slots)


def cacheless_step(settings: CPSettings, q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int]) -> CPStep:
    """The step of a CP layer called without ``inference_params`` (Transformer Engine's convention:
    the inputs are this rank's load-balanced shard of whole sequences of ``lengths`` tokens).

    Inputs that need gradients under autograd (a user's own training loop over swapped layers) make
    a :class:`TrainStep`, others a :class:`PrefillStep`. A shard that does not match the plan is
    one ``ValueError`` on every rank (the agreement runs with this rank's error)."""
    n, r = settings.cp_size, settings.cp_rank
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    plan = ShardPlan([0] * len(lengths), lengths, n, r, load_balance=settings.load_balance)
    if plan.num_local() != q.shape[0]:
        error = f"CP rank {r} got {q.shape[0]} tokens but the load-balanced shard of sequences {list(lengths)} has {plan.num_local()}"
        agree(settings.ring, step_fields(None, q, k, v, scale=None), device=q.device, what="CP attention step",
              local_error=check_inputs(q, k, v, "CP attention") or error)
    return plan_step(settings, plan, heads=HeadShape(q.shape[1], k.shape[1], k.element_size()), device=q.device,
                     training=training)


def static_decode_step(settings: CPSettings, cache: ShardedKVCache, starts: Tensor) -> StaticDecodeStep:
    """The device-resident decode step of the requests whose first cache rows are ``starts [B]``
    (int64, :meth:`ShardedKVCache.decode_state`); the caller fills ``rows`` and ``used`` before each
    replay."""
    b = starts.shape[0]
    plan = ShardPlan([0] * b, [1] * b, settings.cp_size, settings.cp_rank)
    return StaticDecodeStep(settings, plan, cache=cache, rows=torch.empty(b, dtype=torch.long, device=starts.device),
                            starts=starts, used=torch.empty(b, dtype=torch.int32, device=starts.device))
