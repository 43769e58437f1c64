"""Benchmark points in child processes: running out of memory (GPU or host) ends one point, not the
run. A child prints its row as one ``RESULT {json}`` line; :func:`run_child` returns that row, or a
failure row (``oom``, ``host-oom`` when a signal killed it, else ``error``), with the child's peak host
RSS and wall time; :func:`climb` runs a ladder of sizes up to its first failure."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

RESULT = "RESULT "
"""The prefix of a child's result line on its stdout."""


def print_result(row: dict[str, Any]) -> None:
    """A child's result: one ``RESULT {json}`` line."""
    print(RESULT + json.dumps(row), flush=True)


def run_child(module: str, argv: Sequence[str], row: dict[str, Any]) -> dict[str, Any]:
    """Run ``python -m module *argv``; its last ``RESULT`` row, or ``row`` with the failure (its kind,
    the last line of its stderr, its exit status); either with ``host_rss_gib`` (the child's own
    peak RSS, ``os.wait4``) and ``wall_s``."""
    cmd = [sys.executable, "-m", module, *argv]
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss: KiB on Linux)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    found = [line[len(RESULT):] for line in stdout.splitlines() if line.startswith(RESULT)]
    if found:
        row = json.loads(found[-1])
    else:
        tail = [line for line in stderr.splitlines() if line.strip()]
        message = tail[-1][:400] if tail else f"exit status {proc.returncode}"
        kind = ("oom" if "out of memory" in stderr.lower() else
                "host-oom" if proc.returncode < 0 else "error")  # a signal: most often the kernel's OOM killer
        row = {**row, "error": kind, "message": message, "exit": proc.returncode}
    row.update(host_rss_gib=round(usage.ru_maxrss / 2**20, 2), wall_s=round(time.perf_counter() - t, 1))
    return row


def climb(run: Callable[[int], dict[str, Any]], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """``run(size)`` for each of ``sizes`` in turn, each row printed as it comes, up to the first
    row with an ``error`` (included)."""
    rows = []
    for size in sizes:
        row = run(size)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if "error" in row:
            break
    return rows


def header(module: str, argv: Sequence[str], device: str) -> dict[str, Any]:
    """The command, host, host RAM, GPU and library versions of a run of ``module``."""
    info: dict[str, Any] = {"command": " ".join([sys.executable, "-m", module, *argv]),
                            "host": platform.node(),
                            "host_ram_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
                            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                            "torch": torch.__version__}
    for name in ("deepspeed", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info
