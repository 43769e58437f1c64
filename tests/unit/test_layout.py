"""Layout arithmetic of the process mesh (pure Python, no processes)."""

from __future__ import annotations

import itertools

import pytest

from megacp import ParallelLayout
from megacp.parallel.layout import AXES, GROUP_KINDS

SHAPES = [
    dict(),
    dict(cp=2),
    dict(cp=3),
    dict(tp=2, cp=2),
    dict(dp=2, cp=2),
    dict(dp=2, pp=2, cp=2, tp=2),
    dict(dp=3, pp=1, cp=2, tp=2),
    dict(dp=2, pp=3, cp=1, tp=2),
    dict(ext_dp=2, dp=2, pp=2, cp=3, tp=2),
    dict(ext_dp=3, cp=5),
    dict(dp=2, pp=2, cp=2, tp=2, ep_includes_cp=True),
    dict(ext_dp=2, dp=3, cp=2, tp=2, ep_includes_cp=True),
]


def brute_groups(layout: ParallelLayout, varying: tuple[str, ...]) -> list[list[int]]:
    """Reference: bucket every rank by the coordinates outside ``varying`` (independent of groups())."""
    buckets: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        buckets.setdefault(tuple(coords[a] for a in AXES if a not in varying), []).append(rank)
    return sorted((sorted(group) for group in buckets.values()), key=lambda group: group[0])


def test_pinned_ep_groups_with_cp() -> None:
    """16 = dp2 x pp2 x cp2 x tp2: EP = dp x tp of one (pp, cp) cell, never mixing cp in."""
    layout = ParallelLayout(tp=2, cp=2, pp=2, dp=2)
    assert layout.world_size == 16
    assert layout.groups("ep") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]


def test_pinned_groups_world16() -> None:
    layout = ParallelLayout(tp=2, cp=2, pp=2, dp=2)
    assert layout.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.groups("dp") == [[r, r + 8] for r in range(8)]
    assert layout.groups("dp_cp") == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]]
    assert layout.groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def test_pinned_ep_includes_cp() -> None:
    layout = ParallelLayout(tp=2, cp=2, pp=2, dp=2, ep_includes_cp=True)
    assert layout.groups("ep") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_ep_is_not_a_plain_dp_pp_transpose() -> None:
    """The classic bug: swap the dp and pp axes, then reshape into rows of dp*tp: cp leaks in."""
    layout = ParallelLayout(tp=2, cp=2, pp=2, dp=2)
    swapped = [
        layout.rank_of(dp=d, pp=p, cp=c, tp=t)
        for p, d, c, t in itertools.product(range(layout.pp), range(layout.dp), range(layout.cp), range(layout.tp))
    ]
    naive = [sorted(swapped[i:i + 4]) for i in range(0, len(swapped), 4)]
    assert naive[0] == [0, 1, 2, 3]  # mixes cp=0 and cp=1 of one dp replica
    assert sorted(naive) != layout.groups("ep")
    for group in layout.groups("ep"):
        assert len({layout.coords(r)["cp"] for r in group}) == 1
        assert len({layout.coords(r)["pp"] for r in group}) == 1


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (4, 1, 2), (3, 2, 1)])
def test_ep_without_cp_is_dp_by_tp(dp: int, pp: int, tp: int) -> None:
    """cp=1: EP groups are the familiar dp x tp groups: tp-blocks of every dp replica of one stage."""
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    expected = sorted(
        (sorted(d * pp * tp + p * tp + t for d in range(dp) for t in range(tp)) for p in range(pp)),
        key=lambda group: group[0],
    )
    assert layout.groups("ep") == expected
    assert ParallelLayout(tp=tp, pp=pp, dp=dp, ep_includes_cp=True).groups("ep") == expected


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "1")
def test_coords_round_trip_every_rank(shape: dict) -> None:
    layout = ParallelLayout(**shape)
    seen = set()
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        assert list(coords) == list(AXES)
        assert layout.rank_of(**coords) == rank
        e, d, p, c, t = (coords[a] for a in AXES)
        assert rank == (((e * layout.dp + d) * layout.pp + p) * layout.cp + c) * layout.tp + t
        seen.add(tuple(coords.values()))
    assert len(seen) == layout.world_size


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "1")
@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_groups_partition_and_match_reference(shape: dict, kind: str) -> None:
    layout = ParallelLayout(**shape)
    groups = layout.groups(kind)
    flat = [rank for group in groups for rank in group]
    assert sorted(flat) == list(range(layout.world_size))
    assert all(group == sorted(group) for group in groups)
    assert [group[0] for group in groups] == sorted(group[0] for group in groups)
    varying = layout.group_axes(kind)
    expected_size = 1
    for axis in varying:
        expected_size *= getattr(layout, axis)
    assert all(len(group) == expected_size for group in groups)
    assert groups == brute_groups(layout, varying)
    for group in groups:
        for rank in group:
            assert layout.group_of(kind, rank) == group


