"""The process mesh: layout math, process groups, DeepSpeed's mpu view.

* :mod:`megacp.parallel.layout` — :class:`ParallelLayout`, pure rank arithmetic (no torch).
* :mod:`megacp.parallel.state` — :class:`ParallelState` (this rank's groups) and :func:`initialize`.
* :mod:`megacp.parallel.mpu` — :class:`DeepSpeedMPU`, CP presented as DeepSpeed's sequence parallel.

Names are imported lazily: :mod:`megacp.config` imports the layout module, and importing
:mod:`megacp.parallel.state` (which imports the config) eagerly here would be circular.
"""

from __future__ import annotations

from megacp._lazy import lazy_getattr

_EXPORTS = {
    "AXES": "megacp.parallel.layout",
    "GROUP_KINDS": "megacp.parallel.layout",
    "ParallelLayout": "megacp.parallel.layout",
    "ParallelState": "megacp.parallel.state",
    "initialize": "megacp.parallel.state",
    "DeepSpeedMPU": "megacp.parallel.mpu",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
