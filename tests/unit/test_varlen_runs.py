"""Which planned tiles share one varlen call (:func:`megacp.attention.kernels.varlen.group_runs`): packed
documents' tiles as the planner makes them, at CP 1 and CP 2."""

from __future__ import annotations

from megacp.attention.kernels.varlen import TileRun, group_runs
from megacp.placement import ShardPlan, Tile


def test_packed_documents_form_one_run_and_long_tiles_stay_alone() -> None:
    tiles = ShardPlan([0, 0, 0, 0], [5, 3, 9, 2], 1, 0).tiles(0, 0)
    assert tiles == [Tile(0, 5, 0, 5, True), Tile(5, 8, 5, 8, True), Tile(8, 17, 8, 17, True), Tile(17, 19, 17, 19, True)]
    (run,) = group_runs(tiles, None)
    assert isinstance(run, TileRun) and (run.q0, run.q1, run.k0, run.k1, run.causal) == (0, 19, 0, 19, True)
    # a tile longer than the bound breaks the run; a stretch of one tile stays a tile
    assert group_runs(tiles, 5) == [TileRun(tuple(tiles[:2])), tiles[2], tiles[3]]
    assert group_runs(tiles, 2) == tiles


def test_ring_tiles_split_by_mask_kind_and_contiguity() -> None:
    plan = ShardPlan([0, 0, 0], [8, 12, 4], 2, 1)
    own = plan.tiles(1, 1)
    units = group_runs(own, None)
    assert [t for u in units for t in (u.tiles if isinstance(u, TileRun) else (u,))] == own  # order and tiles kept
    for u in units:
        if isinstance(u, TileRun):
            assert len({t.causal for t in u.tiles}) == 1
            assert all(a.q1 == b.q0 and a.k1 == b.k0 for a, b in zip(u.tiles, u.tiles[1:]))
    assert any(isinstance(u, TileRun) for u in units)
    # dense tiles over the first chunk of each request in rank 0's block: the keys have gaps, no run
    earlier = plan.tiles(1, 0)
    assert [t.causal for t in earlier] == [False] * 3 and earlier[0].k1 < earlier[1].k0
    assert group_runs(earlier, None) == earlier
    windowed = [Tile(0, 4, 0, 4, True, left=2), Tile(4, 8, 4, 8, True)]
    assert group_runs(windowed, None) == windowed  # a band never joins
    after_prefix = [Tile(0, 96, 0, 4096, True), Tile(96, 99, 4096, 4099, False)]
    assert group_runs(after_prefix, None) == [TileRun(tuple(after_prefix[:1])), after_prefix[1]]  # one call, not two
    assert group_runs(after_prefix, 64) == after_prefix
    short_keys = [Tile(0, 4, 0, 2, True), Tile(4, 8, 2, 6, True)]
    assert group_runs(short_keys, None) == short_keys  # a causal tile whose first queries see nothing
