"""Building a :class:`CausalLM` from a :class:`ModelConfig`, with torch or Transformer Engine
layers (random weights, or a ``meta`` skeleton for a loader to fill), and the expert-parallel group
an MoE model's experts are sharded over."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from megacp.models.config import ModelConfig
from megacp.models.llama import CausalLM
from megacp.models.moe import local_experts
from megacp.models.ops import group_size
from megacp.models.te_model import build_te_model, te_import_error
from megacp.parallel.state import ParallelState

Backend = Literal["auto", "torch", "te"]
MODEL_BUILDERS = ("auto", "torch", "te")
"""Which layers :func:`build_model` builds the decoder from (``auto``: see :func:`resolve_backend`)."""


def resolve_backend(cfg: ModelConfig, device: Any, backend: Backend = "auto") -> str:
    """``"te"`` or ``"torch"``: ``auto`` picks TE when it is importable, the device is CUDA and the
    model is expressible with ``te.TransformerLayer`` (no Q/K/V bias, no experts); otherwise torch."""
    if backend not in MODEL_BUILDERS:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {', '.join(MODEL_BUILDERS)}")
    if backend != "auto":
        return backend
    usable = (
        te_import_error() is None and torch.device(device).type == "cuda" and not cfg.attention_bias
        and not cfg.num_experts
    )
    return "te" if usable else "torch"


def build_model(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: Any,
    backend: Backend = "auto",
    tp_group: dist.ProcessGroup | None = None,
    ep_group: dist.ProcessGroup | None = None,
) -> CausalLM:
    """A randomly initialised :class:`CausalLM` (``device="meta"``: a skeleton for loading).

    ``ep_group`` shards the experts of an MoE model (:mod:`megacp.models.moe`).

    Raises:
        ValueError: unknown backend, ``backend="te"`` for a model TE cannot express, or an
            expert-parallel group of size > 1 that the model cannot use (see :func:`check_ep_size`).
        RuntimeError: ``backend="te"`` without an importable Transformer Engine.
    """
    check_ep_size(cfg, group_size(ep_group))
    if resolve_backend(cfg, device, backend) == "te":
        return build_te_model(cfg, dtype=dtype, device=device, tp_group=tp_group)
    return CausalLM(cfg, tp_group, ep_group, dtype=dtype, device=device)


def check_ep_size(cfg: ModelConfig, ep_size: int) -> None:
    """Raise ``ValueError`` (one line) unless ``cfg`` can shard its experts over ``ep_size`` ranks:
    a dense model takes only 1, an MoE model a divisor of ``num_experts``."""
    if ep_size > 1 and not cfg.num_experts:
        raise ValueError(
            f"expert_model_parallel.size: got {ep_size}; the {cfg.architecture} model has no expert "
            "layers; allowed values: 1 or null"
        )
    if cfg.num_experts:
        local_experts(cfg.num_experts, ep_size)


def expert_parallel_group(state: ParallelState) -> dist.ProcessGroup | None:
    """The group to shard experts over: ``state.group("ep")`` when the config asks for
    ``expert_model_parallel.size`` > 1, else ``None`` (every rank holds every expert)."""
    size = state.config.expert_model_parallel.size
    return state.group("ep") if size is not None and size > 1 else None


