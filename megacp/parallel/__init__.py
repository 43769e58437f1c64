"""The process mesh: layout math, process groups, DeepSpeed's mpu view.

* :mod:`megacp.parallel.layout` — :class:`ParallelLayout`, pure rank arithmetic (no torch).
* :mod:`megacp.parallel.state` — :class:`ParallelState` (this rank's groups) and :func:`initialize`.
* :mod:`megacp.parallel.mpu` — :class:`DeepSpeedMPU`, CP presented as DeepSpeed's sequence parallel.

Names are imported lazily: :mod:`megacp.config` imports the layout module, and importing
:mod:`megacp.parallel.state` (which imports the config) eagerly here would be circular.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AXES": "megacp.parallel.layout",
    "GROUP_KINDS": "megacp.parallel.layout",
    "ParallelLayout": "megacp.parallel.layout",
    "ParallelState": "megacp.parallel.state",
    "initialize": "megacp.parallel.state",
    "DeepSpeedMPU": "megacp.parallel.mpu",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megacp.parallel' has no attribute {name!r}")
