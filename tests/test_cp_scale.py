"""Every CP path at the CP sizes of one 8-GPU node and beyond it (N = 6 and N = 8), on real gloo
processes on the CPU, against the single-process reference (fp32, <= 1e-5 relative).

The 4- and 8-GPU machines that would run these sizes on NCCL were not lent (issue 7); these runs
are what pins correctness there. One process group per N runs every check (a spawn of 8 processes
on a 2-core machine costs seconds, the tensors are tiny):

* ``megacp.attention.cp_attention`` pass-KV and pass-Q, load-balanced and contiguous, on a ragged
  batch (lengths shorter than 2N, not divisible by 2N, single tokens) — ``_ring_prefill``;
* a cached session through the CP layer, ``CPStep`` and the sharded KV cache (chunked prefill with
  cached prefixes, requests joining late, a mixed prefill + decode batch, all-gather decode steps)
  with each prefill strategy — ``_cached_session``.

Both bodies are the ones of ``tests/test_cp_attention.py`` (imported, not copied), so N = 1..4 and
N = 6, 8 check exactly the same things.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.test_cp_attention import _cached_session, _ring_prefill

STRATEGIES = ("pass_kv", "pass_q", "auto")
TOL = 1e-5


def _all_paths(rank: int, n: int) -> dict[str, object]:
    """Ring prefill errors and one cached session per prefill strategy, on this rank."""
    return {
        "ring": _ring_prefill(rank, n),
        "sessions": {s: _cached_session(rank, n, s) for s in STRATEGIES},
    }


@pytest.mark.parametrize("n", [6, 8])
def test_every_cp_path_at_six_and_eight_ranks(n: int) -> None:
    results = run_distributed(_all_paths, n, timeout=90)
    for rank, res in enumerate(results):
        for name, err in res["ring"].items():
            assert err < TOL, (n, rank, name, err)
        for strategy, session in res["sessions"].items():
            assert session["err"] < TOL, (n, rank, strategy, session)
            assert session["placement"], (n, rank, strategy, session)
            assert session["len0"] == 13 + 9 + 6 + 5, (n, rank, strategy, session)
            # 200 more tokens overflow the 40-token slot at small N; at N = 8 they fit (13 per
            # chunk): the plan must then succeed, otherwise fail with the capacity message.
            msg = session["capacity"]
            assert msg == "" or ("needs" in msg and "capacity" in msg), (n, rank, strategy, msg)
