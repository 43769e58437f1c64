"""What a training checkpoint holds beyond DeepSpeed's files, so that a run resumed from it continues
exactly as if it had not stopped, and how the checkpoints of a ``--save`` directory are found and
thinned out.

``engine.save_checkpoint`` stores the model, the optimizer (ZeRO partitions included), the LR
scheduler and the engine's step counters. :class:`~megacp.train.engine.Trainer` adds, in the tag
directory:

* :data:`RESUME_FILE` (from global rank 0): the optimizer steps done, the data position (a
  :class:`~megacp.train.data.StreamPosition`, the same on every data-parallel replica) and the
  layout it is valid for (``seq_len``, micro-batch, DP size, world size)::

      {"step": 7, "data": {"document": 41, "offset": 17}, "seq_len": 2048, "micro_batch": 1,
       "dp_size": 1, "world_size": 2}

* ``rng_state_<rank>.pt`` (one per global rank): the torch CPU (and CUDA) and Python ``random``
  generator states (:func:`rng_state`).

Tags are ``step<N>``; ``latest`` names the newest complete one (it is moved last).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megacp.checkpoint.deepspeed import tag_dir
from megacp.checkpoint.errors import CheckpointError
from megacp.train.data import StreamPosition

RESUME_FILE = "megacp_resume.json"
"""In every tag directory: the :class:`ResumePoint` of the checkpoint."""

_TAG = re.compile(r"step(\d+)")
"""The tags ``megacp.train`` writes: ``step<N>``, ``N`` the optimizer steps done."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a checkpointed run stands: ``step`` optimizer steps done, the next batch at ``data``,
    valid for batches of ``micro_batch`` sequences of ``seq_len`` tokens per replica, ``dp_size``
    replicas and ``world_size`` ranks."""

    step: int
    data: StreamPosition
    seq_len: int
    micro_batch: int
    dp_size: int
    world_size: int

    def write(self, tag_dir: Path) -> None:
        """Write :data:`RESUME_FILE` into ``tag_dir``."""
        (tag_dir / RESUME_FILE).write_text(json.dumps(asdict(self)), encoding="utf-8")

    @classmethod
    def read(cls, tag_dir: Path) -> ResumePoint:
        """Read ``tag_dir``'s :data:`RESUME_FILE`.

        Raises:
            CheckpointError: it is missing or malformed.
        """
        path = tag_dir / RESUME_FILE
        if not path.is_file():
            raise CheckpointError(f"{tag_dir} holds no {RESUME_FILE}: not a checkpoint megacp.train can resume")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{**raw, "data": StreamPosition(**raw["data"])})
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise CheckpointError(f"{path}: cannot be read ({err})") from None

    def check_layout(self, *, seq_len: int, micro_batch: int, dp_size: int, world_size: int) -> None:
        """Refuse to resume with another batch layout (the data position and the optimizer
        partitions would not match).

        Raises:
            CheckpointError: one line naming the first difference.
        """
        now = {"seq_len": seq_len, "micro_batch": micro_batch, "dp_size": dp_size, "world_size": world_size}
        for key, value in now.items():
            saved = getattr(self, key)
            if saved != value:
                raise CheckpointError(f"the checkpoint was trained with {key} {saved}, this run has {value}: "
                                      "resume with the same --seq-len, DeepSpeed batch sizes and ranks")


def rng_state() -> dict[str, Any]:
    """This process's random generator states: torch's CPU generator, every CUDA device's (when
    CUDA is available) and Python's ``random``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_file(tag_dir: Path, rank: int) -> Path:
    """Global rank ``rank``'s generator states in ``tag_dir``."""
    return tag_dir / f"rng_state_{rank}.pt"


def load_rng_file(path: Path) -> dict[str, Any]:
    """The states :func:`rng_state` saved into ``path`` (plain data: read with ``weights_only``).

    Raises:
        CheckpointError: the file is missing.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint was written by another number of ranks")
    return torch.load(path, map_location="cpu", weights_only=True)


def step_tags(directory: Path) -> list[str]:
    """The ``step<N>`` tag directories of ``directory``, oldest (smallest ``N``) first."""
    found = [(int(m.group(1)), p.name) for p in directory.iterdir() if p.is_dir() and (m := _TAG.fullmatch(p.name))]
    return [name for _, name in sorted(found)]


def prune(directory: Path, keep: int, current: str) -> None:
    """Remove the oldest ``step<N>`` tag directories of ``directory`` until ``keep`` remain
    (``current``, the tag ``latest`` names, is never removed)."""
    tags = [t for t in step_tags(directory) if t != current]
    for tag in tags[: max(0, len(tags) - (keep - 1))]:
        shutil.rmtree(directory / tag)


def locate(resume: str, save: str | None) -> tuple[Path, str] | None:
    """The checkpoint ``--resume`` names, as ``(save directory, tag)``.

    ``resume`` is ``"auto"`` (the ``latest`` checkpoint of ``save``, ``None`` when it has none
    yet: a fresh start), a save directory (its ``latest`` tag) or one of its tag directories.

    Raises:
        CheckpointError: a directory that holds no resumable checkpoint.
    """
    if resume == "auto":
        if save is None:
            raise CheckpointError("--resume auto resumes from the --save directory: pass --save DIR")
        latest = Path(save) / "latest"
        if not latest.is_file():
            return None
        resume = save
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: not a directory")
    if (path / "latest").is_file():
        directory, tag = path, (path / "latest").read_text(encoding="utf-8").strip()
    elif (path / RESUME_FILE).is_file():
        directory, tag = path.parent, path.name
    else:
        raise CheckpointError(f"--resume {resume}: neither a --save directory of megacp.train (no 'latest' file) "
                              f"nor one of its checkpoint tags (no {RESUME_FILE})")
    try:  # a tag of the save directory itself: not ../other, an absolute path or a link out of it
        tag_dir(directory, tag)
    except CheckpointError:
        raise CheckpointError(f"--resume {resume}: the checkpoint tag {tag!r} lies outside {directory}") from None
    if not (directory / tag).is_dir():
        raise CheckpointError(f"--resume {resume}: 'latest' names {tag}, which is missing")
    return directory, tag
