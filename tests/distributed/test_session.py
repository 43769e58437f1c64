"""Sessions on the persistent CP-sharded cache against Hugging Face transformers: every turn's
greedy reply equals transformers' greedy generation on the whole joined history (ragged turns, a
one-token turn, two sessions interleaved in one cache, a slot reused after close), at CP = 2 and 3
with prefill auto / pass-KV / pass-Q; and the capacity errors, raised before any work.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import hf_greedy, make_hf_model

NEW = 5
TURNS_A = (120, 1, 37)
TURNS_B = (9, 64)


def _turns(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    d = tmp_path_factory.mktemp("session")
    return str(d), make_hf_model("llama3", d)


def reference(hf: torch.nn.Module, turns: list[list[int]]) -> list[list[int]]:
    """transformers' greedy reply to each turn given the whole conversation before it."""
    history, replies = [], []
    for turn in turns:
        history += turn
        reply = hf_greedy(hf, [history], NEW)[0]
        replies.append(reply)
        history += reply
    return replies


def _session_body(rank: int, n: int, path: str, strategies: list[str], a: list[list[int]],
                  b: list[list[int]]) -> dict:
    from megacp import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    out = {}
    for strategy in strategies:
        llm = LLM(path, dtype="float32", strategy=strategy, max_sessions=2, max_session_tokens=512)
        sa, sb = llm.session(), llm.session()
        ra, rb, strat = [], [], []
        for i, turn in enumerate(a):  # the two sessions take turns in one cache
            ra.append(sa.send(turn, greedy).token_ids)
            strat.append(sa.last_report["prefill_strategy"])
            if i < len(b):
                rb.append(sb.send(b[i], greedy).token_ids)
        sb.close()
        with llm.session() as sc:  # the slot sb held, reused from an empty history
            rc = sc.send(b[0], greedy).token_ids
        out[strategy] = dict(a=ra, b=rb, c=rc, history=sa.history, strategies=strat)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_three_turn_session_equals_transformers_on_the_joined_history(n: int, tiny) -> None:
    path, hf = tiny
    a, b = _turns(TURNS_A, 1), _turns(TURNS_B, 2)
    ref_a, ref_b = reference(hf, a), reference(hf, b)
    joined = [t for turn, reply in zip(a, ref_a) for t in turn + reply]
    strategies = ["auto", "pass_kv", "pass_q"]
    for got in run_distributed(_session_body, n, path, strategies, a, b):
        for strategy in strategies:
            g = got[strategy]
            assert g["a"] == ref_a, strategy
            assert g["b"] == ref_b and g["c"] == ref_b[0], strategy
            assert g["history"] == joined
            # each turn prefills the last reply's final token with it: even the 1-token turn is a ring prefill
            if strategy != "auto":
                assert all(s[0] == strategy for s in g["strategies"]), g["strategies"]
            else:
                # a full prefill goes pass-KV; 2 new tokens over 125 cached go pass-Q (the paper's rule)
                assert g["strategies"][:2] == [["pass_kv"], ["pass_q"]], g["strategies"]


def _capacity_body(rank: int, n: int, path: str, turn: list[int]) -> list[str]:
    from megacp import LLM, SamplingParams
    from megacp.kv_cache import CacheCapacityError

    llm = LLM(path, dtype="float32", max_sessions=1, max_session_tokens=64)
    s = llm.session()
    errors = []
    for bad, params in ((turn * 20, SamplingParams(max_tokens=4)), (turn, SamplingParams(max_tokens=60)),
                        ([], SamplingParams()), ([300], SamplingParams())):
        with pytest.raises((CacheCapacityError, ValueError)) as err:
            s.send(bad, params)
        errors.append(str(err.value))
    with pytest.raises(CacheCapacityError) as err:
        llm.session()
    errors.append(str(err.value))
    reply = s.send(turn, SamplingParams(max_tokens=3, ignore_eos=True)).token_ids  # nothing was written before
    errors.append(str(len(s.history) == len(turn) + 3 and len(reply) == 3))
    s.close()
    llm.session().close()  # the slot is free again
    return errors


def test_session_capacity_errors_are_clear_and_come_before_any_work(tiny) -> None:
    path, _ = tiny
    got = run_distributed(_capacity_body, 2, path, _turns((5,), 3)[0])
    assert got[0] == got[1]
    assert got[0] == [
        "the session would hold 0 + 100 (turn) + 4 (max_tokens) = 104 tokens, more than its 64 "
        "(LLM(max_session_tokens=...))",
        "the session would hold 0 + 5 (turn) + 60 (max_tokens) = 65 tokens, more than its 64 "
        "(LLM(max_session_tokens=...))",
        "turn is empty; it needs at least one token",
        "turn: token id 300 is outside the model's vocabulary [0, 256)",
        "all 1 sessions are open; close one or raise LLM(max_sessions=...)",
        "True",
    ]


@pytest.mark.parametrize("n", [2, 3])
def test_check_room_predicts_the_steps_that_fit(n: int) -> None:
    """``check_room`` on a request's future steps raises exactly when planning those steps one by
    one would (prefill chunks and turns of any length, then decode steps), on every rank."""
    from megacp.kv_cache import CacheCapacityError, ShardedKVCache

    g = torch.Generator().manual_seed(n)
    outcomes = set()
    for _ in range(40):
        steps = [int(x) for x in torch.randint(1, 12, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)]
        steps += [1] * int(torch.randint(0, 6, (1,), generator=g))
        capacity = int(torch.randint(2, 12, (1,), generator=g))
        for rank in range(n):
            cache = ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=1, max_requests=1, capacity=capacity,
                                   cp_size=n, cp_rank=rank)
            slot = cache.allocate()
            try:
                cache.check_room(slot, steps)
                predicted = None
            except CacheCapacityError as err:
                predicted = str(err)
            try:
                for t in steps:
                    cache.commit([slot], cache.plan([slot], [t]))
                fits = True
            except CacheCapacityError:
                fits = False
            assert fits == (predicted is None), (steps, capacity, rank, predicted)
            outcomes.add(fits)
    assert outcomes == {True, False}
    with pytest.raises(CacheCapacityError, match=r"^20 tokens in all would need 10 KV cache rows on CP rank 0, "
                                                 r"which holds 8 per request"):
        cache = ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=1, max_requests=1, capacity=8, cp_size=2)
        cache.check_room(cache.allocate(), [20])
