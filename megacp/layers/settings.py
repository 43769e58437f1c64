"""The CP settings every step and layer uses, built once from the mesh and carried down.

:class:`CPSettings` is the one corridor for the CP knobs: the ring, the prefill strategy of
``context_parallel.prefill``, the decode algorithm, the attention kernel backend of
``runtime.attention_backend``, the load-balanced sharding switch and where the ``auto`` strategy
reads its calibration. :meth:`CPSettings.from_state` builds it from a
:class:`~megacp.parallel.state.ParallelState`; the generator, the trainer's loss and the CP layers
receive it, and the step planner (:mod:`megacp.layers.step`) reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megacp.attention.kernels.registry import resolve_backend
from megacp.attention.strategy import STRATEGIES
from megacp.parallel.ring import Ring

DECODE_STRATEGIES = ("allgather",)


@dataclass(frozen=True)
class CPSettings:
    """How this rank's CP steps run.

    Attributes:
        ring: the CP ring (``None`` for CP = 1).
        prefill: prefill strategy, ``"auto"`` (the paper's rule, resolved per step by the planner),
            ``"pass_kv"`` or ``"pass_q"``.
        decode: decode algorithm (``"allgather"``).
        backend: partial-attention kernel backend, ``"auto"`` or a backend of
            :mod:`megacp.attention.kernels.registry` (:mod:`megacp.attention.kernels.partial`).
        load_balance: 2N-chunk prefill sharding (else contiguous chunks).
        calibration_dir: where ``auto`` reads this host's calibration (``None``: ``~/.cache/megacp``).
    """

    ring: Ring | None = None
    prefill: str = "auto"
    decode: str = "allgather"
    backend: str = "auto"
    load_balance: bool = True
    calibration_dir: str | None = None

    def __post_init__(self) -> None:
        if self.prefill not in STRATEGIES:
            raise ValueError(f"prefill strategy {self.prefill!r} is not one of {', '.join(STRATEGIES)}")
        if self.decode not in DECODE_STRATEGIES:
            raise ValueError(f"decode strategy {self.decode!r} is not one of {', '.join(DECODE_STRATEGIES)}")
        resolve_backend(self.backend)

    @classmethod
    def from_state(cls, state: Any, *, prefill: str | None = None) -> "CPSettings":
        """The settings of a :class:`~megacp.parallel.state.ParallelState`: its ring, its config's
        ``context_parallel`` and ``runtime`` sections; ``prefill`` overrides the configured strategy."""
        cp, runtime = state.config.context_parallel, state.config.runtime
        return cls(ring=state.ring(), prefill=prefill or cp.prefill, decode=cp.decode,
                   backend=runtime.attention_backend, load_balance=cp.load_balance,
                   calibration_dir=runtime.calibration_cache_dir)

    @property
    def cp_size(self) -> int:
        """Ranks of the CP group."""
        return self.ring.size if self.ring is not None else 1

    @property
    def cp_rank(self) -> int:
        """This rank's index in the CP group."""
        return self.ring.rank if self.ring is not None else 0

    def replace(self, **changes: Any) -> "CPSettings":
        """A copy with ``changes`` (validated like the original)."""
        return dataclasses.replace(self, **changes)
