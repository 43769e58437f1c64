"""Whole jobs through the real launchers: ``deepspeed`` (CPU accelerator) and ``torchrun``, 2 ranks; and a
launched worker's end when its launcher (a stand-in process) is SIGKILLed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S

INIT_CHECK = ROOT / "tests" / "programs" / "init_check.py"
PREFIX = "MEGACP_INIT_CHECK "


def launch(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a launcher command with megacp importable; kill its whole process group on timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{command[0]} did not finish within {HANG_GUARD_S} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


def reports(result: subprocess.CompletedProcess[str]) -> dict[int, dict]:
    """The MEGACP_INIT_CHECK line of every rank, by rank."""
    assert result.returncode == 0, result.stdout[-4000:]
    found = {}
    for match in re.finditer(PREFIX + r"(\{[^{}]*\})", result.stdout):
        report = json.loads(match.group(1))
        found[report["rank"]] = report
    return found


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def cp2_config(tmp_path: Path) -> Path:
    path = tmp_path / "ds_cp2.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}))
    return path


def check_two_cp_ranks(found: dict[int, dict]) -> None:
    assert sorted(found) == [0, 1]
    for rank, report in found.items():
        assert report["world_size"] == 2 and report["local_rank"] == rank
        assert report["cp_size"] == 2 and report["cp_rank"] == rank
        assert report["cp_ranks_gathered"] == [0, 1]
        assert report["backend"] == "gloo" and report["device"] == "cpu"
        assert report["layout"] == "ext_dp1 x dp1 x pp1 x cp2 x tp1 = 2 ranks"


@pytest.mark.slow
def test_deepspeed_launcher_cpu(tmp_path: Path) -> None:
    """``DS_ACCELERATOR=cpu deepspeed --num_gpus 2``: no extra flags are needed on CPU; the
    launcher appends ``--local_rank=N``, which the script accepts."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed: its launcher cannot be tested")
    deepspeed = shutil.which("deepspeed")
    assert deepspeed is not None, "deepspeed is importable but its launcher is not on PATH"
    result = launch([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()),
                     str(INIT_CHECK), "--deepspeed_config", str(cp2_config(tmp_path))])
    check_two_cp_ranks(reports(result))
    assert "--local_rank=1" in result.stdout  # the launcher's echoed command line


@pytest.mark.slow
def test_second_job_on_a_busy_port_stops_and_spares_the_first(tmp_path: Path) -> None:
    """Two ``deepspeed`` jobs on one port (as two on the default 29500): the second stops with one
    line and exit status 2 while the first runs on, and the first then builds a new group through
    its store and finishes with every rank's report (the second job's rank 1 reached the first
    job's store meanwhile)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed: its launcher cannot be tested")
    deepspeed = shutil.which("deepspeed")
    assert deepspeed is not None, "deepspeed is importable but its launcher is not on PATH"
    port, release = free_port(), tmp_path / "release"
    job = [deepspeed, "--num_gpus", "2", "--master_port", str(port), str(INIT_CHECK),
           "--deepspeed_config", str(cp2_config(tmp_path))]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(launch, [*job, "--hold-until", str(release)])
        try:
            deadline = time.monotonic() + HANG_GUARD_S
            while not listening(port):  # the first job's store
                assert not first.done() and time.monotonic() < deadline, "the first job never listened"
                time.sleep(0.2)
            second = launch(job)
        finally:
            release.touch()
        found = reports(first.result())
    check_two_cp_ranks(found)
    assert [found[rank]["held_ranks_gathered"] for rank in (0, 1)] == [[0, 1], [0, 1]]
    assert second.returncode == 2, second.stdout[-4000:]
    errors = [line for line in second.stdout.splitlines() if "error:" in line]
    assert errors == [f"init_check: error: MASTER_PORT={port}: the port is in use on 127.0.0.1 (another job?); "
                      "start this job on a free port: deepspeed --master_port P ... or torchrun --master-port P ..."]
    assert "Traceback" not in second.stdout and PREFIX not in second.stdout


@pytest.mark.slow
def test_torchrun(tmp_path: Path) -> None:
    result = launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_port", str(free_port()), str(INIT_CHECK),
                     "--deepspeed-config", str(cp2_config(tmp_path))])
    check_two_cp_ranks(reports(result))


def test_plain_process_and_bad_config_is_one_line(tmp_path: Path) -> None:
    """Without a launcher the script runs as a world of one; a config that does not fit exits 2
    with one line on stderr and no traceback."""
    result = launch([sys.executable, str(INIT_CHECK), "--deepspeed_config", str(cp2_config(tmp_path))])
    assert result.returncode == 2
    expected = (f"init_check: error: {tmp_path / 'ds_cp2.json'}: context_parallel.size x tensor_model_parallel.size x "
                "pipeline_model_parallel.size = 2 x 1 x 1 = 2 does not divide the world size 1; "
                "allowed: sizes whose product divides 1")
    assert result.stdout.strip().splitlines()[-1] == expected
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts" / "launch").glob("generate_*.sh")))
def test_launch_scripts_parse(script: str) -> None:
    path = ROOT / "scripts" / "launch" / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert "megacp.generate" in text and "--deepspeed_config" in text and '"$@"' in text


def test_init_check_accepts_launcher_arguments() -> None:
    """Both spellings the launchers use parse (no job started)."""
    import argparse

    from megacp.launch import add_launcher_args

    parser = add_launcher_args(argparse.ArgumentParser())
    assert parser.parse_args(["--local_rank=3"]).local_rank == 3
    assert parser.parse_args(["--local-rank", "2", "--deepspeed_config", "x.json"]).deepspeed_config == "x.json"


def test_worker_ends_when_its_launcher_is_killed(tmp_path: Path) -> None:
    """A launched worker (``exit_with_parent``, as ``megacp.initialize`` calls it) gets SIGTERM when
    its launcher is SIGKILLed, instead of running on unsupervised."""
    ready = tmp_path / "ready"
    worker = ("from megacp.parallel.state import exit_with_parent; exit_with_parent(); import pathlib, time; "
              f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    launcher = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
                "print(p.pid, flush=True); p.wait()")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready.exists() and time.monotonic() < deadline:  # the worker has asked for the signal
        time.sleep(0.05)
    parent.kill()
    parent.wait()

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie has ended (its new parent has not reaped it yet)

    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = not alive(child)
    if not ended:
        os.kill(child, signal.SIGKILL)
    assert ended, "the worker outlived its launcher"
