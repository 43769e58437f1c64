"""pytest setup shared by megacp's tests.

* The repository root goes on ``sys.path`` so that ``import megacp`` and
  ``from tests.distributed import run_distributed`` work without installing the package, under
  both ``pytest`` and ``python -m pytest`` (and in the harness's worker processes, which inherit
  ``sys.path``).
* ``slow`` marks tests that launch whole jobs (``deepspeed``/``torchrun``); they run by default,
  ``-m "not slow"`` skips them.
* With pytest-timeout installed, every test gets a 300 s default timeout (a hung collective must
  not hang CI); an explicit ``--timeout`` or ``timeout`` ini setting wins.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_TIMEOUT_S = 300


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: launches whole multi-process jobs (deepspeed / torchrun)")
    if importlib.util.find_spec("pytest_timeout") is not None and not config.getoption("timeout", None):
        if not config.getini("timeout"):
            config.option.timeout = DEFAULT_TIMEOUT_S
