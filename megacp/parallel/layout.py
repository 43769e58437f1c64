"""Pure-Python arithmetic of the process mesh (no ``torch.distributed``), and the mesh a megacp
config describes (:meth:`ParallelLayout.from_config`).

Ranks are laid out over the axes ``(ext_dp, dp, pp, cp, tp)`` with ``tp`` varying fastest::

    rank = (((ext_dp_idx * dp + dp_idx) * pp + pp_idx) * cp + cp_idx) * tp + tp_idx

so the ``tp`` ranks of one cell are consecutive (one node's fast links), then the ``cp`` ring, the
pipeline stages, the data-parallel replicas and, outermost, the external data-parallel replicas.

Group kinds (each group's ranks ascending, groups ordered by their smallest rank):

``tp``     ranks that differ only in ``tp``.
``cp``     ranks that differ only in ``cp`` (the CP ring, in ring order).
``pp``     ranks that differ only in ``pp`` (one pipeline).
``dp``     ranks that differ only in ``dp``. ``ext_dp`` is *not* part of it: external replicas are
           independent copies of the whole job (e.g. externally load-balanced serving replicas)
           that never communicate, so every group lives inside one ``ext_dp`` index.
``dp_cp``  all ``dp x cp`` ranks of one ``(ext_dp, pp, tp)`` cell. CP ranks hold identical
           weights, so this is the gradient-reduction / ZeRO group in training.
``ep``     all ``dp x tp`` ranks of one ``(ext_dp, pp, cp)`` cell: the rank array permuted to
           ``(ext_dp, pp, cp, dp, tp)`` and flattened over the last two axes. With
           ``ep_includes_cp`` it is all ``dp x cp x tp`` ranks of one ``(ext_dp, pp)`` cell.
``edp``    expert data parallel: the ranks that hold the same experts (the same index in their
           ``ep`` groups), i.e. the ``cp`` ranks of one ``(ext_dp, dp, pp, tp)`` cell; a single rank
           with ``ep_includes_cp``. Expert gradients would be reduced over it.
``mp``     all ``pp x tp`` ranks of one ``(ext_dp, dp, cp)`` cell: every rank that holds a
           different shard of the weights (Megatron's and DeepSpeed's "model parallel" group).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from megacp.config import ConfigError, MegacpConfig

AXES: tuple[str, ...] = ("ext_dp", "dp", "pp", "cp", "tp")
"""Mesh axes, slowest-varying first."""

GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "dp_cp": ("dp", "cp"),
    "ep": ("dp", "tp"),
    "edp": ("cp",),
    "mp": ("pp", "tp"),
}
"""For each group kind, the axes whose coordinates vary inside one group (``ep`` and ``edp`` without
``ep_includes_cp``)."""

GROUP_KINDS: tuple[str, ...] = tuple(GROUP_AXES)
"""Every group kind, in the fixed order in which process groups are created."""


def _check_size(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int`` >= 1 (``bool`` excluded), else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ParallelLayout.{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"ParallelLayout.{name} must be an int >= 1, got {value}")
    return value


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the process mesh and the rank arithmetic derived from them.

    Attributes:
        tp: tensor-parallel size.
        cp: context-parallel size (the ring of ranks that shard one sequence).
        pp: pipeline-parallel size (stages).
        dp: data-parallel size (replicas inside one external replica).
        ext_dp: external data-parallel size (independent replicas of the whole job).
        ep_includes_cp: the expert-parallel group spans ``dp x cp x tp`` instead of ``dp x tp``.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ext_dp: int = 1
    ep_includes_cp: bool = False

    def __post_init__(self) -> None:
        for axis in AXES:
            _check_size(axis, getattr(self, axis))
        if not isinstance(self.ep_includes_cp, bool):
            raise ValueError(f"ParallelLayout.ep_includes_cp must be a bool, got {self.ep_includes_cp!r}")

    @classmethod
    def from_world(
        cls,
        world_size: int,
        tp: int = 1,
        cp: int | None = None,
        pp: int = 1,
        dp: int | None = None,
        ext_dp: int = 1,
        ep_includes_cp: bool = False,
    ) -> ParallelLayout:
        """Build the layout of ``world_size`` ranks, deriving the one size left as ``None``.

        ``cp=None`` gives CP every rank that the other sizes leave (``dp`` defaults to 1 then);
        otherwise ``dp=None`` gives DP what is left. With both given, their product must match.

        Raises:
            ValueError: a size is invalid or ``world_size`` is not the product of the sizes.
        """
        _check_size("world_size", world_size)
        derived = "cp" if cp is None else "dp" if dp is None else None
        requested = {"tp": tp, "cp": cp, "pp": pp, "dp": 1 if dp is None and cp is None else dp, "ext_dp": ext_dp}
        given = {name: _check_size(name, value) for name, value in requested.items() if name != derived}
        product = math.prod(given.values())
        shown = " x ".join(f"{name}={value}" for name, value in given.items())
        if derived is None:
            if product != world_size:
                raise ValueError(f"world size {world_size} != {shown} = {product}")
            return cls(**given, ep_includes_cp=ep_includes_cp)
        if world_size % product != 0:
            raise ValueError(f"world size {world_size} is not divisible by {shown} = {product} ({derived} takes the rest)")
        return cls(**given, **{derived: world_size // product}, ep_includes_cp=ep_includes_cp)

    @classmethod
    def from_config(cls, config: MegacpConfig, world_size: int) -> ParallelLayout:
        """The mesh of ``world_size`` ranks from ``config``: configured tp, cp, pp, ext_dp; dp takes
        the rest.

        Raises:
            ConfigError: the sizes do not divide ``world_size``, or ``expert_model_parallel.size``
                differs from the EP group this layout implies.
        """
        prefix = f"{config.source}: " if config.source else ""
        cp, tp, pp = config.context_parallel.size, config.tensor_model_parallel.size, config.pipeline_model_parallel.size
        ext_dp = config.external_data_parallel.size
        names = "context_parallel.size x tensor_model_parallel.size x pipeline_model_parallel.size"
        sizes = f"{cp} x {tp} x {pp}"
        if ext_dp > 1:
            names, sizes = f"{names} x external_data_parallel.size", f"{sizes} x {ext_dp}"
        per_replica = cp * tp * pp * ext_dp
        if world_size < 1 or world_size % per_replica != 0:
            raise ConfigError(
                f"{prefix}{names} = {sizes} = {per_replica} does not divide the world size {world_size}; "
                f"allowed: sizes whose product divides {world_size}"
            )
        expert = config.expert_model_parallel
        layout = cls(
            tp=tp, cp=cp, pp=pp, dp=world_size // per_replica, ext_dp=ext_dp, ep_includes_cp=expert.include_cp
        )
        implied = layout.dp * layout.tp * (layout.cp if expert.include_cp else 1)
        if expert.size is not None and expert.size != implied:
            spans = "dp x cp x tp" if expert.include_cp else "dp x tp"
            raise ConfigError(
                f"{prefix}expert_model_parallel.size: {expert.size} does not match the expert-parallel group "
                f"of {layout} ({spans} = {implied} ranks); allowed value: {implied}"
            )
        return layout


    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh: ``ext_dp * dp * pp * cp * tp``."""
        return self.ext_dp * self.dp * self.pp * self.cp * self.tp

    def sizes(self) -> dict[str, int]:
        """Size of every axis, keyed by axis name in :data:`AXES` order."""
        return {axis: getattr(self, axis) for axis in AXES}

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``: a dict with keys ``ext_dp, dp, pp, cp, tp``.

        Raises:
            ValueError: ``rank`` is not in ``[0, world_size)``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        out: dict[str, int] = {}
        rest = rank
        for axis in reversed(AXES):
            rest, out[axis] = divmod(rest, getattr(self, axis))
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates; omitted axes are 0.

        Raises:
            ValueError: an unknown axis name or a coordinate outside ``[0, size)``.
        """
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; axes are {list(AXES)}")
        rank = 0
        for axis in AXES:
            size, index = getattr(self, axis), coords.get(axis, 0)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise ValueError(f"coordinate {axis}={index!r} is outside [0, {size})")
            rank = rank * size + index
        return rank

    def group_axes(self, name: str) -> tuple[str, ...]:
        """Axes whose coordinates vary inside one group of kind ``name``."""
        if name not in GROUP_AXES:
            raise ValueError(f"unknown group kind {name!r}; kinds are {list(GROUP_KINDS)}")
        if name == "ep" and self.ep_includes_cp:
            return ("dp", "cp", "tp")
        if name == "edp" and self.ep_includes_cp:
            return ()
        return GROUP_AXES[name]

    def groups(self, name: str) -> list[list[int]]:
        """Every group of kind ``name`` (see the module docstring), as lists of global ranks.

        The groups partition ``range(world_size)``; each is sorted ascending and the list is
        ordered by each group's smallest rank.
        """
        inner = self.group_axes(name)
        outer = [axis for axis in AXES if axis not in inner]
        groups = []
        for fixed in itertools.product(*(range(getattr(self, axis)) for axis in outer)):
            base = dict(zip(outer, fixed))
            members = [
                self.rank_of(**base, **dict(zip(inner, varying)))
                for varying in itertools.product(*(range(getattr(self, axis)) for axis in inner))
            ]
            groups.append(sorted(members))
        return sorted(groups, key=lambda group: group[0])

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of kind ``name`` that contains ``rank`` (global ranks, ascending)."""
        here = self.coords(rank)
        inner = self.group_axes(name)
        members = [
            self.rank_of(**{**here, **dict(zip(inner, varying))})
            for varying in itertools.product(*(range(getattr(self, axis)) for axis in inner))
        ]
        return sorted(members)

    def __str__(self) -> str:
        sizes = " x ".join(f"{axis}{getattr(self, axis)}" for axis in AXES)
        ranks = "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"
        suffix = " (ep includes cp)" if self.ep_includes_cp else ""
        return f"{sizes} = {ranks}{suffix}"
