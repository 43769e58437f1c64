"""Census of refused input: every bad input below gets exactly the one-line message pinned here (no
newline, no traceback), a command line exit status 2 with that line alone on stderr, and the
server HTTP 400 with it.

Rows are checked in-process where a function validates (config, runtime knobs, checkpoints,
attention inputs, sampling values, the converter's ``main``, the server's app); four command lines
run as real processes (a tokenizer file symlinked out of the model directory and a KV cache larger
than the host's memory among them). Real gloo ranks run a CP 2 ZeRO 1 training job whose checkpoint
is re-saved with rank 0 stopped at each rename (the previous checkpoint stays loadable and
converting) and then tampered with (shards of another run, swapped, missing, extra; an edited
``megacp_train.json``), generation with rank-divergent prompts, seeds and ``max_tokens``, and an
``LLM`` given prompts that are no prompts.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megacp.checkpoint import CheckpointError, load_model, open_megacp_checkpoint, save_megacp_checkpoint
from megacp.checkpoint.convert import main as convert
from megacp.config import ConfigError, load_config, with_env_overrides
from megacp.models import ModelConfig, parameter_shapes
from megacp.parallel.layout import ParallelLayout
from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                  eos_token_id=2)


def _message(fn: Callable[[], Any], error: type[Exception]) -> str:
    """The message of the ``error`` ``fn`` raises (fails the test when it raises nothing)."""
    with pytest.raises(error) as caught:
        fn()
    return str(caught.value)


def _one_line(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message, message
    return message


CONFIG_ROWS = [
    ({"context_paralel": {"size": 2}}, "context_paralel: unknown top-level key; did you mean context_parallel?"),
    ({"Context_Parallel": {"size": 2}}, "Context_Parallel: unknown top-level key; did you mean context_parallel?"),
    ({"tensor_model_paralel": {"size": 2}},
     "tensor_model_paralel: unknown top-level key; did you mean tensor_model_parallel?"),
    ({"pipeline_model_parallel": {"size": 2}},
     "pipeline_model_parallel.size: got 2; no megacp model has pipeline stages; allowed values: 1"),
    ({"context_parallel": {"size": 1e400}}, "context_parallel.size: got inf; allowed values: an integer >= 1"),
    ({"context_parallel": {"prefill": "ring"}},
     "context_parallel.prefill: got 'ring'; allowed values: 'auto', 'pass_kv', 'pass_q'"),
]


@pytest.mark.parametrize(("config", "message"), CONFIG_ROWS, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(CONFIG_ROWS)])
def test_config_errors(config: dict, message: str) -> None:
    assert _one_line(_message(lambda: load_config(config), ConfigError)) == message


def test_sizes_and_runtime_knobs() -> None:
    cfg = load_config({"context_parallel": {"size": 3}})
    assert _one_line(_message(lambda: ParallelLayout.from_config(cfg, 4), ConfigError)) == (
        "context_parallel.size x tensor_model_parallel.size x pipeline_model_parallel.size = 3 x 1 x 1 = 3 "
        "does not divide the world size 4; allowed: sizes whose product divides 4")
    rows = [({"MEGACP_ATTN_BACKEND": "fast"}, "MEGACP_ATTN_BACKEND='fast': allowed values: 'auto', 'cudnn', 'flash', 'reference'"),
            ({"MEGACP_RING_TRANSPORT": "nvlink"},
             "MEGACP_RING_TRANSPORT='nvlink': allowed values: 'auto', 'nccl', 'copy_engine'")]
    for env, message in rows:
        assert _one_line(_message(lambda: with_env_overrides(cfg, env), ConfigError)) == message  # noqa: B023  # called at once


def test_corrupt_calibration_cache_warns_and_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A corrupt cache is one warning line; the defaults serve until the next calibration rewrites it."""
    from megacp.attention import strategy

    (tmp_path / "calibration.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=strategy.log.name):
        hw = strategy.hardware_for(torch.device("cpu"), 2, cache_dir=tmp_path)
    assert hw == strategy.DEFAULTS["cpu"]
    (record,) = caplog.records
    assert _one_line(record.getMessage()) == (
        f"ignoring the corrupt calibration cache {tmp_path / 'calibration.json'} (Expecting property name enclosed "
        "in double quotes: line 1 column 2 (char 1)); it is rebuilt by the next calibration")


def _checkpoint(directory: Path, poison: str | None = None) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) for name, shape in parameter_shapes(CFG).items()}
    if poison:
        tensors[poison][0, 0] = float("nan")
    save_megacp_checkpoint(directory, CFG, tensors.items(), dtype=torch.float32)
    return directory


