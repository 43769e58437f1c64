"""Run a function on N real processes joined by a gloo process group (the multi-process test harness).

Usage from a test module (the function must be defined at module level so it can be pickled)::

    from tests.helpers.distributed import run_distributed

    def _body(rank: int, world_size: int, n: int) -> list[int]:
        ...                       # torch.distributed is initialised; megacp.initialize() works too
        return result             # any picklable value

    def test_something():
        results = run_distributed(_body, 4, 123)    # results[r] is what rank r returned

Processes are started fresh for every call, from a ``forkserver`` that has imported ``torch``
once (so a call costs fork + gloo rendezvous instead of N cold ``import torch``), with
``torch.set_num_threads(1)`` and the inherited objects frozen (``gc.freeze``: a full collection,
which megacp's ``LLM`` runs per batch, would otherwise walk the ~400,000 objects of the preloaded
imports, about 0.7 s each time on 2 loaded cores, and copy their pages). Like ``spawn`` children they inherit nothing from pytest's process;
unlike them they also do not see environment changes the caller makes after the first call (the
server's environment is fixed when it starts), so pass such values as arguments. Keep heavy
imports (transformers, deepspeed) inside the function or in modules only it imports.

Under gloo, every rank has joined the group before any runs the function (a barrier after
``init_process_group``): a rank can finish joining before a peer has (gloo's connect completes on
one side of a pair first), and one whose function returns at once could then exit, taking the
rendezvous store (rank 0 hosts it) and its connections with it, while the peer is still joining:
the peer would fail with a connection error instead of running.

On a failing rank, the other ranks get a short grace period to report (peers usually fail
right after), then are killed; the AssertionError lists every failing rank's traceback. On a
timeout the hanging ranks' Python stacks are dumped (faulthandler) into the error as well. A rank
that returned its result must then exit with status 0: an abort on the way out fails the call.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S

_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest", "tests.helpers.distributed"]
"""Imported once by the forkserver; every worker is forked from that state (``torch._dynamo``:
every ``torch.optim`` optimizer imports it on construction, seconds per process)."""

_WARM = ("megacp.parallel.state", "megacp.parallel.mpu", "deepspeed", "transformers.models.llama.modeling_llama")
"""Modules most workers import (megacp's mesh with pydantic ~0.35 s per process, DeepSpeed, and
transformers' Llama ~3 s), imported when this module is. A broken module must not take the
forkserver down (it only survives ImportError), so failures are ignored here; the worker that
needs the module imports it again and reports the error with its traceback."""


def _warm_imports() -> None:
    for name in _WARM:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - see _WARM
            pass


_warm_imports()

_GRACE_S = 3.0
"""After the first failure, how long the other ranks may still report before being killed."""


_EXIT_S = 10.0
"""How long a rank that returned its result may take to exit."""


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once per session) with :data:`_PRELOAD` loaded.

    Python < 3.13 starts the server without the caller's ``sys.path``, so the repository root is
    passed to it through ``PYTHONPATH`` for the preload to find ``tests.helpers.distributed``.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([saved] if saved else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return context


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    backend: str,
    timeout: float,
    stack_file: str,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Child entry point: join the process group, run ``fn``, send back ``(ok, payload)``."""
    gc.freeze()  # the forkserver's imports are never garbage: collections walk only what the child makes
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            dist.init_process_group(
                backend, init_method="env://", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
            if backend == "gloo":
                dist.barrier()  # every rank has joined: none leaves while a peer still connects to it
            message = (True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - every failure, SystemExit included, goes to the parent
            message = (False, traceback.format_exc())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        conn.send(message)
        conn.close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = HANG_GUARD_S,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    Each process has ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set and
    a default ``backend`` process group on a fresh localhost port; it is destroyed after ``fn``.

    Args:
        fn: a module-level function (picklable by reference).
        world_size: number of processes.
        args: extra picklable arguments for ``fn``.
        timeout: seconds for the whole call, start-up included (a hang guard, also each rank's
            process-group timeout).
        backend: ``torch.distributed`` backend.

    Raises:
        AssertionError: a rank raised, died, did not finish within ``timeout``, or returned its
            result but did not then exit with status 0 (e.g. an abort at interpreter exit); the
            message holds every failing rank's traceback (and the stacks of hanging ranks).
    """
    context = _context()
    port = free_port()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="megacp-dist-") as tmp:
        stack_files = [str(Path(tmp) / f"stacks-{rank}.txt") for rank in range(world_size)]
        procs, readers = [], []
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            proc = context.Process(
                target=_worker,
                args=(fn, rank, world_size, args, port, backend, timeout, stack_files[rank], writer),
                name=f"{getattr(fn, '__name__', 'fn')}-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        try:
            results, failures = _collect(procs, readers, deadline)
            hung = [rank for rank in range(world_size) if rank not in results and rank not in failures]
            why = f"still running {_GRACE_S:.0f} s after another rank failed" if failures else (
                f"did not finish within the {timeout:.0f} s timeout"
            )
            for rank in hung:
                failures[rank] = _hung_report(procs[rank], stack_files[rank], why)
            for rank in results:
                exit_failure = _exit_report(procs[rank])
                if exit_failure is not None:
                    failures[rank] = exit_failure
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join()
                proc.close()
            for reader in readers:
                reader.close()
    if failures:
        body = "\n".join(f"--- rank {rank} ---\n{failures[rank]}" for rank in sorted(failures))
        raise AssertionError(f"{getattr(fn, '__name__', fn)} failed on ranks {sorted(failures)} of {world_size}:\n{body}")
    return [pickle.loads(results[rank]) for rank in range(world_size)]


def _collect(
    procs: list[multiprocessing.process.BaseProcess],
    readers: list[multiprocessing.connection.Connection],
    deadline: float,
) -> tuple[dict[int, bytes], dict[int, str]]:
    """Wait for each rank's message (or death) until ``deadline``, shortened after a failure."""
    results: dict[int, bytes] = {}
    failures: dict[int, str] = {}
    waiting = {reader: rank for rank, reader in enumerate(readers)}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for reader in multiprocessing.connection.wait(list(waiting), timeout=left):
            rank = waiting.pop(reader)
            try:
                ok, payload = reader.recv()
            except EOFError:
                procs[rank].join(timeout=5)
                failures[rank] = f"process died without a result (exit code {procs[rank].exitcode})"
                continue
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
        if failures:
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return results, failures


def _exit_report(proc: multiprocessing.process.BaseProcess) -> str | None:
    """Why a rank that returned its result did not then exit with status 0 within :data:`_EXIT_S`
    seconds (an abort in an exit handler, a signal from a thread still running), or ``None``."""
    proc.join(timeout=_EXIT_S)
    code = proc.exitcode
    if code == 0:
        return None
    if code is None:
        return "returned its result but did not exit"
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return f"returned its result but then ended with {how} at exit"


def _hung_report(proc: multiprocessing.process.BaseProcess, stack_file: str, why: str) -> str:
    """Dump a hanging rank's Python stacks (SIGUSR1 -> faulthandler) and describe it."""
    if proc.is_alive() and proc.pid is not None:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.3)
    stacks = Path(stack_file).read_text() if os.path.exists(stack_file) else ""
    return f"{why}; its stacks:\n{stacks}"
