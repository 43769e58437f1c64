"""The package root is lazy: ``import megacp`` loads no torch, and ``import megacp.placement`` none of
the heavy optional modules; importing the training modules leaves torch's cuDNN plan reuse off (each
check in a fresh interpreter); the public names still resolve."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.timeouts import HANG_GUARD_S

HEAVY = ("torch", "triton", "deepspeed", "transformers")


def _loaded(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("statement", "allowed"), [("import megacp", ()), ("import megacp.placement", ("torch",)),
                                                    ("import megacp.config", ())])
def test_imports_load_only_what_they_need(statement: str, allowed: tuple[str, ...]) -> None:
    assert [m for m in _loaded(statement) if m not in allowed] == []


def test_inference_entry_points_turn_plan_reuse_on_and_training_does_not() -> None:
    """Only megacp.generate / megacp.serve set torch's plan reuse (no backward runs there)."""
    import subprocess
    import sys

    code = ("import os, megacp, megacp.train.engine, megacp.attention.training; "
            "print(os.environ.get('TORCH_CUDNN_SDPA_AVOID_RECOMPILE'))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert res.stdout.strip() == "None"


def test_public_names_resolve_lazily() -> None:
    import megacp

    for name in megacp.__all__:
        assert getattr(megacp, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        megacp.nope  # noqa: B018


def test_version_is_the_distributions() -> None:
    """``megacp.version.__version__`` (what ``--version`` prints, also from an uninstalled checkout) is
    setup.py's version."""
    import re

    from megacp.version import __version__
    from tests.helpers.paths import ROOT

    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert re.search(r'version="([^"]+)"', setup).group(1) == __version__  # type: ignore[union-attr]
