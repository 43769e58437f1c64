"""Sliding-window tile planning and banded partial attention against explicit position masks."""

from __future__ import annotations

import pytest
import torch

from megacp.attention.kernels.partial import partial_attention
from megacp.attention.kernels.partial_backward import partial_attention_backward
from megacp.attention.kernels.tile_attention import run_tiles
from megacp.placement import ShardPlan
from tests.helpers.reference import naive_attention


def _visible_by_tiles(plan: ShardPlan, qr: int, kr: int) -> torch.Tensor:
    """Bool [local queries, KV block rows] the tiles of (qr, kr) let through."""
    nq, nk = plan.num_local(qr), plan.max_kv_block
    seen = torch.zeros(nq, nk, dtype=torch.int64)
    for t in plan.tiles(qr, kr):
        lq, lk = t.q1 - t.q0, t.k1 - t.k0
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        m = torch.ones(lq, lk, dtype=torch.bool)
        if t.causal:
            m &= j <= i + lk - lq
        if t.left is not None:
            m &= j >= i + lk - lq - t.left
        seen[t.q0:t.q1, t.k0:t.k1] += m.long()
    assert seen.max() <= 1, "a (query, key) pair is computed twice"
    return seen.bool()


def _positions(plan: ShardPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request id, position) of each local token of ``rank``."""
    req = torch.cat([torch.full((b - a,), i) for i, rs in enumerate(plan.ranges[rank]) for a, b in rs])
    return req, plan.local_positions(rank)


@pytest.mark.parametrize("lens,cp,window", [([40], 2, 1), ([40], 2, 7), ([37, 9, 24], 3, 5), ([64], 4, 9),
                                            ([30], 3, 64), ([50, 13], 2, 12)])
def test_windowed_tiles_cover_exactly_the_window(lens: list[int], cp: int, window: int) -> None:
    for r in range(cp):
        plan = ShardPlan([0] * len(lens), lens, cp, r).with_window(window)
        qreq, qpos = _positions(plan, r)
        for j in range(cp):
            kreq, kpos = _positions(plan, j)
            want = (qreq[:, None] == kreq[None]) & (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - window)
            got = _visible_by_tiles(plan, r, j)[:, : kpos.numel()]
            assert torch.equal(got, want), (r, j)


def test_planner_skips_tiles_outside_the_window() -> None:
    """CP 4, one 64-token sequence, window 4: 8 chunks of 8 tokens (rank r holds chunks r and 7-r), so a
    query chunk meets only its own chunk and the one before it: 10 of the 4x4 rank pairs compute
    anything (the own blocks, and (1,0) (2,1) (3,2) (2,3) (1,2) (0,1)); full causal: all 16."""
    full = [ShardPlan([0], [64], 4, r) for r in range(4)]
    win = [p.with_window(4) for p in full]
    pairs = lambda plans: sum(bool(p.tiles(p.rank, j)) for p in plans for j in range(4))  # noqa: E731
    assert pairs(full) == 16
    assert pairs(win) == 10
    assert not win[0].tiles(0, 3) and not win[3].tiles(3, 0)
    assert ShardPlan([0], [64], 4, 0).with_window(64).window is None  # a window over the whole context is causal


def test_windowed_plan_over_a_cache_places_cached_keys_by_their_runs() -> None:
    """A 10-token chunk after a 7-token chunk and two decoded tokens (CP 2): the tiles over each
    rank's block (cached keys, then new) let through exactly the window; without the cached keys'
    positions the windowed plan refuses."""
    history, window = [0, 7, 8, 9], 4
    from megacp.placement import positions_from_history

    held = [positions_from_history(history, 2, j) for j in range(2)]
    counts = [[len(h)] for h in held]
    with pytest.raises(ValueError, match=r"positions of the \d+ cached keys"):
        ShardPlan([9], [10], 2, 0, prefix_counts=counts).with_window(window).tiles(0, 0)
    for r in range(2):
        runs = [[[(p, p + 1) for p in held[j]]] for j in range(2)]  # one run per position: runs need not merge
        plan = ShardPlan([9], [10], 2, r, prefix_counts=counts, cached_runs=runs).with_window(window)
        qpos = plan.local_positions(r)
        for j in range(2):
            kpos = torch.tensor(held[j] + plan.local_positions(j).tolist())
            want = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - window)
            got = _visible_by_tiles(plan, r, j)[:, : kpos.numel()]
            assert torch.equal(got, want), (r, j)


@pytest.mark.parametrize("window", [1, 3, 16, 100])
def test_run_tiles_and_band_backward_equal_masked_reference(window: int) -> None:
    """Local (CP 1) windowed attention through the tiles, forward and gradients, against autograd of
    the explicitly masked reference; GQA 4/2."""
    torch.manual_seed(0)
    n = 33
    q, k, v = (torch.randn(n, h, 8, requires_grad=True) for h in (4, 2, 2))
    plan = ShardPlan([0], [n], 1, 0).with_window(window)
    out, lse = run_tiles(q.detach(), k.detach(), v.detach(), plan.tiles(0, 0), None)
    pos = torch.arange(n)
    ref = naive_attention(q, k, v, q_positions=pos, k_positions=pos, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for t in plan.tiles(0, 0):
        gq, gk, gv = partial_attention_backward(q.detach()[t.q0:t.q1], k.detach()[t.k0:t.k1], v.detach()[t.k0:t.k1],
                                                out[t.q0:t.q1], lse[t.q0:t.q1], dout[t.q0:t.q1], causal=t.causal,
                                                left=t.left)
        dq[t.q0:t.q1] += gq
        dk[t.k0:t.k1] += gk
        dv[t.k0:t.k1] += gv
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_band_on_a_dense_tile() -> None:
    """A dense tile (all keys before the queries) with a band: query i sees keys j >= i + Lk - Lq - left."""
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 2, 4), torch.randn(9, 2, 4), torch.randn(9, 2, 4)
    out, _ = partial_attention(q, k, v, left=6)  # Lk - Lq = 4: query i sees keys i - 2 ..
    i, j = torch.arange(5)[:, None], torch.arange(9)[None]
    mask = j >= i - 2
    scores = torch.einsum("qhd,khd->hqk", q, k) / 2
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", p, v), atol=1e-5, rtol=1e-5)