def test_checkpoint_errors(tmp_path: Path) -> None:
    good = _checkpoint(tmp_path / "good")
    manifest = good / "megacp_checkpoint.json"
    text = manifest.read_text()

    manifest.write_text(text[:-20])
    assert _one_line(_message(lambda: open_megacp_checkpoint(good), CheckpointError)).startswith(
        f"invalid manifest {manifest}: JSONDecodeError(")
    manifest.write_text(text.replace('"rope_theta": 10000.0', '"rope_theta": 500000.0'))
    assert _one_line(_message(lambda: open_megacp_checkpoint(good), CheckpointError)) == (
        f"{manifest}: manifest checksum mismatch: the manifest was edited or is corrupt")
    manifest.write_text(text)
    (good / "model-tp00-of-01.safetensors").unlink()
    assert _one_line(_message(lambda: open_megacp_checkpoint(good), CheckpointError)) == (
        f"{good / 'model-tp00-of-01.safetensors'} is missing")

    nan = _checkpoint(tmp_path / "nan", poison="layers.0.layernorm_mlp.fc2_weight")
    assert _one_line(_message(lambda: load_model(nan, dtype=torch.float32, device="cpu"), CheckpointError)) == (
        f"tensor 'layers.0.layernorm_mlp.fc2_weight' in {nan} holds 1 non-finite value(s) (NaN/inf); "
        "allow_non_finite=True (--allow-non-finite) loads it anyway")


def test_converter_write_errors(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk and a read-only destination (simulated: this may run as root): exit status 2, one line."""
    from megacp.checkpoint import safetensors_io

    source = _checkpoint(tmp_path / "src")
    out = tmp_path / "out"

    def fail(code: int) -> Callable[..., None]:
        def raise_it(*args: object, **kwargs: object) -> None:
            raise OSError(code, os.strerror(code))
        return raise_it

    rows = [(safetensors_io.SafetensorsWriter, "write", errno.ENOSPC, f"error: cannot write {out}: No space left on device"),
            (Path, "mkdir", errno.EROFS, f"error: cannot write {out}: Read-only file system")]
    for owner, name, code, message in rows:
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, fail(code))
            assert convert(["reshard", "--input", str(source), "--output", str(out), "--tp", "2"]) == 2
        assert capsys.readouterr().err == message + "\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cp_attention_input_errors() -> None:
    from megacp.attention import cp_attention

    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    rows = [((q.long(), k.long(), v.long()), "cp_attention needs fp16, bf16 or fp32 inputs; q is torch.int64"),
            ((q, k.half(), v), "cp_attention needs q, k and v of one dtype; got q torch.float32, k torch.float16, "
                               "v torch.float32"),
            ((q.requires_grad_(), k, v), "cp_attention computes without autograd (its output is gathered from every "
                                         "rank); inputs that require grad need megacp.attention.ring_attention on "
                                         "this rank's shard, or the CP layer")]
    for args, message in rows:
        assert _one_line(_message(lambda: cp_attention(*args), ValueError)) == message  # noqa: B023  # called at once


def test_command_lines(tmp_path: Path) -> None:
    """Two real processes: a misspelled config section for ``python -m megacp.train`` and a corrupt
    manifest for the converter (run side by side)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"context_paralel": {"size": 2}}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "megacp_checkpoint.json").write_text("[]")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    rows = [([sys.executable, "-m", "megacp.train", "--deepspeed_config", str(config)],
             f"{config}: context_paralel: unknown top-level key; did you mean context_parallel?"),
            ([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "reshard", "--input", str(broken),
              "--output", str(tmp_path / "out"), "--tp", "1"],
             f"error: invalid manifest {broken / 'megacp_checkpoint.json'}: AttributeError(\"'list' object has no "
             "attribute 'get'\")")]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for argv, _ in rows]
    for proc, (_, message) in zip(procs, rows):
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 2 and stdout == "", (proc.returncode, stdout, stderr)
        assert stderr.count("\n") == 1 and stderr.rstrip("\n").endswith(message), stderr


