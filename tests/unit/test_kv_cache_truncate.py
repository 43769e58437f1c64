"""``ShardedKVCache.truncate``: cutting a slot back to a prefix leaves every CP rank holding exactly
the rows (and positions) it would hold had the request stopped at that prefix, and the next step
places its tokens as on such a cache."""

from __future__ import annotations

import pytest

from megacp.kv_cache import ShardedKVCache


def _cache(n: int, rank: int) -> tuple[ShardedKVCache, int]:
    cache = ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_requests=2, capacity=64, cp_size=n,
                           cp_rank=rank)
    return cache, cache.allocate()


def _run(cache: ShardedKVCache, slot: int, steps: list[int]) -> None:
    for t in steps:
        cache.commit([slot], cache.plan([slot], [t]))


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("length", [0, 1, 5, 7, 9, 12, 13, 16])
def test_truncate_keeps_each_ranks_rows_of_the_prefix(n: int, length: int) -> None:
    steps = [7, 5, 1, 1, 3]
    ranks = [_cache(n, rank) for rank in range(n)]
    for cache, slot in ranks:
        _run(cache, slot, steps)
    before = [[p for p in cache.positions[slot].tolist() if p >= 0] for cache, slot in ranks]
    kept = [[p for p in rows if p < length] for rows in before]  # rows are in position order: a prefix stays
    for (cache, slot), rows in zip(ranks, kept):
        cache.truncate(slot, length)
        assert cache.length(slot) == length
        assert [cache.local_length(slot, j) for j in range(n)] == [len(r) for r in kept]
        assert cache.positions[slot].tolist() == rows + [-1] * (cache.capacity - len(rows))
        _run(cache, slot, [6, 1])  # the next turn continues at position `length`
    after = [[p for p in cache.positions[slot].tolist() if p >= 0] for cache, slot in ranks]
    for rows, new in zip(kept, after):
        assert new[: len(rows)] == rows and all(p >= length for p in new[len(rows):])
    assert sorted(p for rows in after for p in rows) == list(range(length + 7))  # every position on one rank


def test_truncate_refuses_a_length_beyond_the_slot() -> None:
    cache, slot = _cache(2, 0)
    _run(cache, slot, [4])
    with pytest.raises(ValueError, match="cannot truncate KV cache slot 0 of 4 tokens to 5"):
        cache.truncate(slot, 5)
    cache.truncate(slot, 4)
    assert cache.length(slot) == 4


@pytest.mark.parametrize("n", [2, 3])
def test_a_cut_step_keeps_its_placement_for_windowed_plans(n: int) -> None:
    """A slot cut part-way through a step (prefix reuse): the runs the next step's plan places the
    cached keys by (what a windowed plan reads) are the positions every rank really holds, not
    those of a shorter step, which load balancing would place elsewhere."""
    for total in range(2, 30):
        for keep in range(1, total):
            ranks = [_cache(n, rank) for rank in range(n)]
            for cache, slot in ranks:
                _run(cache, slot, [total])
                cache.truncate(slot, keep)
            plan = ranks[0][0].plan([ranks[0][1]], [3])
            for j, (cache, slot) in enumerate(ranks):
                runs = plan.prefix_runs(j)
                assert runs is not None
                held = [p for a, b in runs[0] for p in range(a, b)]
                assert held == [p for p in cache.positions[slot].tolist() if p >= 0], (total, keep, j)
