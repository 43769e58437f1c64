"""Building a :class:`CausalLM` from a :class:`ModelConfig`, with torch or Transformer Engine
layers (random weights, or a ``meta`` skeleton for a loader to fill)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from megacp.models.config import ModelConfig
from megacp.models.llama import CausalLM, tp_world_size
from megacp.models.te_model import build_te_model, te_import_error

Backend = Literal["auto", "torch", "te"]
MODEL_BUILDERS = ("auto", "torch", "te")
"""Which layers :func:`build_model` builds the decoder from (``auto``: see :func:`resolve_backend`)."""


def resolve_backend(cfg: ModelConfig, device: Any, backend: Backend = "auto") -> str:
    """``"te"`` or ``"torch"``: ``auto`` picks TE when it is importable, the device is CUDA and the
    model is expressible with ``te.TransformerLayer`` (no Q/K/V bias); otherwise torch."""
    if backend not in MODEL_BUILDERS:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {', '.join(MODEL_BUILDERS)}")
    if backend != "auto":
        return backend
    usable = te_import_error() is None and torch.device(device).type == "cuda" and not cfg.attention_bias
    return "te" if usable else "torch"


def build_model(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: Any,
    backend: Backend = "auto",
    tp_group: dist.ProcessGroup | None = None,
) -> CausalLM:
    """A randomly initialised :class:`CausalLM` (``device="meta"``: a skeleton for loading).

    Raises:
        ValueError: unknown backend, or ``backend="te"`` for a model TE cannot express.
        RuntimeError: ``backend="te"`` without an importable Transformer Engine.
    """
    if resolve_backend(cfg, device, backend) == "te":
        return build_te_model(cfg, dtype=dtype, device=device, tp_group=tp_group)
    return CausalLM(cfg, tp_group, dtype=dtype, device=device)


def tp_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in its tensor-parallel group and the group's size (``(0, 1)`` without one)."""
    return (0 if tp_group is None else dist.get_rank(tp_group)), tp_world_size(tp_group)
