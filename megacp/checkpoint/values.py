"""Checks of the values a checkpoint carries: model hyper-parameters that no model can run with, and
weights that are not finite."""

from __future__ import annotations

import math

import torch

from megacp.checkpoint.errors import CheckpointError
from megacp.models.config import ModelConfig


def check_model_values(cfg: ModelConfig, where: str) -> ModelConfig:
    """``cfg`` unchanged, or :class:`CheckpointError` naming the first bad value and ``where`` it came from.

    Checked: ``rms_norm_eps``, ``rope_theta`` (finite, > 0), ``max_position_embeddings`` (> 0) and the
    BOS / EOS token ids (in ``[0, vocab_size)``).
    """
    for key in ("rms_norm_eps", "rope_theta"):
        value = getattr(cfg, key)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise CheckpointError(f"{where}: {key}={value!r} must be a finite number > 0")
    if not (isinstance(cfg.max_position_embeddings, int) and cfg.max_position_embeddings > 0):
        raise CheckpointError(f"{where}: max_position_embeddings={cfg.max_position_embeddings!r} must be an integer > 0")
    tokens = [("bos_token_id", cfg.bos_token_id)] if cfg.bos_token_id is not None else []
    tokens += [("eos_token_id", token) for token in cfg.eos_token_ids]
    for key, token in tokens:
        if not (isinstance(token, int) and 0 <= token < cfg.vocab_size):
            raise CheckpointError(f"{where}: {key} {token!r} is not a token id of the vocabulary of {cfg.vocab_size}")
    return cfg


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite (integer tensors always are).

    First the sum (one vectorised pass, no ``[numel]`` bool tensor): NaN and inf propagate through
    addition, so a finite sum proves every value finite; only a sum that is not finite (a NaN or inf,
    or finite values overflowing the dtype) takes the elementwise check. On the CPU this reads a
    bf16 checkpoint tens of times faster than ``isfinite(...).all()``."""
    if not tensor.is_floating_point():
        return True
    tensor = tensor.detach()
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite(name: str, tensor: torch.Tensor, where: object) -> torch.Tensor:
    """``tensor`` unchanged, or :class:`CheckpointError` naming the tensor when it holds NaN or inf."""
    if not all_finite(tensor):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(
            f"tensor {name!r} in {where} holds {bad} non-finite value(s) (NaN/inf); "
            "allow_non_finite=True (--allow-non-finite) loads it anyway"
        )
    return tensor