def test_group_axes() -> None:
    assert ParallelLayout().group_axes("ep") == ("dp", "tp")
    assert ParallelLayout(ep_includes_cp=True).group_axes("ep") == ("dp", "cp", "tp")
    assert ParallelLayout().group_axes("dp_cp") == ("dp", "cp")
    with pytest.raises(ValueError, match="unknown group kind 'sp'"):
        ParallelLayout().groups("sp")


def test_dp_group_stays_inside_one_ext_dp() -> None:
    layout = ParallelLayout(ext_dp=2, dp=2, cp=2)
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("field", AXES)
@pytest.mark.parametrize("bad", [0, -1, 1.0, "2", True, None])
def test_invalid_sizes_name_the_field(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=rf"^ParallelLayout\.{field} must be an int >= 1, got "):
        ParallelLayout(**{field: bad})


def test_invalid_ep_flag_and_frozen() -> None:
    with pytest.raises(ValueError, match="ep_includes_cp must be a bool"):
        ParallelLayout(ep_includes_cp=1)
    layout = ParallelLayout(cp=2)
    with pytest.raises(AttributeError):
        layout.cp = 4  # type: ignore[misc]
    assert layout == ParallelLayout(cp=2) and hash(layout) == hash(ParallelLayout(cp=2))


def test_coords_and_rank_of_reject_out_of_range() -> None:
    layout = ParallelLayout(tp=2, cp=2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\), got 4"):
        layout.coords(4)
    with pytest.raises(ValueError, match=r"coordinate cp=2 is outside \[0, 2\)"):
        layout.rank_of(cp=2)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        layout.rank_of(sp=0)
    assert layout.rank_of(cp=1) == 2 and layout.rank_of() == 0


@pytest.mark.parametrize(
    "world,kwargs,expected",
    [
        (8, {}, dict(cp=8)),
        (8, dict(tp=2), dict(tp=2, cp=4)),
        (8, dict(cp=2), dict(cp=2, dp=4)),
        (8, dict(cp=2, tp=2), dict(cp=2, tp=2, dp=2)),
        (12, dict(cp=None, dp=3, tp=2), dict(cp=2, dp=3, tp=2)),
        (16, dict(cp=2, dp=2, pp=2, tp=2), dict(cp=2, dp=2, pp=2, tp=2)),
        (8, dict(tp=2, ext_dp=2), dict(tp=2, ext_dp=2, cp=2)),
        (1, {}, {}),
    ],
)
def test_from_world(world: int, kwargs: dict, expected: dict) -> None:
    layout = ParallelLayout.from_world(world, **kwargs)
    assert layout == ParallelLayout(**expected)
    assert layout.world_size == world


@pytest.mark.parametrize(
    "world,kwargs,message",
    [
        (6, dict(tp=4), r"^world size 6 is not divisible by tp=4 x pp=1 x dp=1 x ext_dp=1 = 4 \(cp takes the rest\)$"),
        (8, dict(cp=3), r"^world size 8 is not divisible by tp=1 x cp=3 x pp=1 x ext_dp=1 = 3 \(dp takes the rest\)$"),
        (8, dict(cp=2, dp=2), r"^world size 8 != tp=1 x cp=2 x pp=1 x dp=2 x ext_dp=1 = 4$"),
        (0, {}, r"^ParallelLayout\.world_size must be an int >= 1, got 0$"),
        (8, dict(tp=0), r"^ParallelLayout\.tp must be an int >= 1, got 0$"),
    ],
)
def test_from_world_errors(world: int, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelLayout.from_world(world, **kwargs)


def test_str() -> None:
    assert str(ParallelLayout(cp=2, tp=2)) == "ext_dp1 x dp1 x pp1 x cp2 x tp2 = 4 ranks"
    assert str(ParallelLayout(dp=2, ep_includes_cp=True)).endswith("(ep includes cp)")


def test_sizes_product_is_world_size() -> None:
    for sizes in itertools.product([1, 2, 3], repeat=5):
        layout = ParallelLayout(**dict(zip(AXES, sizes)))
        product = 1
        for value in layout.sizes().values():
            product *= value
        assert layout.world_size == product
