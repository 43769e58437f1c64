"""Partial attention, merge, the KV block and the ring entry points' input checks (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from megacp.attention import build_kv_block, merge_stack, merge_states, partial_attention
from megacp.attention.kernels.merge import pack_states, unpack_states
from megacp.placement import ShardPlan
from tests.helpers.reference import naive_attention, rel_err


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


def test_lower_level_entry_points_reject_bad_input_clearly() -> None:
    from megacp.attention.decode import local_decode_states
    from megacp.attention.kernels.merge import merge_into
    from megacp.attention.pass_kv import ring_pass_kv
    from megacp.attention.pass_q import ring_pass_q
    from megacp.attention.training import ring_attention

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
