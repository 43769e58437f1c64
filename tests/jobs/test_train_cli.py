"""``python -m megacp.train`` end to end on CPU, and its argument checks.

* Under the ``deepspeed`` launcher (2 gloo processes, CP = 2, ZeRO 1, fp32) it trains a tiny Llama
  on a tiny corpus, saves a DeepSpeed checkpoint, and ``tools/convert_checkpoint.py`` turns that into
  a Hugging Face directory and a megacp checkpoint (the converter runs in this process; its
  script is tested in tests/jobs/test_checkpoint.py): transformers' logits from the first equal
  megacp's from the DeepSpeed checkpoint's weights, and megacp loads the second (as
  ``megacp.generate --model`` does).
* Under ``torchrun`` (4 gloo processes) it trains a tiny Qwen2-MoE with its experts sharded over
  EP = the DP ranks (CP 2 x DP 2).
* Under ``torchrun`` (2 processes) a Qwen3 directory trains through transformers' modules with its
  layer inputs on the host and tiled MLPs, and a Falcon directory is refused in one line.
* ``kill -9`` of the ``deepspeed`` command ends its ranks; a dead save's staging is removed by the next run.
* Bad arguments or config end with one stderr line and exit status 2 before anything is loaded:
  in-process for each check, and under ``torchrun`` (2 processes) for a config DeepSpeed rejects.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import free_port
from tests.helpers.paths import ROOT
from tests.helpers.reference import rel_err
from tests.helpers.timeouts import HANG_GUARD_S
from tests.helpers.train_cli import make_corpus, make_tiny_model

CPU_CONFIG = ROOT / "configs" / "train_cpu_cp2.json"
STEPS = 3
SEQ_LEN = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model directory, corpus directory: a text file and a JSONL file)."""
    root = tmp_path_factory.mktemp("train_cli")
    make_tiny_model(root / "model")
    return root / "model", make_corpus(root / "corpus")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S, **kwargs)


def _megacp_logits(weights: dict[str, torch.Tensor], model_config, ids: torch.Tensor) -> torch.Tensor:
    from megacp.models import CausalLM

    model = CausalLM(model_config, dtype=torch.float32)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(ids, torch.arange(ids.numel()))


