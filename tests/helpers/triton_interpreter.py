"""Running a test script under Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before
Triton is imported: hence a subprocess), how the Triton kernels are checked without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (the kernel under test needs it)")


def run_interpreted(script: str, done: str) -> None:
    """Run ``script`` in a fresh interpreter with ``TRITON_INTERPRET=1``; fail unless it exits 0
    having printed ``done``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 0 and done in res.stdout, res.stdout + res.stderr
