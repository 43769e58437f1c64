"""pytest setup shared by megacp's tests.

* Tiers: ``tests/unit`` (in-process, no child process), ``tests/distributed`` (spawned gloo ranks),
  ``tests/jobs`` (child processes: launchers and whole jobs, scripts, fresh interpreters; whole-model
  equivalence, DeepSpeed engines), ``tests/gpu`` (skipped without GPUs);
  each test is marked with its tier, so ``pytest tests/unit`` (or ``-m unit``) is the fast loop.
  Shared code lives in ``tests/helpers``; pytest's ``pythonpath`` setting (pyproject.toml) puts the
  repository root on the import path, and the harness passes it to its workers in ``PYTHONPATH``.
* ``slow`` marks tests that launch whole jobs (``deepspeed``/``torchrun``); they run by default,
  ``-m "not slow"`` skips them.
* ``MEGACP_CACHE_DIR`` points at a temporary directory for the session (token and calibration
  caches of the jobs the tests start stay out of the user's home), unless it is set already; the
  process that made it removes it when the session ends (a run leaves no gigabyte of caches behind).
* The pytest process computes with one torch thread (``torch.set_num_threads(1)``, as the ranks the
  harness spawns do): the tests' tensors are small, so a second OpenMP thread costs more in waiting
  than it computes (the unit tier's CPU time halves), and under ``-n 2`` two workers of two threads
  each would oversubscribe two cores.
* With pytest-timeout installed, every test gets a time limit (a hung collective must not hang CI):
  300 s in the unit tier, and in the tiers that spawn processes twice ``HANG_GUARD_S``
  (tests/helpers/timeouts.py), the guard of each child process, rank or job a test waits for, so
  that the guard's report comes first and a busy machine fails nothing; an explicit ``--timeout``
  or ``timeout`` ini setting wins.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.timeouts import HANG_GUARD_S

TIERS = ("unit", "distributed", "jobs", "gpu")

DEFAULT_TIMEOUT_S = 300
"""pytest-timeout's limit of a unit test (in-process, seconds)."""

SPAWNING_TIERS = ("distributed", "jobs", "gpu")
SPAWNING_TIMEOUT_S = 2 * HANG_GUARD_S
"""pytest-timeout's limit of a test of :data:`SPAWNING_TIERS` (above the guard of its calls)."""


_TIER_TIMEOUTS = pytest.StashKey[bool]()
"""Set when this file chose the time limits (no ``--timeout`` or ``timeout`` ini setting)."""

_MADE_CACHE_DIR: list[str] = []
"""The ``MEGACP_CACHE_DIR`` this process made (xdist's workers inherit the controller's)."""


def pytest_configure(config: pytest.Config) -> None:
    if "MEGACP_CACHE_DIR" not in os.environ:
        os.environ["MEGACP_CACHE_DIR"] = tempfile.mkdtemp(prefix="megacp-test-cache-")
        _MADE_CACHE_DIR.append(os.environ["MEGACP_CACHE_DIR"])
    config.addinivalue_line("markers", "slow: launches whole multi-process jobs (deepspeed / torchrun)")
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test of tests/{tier}")
    torch.set_num_threads(1)
    if importlib.util.find_spec("pytest_timeout") is not None and not config.getoption("timeout", None):
        if not config.getini("timeout"):
            config.option.timeout = DEFAULT_TIMEOUT_S
            config.stash[_TIER_TIMEOUTS] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _MADE_CACHE_DIR:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (the folder under ``tests/`` it lives in), and a test of a tier
    that spawns processes with :data:`SPAWNING_TIMEOUT_S` (unless it names its own limit)."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        tier = next((t for t in TIERS if t in parts[-3:-1]), None)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        if (tier in SPAWNING_TIERS and config.stash.get(_TIER_TIMEOUTS, False)
                and item.get_closest_marker("timeout") is None):
            item.add_marker(pytest.mark.timeout(SPAWNING_TIMEOUT_S))
