"""How long a test waits for a child process, a rank or a job before it calls it hung.

``HANG_GUARD_S`` bounds a hang only: a correct run never reaches it, also on a loaded 2-core machine
(it is over 10x the quiet time of the slowest guarded call: a tests/jobs/test_train_long.py run takes
about 100 s on 2 quiet cores). The spawning tiers' pytest-timeout lies above it (tests/conftest.py),
so a guard's own report (with a hanging rank's stacks) comes first.
"""

from __future__ import annotations

HANG_GUARD_S = 1800
