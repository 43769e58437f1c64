"""Integrations of megacp with other libraries, registered only when those libraries load.

:func:`install_transformers_hook` (run by ``import megacp``) makes ``attn_implementation="megacp"``
available to Hugging Face transformers without importing transformers, torch or anything heavy:
when transformers is already loaded it registers at once, otherwise a one-shot import hook does it
right after ``transformers.modeling_utils`` (the module that resolves ``attn_implementation``) has
been imported. ``import megacp.integrations.transformers`` registers explicitly. This module
imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

_TRIGGER = "transformers.modeling_utils"
"""The transformers module whose import makes megacp register its attention function."""

_INTEGRATION = "megacp.integrations.transformers"


def _register() -> None:
    __import__(_INTEGRATION)  # registers on import


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of :data:`_TRIGGER` so that megacp registers
    right after that module has executed, then removes itself from ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            _register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_transformers_hook() -> None:
    """Register megacp's attention with transformers now if transformers' modeling code is
    loaded, else when it is (idempotent; costs one entry in ``sys.meta_path`` until then)."""
    if _TRIGGER in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