class _Payload:
    """Unpickling this calls ``os.system`` (what a malicious checkpoint would carry)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


class _Killed(BaseException):
    """What the re-save below is stopped with in place of SIGKILL (``Trainer.save`` cleans nothing
    up on the way out, so the directory is left as a kill at that point would leave it)."""


def _train_save_and_kill_resaves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """CP 2, ZeRO 1 (two optimizer shards): save ``step1`` into ``root/run`` and, after one more step,
    into ``root/other`` (``step2``: other shards); then re-save ``step1`` into ``root/run`` with
    global rank 0 stopped before each of its renames in turn, the previous checkpoint read back
    after each. Returns the first and the re-saved weights and what was read after each stop."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import shutil

    import torch.distributed as dist

    import megacp
    from megacp.checkpoint.deepspeed import read_deepspeed_checkpoint
    from megacp.models import CausalLM
    from megacp.train import saving
    from megacp.train.data import PackedSequence, StreamPosition
    from megacp.train.engine import Trainer
    from megacp.train.resume import ResumePoint

    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "context_parallel": {"size": 2}}
    state = megacp.initialize(config)
    torch.manual_seed(0)
    model = CausalLM(CFG, dtype=torch.float32).train()
    megacp.swap_attention(model, state, strategy="pass_kv")
    trainer = Trainer(model, config, state)
    ids = torch.randint(0, CFG.vocab_size, (16,), generator=torch.Generator().manual_seed(1))
    batch = PackedSequence(ids, torch.tensor([0, 16], dtype=torch.int32))
    run = Path(root) / "run"
    trainer.step(iter([batch]))
    point = ResumePoint(step=1, data=StreamPosition(), seq_len=16, micro_batch=1, dp_size=1, world_size=world_size)
    trainer.save(run, resume=point)
    trainer.step(iter([batch]))
    trainer.save(Path(root) / "other")
    if rank == 0:
        shutil.copytree(run, Path(root) / "pristine")
    trainer.steps_done = 1  # the run repeated into its own directory: step1 again, with the new weights

    renames = [0, 0]  # [calls so far, the call to stop before]
    real_replace, real_exchange = os.replace, saving.exchange_directories

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            renames[0] += 1
            if renames[0] == renames[1]:
                raise _Killed()
            return fn(*args, **kwargs)
        return wrapper

    read: list[str] = []
    for stop in range(1, 10):
        renames[:] = [0, stop if rank == 0 else 0]
        os.replace, saving.exchange_directories = counted(real_replace), counted(real_exchange)  # type: ignore[assignment]
        try:
            trainer.save(run)
            done = True
        except _Killed:
            dist.barrier()  # the one the stopped rank 0 owed its peer at the end of the save
            done = False
        finally:
            os.replace, saving.exchange_directories = real_replace, real_exchange  # type: ignore[assignment]
        done_everywhere = torch.tensor([done], dtype=torch.int64)
        dist.all_reduce(done_everywhere, op=dist.ReduceOp.MIN)
        if rank == 0:
            weights = read_deepspeed_checkpoint(run).tensors["embedding.weight"]  # verified against its manifest
            read.append("new" if torch.equal(weights, trainer.module.embedding.weight.detach()) else
                        "first" if torch.equal(weights, read_deepspeed_checkpoint(Path(root) / "pristine")
                                               .tensors["embedding.weight"]) else "neither")
        if done_everywhere.item():
            break
    swapped = Path(root) / "swapped"
    if rank == 0:
        shutil.copytree(Path(root) / "pristine", swapped)
        first, second = sorted((swapped / "step1").glob("*_optim_states.pt"))
        first.rename(swapped / "step1" / "tmp")
        second.rename(first)
        (swapped / "step1" / "tmp").rename(second)
    evil = Path(root) / "evil"  # no manifest (as an older megacp wrote), and a model file that runs code
    if rank == 0:
        shutil.copytree(Path(root) / "pristine", evil)
        (evil / "step1" / "megacp_manifest.json").unlink()
        torch.save({"module": _Payload(Path(root) / "pwned")}, evil / "step1" / "mp_rank_00_model_states.pt")
    dist.barrier()
    resumed = []
    for source in (swapped, evil):
        try:
            trainer.load(source, "step1")
            resumed.append("resumed")
        except CheckpointError as err:
            resumed.append(str(err))
    return {"read": read, "resume": resumed}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CP 2 ZeRO 1 ``megacp.train`` checkpoint (``run``), one of the same model saved one step
    later (``other``), and ``run`` as first saved (``pristine``); see :func:`_train_save_and_kill_resaves`."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    from tests.helpers.distributed import run_distributed

    root = tmp_path_factory.mktemp("trained")
    results = run_distributed(_train_save_and_kill_resaves, 2, str(root))
    (root / "read.json").write_text(json.dumps(results[0]["read"]))
    (root / "resume.json").write_text(json.dumps([r["resume"] for r in results]))
    return root


