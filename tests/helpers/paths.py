"""Paths the tests use: the repository root (``ROOT``) and its folders."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PROGRAMS = ROOT / "tests" / "programs"