@pytest.mark.slow
def test_deepspeed_launcher_trains_saves_and_converts(tiny: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed: its launcher cannot run")
    deepspeed = shutil.which("deepspeed")
    assert deepspeed is not None, "deepspeed is importable but its launcher is not on PATH"
    model_dir, corpus = tiny
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    train = _run([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "megacp.train",
                  "--deepspeed_config", str(CPU_CONFIG), "--model", str(model_dir), "--corpus", str(corpus),
                  "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--save", str(save), "--metrics", str(metrics),
                  "--save-every", "2", "--resume", "auto"])
    assert train.returncode == 0, (train.stdout + train.stderr)[-4000:]
    # what happens is said as it happens: the load, a fresh start under --resume auto, each periodic save
    assert f"megacp.train: loading {model_dir.name} (megacp's model) and setting up DeepSpeed ..." in train.stdout
    assert f"megacp.train: --resume auto: {save} holds no checkpoint yet, starting at step 1" in train.stdout
    assert f"megacp.train: step 2, saved {save / 'step2'}" in train.stdout
    assert "megacp.train: CP=2 TP=1 DP=1 on cpu (gloo), float32, ZeRO 1" in train.stdout
    assert f"megacp.train: {STEPS} steps, loss " in train.stdout and f"saved {save / f'step{STEPS}'}" in train.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # 1 sequence per micro-batch, 2 micro-batches per step (the config), one DP replica
    assert all(r["tokens"] == 2 * SEQ_LEN and 0 < r["loss"] < 10 and r["tokens_per_s"] > 0 for r in rows)

    from megacp.checkpoint import load_model
    from megacp.checkpoint.deepspeed import read_deepspeed_checkpoint
    from megacp.checkpoint.hf import load_hf_state_dict

    trained = read_deepspeed_checkpoint(save)
    assert trained.tag == f"step{STEPS}" and trained.dtype == torch.float32
    _, initial = load_hf_state_dict(model_dir)
    assert rel_err(trained.tensors["embedding.weight"], initial["embedding.weight"]) > 1e-6  # it trained

    from megacp.checkpoint.convert import main as convert

    hf_dir, megacp_dir = tmp_path / "hf", tmp_path / "megacp"
    for command, output in (("deepspeed-to-hf", hf_dir), ("deepspeed-to-megacp", megacp_dir)):
        assert convert([command, "--input", str(save), "--output", str(output)]) == 0
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and f"{command}: wrote" in out

    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(hf_dir)("ring attention, trained")["input_ids"])
    expected = _megacp_logits(trained.tensors, trained.config, ids)
    with torch.no_grad():
        hf_logits = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()(ids[None]).logits[0]
    assert rel_err(hf_logits, expected) < 1e-5
    model, _, tokenizer = load_model(megacp_dir, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        assert rel_err(model(ids, torch.arange(ids.numel())), expected) < 1e-6
    assert tokenizer is not None


@pytest.mark.slow
def test_torchrun_trains_experts_sharded_over_ep(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """4 processes (CP 2 x DP 2, a Qwen2-MoE's experts sharded over EP 2 = the dp ranks, ZeRO 1 with
    clipping: configs/train_cpu_cp2.json plus ``expert_model_parallel``) train 2 steps. That this
    training equals one process holding every expert is tests/distributed/test_moe.py's."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    _, corpus = tiny
    model_dir, metrics = tmp_path / "moe", tmp_path / "metrics.jsonl"
    make_tiny_model(model_dir, moe=True)
    train = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                  str(free_port()), "-m", "megacp.train", "--model", str(model_dir), "--corpus", str(corpus),
                  "--seq-len", str(SEQ_LEN), "--steps", "2", "--metrics", str(metrics),
                  "--deepspeed_config", _config(tmp_path, "ep", expert_model_parallel={"size": 2})])
    assert train.returncode == 0, (train.stdout + train.stderr)[-4000:]
    assert "megacp.train: CP=2 TP=1 DP=2 EP=2 on cpu (gloo), float32, ZeRO 1" in train.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # 1 sequence per micro-batch, 2 micro-batches per step, 2 DP replicas
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tokens"] == 4 * SEQ_LEN and 0 < r["loss"] < 10 for r in rows), rows


@pytest.mark.slow
def test_a_transformers_architecture_trains_long_and_an_unfit_one_is_refused(tiny: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    """A Qwen3 directory (an architecture megacp's own models do not implement) trains under ``torchrun``
    (CP = 2) through transformers' modules without ``--hf-native``, with every decoder-layer input on the
    host and the MLPs in tiles of 8 tokens; a Falcon directory (its attention drops megacp's step) is
    refused in one line naming it, before DeepSpeed starts."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    _, corpus = tiny
    qwen3, falcon, metrics = tmp_path / "qwen3", tmp_path / "falcon", tmp_path / "metrics.jsonl"
    make_tiny_model(qwen3, arch="qwen3")
    make_tiny_model(falcon, arch="falcon")
    config = _config(tmp_path, "long", activation_checkpointing={"enabled": True, "offload": "cpu"},
                     sequence_tiling={"mlp": 8})
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "megacp.train", "--corpus", str(corpus), "--seq-len", str(SEQ_LEN), "--deepspeed_config", config]
    train = _run([*base, "--model", str(qwen3), "--steps", "2", "--metrics", str(metrics)])
    assert train.returncode == 0, (train.stdout + train.stderr)[-4000:]
    assert "megacp.train: CP=2 TP=1 DP=1 on cpu (gloo), float32, ZeRO 1, model qwen3" in train.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["loss"] < 10 for r in rows), rows
    base[base.index("--master_port") + 1] = str(free_port())
    refused = _run([*base, "--model", str(falcon), "--steps", "1"])
    assert refused.returncode != 0
    line = f"megacp.train: error: --model {falcon}: FalconForCausalLM (falcon) computes attention in its own modules"
    assert sum(text.startswith(line) for text in refused.stderr.splitlines()) == 1, refused.stderr[-3000:]
    assert "megacp.train: CP=" not in refused.stdout  # stopped before the engine was built


@pytest.mark.slow
def test_the_ranks_stop_when_the_deepspeed_launcher_is_killed(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """``kill -9`` of the ``deepspeed`` command while it trains: both ranks (and the launcher process
    between them) end within seconds, rank 0 saying why in one line; nothing goes on training."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed: its launcher cannot run")
    import signal
    import time

    deepspeed = shutil.which("deepspeed")
    assert deepspeed is not None
    model_dir, corpus = tiny
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "megacp.train",
                             "--deepspeed_config", str(CPU_CONFIG), "--model", str(model_dir), "--corpus", str(corpus),
                             "--seq-len", str(SEQ_LEN), "--steps", "100000", "--metrics", str(metrics), "--quiet"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):  # training
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # the deepspeed command only, not its process group
        proc.wait()
        deadline = time.monotonic() + 15
        while _group_alive(proc.pid):
            assert time.monotonic() < deadline, "ranks still running 15 s after the launcher was killed"
            time.sleep(0.2)
        rows = metrics.read_text().count("\n")
        time.sleep(1.5)
        assert metrics.read_text().count("\n") == rows  # nothing trains any more
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    out = proc.stdout.read() if proc.stdout else ""
    assert out.count("megacp.train: the launcher (pid") == 1, out[-3000:]


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _main_error(argv: list[str], capsys: pytest.CaptureFixture[str], keep_out: bool = False) -> str:
    """Run ``megacp.train``'s main in this process; it must exit 2 with one stderr line, returned
    (``keep_out``: what it printed on stdout is written back for the caller to read)."""
    from megacp.train.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    if keep_out:
        sys.stdout.write(captured.out)
    assert exit_info.value.code == 2
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("megacp.train: error: ")
    return lines[0]


def _config(tmp_path: Path, name: str, **changes) -> str:
    config = json.loads(CPU_CONFIG.read_text())
    config.update(changes)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no_config", "--deepspeed_config is required"),
        ("seq_len", "--seq-len must be >= 1, got 0"),
        ("steps", "--steps must be >= 1, got -1"),
        ("gc_every", "--gc-every must be >= 0, got -1"),
        ("unknown_flag", "unrecognized arguments: --lr"),
        ("missing_corpus", "does not exist"),
        ("missing_model", "--model /nonexistent/model does not exist"),
        ("zero3", "zero_optimization.stage 3 with tensor_model_parallel.size 2 is not supported"),
        ("fp16", "fp16.enabled: fp16 training (loss scaling) is not supported"),
        ("optimizer", "optimizer.type: got 'Adamm'; allowed values: one of DeepSpeed's"),
        ("no_optimizer", "optimizer.type: missing"),
        ("cp_key", "context_parallel.sise: unknown key"),
        ("ep_zero0_clipping", "gradient_clipping with experts sharded over expert_model_parallel.size=2 ranks "
                              "needs ZeRO 1 or 2"),
        ("ep_save", "saving a checkpoint of experts sharded over expert_model_parallel.size=2 ranks is not supported"),
        ("hf_native_not_hf_dir", "--hf-native needs --model DIR, a Hugging Face model directory with a config.json"),
        ("hf_native_backend", "--hf-native trains the transformers modules as they are: --backend"),
        ("seq_len_context", "--seq-len 257 exceeds the model's context of 256 tokens"),
        ("seq_len_cp", "--seq-len 3 is too short for CP=2: every CP rank needs a token with a label"),
        ("seq_len_one_cp", "--seq-len 1 is too short for CP=2: every CP rank needs a token with a label "
                           "(at least 4 tokens)"),
        ("save_every_no_save", "--save-every needs --save DIR"),
        ("keep_last", "--keep-last must be >= 1, got 0"),
        ("saves_nothing", "--no-save-at-end without --save-every saves nothing"),
        ("eval_every", "--eval-every must be >= 1 and needs --eval-corpus, got 5 without --eval-corpus"),
        ("resume_not_checkpoint", "neither a --save directory of megacp.train (no 'latest' file)"),
        ("resume_auto_no_save", "--resume auto resumes from the --save directory: pass --save DIR"),
        ("missing_eval_corpus", "corpus /nonexistent/eval.txt does not exist"),
        ("monitor", "the comet_ml package is not installed: pip install comet_ml, or disable the comet monitor"),
        ("save_other_model", "holds a checkpoint of a different model (megacp_train.json); use --force to save over it"),
        ("save_in_use", "is in use by another run (pid "),
    ],
)
def test_bad_input_is_one_line(case: str, expected: str, tiny: tuple[Path, Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    model_dir, corpus = tiny
    base = ["--model", str(model_dir), "--corpus", str(corpus), "--deepspeed_config", str(CPU_CONFIG)]
    if case == "save_other_model":
        from megacp.checkpoint.deepspeed import MegacpRecord, write_train_state
        from tests.helpers.training import tiny_config

        (tmp_path / "other").mkdir()
        write_train_state(tmp_path / "other", model=MegacpRecord.of(tiny_config(tied=False)).entry(),
                          dtype=torch.float32, tp_size=1, zero_stage=1, tag="step1", tokenizer=None)
    held = None
    if case == "save_in_use":  # another run's lock on the directory
        from megacp.train.save_target import SaveLock

        held = SaveLock(tmp_path / "busy")
    argv = {
        "no_config": ["--model", str(model_dir)],
        "seq_len": base + ["--seq-len", "0"],
        "steps": base + ["--steps", "-1"],
        "gc_every": base + ["--gc-every", "-1"],
        "unknown_flag": base + ["--lr", "1"],
        "missing_corpus": base[:2] + ["--corpus", str(tmp_path / "absent.txt"), *base[4:]],
        "missing_model": ["--model", "/nonexistent/model", *base[2:]],
        "zero3": base[:4] + ["--deepspeed_config", _config(tmp_path, "zero3", zero_optimization={"stage": 3},
                                                                 tensor_model_parallel={"size": 2})],
        "fp16": base[:4] + ["--deepspeed_config", _config(tmp_path, "fp16", fp16={"enabled": True})],
        "optimizer": base[:4] + ["--deepspeed_config", _config(tmp_path, "optimizer", optimizer={"type": "Adamm"})],
        "no_optimizer": base[:4] + ["--deepspeed_config", _config(tmp_path, "no_optimizer", optimizer={})],
        "cp_key": base[:4] + ["--deepspeed_config", _config(tmp_path, "cp_key", context_parallel={"sise": 2})],
        "ep_zero0_clipping": base[:4] + ["--deepspeed_config", _config(tmp_path, "ep", expert_model_parallel={"size": 2},
                                                                     zero_optimization={"stage": 0})],
        "ep_save": base + ["--save", str(tmp_path / "ckpt"), "--deepspeed_config",
                           _config(tmp_path, "ep_save", expert_model_parallel={"size": 2})],
        "hf_native_not_hf_dir": ["--hf-native", "--model", str(corpus), *base[2:]],
        "hf_native_backend": ["--hf-native", "--backend", "torch", *base],
        "seq_len_context": base + ["--seq-len", "257"],
        "seq_len_cp": base + ["--seq-len", "3"],
        "seq_len_one_cp": base + ["--seq-len", "1"],
        "save_every_no_save": base + ["--save-every", "2"],
        "keep_last": base + ["--save", str(tmp_path / "c"), "--keep-last", "0"],
        "saves_nothing": base + ["--save", str(tmp_path / "c"), "--no-save-at-end"],
        "eval_every": base + ["--eval-every", "5"],
        "resume_not_checkpoint": base + ["--seq-len", "40", "--resume", str(tmp_path)],
        "resume_auto_no_save": base + ["--seq-len", "40", "--resume", "auto"],
        "missing_eval_corpus": base + ["--eval-corpus", "/nonexistent/eval.txt"],
        "monitor": base[:4] + ["--deepspeed_config", _config(tmp_path, "monitor", comet={"enabled": True})],
        "save_other_model": base + ["--seq-len", "40", "--save", str(tmp_path / "other")],
        "save_in_use": base + ["--seq-len", "40", "--save", str(tmp_path / "busy")],
    }[case]
    assert expected in _main_error(argv, capsys)
    del held


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without a GPU")
def test_seq_len_auto_needs_a_gpu(capsys):
    """``--seq-len auto`` without a GPU and a length that is no number, with the default model (SmolLM2's
    GGUF, whose header megacp reads for the plan's sizes: seconds of CPU)."""
    from megacp.train.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--deepspeed_config", "configs/train_cpu_cp1.json", "--seq-len", "auto"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "megacp.train: error: --seq-len auto fits a step into GPU memory by the memory plan: it needs a GPU and a "
        "model the plan has sizes for (not a mixture of experts megacp's own models do not implement)"]
    with pytest.raises(SystemExit):
        main(["--deepspeed_config", "configs/train_cpu_cp1.json", "--seq-len", "long"])
    assert "--seq-len: expected a number of tokens or 'auto', got 'long'" in capsys.readouterr().err


def test_trains_without_a_launcher(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """``python -m megacp.train`` as a plain process (no launcher environment) trains at CP 1 on
    CPU as a world of one, with DeepSpeed's ``--deepspeed`` flag, and exits 0. Run twice on the
    same corpus: the first tokenises it into the token cache, the second reuses it, each saying so
    in one line, and both train on the same tokens (equal losses)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    model_dir, corpus = tiny
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    runs = []
    for run in ("first", "second"):
        result = subprocess.run([sys.executable, "-m", "megacp.train", "--deepspeed", "--model", str(model_dir),
                                 "--corpus", str(corpus), "--steps", "2", "--seq-len", "64", "--token-cache",
                                 str(tmp_path / "tokens"), "--metrics", str(tmp_path / f"{run}.jsonl"),
                                 "--deepspeed_config", str(ROOT / "configs" / "train_cpu_cp1.json")],
                                env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "megacp.train: 2 steps, loss" in result.stdout
        runs.append([line for line in result.stdout.splitlines() if "the corpus" in line or "tokenised corpus" in line])
    (cache,) = (tmp_path / "tokens").iterdir()
    documents = "4 documents, "  # a.txt, then b.jsonl's three lines
    assert len(runs[0]) == 1 and runs[0][0].startswith("megacp.train: tokenised the corpus in ")
    assert documents in runs[0][0] and runs[0][0].endswith(f"({cache})")
    assert runs[1] == [runs[0][0].replace(runs[0][0].split(": ")[1], "reused the tokenised corpus")]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / f"{run}.jsonl").read_text().splitlines()]
              for run in ("first", "second")]
    assert losses[0] == losses[1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from megacp.train.cli import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("megacp ")


@pytest.mark.slow
def test_deepspeed_rejection_is_one_line_under_torchrun(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """A batch size that does not fit the mesh (DeepSpeed's own check, after the process group
    exists): rank 0 prints one line, rank 1 nothing, exit status 2, nothing is loaded."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    model_dir, corpus = tiny
    logs = tmp_path / "logs"
    result = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), "--log-dir", str(logs), "--redirects", "3", "-m", "megacp.train",
                   "--model", str(model_dir), "--corpus", str(corpus), "--seq-len", "64",
                   "--deepspeed_config", _config(tmp_path, "batch", train_batch_size=3)])
    assert result.returncode != 0
    errors = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(errors) == [0, 1]
    lines = [line for text in errors.values() for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and errors[1].strip() == "", errors
    assert lines[0].startswith("megacp.train: error: DeepSpeed rejects the config: ")
    assert "train_batch_size" in lines[0]
    assert "exitcode  : 2" in result.stderr  # the root cause; torchrun may stop the other rank first


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("train_*.json")))
def test_shipped_training_configs_parse(name: str) -> None:
    """megacp's sections, megacp.train's checks and DeepSpeed's own parser accept every shipped
    training config (the GPU ones included: no process group needed)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    from deepspeed.runtime.config import DeepSpeedConfig

    from megacp.config import load_config

    config = load_config(ROOT / "configs" / f"{name}.json", training=True)
    settings = config.training
    parsed = DeepSpeedConfig(dict(config.deepspeed))
    assert parsed.zero_optimization_stage == settings.zero_stage
    assert parsed.optimizer_name == "adamw" and parsed.gradient_clipping > 0
    assert settings.dtype == (torch.float32 if "cpu" in name else torch.bfloat16)


def test_only_the_known_harmless_warnings_are_silenced() -> None:
    import logging
    import warnings

    from megacp.train.cli import silence_harmless_warnings

    logger, seen = logging.getLogger("DeepSpeed"), []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            silence_harmless_warnings()
            logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
            logger.warning("Attempting to get learning rate from scheduler before it has started")
            logger.warning("ZeRO: something worth reading")
            warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning, stacklevel=2)
            warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning, stacklevel=2)
            warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated", UserWarning, stacklevel=2)  # another category
            warnings.warn("some other deprecation", FutureWarning, stacklevel=2)
    finally:
        logger.removeHandler(handler)
    assert seen == ["ZeRO: something worth reading"]
    assert [(w.category, str(w.message)) for w in caught] == [
        (UserWarning, "`torch.distributed.all_gather_into_tensor` is deprecated"), (FutureWarning, "some other deprecation")]


def test_a_dead_saves_staging_is_removed_and_named(tiny: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A save that did not finish left ``.step7.staging`` (say, the disk filled): the next run into the
    directory removes it, in one line naming it, before it counts the room it needs (here the run then
    stops at its bad --resume, in one line)."""
    model_dir, corpus = tiny
    stale = tmp_path / "ckpt" / ".step7.staging" / "step7"
    stale.mkdir(parents=True)
    (stale / "mp_rank_00_model_states.pt").write_bytes(b"\0" * (3 << 20))
    base = ["--model", str(model_dir), "--corpus", str(corpus), "--deepspeed_config", str(CPU_CONFIG)]
    assert "--resume" in _main_error(base + ["--seq-len", "40", "--save", str(tmp_path / "ckpt"), "--resume",
                                             str(tmp_path)], capsys, keep_out=True)
    assert not stale.parent.exists()
    assert capsys.readouterr().out == (f"megacp.train: removed {stale.parent} (3 MiB), the staging of a save that "
                                       "did not finish\n")
