"""Atomic output directories: a checkpoint is written into a hidden staging directory next to its
destination and renamed into place only when complete.

A staging directory's name records its writer, ``.<output>.staging-<pid>-<host>-<random>.tmp``, so
that a later write into the same parent directory removes the staging directories of writers on
this host that no longer run (a writer killed with ``kill -9``, or a machine that lost power). A
writer that ends by an exception, Ctrl-C included, removes its own; so does a SIGTERM where the
program turns it into an exception (``tools/convert_checkpoint.py`` does).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megacp.checkpoint.errors import CheckpointError

CHECKPOINT_MARKERS = ("megacp_checkpoint.json", "config.json")
"""Files that make a directory a checkpoint (megacp manifest, Hugging Face config)."""

_STAGING = re.compile(r"^\.(?P<output>.+)\.staging-(?P<pid>\d+)-(?P<host>\w+)-[0-9a-f]{12}\.(?P<kind>tmp|old)$")
"""A staging directory (``tmp``) or a checkpoint it replaced and is about to remove (``old``)."""

_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
"""``OSError`` numbers that mean the destination cannot take the checkpoint."""


def exchange_directories(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``): at no moment is either path missing. ``False`` where the system or the
    file system cannot (nothing was changed then); the caller falls back to two renames."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _host() -> str:
    """This machine's name as a staging directory records it (word characters only)."""
    return re.sub(r"\W", "_", socket.gethostname()) or "_"


def _writer_is_gone(pid: int, host: str) -> bool:
    """Whether the writer ``pid`` on ``host`` has ended (unknown for another host: ``False``)."""
    if host != _host() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging directories in ``parent`` whose writers on this host have ended; returns them.

    A retired checkpoint (``.old``) is removed only when its destination exists (a writer killed
    between its two renames leaves the destination missing: the old and new checkpoints are then
    both kept).
    """
    removed = []
    for entry in parent.iterdir():
        found = _STAGING.match(entry.name)
        if found is None or not entry.is_dir() or entry.is_symlink():
            continue
        if not _writer_is_gone(int(found["pid"]), found["host"]):
            continue
        if found["kind"] == "old" and not (parent / found["output"]).exists():
            continue
        try:
            shutil.rmtree(entry)
        except FileNotFoundError:  # another writer removed it first
            continue
        removed.append(entry)
    return removed


@contextmanager
def staged_directory(output_dir: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """Yield a fresh staging directory that replaces ``output_dir`` when the block succeeds.

    The staging directory lies next to ``output_dir`` (same file system, so the final step is a
    rename); stale staging directories of ended writers there are removed first. On any error (or
    ``BaseException``) it is removed and ``output_dir`` is left untouched.

    Raises:
        CheckpointError: ``output_dir`` exists and ``force`` is false, ``force`` would replace
            something that is not a checkpoint directory, the parent directory does not exist, or
            the destination cannot take the checkpoint (full disk or quota, read-only file system,
            no permission), naming the path and the reason.
    """
    output = Path(output_dir)
    check_output_dir(output, force=force)
    staging = output.parent / f".{output.name}.staging-{os.getpid()}-{_host()}-{uuid.uuid4().hex[:12]}.tmp"
    try:
        remove_stale_staging(output.parent)
        staging.mkdir()
    except OSError as err:
        if err.errno in _WRITE_ERRORS:  # the parent directory refuses
            raise _write_error(output, err) from None
        raise
    try:
        yield staging
        if output.exists():
            retired = staging.with_suffix(".old")
            os.replace(output, retired)
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, output)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in _WRITE_ERRORS and _on_destination(err, staging, output):
            raise _write_error(output, err) from None
        raise


def _on_destination(err: OSError, staging: Path, output: Path) -> bool:
    """Whether ``err`` came from writing the checkpoint (no file named, or a path in ``staging`` or
    ``output``), not from reading an input."""
    if not err.filename:
        return True
    path = Path(os.fsdecode(err.filename))
    return any(path == root or root in path.parents for root in (staging, output))


def _write_error(output: Path, err: OSError) -> CheckpointError:
    """One line naming the destination and why it cannot take the checkpoint (``err``: one of
    :data:`_WRITE_ERRORS`)."""
    where = f" ({err.filename})" if err.filename else ""
    return CheckpointError(f"cannot write {output}: {os.strerror(err.errno or 0)}{where}")


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
