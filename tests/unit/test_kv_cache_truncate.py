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
