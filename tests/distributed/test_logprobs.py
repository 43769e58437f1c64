"""``SamplingParams(logprobs=k)`` through ``LLM.generate``: per generated token, the chosen token's
log-probability and the top ``k`` tokens' equal transformers' log-softmax of the same tokens'
logits (the raw model: before penalties and temperature), on the eager decode loop and on the graph
loop (its static step run eagerly: CPU), at CP = 1 and 2; a request without ``logprobs`` gets none."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import make_hf_model

NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    d = tmp_path_factory.mktemp("logprobs")
    return str(d), make_hf_model("llama3", d)


def _runs(rank: int, n: int, path: str, prompts: list[list[int]]) -> dict:
    from megacp import LLM, SamplingParams

    llm = LLM(path, dtype="float32")
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.7, top_p=0.9, repetition_penalty=1.5,
                             seed=3, logprobs=5),
              SamplingParams(max_tokens=NEW, ignore_eos=True)]
    runs = {}
    for mode in (False, True):
        llm.generator.static_step = mode  # eager steps (False) against the batch decoder's static step (True)
        outs = llm.generate(prompts, params)
        runs[mode] = {"decode": llm.last_report["decode"], "tokens": [o.token_ids for o in outs],
                      "logprobs": [o.logprobs for o in outs], "cumulative": [o.cumulative_logprob for o in outs]}
    return runs


def _reference(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax ``[len(tokens), V]`` before each generated token (fp64 of fp32 logits)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1]
    return logits.double().log_softmax(-1)


def test_logprobs_match_transformers_eager_graph_cp1_cp2(tiny: tuple[str, torch.nn.Module]) -> None:
    path, model = tiny
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (k,), generator=g).tolist() for k in (7, 12, 4)]
    by_cp = {}
    for cp in (1, 2):
        results = run_distributed(_runs, cp, path, prompts)
        runs = results[0]
        eager, graph = runs[False], runs[True]
        assert eager["decode"] == "eager" and graph["decode"] == "static_eager"
        assert graph["tokens"] == eager["tokens"]
        by_cp[cp] = eager
        for mode in (eager, graph):
            assert mode["logprobs"][2] is None and mode["cumulative"][2] is None
            for i, k in ((0, 3), (1, 5)):
                toks, lps = mode["tokens"][i], mode["logprobs"][i]
                ref = _reference(model, prompts[i], toks)
                assert len(lps) == NEW
                for step, (tok, row) in enumerate(zip(toks, lps)):
                    top = ref[step].topk(k)
                    assert list(row)[0] == tok
                    assert set(row) == {tok, *top.indices.tolist()}, (i, step)
                    for t, v in row.items():
                        assert abs(v - float(ref[step, t])) < 1e-4, (cp, i, step, t, v, float(ref[step, t]))
                assert abs(mode["cumulative"][i] - sum(row[t] for row, t in zip(lps, toks))) < 1e-9
                for a, b in zip(lps, eager["logprobs"][i]):  # graph and eager: one computation
                    assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-6 for t in a)
    assert by_cp[2]["tokens"] == by_cp[1]["tokens"]
    assert any(len(row) == 6 for row in by_cp[1]["logprobs"][1])  # a sampled token outside the top 5 shows too
