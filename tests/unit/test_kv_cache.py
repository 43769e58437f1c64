"""The CP-sharded KV cache's bookkeeping: slots, placement across steps, capacity checks before any
write (single process: every CP rank's cache is built here, no communication is needed to plan)."""

from __future__ import annotations

import pytest
import torch

from megacp.kv_cache import CacheCapacityError, ShardedKVCache
from megacp.placement import positions_from_history

HKV, D = 2, 4


def _caches(n: int, capacity: int) -> list[ShardedKVCache]:
    return [ShardedKVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_requests=2, capacity=capacity,
                           cp_size=n, cp_rank=r) for r in range(n)]


def test_every_rank_holds_the_positions_of_the_placement_rule() -> None:
    n = 3
    caches = _caches(n, capacity=16)
    slots = [c.allocate() for c in caches]
    assert len(set(slots)) == 1
    slot = slots[0]
    for new in (13, 5, 1, 1, 1):  # chunked prefill, then decode steps
        total = caches[0].length(slot) + new
        keys = torch.arange(total, dtype=torch.float32)[:, None, None].expand(total, HKV, D)
        for c in caches:
            plan = c.plan([slot], [new])
            local = keys[plan.local_positions()]  # key value = its global position
            c.write(0, [slot], plan, local, local)
            c.commit([slot], plan)
    history = caches[0].history(slot)
    assert history == [0, 13, 18, 19, 20, 21]
    for r, c in enumerate(caches):
        expect = positions_from_history(history, n, r)
        held = c.local_length(slot)
        assert held == len(expect) and c.positions[slot, :held].tolist() == expect
        assert c.k[0, slot, :held, 0, 0].tolist() == [float(x) for x in expect]
        assert all(c.local_length(slot, j) == len(positions_from_history(history, n, j)) for j in range(n))


def test_capacity_and_slots_are_checked_before_anything_is_written() -> None:
    (cache,) = _caches(1, capacity=8)
    a, b = cache.allocate(), cache.allocate()
    with pytest.raises(CacheCapacityError, match="slots are in use"):
        cache.allocate()
    with pytest.raises(CacheCapacityError, match="needs 9 tokens on CP rank 0 but the KV cache holds 8"):
        cache.plan([a], [9])
    assert cache.length(a) == 0 and cache.history(a) == [0]
    with pytest.raises(ValueError, match="lists a slot twice"):
        cache.plan([a, a], [1, 1])
    cache.free(b)
    with pytest.raises(KeyError, match="slot 1 is not allocated"):
        cache.length(b)
    assert cache.allocate() == b and bool((cache.positions[b] == -1).all())


def test_the_slot_table_keeps_no_tensors_and_matches_the_cache() -> None:
    """The slot table alone (no storage) plans and commits the steps a whole cache does, holding
    only host values, and says the same lengths and positions."""
    import torch

    from megacp.kv_cache import SlotTable

    steps = [7, 5, 1, 1, 3]
    for n in (1, 3):
        for r in range(n):
            table = SlotTable(max_requests=2, capacity=32, cp_size=n, cp_rank=r)
            cache = ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_requests=2, capacity=32, cp_size=n,
                                   cp_rank=r)
            a, b = table.allocate(), cache.allocate()
            for t in steps:
                table.commit([a], table.plan([a], [t]))
                cache.commit([b], cache.plan([b], [t]))
            table.advance_decoded(a, 2)
            cache.advance_decoded(b, 2)
            assert not any(isinstance(v, torch.Tensor) for v in vars(table).values())
            assert table.snapshot(a) == cache.snapshot(b)
            assert torch.equal(table.positions, cache.positions)
            assert table.history(a) == [0, 7, 12, 13, 14, 17, 18, 19]
