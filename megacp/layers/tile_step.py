"""The training step as a decoder layer sees it while its attention sublayer runs over query tiles.

A layer whose attention runs over tiles of its queries (:mod:`megacp.models.tiled_layer`) calls its
attention sublayer — the family's own module code: norm, q/k/v projections, RoPE, q/k norms — once
per tile of local rows and phase, with a :class:`TileStep` in place of the :class:`~megacp.layers.step.TrainStep`.
The step's ``attend`` then does what the phase asks of the tile's q, k, v:

* ``"kv"``: keep k and v in the layer's KV block (rows ``[a, b)``), return zeros — the block is
  complete once every tile has run, before any query tile attends;
* ``"forward"``: the tile's queries over every rank's block (pass-KV ring, no autograd);
* ``"grad"``: the same, differentiable in the queries; its backward adds the block's K/V
  gradients to the layer's fp32 accumulators (:class:`~megacp.attention.training.KVGradients`);
* ``"kv_grad"``: hand the tile's k and v (under autograd) to the layer, which back-propagates the
  accumulated K/V gradients of rows ``[a, b)`` through them; return zeros.

So K and V are projected from the whole input once per pass and kept ``[M, Hkv, D]``, and no
``[T, Hq, D]`` query, output or score tensor of the whole sequence exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from megacp.attention.preconditions import check_inputs
from megacp.attention.training import KVGradients, ring_attention_rows
from megacp.layers.step import AttentionLayer, TrainStep

Phase = Literal["kv", "forward", "grad", "kv_grad"]


@dataclass
class LayerTiles:
    """One decoder layer's tile loop: the phase and rows its attention calls run for, its KV block
    and the K/V gradient accumulators.

    Attributes:
        phase: what :meth:`TileStep.attend` does (module docstring).
        rows: the local rows ``[a, b)`` of the current tile.
        k, v: the layer's KV block ``[M, Hkv, D]`` (``M = plan.max_kv_block``; rows past the local
            tokens zero), filled by the ``"kv"`` phase.
        grads: the block's fp32 K/V gradient accumulators (``"grad"`` phase; ``None`` before).
        pending: the tile's ``(k, v)`` under autograd (``"kv_grad"`` phase), ``[b - a, Hkv, D]``.
        kv_inputs: the tensors the tile's k and v were computed from under autograd (first ``"grad"``
            tile), for :func:`autograd_leaves`.
    """

    phase: Phase = "kv"
    rows: tuple[int, int] = (0, 0)
    k: Tensor | None = None
    v: Tensor | None = None
    grads: KVGradients | None = None
    pending: tuple[Tensor, Tensor] | None = None
    kv_inputs: tuple[Tensor, Tensor] | None = None

    def block(self) -> tuple[Tensor, Tensor]:
        """The layer's KV block (after the ``"kv"`` phase)."""
        if self.k is None or self.v is None:
            raise RuntimeError("a query tile attended before the layer's KV block was built")
        return self.k, self.v


@dataclass
class TileStep(TrainStep):
    """A :class:`~megacp.layers.step.TrainStep` (``base``) for the attention calls of one tiled layer
    (:class:`LayerTiles` says the phase and rows). The checks of the base step run on the first call
    (rank agreement included); each call takes the local rows ``tiles.rows`` only."""

    base: TrainStep | None = None
    tiles: LayerTiles = field(default_factory=LayerTiles)

    @classmethod
    def of(cls, base: TrainStep) -> "TileStep":
        """A tile step over ``base``'s plan and settings."""
        return cls(base.settings, base.plan, base=base)

    def attend(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
               window: int | None = None) -> Tensor:
        """The phase's work for the tile's ``q [b - a, Hq, D]``, ``k``/``v [b - a, Hkv, D]``
        (module docstring); returns ``[b - a, Hq, D]`` in ``q.dtype``."""
        assert self.base is not None
        a, b = self.tiles.rows
        local_error = check_inputs(q, k, v, "CP attention") or self.window_error(window)
        if local_error is None and q.shape[0] != b - a:
            local_error = f"a query tile of rows [{a}, {b}) got {q.shape[0]} tokens"
        self.base.agree(q, k, v, scale=scale, local_error=local_error)
        work, plan = self.tiles, self.plan.with_window(window)
        if work.phase == "kv":
            if work.k is None:
                shape = (plan.max_kv_block, *k.shape[1:])
                work.k, work.v = k.new_zeros(shape), v.new_zeros(shape)
            assert work.v is not None
            work.k[a:b], work.v[a:b] = k, v
            return q.new_zeros(q.shape)
        if work.phase == "kv_grad":
            work.pending = (k, v)
            return q.new_zeros(q.shape)
        if work.phase == "grad" and work.kv_inputs is None:
            work.kv_inputs = (k, v)
        grads = work.grads if work.phase == "grad" else None
        return ring_attention_rows(q, work.block(), plan, self.settings.ring, rows=(a, b), grads=grads, scale=scale,
                                   backend=self.settings.backend)


def autograd_leaves(*tensors: Tensor) -> list[Tensor]:
    """The leaf tensors (parameters) whose gradients ``tensors``' autograd graphs accumulate."""
    seen: set[Any] = set()
    leaves: list[Tensor] = []
    todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        todo.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return leaves
