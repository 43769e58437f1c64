"""Property-based test: random CP prefill / cached-prefill / decode cases against an fp64 reference.

Hypothesis draws the cases in the test process (a fixed seed, printed; ``MEGACP_PROPERTY_SEED``
picks another one to reproduce a run) and hands the whole list to one group of real gloo
processes per CP size N, whose ranks all run the same cases in the same order (no collective is
ever skipped on one rank only). A case is one of

* ``packed`` — :func:`megacp.attention.cp_attention` over a ragged packed batch (lengths shorter
  than 2N and not divisible by it included), pass-KV or pass-Q, load-balanced or contiguous;
* ``session`` — a sequence of steps of the CP attention layer over a :class:`ShardedKVCache`:
  prefills on top of cached prefixes, requests joining late, mixed steps and decode steps
  (all-gather decode), every output checked against attention over the request's full history.

Shapes vary in KV heads, GQA ratio, head dim and ``softmax_scale``. Every case is fp32 and must
match float64 attention within 1e-5 relative (:func:`tests.helpers.reference.rel_err`). A failure names
the case (its tensor seed and parameters) so that it can be replayed alone.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.helpers.distributed import run_distributed
from tests.helpers.reference import naive_attention, rel_err, session_step_reference

SEED = int(os.environ.get("MEGACP_PROPERTY_SEED", "20261201"))
CASES_PER_N = {1: 90, 2: 170, 3: 130, 4: 130}
"""Cases drawn per CP size (>= 500 in all); each group of processes runs its list in ~10 s."""
TOL = 1e-5

Case = dict[str, Any]


@st.composite
def _case(draw: st.DrawFn, n: int) -> Case:
    """One random case for CP size ``n`` (plain data: it travels to the ranks pickled)."""
    hkv = draw(st.sampled_from([1, 2, 3]))
    case: Case = {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "hkv": hkv,
        "hq": hkv * draw(st.sampled_from([1, 2, 4])),
        "d": draw(st.sampled_from([4, 8, 16])),
        "scale": draw(st.none() | st.floats(0.05, 1.0)),
        "strategy": draw(st.sampled_from(["pass_kv", "pass_q"])),
        "load_balance": draw(st.booleans()),
        "kind": draw(st.sampled_from(["packed", "session"])),
    }
    short = st.integers(1, 2 * n + 3)  # around 2N: shorter, equal, not divisible
    if case["kind"] == "packed":
        case["lens"] = draw(st.lists(st.integers(1, 6 * n + 5) | short, min_size=1, max_size=4))
        return case
    requests = draw(st.integers(1, 3))
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        slots = draw(st.lists(st.integers(0, requests - 1), min_size=1, max_size=requests, unique=True))
        decode = bool(steps) and draw(st.booleans())
        steps.append([(s, 1 if decode else draw(short | st.integers(1, 5 * n + 4))) for s in slots])
    case["requests"], case["steps"] = requests, steps
    return case


def draw_cases(n: int, count: int, base_seed: int = SEED) -> list[Case]:
    """``count`` cases for CP size ``n``, the same for the same seed (generation only: no shrinking
    happens here; a failing case is reported with its parameters by the ranks)."""
    cases: list[Case] = []

    @seed(base_seed + n)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_case(n))
    def collect(case: Case) -> None:
        cases.append(case)

    collect()
    return cases


def _packed(case: Case, n: int) -> float:
    from megacp.attention import cp_attention

    g = torch.Generator().manual_seed(case["seed"])
    lens, d = case["lens"], case["d"]
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, generator=g) for h in (case["hq"], case["hkv"], case["hkv"]))
    cu = torch.tensor([0, *lens]).cumsum(0)
    out = cp_attention(q, k, v, cu_seqlens=cu, strategy=case["strategy"], load_balance=case["load_balance"],
                       scale=case["scale"])
    refs, s = [], 0
    for length in lens:
        pos = torch.arange(length)
        refs.append(naive_attention(q[s:s + length], k[s:s + length], v[s:s + length], q_positions=pos,
                                    k_positions=pos, scale=case["scale"]))
        s += length
    return rel_err(out, torch.cat(refs))


def _session(case: Case, n: int, rank: int, ring: Any) -> float:
    from megacp.kv_cache import ShardedKVCache
    from megacp.layers.cp_attention import CPDotProductAttention
    from megacp.layers.settings import CPSettings
    from megacp.layers.step import HeadShape, begin_step

    hq, hkv, d = case["hq"], case["hkv"], case["d"]
    layer = CPDotProductAttention(hq, d, hkv, qkv_format="thd", layer_number=1, softmax_scale=case["scale"],
                                  settings=CPSettings(ring=ring))
    settings = CPSettings(ring=ring, prefill=case["strategy"], load_balance=case["load_balance"])
    totals = [0] * case["requests"]
    for step_spec in case["steps"]:
        for s, t in step_spec:
            totals[s] += t
    cache = ShardedKVCache(num_layers=1, num_kv_heads=hkv, head_dim=d, max_requests=case["requests"],
                           capacity=max(totals), cp_size=n, cp_rank=rank, load_balance=case["load_balance"])
    slots = [cache.allocate() for _ in range(case["requests"])]
    hist_k = [torch.empty(0, hkv, d) for _ in slots]
    hist_v = [torch.empty(0, hkv, d) for _ in slots]
    g = torch.Generator().manual_seed(case["seed"])
    worst = 0.0
    for step_spec in case["steps"]:
        step_slots, new = [slots[s] for s, _ in step_spec], [t for _, t in step_spec]
        q, k, v = (torch.randn(sum(new), h, d, generator=g) for h in (hq, hkv, hkv))
        step = begin_step(settings, cache, step_slots, new, heads=HeadShape(hq, hkv, 4), device=q.device)
        idx = step.token_index()
        out = layer(q[idx], k[idx], v[idx], qkv_format="thd", inference_params=step).view(-1, hq, d)
        step.commit()
        ref = session_step_reference(q, k, v, step_slots, new, hist_k, hist_v, case["scale"])
        worst = max(worst, rel_err(out, ref[idx]))
    return worst


def _run_cases(rank: int, n: int, cases: list[Case]) -> list[tuple[int, float]]:
    """Every case on this rank, in order; returns ``(case index, error)`` for those above :data:`TOL`
    and re-raises a case's exception with the case attached."""
    from megacp.parallel.ring import Ring

    ring = Ring() if n > 1 else None
    bad = []
    for i, case in enumerate(cases):
        try:
            err = _packed(case, n) if case["kind"] == "packed" else _session(case, n, rank, ring)
        except Exception as exc:
            raise RuntimeError(f"case {i} {case} failed on rank {rank} of {n}") from exc
        if not err <= TOL:  # NaN fails too
            bad.append((i, err))
    return bad


@pytest.mark.parametrize("n", sorted(CASES_PER_N))
def test_random_cases_match_fp64_reference(n: int) -> None:
    cases = draw_cases(n, CASES_PER_N[n])
    print(f"hypothesis seed {SEED + n} (MEGACP_PROPERTY_SEED={SEED}): {len(cases)} cases at N={n}")
    assert len(cases) >= CASES_PER_N[n] * 0.9, len(cases)
    results = run_distributed(_run_cases, n, cases)
    failures = {(i, rank, err) for rank, bad in enumerate(results) for i, err in bad}
    assert not failures, [(f"rank {rank}", f"err {err:.2e}", cases[i]) for i, rank, err in sorted(failures)[:5]]
