"""Partial attention, merge, sharding, tile planning and the strategy rule (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from megacp.attention import (
    ShardPlan,
    build_kv_block,
    choose_strategy,
    local_counts,
    local_positions,
    merge_stack,
    merge_states,
    partial_attention,
    shard_ranges,
)
from megacp.attention.merge import pack_states, unpack_states
from megacp.attention.strategy import Hardware
from megacp.attention.tiles import Tile, plan_tiles
from tests.reference import naive_attention, rel_err


@pytest.mark.parametrize("lq,lk,causal", [(7, 7, True), (5, 300, True), (300, 1500, False), (300, 1500, True), (9, 4, True), (1, 1, True)])
def test_partial_attention_matches_reference(lq: int, lk: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(lq * 1000 + lk)
    q, k, v = torch.randn(lq, 8, 16, generator=g), torch.randn(lk, 2, 16, generator=g), torch.randn(lk, 2, 16, generator=g)
    qpos = torch.arange(lk - lq, lk) if causal else torch.full((lq,), lk)
    ref = naive_attention(q, k, v, q_positions=qpos, k_positions=torch.arange(lk))
    out, lse = partial_attention(q, k, v, causal=causal, backend="reference")
    assert rel_err(out, ref) < 1e-5
    # LSE: natural log of the sum of exp(scaled scores) over visible keys
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(4, 1)) / 4.0
    scores = scores.masked_fill(torch.arange(lk)[None, None, :] > qpos[None, :, None], -math.inf)
    ref_lse = torch.logsumexp(scores, -1).T
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse))
    assert torch.allclose(lse[seen].double(), ref_lse[seen], atol=1e-5)
    assert torch.all(out[~seen.any(-1)] == 0)


def test_partial_attention_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="Hq divisible by Hkv"):
        partial_attention(torch.randn(4, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match="not one of"):
        partial_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), backend="magic")


def test_merge_is_exact_and_handles_empty_partials() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 4, 8, generator=g), torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    full, full_lse = partial_attention(q, k, v)
    parts = [partial_attention(q, k[a:b], v[a:b]) for a, b in [(0, 13), (13, 14), (14, 40)]]
    empty = (torch.zeros(6, 4, 8), torch.full((6, 4), -math.inf))
    outs = torch.stack([p[0] for p in parts] + [empty[0]])
    lses = torch.stack([p[1] for p in parts] + [empty[1]])
    out, lse = merge_stack(outs, lses)
    assert rel_err(out, full) < 1e-6 and torch.allclose(lse, full_lse, atol=1e-6)
    out2, lse2 = merge_states(*parts[0], *empty)
    assert torch.allclose(out2, parts[0][0]) and torch.equal(lse2, parts[0][1])
    both_empty, lse_e = merge_states(*empty, *empty)
    assert not torch.isnan(both_empty).any() and torch.all(both_empty == 0) and torch.all(torch.isneginf(lse_e))
    stack_empty, _ = merge_stack(torch.stack([empty[0]] * 3), torch.stack([empty[1]] * 3))
    assert not torch.isnan(stack_empty).any()


def test_pack_states_round_trips_into_a_row_range_of_a_send_buffer() -> None:
    g = torch.Generator().manual_seed(1)
    out, lse = torch.randn(5, 4, 8, generator=g, dtype=torch.bfloat16), torch.randn(5, 4, generator=g)
    send = torch.zeros(3, 7, 4 * 8 * 2 + 4 * 4, dtype=torch.uint8)
    packed = pack_states(out, lse, into=send[1, :5])
    assert packed.data_ptr() == send[1].data_ptr()
    got_out, got_lse = unpack_states(send[1, :5], 4, 8, torch.bfloat16)
    assert torch.equal(got_out, out) and torch.equal(got_lse, lse)
    assert torch.count_nonzero(send[0]) == 0 and torch.count_nonzero(send[1, 5:]) == 0
    with pytest.raises(ValueError, match="destination must be uint8"):
        pack_states(out, lse, into=send[1, :4])


def test_bookkeeping_worked_example() -> None:
    history = [0, 4, 8, 9, 10, 11]
    assert local_positions(history, 2, 0) == [0, 3, 4, 7, 8, 10]
    assert local_positions(history, 2, 1) == [1, 2, 5, 6, 9]
    # a batch mixing a decoding request and a prefilling request: one int per request
    # (6 new tokens padded to 8 = 4 chunks of 2: rank 0 holds chunk 0 and the all-padding chunk 3)
    assert local_counts([history, [0, 6]], 2, 0) == [6, 2]
    assert local_counts([history, [0, 6]], 2, 1) == [5, 4]
    with pytest.raises(ValueError, match="start at 0"):
        local_positions([1, 4], 2, 0)


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


def test_kv_block_is_the_local_kv_when_blocks_are_unpadded() -> None:
    k, v = torch.randn(8, 2, 4), torch.randn(8, 2, 4)
    even = ShardPlan([0], [16], 2, 1)  # 8 tokens per rank, no cache: K and V travel as they are
    assert even.kv_blocks_unpadded
    bk, bv = build_kv_block(even, k, v)
    assert bk.data_ptr() == k.data_ptr() and bv.data_ptr() == v.data_ptr()
    ragged = ShardPlan([0], [15], 2, 0)  # rank 0 holds 7, rank 1 8: padded to one message size
    assert not ragged.kv_blocks_unpadded
    block = build_kv_block(ragged, k[:7], v[:7])
    assert block.shape == (2, 8, 2, 4) and torch.equal(block[0, :7], k[:7]) and not block[:, 7].any()
    with pytest.raises(ValueError, match="this rank's 7 new tokens"):
        build_kv_block(ragged, k, v)


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


def test_strategy_rule_on_the_papers_numbers() -> None:
    # Llama3-405B: NH=128, NKV=8 => miss-rate threshold 2*8/128 = 12.5% (when transfers are slow)
    hw = Hardware(flops=400e12, bandwidth=50e9)
    kw = dict(num_heads=128, num_kv_heads=8, cp_size=16, elem_bytes=2, hw=hw)
    full = choose_strategy(128_000, 0, **kw)
    assert full.strategy == "pass_kv"
    decode = choose_strategy(1, 128_000, **kw)
    assert decode.strategy == "pass_q"
    low_miss = choose_strategy(1000, 99_000, **kw)  # 1% miss rate, short T: pass-Q
    assert low_miss.strategy == "pass_q" and low_miss.miss_rate == pytest.approx(0.01)
    assert low_miss.miss_threshold == pytest.approx(0.125 - 4 * 1000 * 50e9 / (16 * 400e12 * 2))
    high_miss = choose_strategy(20_000, 80_000, **kw)  # 20% > 12.5%: pass-KV
    assert high_miss.strategy == "pass_kv"
    # transfers hidden: T >= N*C*NKV*e / (2*NH*BW)
    assert full.hide_threshold == pytest.approx(16 * 400e12 * 8 * 2 / (2 * 128 * 50e9))


def _calibrate(rank: int, n: int, cache_dir: str) -> tuple:
    import os

    os.environ["MEGACP_CACHE_DIR"] = cache_dir
    from megacp.attention.strategy import calibrate, hardware_for

    hw = calibrate(None, torch.device("cpu"))
    import torch.distributed as dist

    dist.barrier()  # rank 0 has written the cache
    return hw, hardware_for(torch.device("cpu"), n)


def test_calibration_measures_and_caches(tmp_path) -> None:
    from tests.distributed import run_distributed

    results = run_distributed(_calibrate, 2, str(tmp_path))
    (hw0, cached0), (hw1, _) = results
    assert hw0 == hw1 and hw0.source == "measured"  # the slowest rank's numbers, agreed by all
    assert 1e6 < hw0.flops < 1e14 and 1e5 < hw0.bandwidth < 1e13
    assert cached0 == hw0 and (tmp_path / "calibration.json").is_file()
    import json

    assert json.loads((tmp_path / "calibration.json").read_text())["cpu|cp2"] == {
        "flops": hw0.flops, "bandwidth": hw0.bandwidth, "source": "measured"}


def _lookup(rank: int, n: int, dirs: list[str]) -> tuple:
    import os

    import torch.distributed as dist

    os.environ["MEGACP_CACHE_DIR"] = dirs[rank]
    from megacp.attention.strategy import hardware_for

    own = hardware_for(torch.device("cpu"), n)
    agreed = hardware_for(torch.device("cpu"), n, dist.group.WORLD)
    return own, agreed, hardware_for(torch.device("cpu"), n)


def test_a_cp_group_agrees_on_one_calibration(tmp_path) -> None:
    """Ranks whose hosts cache different numbers (or none) would choose differently and hang the ring."""
    import json

    from megacp.attention.strategy import DEFAULTS, Hardware
    from tests.distributed import run_distributed

    dirs = [tmp_path / "host0", tmp_path / "host1"]
    for d in dirs:
        d.mkdir()
    (dirs[0] / "calibration.json").write_text(json.dumps({"cpu|cp2": {"flops": 1e9, "bandwidth": 5e8, "source": "measured"}}))
    (own0, agreed0, later0), (own1, agreed1, later1) = run_distributed(_lookup, 2, [str(d) for d in dirs])
    rank0 = Hardware(1e9, 5e8, "measured")
    assert own0 == rank0 and own1 == DEFAULTS["cpu"]  # alone, each rank reads its own host
    assert agreed0 == agreed1 == later0 == later1 == rank0  # the group takes rank 0's, and keeps it


def test_lower_level_entry_points_reject_bad_input_clearly() -> None:
    from megacp.attention.backward import ring_attention
    from megacp.attention.decode import local_decode_states
    from megacp.attention.merge import merge_into
    from megacp.attention.pass_kv import ring_pass_kv
    from megacp.attention.pass_q import ring_pass_q

    plan = ShardPlan([0], [16], 2, 1)  # CP = 2: without a ring only the own block would be attended
    q, k = torch.randn(8, 4, 8), torch.randn(8, 2, 8)
    for fn in (ring_pass_kv, ring_pass_q):
        with pytest.raises(ValueError, match="CP size 2 needs a ring"):
            fn(q, (k, k), plan, None)
    with pytest.raises(ValueError, match="CP size 2 needs a ring"):
        ring_attention(q, k, k, plan, None)
    out, lse = local_decode_states(torch.randn(0, 4, 8), [])  # no request
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)
    with pytest.raises(ValueError, match="fused merge forced but it does not apply"):
        merge_into(torch.zeros(3, 4, 8), torch.zeros(3, 4), torch.zeros(3, 4, 8), torch.zeros(3, 4), fused=True)
    with pytest.raises(ValueError, match="rank 2 outside a CP group of size 2"):
        shard_ranges(0, 10, 2, 2)
    with pytest.raises(ValueError, match="sum over the ranks"):
        ShardPlan([5], [3], 2, 0, prefix_counts=[[2], [2]])