def test_kill_during_resave_keeps_a_checkpoint_that_converts(trained: Path) -> None:
    """Stopped before any of its renames, the re-save leaves ``latest`` naming a complete tag that
    passes its manifest: the first checkpoint until the new one is swapped in, the new one after."""
    read = json.loads((trained / "read.json").read_text())
    assert len(read) >= 3 and "neither" not in read, read
    assert read[0] == "first" and read[-1] == "new", read  # stopped before the swap: untouched
    assert convert(["deepspeed-to-hf", "--input", str(trained / "run"), "--output", str(trained / "hf")]) == 0


def test_resume_from_swapped_shards_or_a_pickle_payload_is_refused_on_every_rank(trained: Path) -> None:
    """``--resume`` checks the manifest and that every ``.pt`` file is plain data (each rank its share)
    before DeepSpeed's loader, which unpickles unguarded, reads anything: the same line on every rank."""
    for swapped, evil in json.loads((trained / "resume.json").read_text()):
        assert _one_line(swapped).startswith(f"{trained / 'swapped' / 'step1'}: zero_pp_rank_0_mp_rank_00_optim_"
                                             "states.pt holds the data of zero_pp_rank_1_mp_rank_00_optim_states.pt "
                                             "(shards swapped or renamed)"), swapped
        assert _one_line(evil) == (f"{trained / 'evil' / 'step1' / 'mp_rank_00_model_states.pt'} is not plain tensor "
                                   "data (it holds the object type posix.system); megacp.train resumes only from "
                                   "checkpoints of plain data"), evil
    assert not (trained / "pwned").exists()


