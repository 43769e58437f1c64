"""Sequence-tiled MLP: a dense layer's RMSNorm + SwiGLU run over tiles of the sequence, so that its
working set is O(tile) instead of O(T).

Untiled, the MLP of a layer keeps ``gate``/``up`` ``[T, 2F]``, ``silu(gate)`` and their product
``[T, F]`` for its backward: with Llama-3.1-8B's shape (H 4096, F 14336, bf16) that is ~140 KiB per
token, 17× the layer's input. :func:`tiled_norm_swiglu` keeps only the input ``x [T, H]``:

* forward: each tile of ``tile`` tokens is normed and run through the MLP without autograd, its
  output written into ``y [T, H]``;
* backward: each tile is recomputed under autograd against detached copies of the weights, its
  input and weight gradients taken with :func:`torch.autograd.grad` and summed (weight gradients in
  at least fp32 across tiles), and the weights' gradients are returned once (so a training engine's gradient
  hooks — DeepSpeed's ZeRO buckets — fire once per weight, as for the untiled MLP).

The MLP's forward therefore runs once more than without tiling (twice per step, three times under
activation checkpointing, as in DeepSpeed's ``TiledMLP``). The weights are read from the module in
backward rather than saved, so an engine that partitions parameters (ZeRO 3) may release them
between the forward and the backward and gather them again before the module's backward.

Tensor parallelism: the weights are this rank's shards (``fc1`` column-, ``fc2`` row-parallel); the
caller sums the output over the TP group (:func:`~megacp.models.ops.reduce_from_tp`) and the
backward sums each tile's gradient of the normed input over the group before the norm's backward
(what :func:`~megacp.models.ops.copy_to_tp` does untiled), so every TP rank gets the full gradient of
``x`` and of the replicated norm weight.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.models.ops import group_size, rms_norm, swiglu

INFERENCE_TILE_TOKENS = 8192
"""Tokens per MLP tile of a longer input without autograd (generation; no backward: tiling costs
no compute there, and a 64K-token prefill chunk of Llama-3.1-8B's shape would otherwise hold ~5 GiB
of gate/up/activation for each layer's MLP)."""


class NormedMLP(Protocol):
    """What :func:`tiled_norm_swiglu` reads from its module (:class:`~megacp.models.llama.LayerNormMLP`)."""

    @property
    def layer_norm_weight(self) -> Tensor: ...
    @property
    def fc1_weight(self) -> Tensor: ...
    @property
    def fc2_weight(self) -> Tensor: ...
    @property
    def eps(self) -> float: ...
    @property
    def tp_group(self) -> dist.ProcessGroup | None: ...


@torch.no_grad()
def _forward_tiles(x: Tensor, norm_weight: Tensor, fc1: Tensor, fc2: Tensor, eps: float, tile: int) -> Tensor:
    """``swiglu(rms_norm(x))`` of ``x [T, H]``, ``tile`` tokens at a time, without autograd -> ``[T, H]``."""
    y = torch.empty_like(x)
    for a in range(0, x.shape[0], tile):
        y[a:a + tile] = swiglu(rms_norm(x[a:a + tile], norm_weight, eps), fc1, fc2)
    return y


class _TiledNormSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, norm_weight: Tensor, fc1: Tensor, fc2: Tensor, module: NormedMLP,
                tile: int) -> Tensor:
        y = _forward_tiles(x, norm_weight, fc1, fc2, module.eps, tile)
        ctx.save_for_backward(x)
        ctx.module, ctx.tile = module, tile
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        module: NormedMLP = ctx.module
        tile: int = ctx.tile
        weights = (module.layer_norm_weight, module.fc1_weight, module.fc2_weight)
        wants = ctx.needs_input_grad[1:4]
        leaves = [w.detach().requires_grad_(want) for w, want in zip(weights, wants)]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        sums: list[Tensor | None] = [None, None, None]
        tp = module.tp_group if group_size(module.tp_group) > 1 else None
        dy = dy.contiguous()
        for a in range(0, x.shape[0], tile):
            with torch.enable_grad():
                xt = x[a:a + tile].detach().requires_grad_(dx is not None)
                normed = rms_norm(xt, leaves[0], module.eps)
                h = normed.detach().requires_grad_(True)  # the TP reduction sits between norm and matmul
                out = swiglu(h, leaves[1], leaves[2])
            mlp_in = [h] + [leaf for leaf in leaves[1:] if leaf.requires_grad]
            grads = list(torch.autograd.grad(out, mlp_in, dy[a:a + tile]))
            dh = grads.pop(0)
            if tp is not None:
                dist.all_reduce(dh, group=tp)
            norm_in = [t for t in (xt, leaves[0]) if t.requires_grad]
            norm_grads = list(torch.autograd.grad(normed, norm_in, dh)) if norm_in else []
            if dx is not None:
                dx[a:a + tile] = norm_grads.pop(0)
            tile_grads = [norm_grads.pop(0) if wants[0] else None] + [grads.pop(0) if w else None for w in wants[1:]]
            for i, g in enumerate(tile_grads):
                if g is not None:
                    s = sums[i]
                    sums[i] = g.to(torch.promote_types(g.dtype, torch.float32)) if s is None else s.add_(g)
        return (dx, *(s.to(w.dtype) if s is not None else None for s, w in zip(sums, weights)), None, None)


def tiled_norm_swiglu(module: NormedMLP, x: Tensor, tile: int) -> Tensor:
    """``swiglu(rms_norm(x))`` of ``x [T, H]`` over sequence tiles of ``tile`` tokens -> ``[T, H]``
    (this rank's partial sum under TP: the caller reduces it), keeping only ``x`` for the backward.

    Without autograd the tiles simply run one after another. Equal to the untiled computation
    (fp32: to rounding; the weight gradients are summed over tiles in fp32).
    """
    if tile < 1:
        raise ValueError(f"tile must be at least 1 token; got {tile}")
    weights = (module.layer_norm_weight, module.fc1_weight, module.fc2_weight)
    if not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))):
        return _forward_tiles(x, *weights, module.eps, tile)
    return _TiledNormSwiGLU.apply(x, *weights, module, tile)
