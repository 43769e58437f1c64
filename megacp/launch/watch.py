"""A launched rank ends when its launcher is gone.

``deepspeed`` starts a launcher process (``deepspeed.launcher.launch``) that starts the ranks; when the
``deepspeed`` command itself is killed with SIGKILL, nothing tells that launcher or the ranks, which
go on training and saving (a restart then has two jobs in one directory). torchrun's agent is the
ranks' parent, with the same problem when it is SIGKILLed. :func:`watch_launcher` starts a daemon
thread in a rank that looks, every :data:`POLL_S` seconds, whether the launcher processes above it
(its parent and grandparent whose command line names a launcher) still exist, and ends the rank with
exit status 1 when one is gone, rank 0 saying so in one line on stderr (Linux: ``/proc``; elsewhere it
does nothing).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from megacp.launch import launcher_rank

POLL_S = 1.0
"""Seconds between two looks at the launcher processes."""

LAUNCHERS = ("deepspeed", "torch.distributed.run", "torchrun", "torch.distributed.launch")
"""Words in a command line that make a process a launcher."""


def _process(pid: int) -> tuple[int, str] | None:
    """``(parent pid, command line)`` of ``pid`` from ``/proc``, ``None`` when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1]), cmdline


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def launcher_processes(pid: int | None = None) -> list[tuple[int, str]]:
    """The launcher processes among the parent and grandparent of ``pid`` (default: this process),
    as ``(pid, start time)`` (the start time tells a reused pid apart)."""
    found = []
    me = _process(pid if pid is not None else os.getpid())
    parent = me[0] if me else None
    for _ in range(2):
        if parent is None or parent <= 1:
            break
        info = _process(parent)
        if info is None:
            break
        if any(word in info[1] for word in LAUNCHERS):
            start = _start_time(parent)
            if start is not None:
                found.append((parent, start))
        parent = info[0]
    return found


def _stop(prog: str, pid: int) -> None:
    """End this rank: rank 0 says why in one line; every rank's further output is dropped (a peer
    that ended first makes its collectives fail with tracebacks that say nothing new), and the other
    ranks wait a moment first, so that rank 0 ends before their exits break its collectives."""
    rank = launcher_rank()
    if rank == 0:
        print(f"{prog}: the launcher (pid {pid}) is gone: the ranks stop", file=sys.stderr, flush=True)
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    if rank != 0:
        time.sleep(POLL_S + 1.0)
    os._exit(1)


def watch_launcher(prog: str) -> threading.Thread | None:
    """Start the watch in a launched rank (``LOCAL_RANK`` set; nothing otherwise or without
    ``/proc``); returns its thread."""
    if "LOCAL_RANK" not in os.environ or not Path("/proc/self/stat").is_file():
        return None
    watched = launcher_processes()
    if not watched:
        return None
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(POLL_S):
            for pid, start in watched:
                if _start_time(pid) != start:
                    _stop(prog, pid)

    thread = threading.Thread(target=watch, name="megacp-launcher-watch", daemon=True)
    thread.start()
    return thread