def _tamper(trained: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the pristine checkpoint, changed as ``how`` says."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "pristine", ckpt)
    tag, other = ckpt / "step1", trained / "other" / "step2"
    shards = sorted(tag.glob("*_optim_states.pt"))
    assert len(shards) == 2, shards  # ZeRO 1 over the two CP ranks
    if how == "swapped":
        shards[0].rename(tag / "tmp")
        shards[1].rename(shards[0])
        (tag / "tmp").rename(shards[1])
    elif how == "foreign":
        shutil.copyfile(other / shards[1].name, shards[1])
    elif how == "missing":
        shards[1].unlink()
    elif how == "extra":
        shutil.copyfile(shards[1], tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    elif how == "sidecar":
        sidecar = ckpt / "megacp_train.json"
        sidecar.write_text(sidecar.read_text().replace('"rope_theta": 10000.0', '"rope_theta": 500000.0'))
    return ckpt


@pytest.mark.parametrize(("how", "message"), [
    ("swapped", "step1: zero_pp_rank_0_mp_rank_00_optim_states.pt holds the data of "
                "zero_pp_rank_1_mp_rank_00_optim_states.pt (shards swapped or renamed); checkpoint step1 of run "),
    ("foreign", "step1: zero_pp_rank_1_mp_rank_00_optim_states.pt does not belong to checkpoint step1 of run "),
    ("missing", "step1: zero_pp_rank_1_mp_rank_00_optim_states.pt is missing (run "),
    ("extra", "step1: zero_pp_rank_2_mp_rank_00_optim_states.pt is not part of checkpoint step1 of run "),
    ("sidecar", "megacp_train.json does not match checkpoint step1 (its values differ from the ones "
                "megacp_manifest.json records): it was edited, or the tag belongs to another model"),
])
def test_shards_that_do_not_belong_together_are_refused(how: str, message: str, trained: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    ckpt = _tamper(trained, tmp_path, how)
    out = tmp_path / "hf"
    assert convert(["deepspeed-to-hf", "--input", str(ckpt), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _divergent_generation(rank: int, n: int) -> dict[str, Any]:
    """Rank 1 generates with another prompt of the same length, another seed, another ``max_tokens``:
    the message each rank got; then a call every rank makes alike (the group is still in step)."""
    import megacp
    from megacp.generate.engine import generate
    from megacp.generate.loop import Generator
    from megacp.generate.sampling import SamplingParams
    from megacp.layers.settings import CPSettings
    from megacp.models import CausalLM

    state = megacp.initialize({"context_parallel": {"size": n}})
    torch.manual_seed(0)
    model = CausalLM(CFG, dtype=torch.float32).eval()
    settings = CPSettings.from_state(state, prefill="pass_kv")
    megacp.swap_attention(model, settings)
    gen = Generator.for_model(model, CFG, settings, device=state.device, dtype=torch.float32)
    odd, prompt = rank == 1, [5, 6, 7, 8, 9, 10, 11]
    cases = {
        "prompt": lambda: generate(gen, [prompt[:-1] + [12 if odd else 11]], SamplingParams(max_tokens=2),
                                   vocab=CFG.vocab_size),
        "seed": lambda: generate(gen, [prompt], SamplingParams(max_tokens=2, temperature=1.0, seed=int(odd)),
                                  vocab=CFG.vocab_size),
        "max_tokens": lambda: generate(gen, [prompt], SamplingParams(max_tokens=2 + odd), vocab=CFG.vocab_size),
    }
    out: dict[str, Any] = {name: _message(fn, ValueError) for name, fn in cases.items()}
    out["after"] = generate(gen, [prompt], SamplingParams(max_tokens=3, temperature=1.0, seed=7),
                            vocab=CFG.vocab_size).tokens
    return out


def test_rank_divergent_generation_is_one_error_on_every_rank() -> None:
    """Same shapes, other values: caught in the step's one agreement, on every rank, before the ring."""
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_divergent_generation, 2)
    for rank, res in enumerate(results):
        other = 1 - rank
        assert _one_line(res["prompt"]) == (
            "CP attention step: the 2 CP ranks must pass the same values but differ in new token ids (digest) "
            f"(rank {rank} has its own, rank(s) [{other}] another value)"), res
        assert res["seed"].startswith("CP attention step: the 2 CP ranks must pass the same values but differ in "
                                      f"sampling seeds and parameters (rank {rank} has [SamplingParams("), res
        assert f"seed={rank}," in res["seed"] and "new token ids" not in res["seed"], res
        assert f"max_tokens={2 + rank}," in res["max_tokens"], res
    assert results[0]["after"] == results[1]["after"] and len(results[0]["after"][0]) == 3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a character-level tokenizer (a Hugging Face directory)."""
    from tests.helpers.hf_models import make_hf_model, save_char_tokenizer

    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama3", directory)
    save_char_tokenizer(directory)
    return directory


def test_generate_and_serve_command_lines(tiny_llama: Path, tmp_path: Path) -> None:
    """Two real processes side by side: ``megacp.generate`` on a model whose ``tokenizer.json`` is a
    symlink to a file outside its directory (refused before the weights load, as the converter
    refuses to copy it), and ``megacp.serve --max-num-seqs 100000`` (a KV cache larger than the
    host's memory, refused before it is allocated, naming both sizes)."""
    from tests.helpers.distributed import free_port

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (tmp_path / "outside.json").write_text("not a tokenizer")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(tmp_path / "outside.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    rows = [([sys.executable, "-m", "megacp.generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2",
              "--dtype", "float32"],
             re.escape(f"megacp.generate: {model / 'tokenizer.json'} is a symlink leading outside the checkpoint "
                       f"{model}; refusing to read it")),
            ([sys.executable, "-m", "megacp.serve", "--model", str(tiny_llama), "--dtype", "float32", "--max-num-seqs",
              "100000", "--host", "127.0.0.1", "--port", str(free_port())],
             r"megacp\.serve: the KV cache of 100001 slots x 4097 rows per CP rank needs 314652746496 bytes \(293\.0 "
             r"GiB\) on cpu, more than the \d+ bytes \(\d+\.\d GiB\) available there: lower the request slots "
             r"\(--max-num-seqs, LLM\(max_num_seqs=\.\.\.\), max_sessions\) or the tokens per request "
             r"\(--max-model-len, max_session_tokens\)")]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for argv, _ in rows]
    for proc, (_, message) in zip(procs, rows):
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 2 and "loading" not in stdout, (proc.returncode, stdout, stderr)
        assert stderr.count("\n") == 1 and re.fullmatch(message, stderr.rstrip("\n")), stderr


class _NoEngine:
    """What the server's handlers read of an engine before a request reaches it."""

    tokenizer = None
    failure = None


def test_server_bodies_that_are_no_object_and_values_out_of_range_are_400() -> None:
    """A JSON body ``null`` or ``[]``, a seed of 2**64 (would alias seed 0) and an infinite
    temperature: HTTP 400 in OpenAI's error shape, one line naming the problem."""
    from fastapi.testclient import TestClient

    from megacp.serve.app import build_app

    client = TestClient(build_app(_NoEngine(), CFG, model_name="tiny", max_model_len=32,  # type: ignore[arg-type]
                                  api_key=None))  # no `with`: the engine is never started
    ok = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    rows = [(b"null", None, "the request body must be a JSON object, got null"),
            (b"[]", None, "the request body must be a JSON object, got an array"),
            (json.dumps(dict(ok, seed=2**64)).encode(), "seed",
             "seed must be in [-2**63, 2**64) (torch.manual_seed's range), got 18446744073709551616"),
            (json.dumps(dict(ok, temperature=math.inf)).encode(), "temperature",
             "temperature must be a finite number (0 = greedy), got inf")]
    for body, param, message in rows:
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], _one_line(error["message"])) == (param, message), error
    r = client.post("/v1/chat/completions", content=b"[]", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object, got an array"


def test_sampling_values_that_would_be_ignored_or_aliased() -> None:
    from megacp import LLM, SamplingParams

    rows = [(dict(seed=2**64), "seed must be in [-2**63, 2**64) (torch.manual_seed's range), got 18446744073709551616"),
            (dict(seed=-(2**63) - 1),
             "seed must be in [-2**63, 2**64) (torch.manual_seed's range), got -9223372036854775809"),
            (dict(temperature=math.inf), "temperature must be a finite number (0 = greedy), got inf"),
            (dict(logprobs=21), "logprobs must be None or an integer >= 0 and <= 20 (top tokens per generated token; "
                                "vLLM's max_logprobs), got 21")]
    for kwargs, message in rows:
        assert _one_line(_message(lambda kwargs=kwargs: SamplingParams(**kwargs), ValueError)) == message
    assert SamplingParams(seed=2**64 - 1, logprobs=20).seed == 2**64 - 1
    assert _one_line(_message(lambda: LLM(max_num_seqs="2"), ValueError)) == (  # type: ignore[arg-type]
        "max_num_seqs must be an integer >= 1, got '2'")


def _no_prompts(rank: int, n: int, path: str) -> dict[str, str]:
    """The messages of ``generate`` given ``None``, a list holding ``None`` and a number."""
    from megacp import LLM

    llm = LLM(path, dtype="float32")
    return {repr(bad): _message(lambda bad=bad: llm.generate(bad), ValueError) for bad in (None, [None], 5)}


def test_llm_generate_of_no_prompt_is_one_error(tiny_llama: Path) -> None:
    from tests.helpers.distributed import run_distributed

    (got,) = run_distributed(_no_prompts, 1, str(tiny_llama))
    assert {k: _one_line(v) for k, v in got.items()} == {
        "None": "prompts must be text, token ids, or a list of them, got None",
        "[None]": "prompt 0 must be text or a list of integer token ids",
        "5": "prompts must be text, token ids, or a list of them, got int"}
