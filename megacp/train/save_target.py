"""Checks on ``megacp.train --save DIR`` made before the model loads: the directory can be written,
its file system has room for the checkpoint, and it does not hold a checkpoint of another model."""

from __future__ import annotations

import json
import math
import os
import re
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


def saved_tags(save: str | os.PathLike[str]) -> list[str]:
    """The checkpoint tags (``step<N>`` directories) ``save`` holds now."""
    target = Path(save)
    if not target.is_dir():
        return []
    return [p.name for p in target.iterdir() if p.is_dir() and re.fullmatch(r"step\d+", p.name)]


def checkpoints_at_once(saves: int, keep_last: int | None, existing: int) -> int:
    """How many checkpoints a run adds to its save directory's disk use at its peak: with
    ``keep_last`` k, k kept plus the one being written (in its staging directory) before the oldest
    is pruned, less the ``existing`` tags already on the disk; without, every one of its ``saves``."""
    if keep_last is None:
        return max(saves, 1)
    return max(min(saves, keep_last + 1) - min(existing, keep_last), 1)


def check_save_target(save: str | os.PathLike[str], config: ModelConfig | None, dtype: torch.dtype, *,
                      force: bool, checkpoints: int = 1) -> None:
    """Refuse ``--save save`` before training: the nearest existing directory is not writable, its
    file system has less free space than ``checkpoints`` (:func:`checkpoints_at_once`) times
    :func:`estimated_checkpoint_bytes`, or ``save`` holds a :data:`TRAIN_STATE_FILE` of another model
    config (unless ``force``).

    Raises:
        ValueError: one line naming the directory and the problem.
    """
    target = Path(save)
    existing = target if target.is_dir() else target.resolve().parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--save {save}: {existing} is not writable")
    if config is None:
        return
    one = estimated_checkpoint_bytes(config, dtype)
    needed = one * checkpoints
    free = shutil.disk_usage(existing).free
    if free < needed:
        what = "the checkpoint needs" if checkpoints == 1 else f"{checkpoints} checkpoints at once (kept and staged) need"
        raise ValueError(f"--save {save}: {what} about {needed / 2**20:,.0f} MiB, "
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


class SaveLock:
    """An exclusive lock on a ``--save`` directory for one run's lifetime (``fcntl.flock`` on
    ``<save>/.megacp.lock``, released when the process ends, however it ends): a second run that would
    write into the same directory stops before it starts, naming the holder.

    Raises:
        ValueError: another process holds the lock (one line: its pid, host and start time).
    """

    FILE = ".megacp.lock"

    def __init__(self, save: str | os.PathLike[str]) -> None:
        import fcntl
        import socket
        import time

        path = Path(save) / self.FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise ValueError(f"--save {save} is in use by another run ({holder}): wait for it to end or save "
                             "elsewhere") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self._file.flush()
