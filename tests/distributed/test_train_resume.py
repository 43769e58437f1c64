"""``python -m megacp.train`` killed and resumed continues exactly as if it had not stopped.

A CP 2 run (2 gloo processes, fp32, ZeRO 1, 2 micro-batches per step, checkpoints every 7 steps,
keeping 1) is killed with SIGKILL while it trains; ``--resume`` from its latest checkpoint (step
``K``) for 5 more steps must give the losses and learning rates of an uninterrupted run of ``K + 5``
steps at steps ``K + 1 ...`` and the same final parameters (fp32 master weights, 1e-6 relative).
Both also report the evaluation loss of a held-out file after their last step: the same, and
transformers' mean token loss of its packed document pieces. The resumed run's save folder holds megacp's ``zero_to_fp32.py``, whose Hugging Face output loads in
transformers with megacp's logits. ZeRO 0, 2 and 3 at CP 2 are checked the same way (ZeRO 2 with DeepSpeed's
``csv_monitor``, which must get every step's loss and tokens): their uninterrupted runs of 12 steps save every
3 steps keeping the last 2, which must leave exactly ``step9`` and ``step12``, and a run resumed
from ``step9`` must end as they do. The killed job's two processes run the CLI's ``main`` (rank environment set
by hand), as do ``run_distributed``'s ranks for the other runs.

At DP 2 x CP 2 (4 ranks, the same config at ZeRO 2: the optimizer state partitioned over the 4
ranks, each data-parallel replica reading its own sequences) an uninterrupted run of 3 steps saves
``step2``, and a run resumed from it must give its step 3 and final parameters.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import distributed
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.reference import rel_err
from tests.helpers.timeouts import HANG_GUARD_S
from tests.helpers.train_cli import make_corpus, make_tiny_model

pytest.importorskip("deepspeed", reason="DeepSpeed not installed")

SEQ_LEN = 40
MORE = 5
"""Steps the killed run is resumed for."""


def _write_configs(tmp: Path) -> None:
    """``configs/train_cpu_cp2.json`` at ZeRO 0, 1, 2 and 3, as ``tmp/zero<stage>.json`` (ZeRO 2 with
    DeepSpeed's ``csv_monitor`` writing into ``tmp/csv/zero2``)."""
    config = json.loads((ROOT / "configs" / "train_cpu_cp2.json").read_text())
    for stage in (0, 1, 2, 3):
        monitor = {"csv_monitor": {"enabled": True, "output_path": str(tmp / "csv"), "job_name": "zero2"}} if stage == 2 else {}
        (tmp / f"zero{stage}.json").write_text(json.dumps({**config, "zero_optimization": {"stage": stage}, **monitor}))


def _args(tmp: Path, stage: int, *extra: str) -> list[str]:
    return ["--deepspeed_config", str(tmp / f"zero{stage}.json"), "--model", str(tmp / "model"), "--corpus",
            str(tmp / "corpus"), "--seq-len", str(SEQ_LEN), "--quiet", *extra]


def _killed_rank(rank: int, port: int, args: list[str]) -> None:
    """One rank of the run that is killed: the CLI's ``main`` in a world of 2 on ``port``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from megacp.train.cli import main

    main(args)


def _kill_after_a_checkpoint(tmp: Path) -> int:
    """Train at CP 2 (ZeRO 1) for up to 1000 steps, saving every 7 and keeping 1, in two processes
    (forked from the test harness's server, where torch is loaded); SIGKILL both as soon as a
    checkpoint is complete. Returns the step of the checkpoint ``latest`` names."""
    args = _args(tmp, 1, "--steps", "1000", "--save", str(tmp / "killed"), "--save-every", "7", "--keep-last", "1",
                 "--metrics", str(tmp / "killed.jsonl"))
    port, context = free_port(), distributed._context()
    ranks = [context.Process(target=_killed_rank, args=(r, port, args)) for r in range(2)]  # type: ignore[attr-defined]
    for p in ranks:
        p.start()
    latest, deadline = tmp / "killed" / "latest", time.monotonic() + HANG_GUARD_S
    try:
        while not latest.is_file():
            assert all(p.is_alive() for p in ranks), "a rank of the run to be killed ended early"
            assert time.monotonic() < deadline, f"no checkpoint within {HANG_GUARD_S} s"
            time.sleep(0.005)
    finally:
        for p in ranks:
            p.kill()
    for p in ranks:
        p.join()
    assert [p.exitcode for p in ranks] == [-signal.SIGKILL] * 2  # killed while training, not finished
    return int(latest.read_text().removeprefix("step"))


def _main(port: int, args: list[str]) -> int:
    """The CLI's ``main`` in this rank, its world rendezvousing on a ``port`` of its own (a second
    rendezvous on the first run's store would meet that run's stale keys)."""
    from megacp.train.cli import main

    os.environ["MASTER_PORT"] = str(port)
    return main(args)


def _runs(rank: int, world_size: int, tmp: Path, killed_at: int, ports: list[int]) -> None:
    """ZeRO 1: the uninterrupted run and the resumed killed one; ZeRO 0, 2 and 3: the uninterrupted
    run and one resumed from its ``step9``."""
    ref = str(killed_at + MORE)
    evaluation = ["--eval-corpus", str(tmp / "corpus" / "a.txt")]
    assert _main(ports.pop(), _args(tmp, 1, "--steps", ref, "--save", str(tmp / "ref1"), "--metrics",
                                    str(tmp / "ref1.jsonl"), *evaluation)) == 0
    assert _main(ports.pop(), _args(tmp, 1, "--steps", ref, "--save", str(tmp / "killed"), "--resume",
                                    str(tmp / "killed"), "--metrics", str(tmp / "killed.jsonl"), *evaluation)) == 0
    with pytest.raises(SystemExit) as exit_:  # another ZeRO stage than the checkpoint's: one line, exit 2
        _main(ports.pop(), _args(tmp, 2, "--steps", ref, "--save", str(tmp / "killed"), "--resume", str(tmp / "killed")))
    assert exit_.value.code == 2
    for stage in (0, 2, 3):
        assert _main(ports.pop(), _args(tmp, stage, "--steps", "12", "--save", str(tmp / f"ref{stage}"), "--save-every",
                                        "3", "--keep-last", "2", "--metrics", str(tmp / f"ref{stage}.jsonl"))) == 0
        assert _main(ports.pop(), _args(tmp, stage, "--steps", "12", "--save", str(tmp / f"resumed{stage}"), "--resume",
                                        str(tmp / f"ref{stage}" / "step9"), "--metrics",
                                        str(tmp / f"resumed{stage}.jsonl"))) == 0


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same_run(ref: list[dict], resumed: list[dict], ref_dir: Path, resumed_dir: Path) -> None:
    from megacp.checkpoint.deepspeed import read_deepspeed_checkpoint

    by_step = {r["step"]: r for r in ref}
    assert resumed and resumed[-1]["step"] == ref[-1]["step"]
    for row in resumed:
        assert (row["loss"], row["lr"], row["tokens"]) == pytest.approx(
            (by_step[row["step"]]["loss"], by_step[row["step"]]["lr"], by_step[row["step"]]["tokens"]), rel=1e-6)
    a, b = read_deepspeed_checkpoint(ref_dir), read_deepspeed_checkpoint(resumed_dir)
    assert a.tag == b.tag == f"step{ref[-1]['step']}"
    assert max(rel_err(b.tensors[n], t) for n, t in a.tensors.items()) <= 1e-6


def _dp2_runs(rank: int, world_size: int, tmp: Path, ports: list[int]) -> None:
    """At DP 2 x CP 2, ZeRO 2: an uninterrupted run of 3 steps saving ``step2``, and one resumed from it."""
    assert _main(ports.pop(), _args(tmp, 2, "--steps", "3", "--save", str(tmp / "ref"), "--save-every", "2",
                                    "--metrics", str(tmp / "ref.jsonl"))) == 0
    assert _main(ports.pop(), _args(tmp, 2, "--steps", "3", "--save", str(tmp / "resumed"), "--resume",
                                    str(tmp / "ref" / "step2"), "--metrics", str(tmp / "resumed.jsonl"))) == 0


def test_resumed_run_continues_exactly_at_dp2_cp2(tmp_path: Path) -> None:
    make_tiny_model(tmp_path / "model")
    make_corpus(tmp_path / "corpus")
    _write_configs(tmp_path)
    run_distributed(_dp2_runs, 4, tmp_path, [free_port() for _ in range(2)])
    ref, resumed = _rows(tmp_path / "ref.jsonl"), _rows(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["tokens"] == 2 * 2 * SEQ_LEN  # 2 micro-batches of one sequence on each of 2 replicas
    _assert_same_run(ref, resumed, tmp_path / "ref", tmp_path / "resumed")


def test_killed_and_resumed_runs_continue_exactly(tmp_path: Path) -> None:
    make_tiny_model(tmp_path / "model")
    make_corpus(tmp_path / "corpus")
    _write_configs(tmp_path)
    killed_at = _kill_after_a_checkpoint(tmp_path)
    assert killed_at % 7 == 0
    run_distributed(_runs, 2, tmp_path, killed_at, [free_port() for _ in range(9)])

    ref = _rows(tmp_path / "ref1.jsonl")
    # one --metrics file for both runs: the killed run's rows up to its checkpoint (its later ones dropped
    # on resume), then the resumed run's, every step once
    rows = _rows(tmp_path / "killed.jsonl")
    assert [r["step"] for r in rows] == list(range(1, killed_at + MORE + 1))
    before, resumed1 = rows[:killed_at], rows[killed_at:]
    assert [(r["step"], r["loss"]) for r in before] == [(r["step"], r["loss"]) for r in ref[:killed_at]]
    _assert_same_run(ref, resumed1, tmp_path / "ref1", tmp_path / "killed")
    ref1 = ref
    for stage in (0, 2, 3):
        ref = _rows(tmp_path / f"ref{stage}.jsonl")
        resumed = _rows(tmp_path / f"resumed{stage}.jsonl")
        assert [r["step"] for r in resumed] == list(range(10, 13))
        _assert_same_run(ref, resumed, tmp_path / f"ref{stage}", tmp_path / f"resumed{stage}")
        assert sorted(p.name for p in (tmp_path / f"ref{stage}").glob("step*")) == ["step12", "step9"]
    # DeepSpeed's csv_monitor got every step's loss and tokens from both ZeRO 2 runs
    for field in ("loss", "tokens"):
        lines = (tmp_path / "csv" / "zero2" / f"Train_Steps_{field}.csv").read_text().split()
        assert lines.count(f"step,{field}") == 2  # each run starts with a header
        values = [line.split(",") for line in lines if line != f"step,{field}"]
        rows = ref + resumed
        assert [int(step) for step, _ in values] == [r["step"] for r in rows]
        assert [float(v) for _, v in values] == pytest.approx([r[field] for r in rows], rel=1e-6)
    _check_save_folder_script(tmp_path / "killed", tmp_path / "hf")
    eval_loss, eval_tokens = _hf_eval_loss(tmp_path / "hf", tmp_path / "corpus" / "a.txt")
    for rows in (ref1, resumed1):  # evaluated after the last step only
        assert "eval_loss" not in rows[-2] and rows[-1]["eval_tokens"] == eval_tokens
        assert rows[-1]["eval_loss"] == pytest.approx(eval_loss, rel=1e-5)
        assert rows[-1]["eval_perplexity"] == pytest.approx(math.exp(eval_loss), rel=1e-5)


def _check_save_folder_script(save: Path, output: Path) -> None:
    """``save``'s ``zero_to_fp32.py`` writes a Hugging Face directory whose logits in transformers
    equal megacp's from the checkpoint's weights, as do those of the model ``load_model(save)``
    (``--model save``) builds; one of its tags is refused naming the converter."""
    import runpy

    from transformers import AutoModelForCausalLM

    from megacp.checkpoint.deepspeed import read_deepspeed_checkpoint
    from megacp.models import CausalLM

    script = runpy.run_path(str(save / "zero_to_fp32.py"))  # the copy in the folder, as a user runs it
    assert script["main"]([str(save), str(output)]) == 0
    trained = read_deepspeed_checkpoint(save)
    model = CausalLM(trained.config, dtype=torch.float32)
    model.load_state_dict(trained.tensors)
    ids = torch.arange(3, 30)
    with torch.no_grad():
        expected = model.eval()(ids, torch.arange(ids.numel()))
        got = AutoModelForCausalLM.from_pretrained(output).float().eval()(ids[None]).logits[0]
    assert rel_err(got, expected) < 1e-5
    from megacp.checkpoint import CheckpointError, load_model

    loaded, _, tokenizer = load_model(save, dtype=torch.float32, device="cpu")  # what --model DIR loads
    with torch.no_grad():
        assert rel_err(loaded(ids, torch.arange(ids.numel())), expected) < 1e-6
    assert tokenizer == str(save)
    with pytest.raises(CheckpointError, match="deepspeed-to-hf --input"):  # a tag: the converter is named
        load_model(save / trained.tag, dtype=torch.float32, device="cpu")


def _hf_eval_loss(hf_dir: Path, corpus: Path) -> tuple[float, int]:
    """The mean token loss of ``corpus``'s packed sequences in transformers: each document piece
    run on its own, every token but a piece's last predicting the next. Returns (loss, tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megacp.train.data import held_out_sequences, resolve_corpus

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    total, count = 0.0, 0
    for seq in held_out_sequences(resolve_corpus([corpus]), tokenizer, eos_id=tokenizer.eos_token_id, seq_len=SEQ_LEN,
                                  dp_size=1, dp_rank=0):
        bounds = seq.cu_seqlens.tolist()
        for a, b in zip(bounds, bounds[1:]):
            piece = seq.input_ids[a:b]
            with torch.no_grad():
                logits = model(piece[None]).logits[0].double()
            total += float(torch.nn.functional.cross_entropy(logits[:-1], piece[1:], reduction="sum"))
            count += b - a - 1
    return total / count, count


def _hf_runs(rank: int, world_size: int, tmp: Path, killed_at: int, ports: list[int]) -> None:
    """A transformers Qwen3 (trained through transformers' modules): the uninterrupted run, and the
    killed one resumed, both with their layer inputs on the host and tiled MLPs."""
    ref = str(killed_at + MORE)
    assert _main(ports.pop(), _args(tmp, 1, "--steps", ref, "--save", str(tmp / "ref1"), "--metrics",
                                    str(tmp / "ref1.jsonl"))) == 0
    assert _main(ports.pop(), _args(tmp, 1, "--steps", ref, "--save", str(tmp / "killed"), "--resume", "auto",
                                    "--metrics", str(tmp / "killed.jsonl"))) == 0


def test_a_killed_transformers_model_run_resumes_exactly(tmp_path: Path) -> None:
    """``megacp.train`` on a Qwen3 directory (an architecture megacp's own models lack: transformers'
    modules train, with ``offload: "cpu"`` and ``sequence_tiling.mlp`` 8) at CP 2, ZeRO 1: killed
    (SIGKILL) after its first periodic checkpoint and resumed, it ends with the losses and weights of
    an uninterrupted run (1e-6); ``tools/convert_checkpoint.py deepspeed-to-hf`` turns the checkpoint
    into the model's own directory, which transformers loads with those weights, and equals the
    run's own ``save_pretrained`` files."""
    make_tiny_model(tmp_path / "model", arch="qwen3")
    make_corpus(tmp_path / "corpus")
    config = json.loads((ROOT / "configs" / "train_cpu_cp2.json").read_text())
    config.update(activation_checkpointing={"enabled": True, "offload": "cpu"}, sequence_tiling={"mlp": 8})
    (tmp_path / "zero1.json").write_text(json.dumps({**config, "zero_optimization": {"stage": 1}}))
    killed_at = _kill_after_a_checkpoint(tmp_path)
    run_distributed(_hf_runs, 2, tmp_path, killed_at, [free_port() for _ in range(2)])

    from megacp.checkpoint.convert import main as convert
    from megacp.checkpoint.deepspeed import read_transformers_checkpoint

    ref, rows = _rows(tmp_path / "ref1.jsonl"), _rows(tmp_path / "killed.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, killed_at + MORE + 1))
    for a, b in zip(ref, rows):
        assert (b["loss"], b["lr"]) == pytest.approx((a["loss"], a["lr"]), rel=1e-6)
    _, want, _ = read_transformers_checkpoint(tmp_path / "ref1")
    config_values, got, dtype = read_transformers_checkpoint(tmp_path / "killed")
    assert config_values["architectures"] == ["Qwen3ForCausalLM"] and dtype == torch.float32
    assert got.keys() == want.keys() and max(rel_err(got[k], t) for k, t in want.items()) <= 1e-6
    assert convert(["deepspeed-to-hf", "--input", str(tmp_path / "killed"), "--output", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    own = AutoModelForCausalLM.from_pretrained(tmp_path / "killed").state_dict()  # the run's save_pretrained files
    for name, tensor in converted.items():
        assert rel_err(tensor, own[name]) <= 1e-6 and rel_err(tensor, got[name]) <= 1e-6, name
