"""One request engine under ``LLM.generate`` and the server (:mod:`megacp.generate.engine`).

At CP = 1, 2 and 3 (gloo), ten seeded requests of mixed sampling settings give the same tokens
through ``LLM.generate`` (all at once), through ``LLM(max_num_seqs=3)`` (continuous batching: a
finished request's slot takes the next prompt) and through the server's engine (rank 0 schedules
three slots with a chunked-prefill budget of 8 tokens and broadcasts each step; the other ranks
follow), each against an independent single-process reference: transformers' greedy ``generate``
for the greedy requests."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import make_hf_model

KINDS = [dict(), dict(temperature=0.8, top_k=20), dict(repetition_penalty=1.3), dict(top_p=0.9, presence_penalty=0.5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    d = tmp_path_factory.mktemp("engine")
    return str(d), make_hf_model("llama3", d)


def _params(n: int) -> list:
    from megacp import SamplingParams

    return [SamplingParams(max_tokens=2 + i % 5, seed=i, ignore_eos=True, **KINDS[i % 4]) for i in range(n)]


def _three_ways(rank: int, n: int, path: str, prompts: list[list[int]]) -> dict:
    from megacp import LLM
    from megacp.generate.worker import Work, Worker
    from megacp.serve.engine import Engine, Request

    params = _params(len(prompts))
    llm = LLM(path, dtype="float32")
    offline = [o.token_ids for o in llm.generate(prompts, params)]
    slots = llm._engine.slots if llm._engine is not None else []
    few = LLM(path, dtype="float32", max_num_seqs=3, state=llm.state)
    continuous = [o.token_ids for o in few.generate(prompts, params)]
    worker = Worker(llm.generator, 3, 64, vocab=llm.model_config.vocab_size, static=llm.static_decode, capture=False)
    served = None
    if rank == 0:
        engine = Engine(worker, None, max_queue=16, max_batched_tokens=8)
        loop = asyncio.new_event_loop()
        reqs = [Request(p, sp, loop=loop) for p, sp in zip(prompts, params)]
        for r in reqs:
            engine.add(r)
        while engine.busy:
            engine.step()
        worker.share(Work(stop=True))
        loop.close()
        served = [r.tokens for r in reqs]
    else:
        worker.follow()
    return {"offline": offline, "continuous": continuous, "served": served, "slots": len(slots),
            "few_slots": len(few._engine.slots) if few._engine is not None else 0}


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_offline_continuous_and_served_tokens_agree(tiny: tuple[str, torch.nn.Module], cp: int) -> None:
    path, model = tiny
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 256, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (10,), generator=g)]
    results = run_distributed(_three_ways, cp, path, prompts)
    first = results[0]
    assert first["slots"] == 10 and first["few_slots"] == 3
    for r in results:  # every rank returns the same tokens
        assert r["offline"] == first["offline"] and r["continuous"] == first["offline"]
    assert first["served"] == first["offline"]
    params = _params(len(prompts))
    for i, p in enumerate(prompts):  # the greedy requests against transformers
        if params[i].temperature == 0 and params[i].repetition_penalty == 1.0:
            with torch.no_grad():
                ref = model.generate(torch.tensor([p]), max_new_tokens=params[i].max_tokens, do_sample=False,
                                     attention_mask=torch.ones(1, len(p), dtype=torch.long))
            assert first["offline"][i] == ref[0, len(p):].tolist(), i


def test_a_stream_cut_off_by_another_call_says_so(tiny: tuple[str, torch.nn.Module]) -> None:
    """Streams share the LLM's engine: a ``generate`` call while a stream is half read cuts the
    stream off with one ``RuntimeError`` (not a silently short stream); a new stream then gives the
    whole of the offline tokens."""
    from megacp import LLM, SamplingParams

    llm = LLM(tiny[0], dtype="float32")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = llm.generate([[5, 6, 7]], params)[0].token_ids
    stream = llm.stream([5, 6, 7], params)
    first = [next(stream).token_id, next(stream).token_id]
    assert llm.generate([[9, 10]], params)[0].token_ids != []
    with pytest.raises(RuntimeError, match="this stream was cut off"):
        list(stream)
    assert first == ref[:2] and [p.token_id for p in llm.stream([5, 6, 7], params)] == ref
