"""Paths the tests use: the repository root (``ROOT``) and its folders, and the session's shared cache."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PROGRAMS = ROOT / "tests" / "programs"


@contextlib.contextmanager
def session_shared(name: str) -> Iterator[Path]:
    """``MEGACP_CACHE_DIR / name`` (the test session's temporary directory, ``tests/conftest.py``)
    held under a file lock: what one pytest-xdist worker makes there the others find complete."""
    path = Path(os.environ["MEGACP_CACHE_DIR"]) / name
    with FileLock(f"{path}.lock"):
        yield path
