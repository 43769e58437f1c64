"""The process mesh: layout math, process groups, the CP ring, DeepSpeed's mpu view.

* :mod:`megacp.parallel.layout` — :class:`ParallelLayout`, pure rank arithmetic (no torch).
* :mod:`megacp.parallel.state` — :class:`ParallelState` (this rank's groups), :func:`initialize` and
  :func:`shutdown`.
* :mod:`megacp.parallel.ring` — :class:`Ring`, the CP ring's rotation and all-gather.
* :mod:`megacp.parallel.peer` — symmetric-memory windows for copy-engine rotation.
* :mod:`megacp.parallel.mpu` — :class:`DeepSpeedMPU`, CP presented as DeepSpeed's sequence parallel.
"""

from megacp.parallel.layout import AXES, GROUP_KINDS, ParallelLayout
from megacp.parallel.mpu import DeepSpeedMPU
from megacp.parallel.state import ParallelState, initialize, peak_memory_mib, shutdown

__all__ = ["AXES", "DeepSpeedMPU", "GROUP_KINDS", "ParallelLayout", "ParallelState", "initialize", "peak_memory_mib", "shutdown"]
