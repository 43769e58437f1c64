"""The placement rule: prefill sharding, decode placement, history bookkeeping, per-rank layouts
and tile planning (pure host-side integers, single process)."""

from __future__ import annotations

import pytest

from megacp.placement import ShardPlan, Tile, local_counts, plan_tiles, positions_from_history, shard_ranges


def test_bookkeeping_worked_example() -> None:
    history = [0, 4, 8, 9, 10, 11]
    assert positions_from_history(history, 2, 0) == [0, 3, 4, 7, 8, 10]
    assert positions_from_history(history, 2, 1) == [1, 2, 5, 6, 9]
    # a batch mixing a decoding request and a prefilling request: one int per request
    # (6 new tokens padded to 8 = 4 chunks of 2: rank 0 holds chunk 0 and the all-padding chunk 3)
    assert local_counts([history, [0, 6]], 2, 0) == [6, 2]
    assert local_counts([history, [0, 6]], 2, 1) == [5, 4]
    with pytest.raises(ValueError, match="start at 0"):
        positions_from_history([1, 4], 2, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("start,count", [(0, 1), (5, 1), (0, 3), (0, 16), (7, 33), (100, 1000)])
def test_shard_ranges_partition_and_balance(n: int, start: int, count: int) -> None:
    held = [[x for a, b in shard_ranges(start, count, n, r) for x in range(a, b)] for r in range(n)]
    assert sorted(x for h in held for x in h) == list(range(start, start + count))
    if count == 1:
        assert held[start % n] == [start]
    elif count % (2 * n) == 0:
        assert len({len(h) for h in held}) == 1  # equal shares when divisible


def test_shard_plan_indices_and_layouts() -> None:
    plan = ShardPlan([0, 10], [5, 1], 2, 0, prefix_counts=[[0, 6], [0, 4]])
    assert plan.ranges[0] == [[(0, 2)], [(10, 11)]] and plan.ranges[1] == [[(2, 4), (4, 5)], []]
    assert plan.local_index().tolist() == [0, 1, 5] and plan.local_positions().tolist() == [0, 1, 10]
    assert plan.local_index(1).tolist() == [2, 3, 4]
    assert plan.max_kv_block == 9 and plan.max_local == 3


def test_tiles_are_the_papers_three_kinds() -> None:
    plan = ShardPlan([0], [16], 2, 0)  # chunks of 4: rank 0 holds [0,4)+[12,16), rank 1 [4,8)+[8,12)
    assert plan_tiles(plan.q_layout(0), plan.kv_layout(0)) == [Tile(0, 8, 0, 8, True)]  # causal, local
    assert plan_tiles(plan.q_layout(1), plan.kv_layout(0)) == [Tile(0, 8, 0, 4, False)]  # lower rank: 1st chunk
    assert plan_tiles(plan.q_layout(0), plan.kv_layout(1)) == [Tile(4, 8, 0, 8, False)]  # higher: 2nd local chunk
    # what each rank's push carries: a later rank reads only the first chunk of an earlier rank's block
    assert (plan.kv_rows_read(1, 0), plan.kv_rows_read(0, 1), plan.kv_rows_read(0, 0)) == (4, 8, 8)
    four = ShardPlan([0], [32], 4, 0)  # chunks of 4, rank j holds chunks j and 7-j
    assert [[four.kv_rows_read(t, b) for b in range(4)] for t in range(4)] == [
        [8, 8, 8, 8], [4, 8, 8, 8], [4, 4, 8, 8], [4, 4, 4, 8]]


def test_bad_placement_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="rank 2 outside a CP group of size 2"):
        shard_ranges(0, 10, 2, 2)
    with pytest.raises(ValueError, match="sum over the ranks"):
        ShardPlan([5], [3], 2, 0, prefix_counts=[[2], [2]])
