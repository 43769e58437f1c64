"""Tensor-parallel (Megatron-style) splitting and merging of megacp tensors.

Rules, by parameter (rank r of t holds the r-th of t equal parts):

* ``query_weight`` / ``query_bias``: rows (output features), i.e. query heads ``r*NH/t ...``;
  ``key_*`` / ``value_*``: rows by KV heads ``r*NKV/t ...`` — the KV heads those query heads use.
* ``fc1_weight`` = [gate; up]: the gate rows and the up rows are each split, then re-stacked, so
  rank r holds ``[gate_r; up_r]`` (a local SwiGLU stays gate-then-up).
* ``proj.weight`` and ``fc2_weight``: columns (input features), matching the heads / MLP rows above.
* norms, ``embedding.weight``, ``lm_head.weight``: replicated.
* MoE layers: ``moe.shared_fc1_weight`` like ``fc1``, ``moe.shared_fc2_weight`` by columns; the router,
  the shared-expert gate and the routed experts are replicated over TP (a TP shard file holds every
  expert). Routed experts are split by *expert-parallel* rank instead, when a model is loaded
  (:func:`shard_experts`): EP rank e of P holds experts ``[e*E/P, (e+1)*E/P)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megacp.checkpoint.errors import CheckpointError
from megacp.models.build import check_ep_size
from megacp.models.config import ModelConfig

_EXPERTS = ("moe.expert_fc1_weight", "moe.expert_fc2_weight")
_REPLICATED = (
    "layer_norm_weight", "embedding.weight", "final_norm.weight", "lm_head.weight",
    "moe.router_weight", "moe.shared_gate_weight", *_EXPERTS,
)
# Split by output features: query rows by query heads, key/value rows by KV heads.
_ROWS = tuple(
    f"layernorm_qkv.{proj}_{kind}" for proj in ("query", "key", "value") for kind in ("weight", "bias")
)
_FC1 = ("layernorm_mlp.fc1_weight", "moe.shared_fc1_weight")
_COLUMNS = ("self_attention.proj.weight", "layernorm_mlp.fc2_weight", "moe.shared_fc2_weight")


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """Raise :class:`CheckpointError` unless heads, KV heads and the dense MLP and shared-expert
    widths divide by ``tp_size``."""
    if tp_size < 1:
        raise CheckpointError(f"tensor-parallel size must be >= 1, got {tp_size}")
    counts = [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)]
    if cfg.has_dense_layers:
        counts.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:
        counts.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    for key, count in counts:
        if count % tp_size:
            raise CheckpointError(f"{key}={count} is not divisible by tensor-parallel size {tp_size}")


def check_tp_rank(cfg: ModelConfig, tp_rank: int, tp_size: int) -> None:
    """:func:`check_tp_size`, and raise unless ``0 <= tp_rank < tp_size``."""
    check_tp_size(cfg, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise CheckpointError(f"tensor-parallel rank {tp_rank} is outside [0, {tp_size})")


def _rule(name: str) -> str:
    if name.endswith(_REPLICATED):
        return "replicated"
    if name.endswith(_ROWS):
        return "rows"
    if name.endswith(_FC1):
        return "fc1"
    if name.endswith(_COLUMNS):
        return "columns"
    raise CheckpointError(f"{name!r} is not a megacp parameter name")


def is_replicated(name: str) -> bool:
    """Whether every TP rank holds the whole of megacp tensor ``name``."""
    return _rule(name) == "replicated"


def shard_tensor(
    cfg: ModelConfig, name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """The part of the full megacp tensor ``name`` held by TP rank ``tp_rank`` of ``tp_size``.

    Row and column parts are views (replicated tensors are returned as given); ``fc1`` parts are
    new tensors.
    """
    check_tp_rank(cfg, tp_rank, tp_size)
    rule = _rule(name)
    if rule == "replicated" or tp_size == 1:
        return tensor
    if rule == "rows":
        return tensor.chunk(tp_size, dim=0)[tp_rank]
    if rule == "columns":
        return tensor.chunk(tp_size, dim=1)[tp_rank]
    gate, up = tensor.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])


def merge_shards(cfg: ModelConfig, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Invert :func:`shard_tensor`: the full tensor from the parts of all ranks, in rank order.

    Raises:
        CheckpointError: the copies of a replicated tensor differ between ranks.
    """
    tp_size = len(shards)
    check_tp_size(cfg, tp_size)
    rule = _rule(name)
    if rule == "replicated" or tp_size == 1:
        if any(not torch.equal(shards[0], shard) for shard in shards[1:]):
            raise CheckpointError(f"the tensor-parallel copies of replicated {name!r} differ")
        return shards[0]
    if rule == "rows":
        return torch.cat(list(shards), dim=0)
    if rule == "columns":
        return torch.cat(list(shards), dim=1)
    halves = [shard.chunk(2, dim=0) for shard in shards]
    return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)


def shard_shape(
    cfg: ModelConfig, name: str, shape: Sequence[int], tp_rank: int, tp_size: int
) -> tuple[int, ...]:
    """The shape of :func:`shard_tensor`'s result for a full tensor of ``shape``."""
    check_tp_rank(cfg, tp_rank, tp_size)
    rule = _rule(name)
    if rule == "columns":
        return (shape[0], shape[1] // tp_size, *shape[2:])
    if rule in ("rows", "fc1"):
        return (shape[0] // tp_size, *shape[1:])
    return tuple(shape)


def check_ep_rank(cfg: ModelConfig, ep_rank: int, ep_size: int) -> None:
    """Raise :class:`CheckpointError` unless the experts of ``cfg`` split over ``ep_size`` ranks (a
    dense model: only 1) and ``0 <= ep_rank < ep_size``."""
    try:
        check_ep_size(cfg, ep_size)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if not 0 <= ep_rank < ep_size:
        raise CheckpointError(f"expert-parallel rank {ep_rank} is outside [0, {ep_size})")


def shard_experts(name: str, tensor: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    """The experts of the full stacked expert tensor ``name`` [E, ...] held by EP rank ``ep_rank``
    of ``ep_size`` (a view); any other tensor is returned as given."""
    if ep_size == 1 or not name.endswith(_EXPERTS):
        return tensor
    return tensor.chunk(ep_size, dim=0)[ep_rank]
