"""Atomic output directories: a checkpoint is written into a hidden staging directory next to its
destination and renamed into place only when complete."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megacp.checkpoint.errors import CheckpointError

CHECKPOINT_MARKERS = ("megacp_checkpoint.json", "config.json")
"""Files that make a directory a checkpoint (megacp manifest, Hugging Face config)."""


@contextmanager
def staged_directory(output_dir: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """Yield a fresh staging directory that replaces ``output_dir`` when the block succeeds.

    The staging directory lies next to ``output_dir`` (same file system, so the final step is a
    rename); on any error it is removed and ``output_dir`` is left untouched.

    Raises:
        CheckpointError: ``output_dir`` exists and ``force`` is false, ``force`` would replace
            something that is not a checkpoint directory, or the parent directory does not exist.
    """
    output = Path(output_dir)
    check_output_dir(output, force=force)
    staging = output.parent / f".{output.name}.{uuid.uuid4().hex[:12]}.tmp"
    staging.mkdir()
    try:
        yield staging
        if output.exists():
            retired = staging.with_suffix(".old")
            os.replace(output, retired)
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_output_dir(output_dir: str | os.PathLike[str], *, force: bool = False) -> None:
    """Raise :class:`CheckpointError` unless :func:`staged_directory` may create ``output_dir``.

    With ``force`` an existing ``output_dir`` is replaced only when it is an empty directory or a
    checkpoint (holds ``megacp_checkpoint.json`` or ``config.json``), never any other path.
    """
    output = Path(output_dir)
    if output.exists() or output.is_symlink():
        if not force:
            raise CheckpointError(f"output {output} already exists (use --force to replace it)")
        if not output.is_dir() or output.is_symlink() or not _is_replaceable(output):
            raise CheckpointError(
                f"refusing to replace {output}: it is not an empty or checkpoint directory"
            )
    if not output.parent.is_dir():
        raise CheckpointError(f"the parent directory of {output} does not exist")


def _is_replaceable(directory: Path) -> bool:
    return not any(directory.iterdir()) or any(
        (directory / marker).is_file() for marker in CHECKPOINT_MARKERS
    )
