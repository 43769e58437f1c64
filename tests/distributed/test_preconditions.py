"""Distributed preconditions and tensor inputs: ranks that disagree (lengths, options, shapes, dtypes)
or inputs attention cannot take get one clear ValueError on every rank of real gloo groups, never a
hang, an abort or a silent wrong result; the group stays usable afterwards."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.reference import packed_causal, rel_err

HQ, HKV, D = 4, 2, 8
T = 12


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(T, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def _cp_attention_cases(rank: int, n: int) -> dict[str, str]:
    """Each case: rank 1 passes something else than the others; the message every rank got."""
    from megacp.attention import cp_attention

    q, k, v = _inputs()
    odd = rank == 1
    cases = {
        "cu_seqlens": lambda: cp_attention(q, k, v, cu_seqlens=[0, 5, T] if odd else [0, 7, T]),
        "load_balance": lambda: cp_attention(q, k, v, load_balance=not odd),
        "strategy": lambda: cp_attention(q, k, v, strategy="pass_q" if odd else "pass_kv"),
        "shape": lambda: cp_attention(*(x[: T - odd] for x in (q, k, v))),
        "dtype": lambda: cp_attention(*(x.to(torch.bfloat16 if odd else torch.float32) for x in (q, k, v))),
        "scale": lambda: cp_attention(q, k, v, scale=0.5 if odd else None),
        "int on one rank": lambda: cp_attention(*((x.long() if odd else x) for x in (q, k, v))),
        "int everywhere": lambda: cp_attention(q.long(), k.long(), v.long()),
        "mixed dtypes": lambda: cp_attention(q, k.half(), v),
        "bad cu_seqlens on one rank": lambda: cp_attention(q, k, v, cu_seqlens=[0, 9, 3, T] if odd else [0, 3, T]),
        "requires grad": lambda: cp_attention(q.clone().requires_grad_(), k, v),
        "contents": lambda: cp_attention(q, k, v + 1e-3 * odd),
    }
    out = {name: _error(fn) for name, fn in cases.items()}
    # the group is still in step: a correct call after the errors is exact
    out["after"] = rel_err(cp_attention(q, k, v, cu_seqlens=[0, 5, T]), packed_causal(q, k, v, [5, T - 5]))
    with torch.no_grad():
        out["no_grad"] = rel_err(cp_attention(q.clone().requires_grad_(), k, v), packed_causal(q, k, v, [T]))
    return out


def _layer_cases(rank: int, n: int) -> dict[str, Any]:
    """The CP layer: a cached step planned differently on rank 1, different cu_seqlens_q on the
    cacheless path, and the one agreement per step (a second layer call does not communicate)."""
    from megacp.kv_cache import ShardedKVCache
    from megacp.layers.cp_attention import CPDotProductAttention
    from megacp.layers.settings import CPSettings
    from megacp.layers.step import begin_step
    from megacp.parallel.ring import Ring

    ring = Ring()
    gathers = []
    all_gather = ring.all_gather
    ring.all_gather = lambda t: gathers.append(t.numel()) or all_gather(t)  # count the collectives
    layers = [CPDotProductAttention(HQ, D, HKV, qkv_format="thd", layer_number=i + 1, settings=CPSettings(ring=ring)) for i in range(2)]
    odd = rank == 1
    q, k, v = _inputs()
    out: dict[str, Any] = {}

    def cached(new: list[int]) -> None:
        cache = ShardedKVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, max_requests=2, capacity=T, cp_size=n, cp_rank=rank)
        slots = [cache.allocate(), cache.allocate()]
        step = begin_step(CPSettings(ring=ring, prefill="pass_kv"), cache, slots, new)
        idx = step.token_index()
        for layer in layers:
            layer.eval()(q[idx], k[idx], v[idx], inference_params=step)

    out["cached plan"] = _error(lambda: cached([4, 6] if odd else [6, 4]))
    cu = torch.tensor([0, 4, T] if odd else [0, 8, T], dtype=torch.int32)  # 6 local tokens on either rank
    local = lambda: layers[0](*(x[: T // n] for x in (q, k, v)), cu_seqlens_q=cu)  # noqa: E731
    out["cacheless cu_seqlens"] = _error(local)
    out["int inputs"] = _error(lambda: layers[0](*(x.long()[: T // n] for x in (q, k, v)), cu_seqlens_q=cu))
    before = len(gathers)
    cached([6, 4])  # agreed once: the second layer adds no collective
    out["gathers per step"] = len(gathers) - before
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_cp_attention_mismatch_is_one_error_on_every_rank(n: int) -> None:
    expect = {
        "cu_seqlens": "differ in sequence lengths", "load_balance": "differ in load_balance",
        "strategy": "differ in strategy", "shape": "differ in q shape", "dtype": "differ in dtypes of q, k, v",
        "scale": "differ in scale", "int everywhere": "needs fp16, bf16 or fp32 inputs; q is torch.int64",
        "mixed dtypes": "of one dtype",
        "requires grad": "computes without autograd",
        "contents": "differ in v contents (rank",
    }
    for rank, res in enumerate(run_distributed(_cp_attention_cases, n)):
        for name, text in expect.items():
            assert text in res[name], (rank, name, res[name])
        own = "needs fp16, bf16 or fp32 inputs" if rank == 1 else "CP rank(s) [1] refused their inputs"
        assert own in res["int on one rank"], (rank, res["int on one rank"])
        own = "cu_seqlens" if rank == 1 else "CP rank(s) [1] refused their inputs"
        assert own in res["bad cu_seqlens on one rank"], (rank, res["bad cu_seqlens on one rank"])
        assert res["after"] < 1e-5 and res["no_grad"] < 1e-5, res


def test_cp_layer_mismatch_is_one_error_on_every_rank_once_per_step() -> None:
    for rank, res in enumerate(run_distributed(_layer_cases, 2)):
        assert "differ in new tokens per request" in res["cached plan"], (rank, res)
        assert "differ in new tokens per request" in res["cacheless cu_seqlens"], (rank, res)
        assert "needs fp16, bf16 or fp32 inputs; q is torch.int64" in res["int inputs"], (rank, res)
        assert res["gathers per step"] == 1, res


# --------------------------------------------------------------------------- ending cleanly


def _close_and_shutdown(rank: int, n: int) -> dict[str, Any]:
    """A 2-rank CP ring plus a DP group of 1: ``close`` destroys the groups the state created, the
    default group survives it; ``shutdown`` ends the default group; both are idempotent."""
    import torch.distributed as dist

    import megacp
    from megacp.parallel.layout import ParallelLayout
    from megacp.parallel.state import ParallelState

    state = ParallelState.build(ParallelLayout(cp=2))
    own = state.group("dp")  # [rank] alone: a group build created
    before = dist.get_process_group_ranks(own)
    state.close()
    state.close()
    out: dict[str, Any] = {"before": before, "cp is world": state.group("cp") is dist.group.WORLD}
    try:
        dist.get_process_group_ranks(own)
        out["after close"] = "still registered"
    except (KeyError, RuntimeError, ValueError) as exc:
        out["after close"] = type(exc).__name__
    out["world after close"] = float(state.ring().all_gather(torch.ones(1)).sum()) if state.ring() else None
    megacp.shutdown()
    megacp.shutdown()
    out["initialized"] = dist.is_initialized()
    return out


def test_close_and_shutdown_destroy_the_groups() -> None:
    for rank, res in enumerate(run_distributed(_close_and_shutdown, 2)):
        assert res == {"before": [rank], "cp is world": True, "after close": "KeyError", "world after close": 2.0,
                       "initialized": False}, res


def _abort_at_exit(rank: int, n: int) -> int:
    """Return a result, then abort while the process exits (as a gloo worker thread could)."""
    import multiprocessing.util

    multiprocessing.util.Finalize(None, os.abort, exitpriority=0)
    return rank


def test_harness_fails_a_rank_that_aborts_after_returning() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 ---\nreturned its result but then ended with signal SIGABRT"):
        run_distributed(_abort_at_exit, 2)


def _stalled_cp_collective(rank: int, n: int) -> tuple[str, float] | None:
    """cp = 2, dp = 2 with a 3 s timeout: rank 0 enters an all-reduce of its CP group [0, 1] that
    rank 1 (waiting in a barrier of the whole world) never joins; returns rank 0's error and how
    long it waited."""
    import time

    import torch.distributed as dist

    from megacp.config import MegacpConfig
    from megacp.parallel.layout import ParallelLayout
    from megacp.parallel.state import ParallelState

    config = MegacpConfig.from_dict({"context_parallel": {"size": 2}, "runtime": {"timeout_minutes": 0.05}})
    state = ParallelState.build(ParallelLayout(cp=2, dp=2), config)
    assert state.ranks("cp") == ((0, 1) if rank < 2 else (2, 3))
    if rank != 0:
        dist.barrier()  # alive, but not in the CP collective
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=state.group("cp"))
        error = "no error"
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    waited = time.monotonic() - start
    dist.barrier()
    return error, waited


def test_cp_group_collective_times_out_after_timeout_minutes() -> None:
    """The groups ParallelState creates take runtime.timeout_minutes (torch's new_group default is
    30 min for gloo, 10 for NCCL)."""
    error, waited = run_distributed(_stalled_cp_collective, 4)[0]
    assert "Timed out" in error and 2.5 < waited < 30, (error, waited)
