"""``megacp.LLM`` over transformers models whose architectures megacp's own models do not implement
(Qwen3's q/k norm, Phi-3's fused qkv; Mistral with a 4-token sliding window): greedy tokens at CP = 1, 2 and 3 (real gloo
ranks) equal transformers' own ``generate`` for a ragged batch of two prompts (one shorter than
2N) and for both turns of a session on the CP-sharded cache, under pass-KV, pass-Q and chunked
prefill; a model megacp cannot run exactly,
and ``cuda_graphs=True``, are refused in one line."""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import make_model
from tests.helpers.hf_models import hf_greedy

NEW = 8
ARCHS = {"qwen3": dict(strategy="pass_q"), "phi3": dict(strategy="pass_kv", prefill_chunk=8),
         "mistral": dict(strategy="pass_kv", prefill_chunk=8)}
"""arch -> LLM options: each prefill strategy, and chunked prefill."""
MODEL = {"mistral": dict(sliding_window=4)}
"""arch -> config arguments: a sliding window shorter than the chunks, the prompts and the session."""
PROMPTS = [[5, 17, 33, 9, 41, 12, 60, 7, 22, 50, 3, 28, 44, 19, 36, 11, 58, 25, 6, 47, 30], [14, 52, 8]]
TURN = [23, 9, 61, 4, 38]
NO_EOS = dict(eos_token_id=None)
"""No stop token: transformers' ``min_new_tokens`` would otherwise mask it out of the reference."""


def _generate(rank: int, world: int) -> dict[str, tuple[list[list[int]], list[int], list[int], list[str]]]:
    from megacp import LLM, SamplingParams, initialize, shutdown

    state = initialize()  # every rank in one CP group
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    out = {}
    for arch, options in ARCHS.items():
        llm = LLM(make_model(arch, **NO_EOS, **MODEL.get(arch, {})), max_session_tokens=64, state=state, **options)
        batch = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        with llm.session() as session:
            first = session.send(PROMPTS[0], greedy).token_ids
            second = session.send(TURN, greedy)
        out[arch] = (batch, first, second.token_ids, llm.last_report["prefill_strategy"])
    if world == 1:  # a directory of an architecture megacp's own models do not implement
        with tempfile.TemporaryDirectory() as d:
            make_model("qwen3", **NO_EOS).save_pretrained(d)
            out["qwen3 directory"] = ([o.token_ids for o in LLM(d, state=state).generate(PROMPTS, greedy)], [], [], [])
    with pytest.raises(ValueError, match="soft-caps attention logits"):
        LLM(make_model("qwen3", attn_logit_softcapping=30.0), state=state)
    with pytest.raises(ValueError, match="cuda_graphs=True needs one of megacp's own models"):
        LLM(make_model("qwen3"), cuda_graphs=True, state=state)
    with pytest.raises(ValueError, match="takes a transformers causal LM object"):
        LLM(torch.nn.Linear(2, 2), state=state)
    with pytest.raises(ValueError, match="tokenizer= goes with a transformers model object"):
        LLM("no-such-dir", tokenizer=object(), state=state)
    shutdown()
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[list[int]], list[int]]]:
    """transformers' greedy ``generate``: the batch one prompt at a time, and the second turn as one
    prompt holding the first turn, its reply and the new turn."""
    ref = {}
    for arch in ARCHS:
        model = make_model(arch, **NO_EOS, **MODEL.get(arch, {})).eval()
        batch = hf_greedy(model, PROMPTS, NEW)
        ref[arch] = (batch, hf_greedy(model, [PROMPTS[0] + batch[0] + TURN], NEW)[0])
    return ref


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_llm_over_transformers_model_equals_generate(cp: int, reference: dict) -> None:
    for rank, result in enumerate(run_distributed(_generate, cp)):
        assert cp > 1 or result.pop("qwen3 directory")[0] == reference["qwen3"][0], "LLM(directory)"
        for arch, (batch, first, second, strategies) in result.items():
            want = ARCHS[arch].get("strategy")
            assert want is None or set(strategies) == {want}, f"{arch}: prefill ran {strategies}"
            assert "prefill_chunk" not in ARCHS[arch] or len(strategies) == 3, f"{arch}: 21 tokens in chunks of 8"
            ref_batch, ref_second = reference[arch]
            assert len({t for row in ref_batch for t in row}) > 2, f"{arch}: the reference is degenerate"
            assert batch == ref_batch, f"CP={cp} rank {rank} {arch}: batch"
            assert first == ref_batch[0], f"CP={cp} rank {rank} {arch}: session turn 1"
            assert second == ref_second, f"CP={cp} rank {rank} {arch}: session turn 2"

