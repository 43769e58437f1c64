"""The package root is lazy: ``import megacp`` loads no torch, and ``import megacp.placement`` none of
the heavy optional modules (each check in a fresh interpreter); the public names still resolve."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "deepspeed", "transformers")


def _loaded(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("statement", "allowed"), [("import megacp", ()), ("import megacp.placement", ("torch",)),
                                                    ("import megacp.config", ())])
def test_imports_load_only_what_they_need(statement: str, allowed: tuple[str, ...]) -> None:
    assert [m for m in _loaded(statement) if m not in allowed] == []


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
