"""Checks on ``megacp.train --save DIR`` made before the model loads: the directory can be written,
its file system has room for the checkpoint, and it does not hold a checkpoint of another model."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from megacp.checkpoint.deepspeed import TRAIN_STATE_FILE
from megacp.models.config import ModelConfig
from megacp.models.schema import parameter_shapes

OPTIMIZER_BYTES_PER_PARAMETER = 12
"""Adam's state per parameter as DeepSpeed saves it: fp32 master weight, first and second moment."""


def estimated_checkpoint_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of a DeepSpeed checkpoint of ``config`` trained in ``dtype``: the module's parameters in
    ``dtype`` plus :data:`OPTIMIZER_BYTES_PER_PARAMETER` per parameter (summed over the ZeRO 1/2
    shards, the same total at every stage)."""
    count = sum(math.prod(shape) for shape in parameter_shapes(config).values())
    return count * (torch.empty((), dtype=dtype).element_size() + OPTIMIZER_BYTES_PER_PARAMETER)


def check_save_target(save: str | os.PathLike[str], config: ModelConfig | None, dtype: torch.dtype, *,
                      force: bool) -> None:
    """Refuse ``--save save`` before training: the nearest existing directory is not writable, its
    file system has less free space than :func:`estimated_checkpoint_bytes`, or ``save`` holds a
    :data:`TRAIN_STATE_FILE` of another model config (unless ``force``).

    Raises:
        ValueError: one line naming the directory and the problem.
    """
    target = Path(save)
    existing = target if target.is_dir() else target.resolve().parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--save {save}: {existing} is not writable")
    if config is None:
        return
    needed = estimated_checkpoint_bytes(config, dtype)
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise ValueError(f"--save {save}: the checkpoint needs about {needed / 2**20:,.0f} MiB, "
                         f"{existing} has {free / 2**20:,.0f} MiB free")
    meta_file = target / TRAIN_STATE_FILE
    if force or not meta_file.is_file():
        return
    try:
        saved = json.loads(meta_file.read_text(encoding="utf-8")).get("model_config")
    except (OSError, ValueError, AttributeError):
        saved = None
    if saved != json.loads(json.dumps(config.to_dict())):  # as the file holds it (lists, not tuples)
        raise ValueError(f"--save {save} holds a checkpoint of a different model ({TRAIN_STATE_FILE}); "
                         "use --force to save over it")
