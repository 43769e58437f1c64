"""Seeded sampled and penalised requests through ``LLM.generate`` on the eager decode loop and on
the graph decode loop (its static step run eagerly: CPU): a request's tokens are the same alone
and inside a batch of mixed settings, on both paths, at CP = 1, 2 and 3."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import make_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("sampled")
    make_hf_model("llama3", d)
    return str(d)


def _runs(rank: int, n: int, path: str, prompts: list[list[int]]) -> dict:
    from megacp import LLM, SamplingParams

    llm = LLM(path, dtype="float32")
    nucleus = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1)
    penalised = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.2, top_k=20, min_p=0.05,
                               repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, seed=7)
    mixed = [SamplingParams(max_tokens=6, ignore_eos=True), nucleus, penalised]
    runs = {}
    for mode in (False, True):
        llm.generator.static_step = mode  # eager steps (False) against the batch decoder's static step (True)
        batch = [o.token_ids for o in llm.generate(prompts, mixed)]
        runs[mode] = {"batch": batch, "decode": llm.last_report["decode"],
                      "alone": [llm.generate(prompts[i], mixed[i])[0].token_ids for i in (1, 2)]}
    return runs


def test_seeded_requests_alone_and_in_a_mixed_batch_cp1_cp2_cp3(tiny: str) -> None:
    """A greedy request that stops early, a nucleus-sampled one and a penalised top-k / min-p one
    in one batch: the sampled requests give the tokens they give alone, the graph loop the eager
    loop's, every rank the same, and CP = 2 and 3 the tokens of CP = 1."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (k,), generator=g).tolist() for k in (5, 19, 8)]
    by_cp = {}
    for cp in (1, 2, 3):
        results = run_distributed(_runs, cp, tiny, prompts)
        runs = results[0]
        assert all(r == runs for r in results)
        eager, graph = runs[False], runs[True]
        assert eager["decode"] == "eager" and graph["decode"] == "static_eager"
        assert graph["batch"] == eager["batch"] and graph["alone"] == eager["alone"], cp
        assert eager["alone"] == eager["batch"][1:], cp
        by_cp[cp] = eager["batch"]
    assert len(by_cp[1][0]) == 6 and len(set(by_cp[1][2])) > 5  # the greedy row stops early; the others sample
    assert by_cp[2] == by_cp[1] and by_cp[3] == by_cp[1]
