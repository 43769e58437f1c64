"""The static decode step that a CUDA graph replays, and the graph decode path.

On CPU (gloo), the static step (:class:`~megacp.generate.graph.BatchDecoder` run eagerly: device
buffers for tokens, positions, lengths and cache rows; no host bookkeeping per token) must equal
the eager decode step, logits and tokens, at CP = 3 with a rank that holds nothing of a request,
and so must the whole graph decode loop of a run (late reads, padding, stop tokens, sessions);
``LLM(cuda_graphs=True)`` on CPU is refused in one line and the default decodes eagerly; the
decode benchmark against transformers refuses ``--device cpu`` and copies weights exactly. On a
CUDA GPU, ``tests/programs/graph_decode_check.py`` checks captured graphs against eager decode.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import make_hf_model
from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S

STEPS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("graph")
    make_hf_model("llama3", d)
    return str(d)


def _static_vs_eager(rank: int, n: int, path: str, prompts: list[list[int]], steps: int) -> dict:
    import megacp
    from megacp.checkpoint import load_model
    from megacp.generate import Generator
    from megacp.layers.settings import CPSettings
    from tests.helpers.static_decode import fixed_batch

    state = megacp.initialize()
    model, cfg, _ = load_model(path, dtype=torch.float32, device="cpu")
    megacp.swap_attention(model, state)
    cpu = torch.device("cpu")
    gen = Generator.for_model(model, cfg, CPSettings.from_state(state), device=cpu, dtype=torch.float32)
    (eager, se), (static, ss) = (gen.batch_cache(prompts, steps + 2) for _ in range(2))
    errs, same = [], True
    with torch.inference_mode():
        tok = gen.prefill(eager, se, prompts)[0].argmax(-1)
        logits = gen.prefill(static, ss, prompts)[0]
        dec = fixed_batch(model, static, ss, gen.settings, cpu, logits.argmax(-1), logits.shape[-1])
        for _ in range(steps):
            ref = gen.decode_step(eager, se, tok)
            got = dec.step().clone()
            errs.append(float((dec.logits - ref).abs().max() / ref.abs().max()))
            tok = ref.argmax(-1)
            same = same and got.tolist() == tok.tolist()
        dec.leave(ss)
        books = all(eager.history(a) == static.history(b) and eager.local_length(a) == static.local_length(b)
                    for a, b in zip(se, ss))
        rows = all(torch.equal(eager.positions[a], static.positions[b]) for a, b in zip(se, ss))
        after = gen.decode_step(static, ss, tok)  # the eager path continues on the static step's cache
        ref = gen.decode_step(eager, se, tok)
    held = [static.local_length(s) for s in ss]
    return {"err": max(errs), "same": same, "books": books, "rows": rows, "held": held,
            "after": float((after - ref).abs().max() / ref.abs().max())}


def test_static_step_equals_eager_decode_cp3(tiny: str) -> None:
    """Ragged prompts of 1, 5 and 23 tokens at CP = 3 (the 1-token prompt leaves rank 2 empty at
    first), 8 steps: logits within fp32 1e-5 and equal tokens; the cache's bookkeeping after the
    run equals eager decode's, and eager decode continues on the static step's cache."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (k,), generator=g).tolist() for k in (1, 5, 23)]
    results = run_distributed(_static_vs_eager, 3, tiny, prompts, STEPS)
    assert min(r["held"][0] for r in results) >= 1  # every rank took decoded tokens of the short prompt
    for r in results:
        assert r["same"] and r["books"] and r["rows"], r
        assert r["err"] < 1e-5 and r["after"] < 1e-5, r


def _run_loop(rank: int, n: int, path: str, prompts: list[list[int]]) -> dict:
    """Eager decode, then the graph decode loop (its static step run eagerly: CPU), on one LLM."""
    from megacp import LLM, SamplingParams

    llm = LLM(path, dtype="float32")
    eager = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    stop = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[eager[1].token_ids[3]])
    runs = {}
    for mode in (False, True):
        llm.generator.static_step = mode  # eager steps (False) against the batch decoder's static step (True)
        outs = llm.generate(prompts, stop)
        with llm.session() as chat:
            turns = [chat.send(prompts[2], stop).token_ids, chat.send(prompts[0], stop).token_ids]
            history = chat.history
        runs[mode] = {"tokens": [o.token_ids for o in outs], "finish": [o.finish_reason for o in outs],
                      "decode": llm.last_report["decode"], "turns": turns, "history": history}
    return runs


def test_graph_decode_loop_equals_eager_cp3(tiny: str) -> None:
    """The graph decode loop (one-step-late reads, finished requests padded and their extra token
    dropped, host bookkeeping caught up at the end) at CP = 3: a stop token that ends one request
    early gives the eager tokens and finish reasons; a session's second turn continues exactly."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (k,), generator=g).tolist() for k in (2, 17, 6)]
    for runs in run_distributed(_run_loop, 3, tiny, prompts):
        eager, graph = runs[False], runs[True]
        assert eager["decode"] == "eager" and graph["decode"] == "static_eager"
        assert "stop" in eager["finish"] and "length" in eager["finish"], eager
        for key in ("tokens", "finish", "turns", "history"):
            assert graph[key] == eager[key], key


def _cpu_llm(rank: int, n: int, path: str) -> dict:
    from megacp import LLM, SamplingParams

    try:
        LLM(path, dtype="float32", cuda_graphs=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    llm = LLM(path, dtype="float32")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    return {"refused": refused, "decode": llm.last_report["decode"], "graphs": llm.generator.cuda_graphs}


def test_cuda_graphs_refused_on_cpu_and_the_static_step_eager_by_default(tiny: str) -> None:
    (r,) = run_distributed(_cpu_llm, 1, tiny)
    assert r["refused"].startswith("cuda_graphs=True needs a CUDA GPU; this LLM runs on cpu") and "\n" not in r["refused"]
    assert r["decode"] == "static_eager" and r["graphs"] is False  # the batch decoder's step, run eagerly


def test_cli_takes_no_cuda_graphs() -> None:
    from megacp.generate.cli import parse_args

    assert parse_args(["--no-cuda-graphs"]).no_cuda_graphs and not parse_args([]).no_cuda_graphs


def test_decode_hf_bench_refuses_cpu_and_copies_weights() -> None:
    """``scripts.bench.decode_hf``: ``--device cpu`` is one line and exit status 2; lengths are capped
    to the context; the HF copy of a megacp model gives the same logits (fp32, tiny shape)."""
    from megacp.checkpoint.hf import config_from_hf
    from megacp.models import build_model
    from scripts.bench.decode_hf import MODELS, hf_copy, model_lengths

    proc = subprocess.run([sys.executable, "-m", "scripts.bench.decode_hf", "--device", "cpu"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert model_lengths("smollm2", [1024, 8192, 32768], 128) == [1024, 8064]
    assert model_lengths("llama8b", [1024, 32768], 128) == [1024, 32768]
    cfg = config_from_hf(dict(MODELS["smollm2"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300))
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device="cpu", backend="torch")
    hf = hf_copy(model, cfg, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 300, (12,))
    with torch.no_grad():
        ours, theirs = model(ids, torch.arange(12)), hf(ids[None]).logits[0]
    assert (ours - theirs).abs().max() < 1e-5 * ours.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graph_decode_on_gpu() -> None:
    """Captured graph decode equals eager decode (tiny Llama and a SmolLM2-shaped model, fp32 and
    bf16, ragged batch, 64+ tokens, a session's second turn); the program prints PASS/FAIL lines."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "tests/programs/graph_decode_check.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0 and "ALL PASS" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
