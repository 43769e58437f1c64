"""A pre-norm decoder layer trained over tiles of its queries, keeping only its input.

Untiled, one layer's recompute and backward hold its normed input, q, k, v, the attention output,
the residual and their gradients for the whole sequence (~114 KiB per token for Llama-3.1-8B's
shape, bf16, with the fp32 dQ accumulator). :func:`tiled_layer` runs ``y = rest(x + attention(x))``
over tiles of ``tile`` local rows, where ``attention`` is the family's own sublayer code (norm,
q/k/v projections, RoPE, q/k norms, the CP attention call, the output projection) and ``rest`` the
token-wise remainder (post-attention norm, MLP, residual):

* forward (no autograd): every tile's sublayer runs once to fill the layer's KV block (K and V of
  all local tokens, projected once: :class:`~megacp.layers.tile_step.TileStep`'s ``"kv"`` phase),
  then each tile's queries attend over every rank's block (the pass-KV ring per tile) and the
  tile's output is written; only ``x`` is kept (on the device, or in a host stash), so the layer is
  its own activation checkpoint;
* backward: the KV block is built again; each tile is recomputed under autograd and
  back-propagated (its dQ local; the K/V gradients of every tile added to fp32 accumulators of the
  block, travelling the CP ring with it); then each tile's K and V are recomputed under autograd
  and the accumulated K/V gradients of its rows back-propagated through them.

The layer then holds its input, its input's gradient, the KV block and its fp32 gradients whole
(8 + 8 + 4 + 8 KiB per token for Llama-3.1-8B's shape) and everything else per tile. Each phase
calls every rank's ring as often (every rank cuts as many tiles), in the same order.

Parameter gradients accumulate in ``.grad`` over the tiles (:func:`torch.autograd.backward`, so a
training engine's hooks see them); a DeepSpeed ZeRO engine is told through ``ds_grad_is_ready``
(its protocol for tiled compute) that a parameter's gradient is complete only at its last tile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megacp.attention.training import KVGradients
from megacp.layers.step import TrainStep
from megacp.layers.tile_step import LayerTiles, Phase, TileStep, autograd_leaves
from megacp.models.checkpointing import HostStash, keep_input, kept_input

Sublayer = Callable[[Tensor, TileStep, slice], Tensor]
"""``(x rows, step, rows) -> attention output rows`` (without the residual): the family's attention
sublayer of the rows ``rows`` of the layer input."""


@dataclass
class TiledLayer:
    """What :func:`tiled_layer` runs.

    Attributes:
        step: the training step of the forward (its plan and ring).
        sublayer: the attention sublayer (:data:`Sublayer`).
        rest: the token-wise rest of the layer, ``h -> y`` (residual included).
        params: the layer's parameters (their ``ds_grad_is_ready`` flags are set per tile).
        tile: local rows per tile (every rank cuts as many tiles as the rank with the most rows).
        dim: the token dimension of ``x`` (0 for ``[T, H]``, 1 for ``[B, S, H]``).
    """

    step: TrainStep
    sublayer: Sublayer
    rest: Callable[[Tensor], Tensor]
    params: Sequence[Tensor]
    tile: int
    dim: int = 0

    def row_tiles(self) -> list[tuple[int, int]]:
        """This rank's tiles ``[a, b)``: as many on every rank, near-equal, none empty."""
        plan = self.step.plan
        count = max(1, min(-(-plan.max_local // self.tile), min(plan.num_local(j) for j in range(plan.cp_size))))
        n = plan.num_local()
        bounds = [n * i // count for i in range(count + 1)]
        return list(zip(bounds, bounds[1:]))

    def _rows(self, x: Tensor, rows: tuple[int, int]) -> Tensor:
        return x.narrow(self.dim, rows[0], rows[1] - rows[0])

    def _run(self, x: Tensor, step: TileStep, phase: Phase, rows: tuple[int, int]) -> Tensor:
        step.tiles.phase, step.tiles.rows = phase, rows
        return self.sublayer(x, step, slice(*rows))

    def kv_block(self, x: Tensor, tiles: Sequence[tuple[int, int]]) -> TileStep:
        """A tile step whose KV block holds every local token's K and V (no autograd)."""
        step = TileStep.of(self.step)
        with torch.no_grad():
            for rows in tiles:
                self._run(self._rows(x, rows), step, "kv", rows)
        return step

    @torch.no_grad()
    def forward(self, x: Tensor) -> Tensor:
        """``rest(x + attention(x))`` of ``x``, tile by tile, without autograd."""
        tiles = self.row_tiles()
        step = self.kv_block(x, tiles)
        y = torch.empty_like(x)
        for rows in tiles:
            xt = self._rows(x, rows)
            self._rows(y, rows).copy_(self.rest(xt + self._run(xt, step, "forward", rows)))
        return y

    def backward(self, x: Tensor, dy: Tensor, wants_dx: bool) -> Tensor | None:
        """The gradient of ``x`` (``None`` unless ``wants_dx``); parameter gradients go to ``.grad``."""
        tiles = self.row_tiles()
        step = self.kv_block(x, tiles)
        work: LayerTiles = step.tiles
        k, v = work.block()
        work.grads = KVGradients(torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                                 torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        params = [p for p in self.params if p.requires_grad]
        dx = torch.empty_like(x) if wants_dx else None
        kv_params: set[int] = set()
        dy = dy.contiguous()
        try:
            _ready(params, False)
            for i, rows in enumerate(tiles):
                with torch.enable_grad():
                    xt = self._rows(x, rows).detach().requires_grad_(wants_dx)
                    yt = self.rest(xt + self._run(xt, step, "grad", rows))
                if work.kv_inputs is not None:  # first tile: which parameters the K/V pass reaches
                    kv_params = {id(p) for p in autograd_leaves(*work.kv_inputs)}
                    work.kv_inputs = None
                if i == len(tiles) - 1:  # the last gradients of the parameters the K/V pass does not reach
                    _ready([p for p in params if id(p) not in kv_params], True)
                torch.autograd.backward(yt, self._rows(dy, rows))
                if dx is not None:
                    assert xt.grad is not None
                    self._rows(dx, rows).copy_(xt.grad)
            grads = work.grads
            for i, rows in enumerate(tiles):
                if i == len(tiles) - 1:
                    _ready([p for p in params if id(p) in kv_params], True)
                with torch.enable_grad():
                    xt = self._rows(x, rows).detach().requires_grad_(wants_dx)
                    self._run(xt, step, "kv_grad", rows)
                assert work.pending is not None
                (kt, vt), work.pending = work.pending, None
                a, b = rows
                pairs = [(t, g[a:b].to(t.dtype)) for t, g in ((kt, grads.k), (vt, grads.v)) if t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                if dx is not None and xt.grad is not None:  # None: K and V do not depend on x
                    self._rows(dx, rows).add_(xt.grad)
        finally:
            _ready(params, True)
        return dx


def _ready(params: Sequence[Tensor], ready: bool) -> None:
    """Tell a DeepSpeed ZeRO engine whether ``params``' gradients are complete (``ds_grad_is_ready``)."""
    for p in params:
        p.ds_grad_is_ready = ready  # type: ignore[attr-defined]


class _TiledLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor | None, layer: TiledLayer, stash: HostStash | None) -> Tensor:
        y = layer.forward(x)
        ctx.layer = layer
        keep_input(ctx, x, stash)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None, None]:
        return ctx.layer.backward(kept_input(ctx), dy, ctx.needs_input_grad[0]), None, None, None


def tiled_layer(layer: TiledLayer, x: Tensor, stash: HostStash | None = None) -> Tensor:
    """``layer.rest(x + layer.sublayer(x))`` over query tiles, keeping only ``x`` (on the device, or
    in ``stash``) for the backward (module docstring); without autograd the tiles run once.

    Args:
        layer: the layer's sublayer, rest, parameters, step and tile.
        x: the layer input, ``[T, H]`` or ``[B, S, H]`` (tokens on ``layer.dim``).
        stash: host memory for ``x`` between the forward and the backward (``None``: the device).

    Returns:
        The layer output, shaped as ``x``.
    """
    if not torch.is_grad_enabled():
        return layer.forward(x)
    anchor = None if x.requires_grad else torch.empty(0, requires_grad=True)
    return _TiledLayer.apply(x, anchor, layer, stash)
