"""Peer windows: symmetric memory that every GPU of a group can write over NVLink.

A :class:`PeerWindow` is one buffer per rank, allocated collectively with
``torch.distributed._symmetric_memory`` and mapped into every peer's address space. It holds two
*slots* (double buffering) for blocks that peers *push* into it, and a small *signal* area.

Everything a rotation does between GPUs avoids the SMs. Measured on H200 (``scripts/diagnostics/profile_prefill.py``
and a side-stream probe, see docs/PERFORMANCE.md): cuDNN's attention kernel keeps every SM until it
ends, and any kernel on another stream — an NCCL send/recv, a barrier, even a same-device
``cudaMemcpy``, whatever the stream priority — starts only at its tail, so a transfer that needs an
SM is exposed. Two things do run beside it:

* a copy **into another GPU's memory** (``cudaMemcpyAsync`` to a peer-mapped address), which the
  driver runs on a copy engine (128 MiB in ~0.4 ms over NVLink);
* **stream memory operations** (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``), executed by
  the GPU's front end: a flag written into a peer's signal area, a stream that waits until a flag
  in the own signal area reaches a value.

So a rank pushes its block straight from its own memory into the peer's slot, then writes the
peer's *ready* flag; the peer's compute stream waits on that flag (no host sync, no kernel) and
reads the block in place; after its compute on the slot, the peer writes a *free* flag into every
rank's signal area, on which the next writer of that slot waits. Flags count uses (monotonic, never
reset), so no flag is ever cleared. A flag wait has no timeout: if a peer dies mid-rotation, the
waiting stream stays blocked and the job stops at its next NCCL collective (NCCL's watchdog).

This transport needs CUDA tensors, an NCCL group whose ranks share one host (NVLink / PCIe P2P), a
torch with symmetric memory and the CUDA driver's stream memory operations;
:func:`copy_engine_supported` says whether a group qualifies.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

log = logging.getLogger("megacp.peer")

TRANSPORTS = ("auto", "nccl", "copy_engine")
DEFAULT_WINDOW_MB = 1024
"""MiB of each of a window's two slots unless the ring is given another size."""
_ALIGN = 2 << 20  # slot sizes are rounded up to 2 MiB
_SIGNAL_BYTES = 4096  # flags: ready[slot] at words 0-1, free[rank][slot] at words 16 + 2*rank + slot
_MAX_RANKS = (_SIGNAL_BYTES // 4 - 16) // 2


@functools.cache
def _stream_mem_ops() -> tuple | None:
    """``(cuStreamWaitValue32, cuStreamWriteValue32)`` of the CUDA driver, or ``None``."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fns = []
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
        fn = getattr(cu, name + "_v2", None) or getattr(cu, name, None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return tuple(fns)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def wait_value(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    """Work queued on ``stream`` after this waits until the uint32 at device address ``addr``
    reaches ``value`` (cyclic ``>=``); executed by the GPU front end, no SM, no host sync."""
    _check(_stream_mem_ops()[0](stream.cuda_stream, addr, value & 0xFFFFFFFF, 0), "cuStreamWaitValue32")


def write_value(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    """Write the uint32 ``value`` to device address ``addr`` (this GPU's or a peer-mapped one) when
    the work queued on ``stream`` before it is done, after a memory fence; no SM."""
    _check(_stream_mem_ops()[1](stream.cuda_stream, addr, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")


def copy_engine_supported(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` can use peer windows: NCCL backend, CUDA available, every rank of the group
    on this host (by the launcher's ``LOCAL_WORLD_SIZE``), symmetric memory in this torch and the
    driver's stream memory operations. Decided from local facts only (no collective), identically
    on every rank of a uniform job."""
    if not torch.cuda.is_available() or dist.get_backend(group) != "nccl":
        return False
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None or _stream_mem_ops() is None:
        return False
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    ranks = dist.get_process_group_ranks(group)
    return local > 0 and len({r // local for r in ranks}) == 1 and len(ranks) <= _MAX_RANKS


class PeerWindow:
    """Two slots of ``slot_bytes`` and a signal area on every rank of ``group`` (collective to create).

    Attributes:
        stream: the side stream on which this rank's pushes run.
        slot_bytes: the capacity of each slot.
        uses: how many rotations' steps have used each slot so far (the same on every rank).
    """

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by torch < 2.9, a deprecated no-op after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group.group_name)
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        total = _SIGNAL_BYTES + 2 * self.slot_bytes
        buf = symm_mem.empty(total, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(buf, group)
        self._bufs = [self._handle.get_buffer(p, [total], torch.uint8) for p in range(dist.get_world_size(group))]
        buf[:_SIGNAL_BYTES].zero_()
        # Every rank's flags are zero before any rank writes a peer's flag (and torch 2.11 zeroes
        # its own signal pads unordered: nothing may run on the window before all ranks are here).
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
        self.stream = torch.cuda.Stream(device=device)
        self.uses = [0, 0]
        log.debug("peer window: 2 slots of %d bytes per rank on %s", self.slot_bytes, device)

    def slot(self, rank: int, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of slot ``k`` of group rank ``rank``'s window (uint8, contiguous)."""
        off = _SIGNAL_BYTES + k * self.slot_bytes
        return self._bufs[rank][off:off + nbytes]

    def ready_flag(self, rank: int, k: int) -> int:
        """Device address of rank ``rank``'s flag counting the blocks pushed into its slot ``k``."""
        return self._bufs[rank].data_ptr() + 4 * k

    def free_flag(self, rank: int, user: int, k: int) -> int:
        """Device address, in rank ``rank``'s window, of the flag counting how often rank ``user``
        has finished with its slot ``k``."""
        return self._bufs[rank].data_ptr() + 4 * (16 + 2 * user + k)


@dataclass(frozen=True)
class PushOp:
    """One operation of a rotation over peer windows, in the order the host queues it.

    ``kind`` (the stream it runs on):

    * ``"wait_free"`` (window stream) — until rank ``peer`` has released its ``slot`` ``value`` times;
    * ``"push"`` (window stream) — copy this rank's block into ``slot`` of rank ``peer``;
    * ``"ready"`` (window stream) — set rank ``peer``'s ready flag of ``slot`` to ``value``;
    * ``"wait_ready"`` (consumer stream) — until this rank's ready flag of ``slot`` reaches ``value``;
    * ``"hand_out"`` — step ``step``'s block (this rank's ``slot``) goes to the caller, whose work on
      it is queued on the consumer stream;
    * ``"release"`` (consumer stream) — write ``value`` into every peer's free flag of (this rank, ``slot``).
    """

    kind: Literal["wait_free", "push", "ready", "wait_ready", "hand_out", "release"]
    step: int
    slot: int
    peer: int
    value: int


def push_schedule(n: int, r: int, uses: list[int]) -> tuple[list[PushOp], list[int]]:
    """Rank ``r``'s operations for steps ``1..N-1`` of one rotation over peer windows, and the slots'
    use counts after it (``uses[k]``: how many steps of earlier rotations used slot ``k``; the same on
    every rank). Step ``s`` uses slot ``(s-1) % 2``; rank ``r`` pushes into rank ``r+s`` for step ``s``,
    at most two steps ahead of its own consumption, so a push only ever waits for releases that are
    queued before it on every rank (no deadlock even where streams share one hardware queue:
    ``tests/unit/test_push_protocol.py`` simulates every N up to 8)."""
    uses = list(uses)
    slot_use: dict[int, tuple[int, int]] = {}  # step -> (slot, how many earlier uses that slot had)
    for s in range(1, n):
        k = (s - 1) % 2
        slot_use[s] = (k, uses[k])
        uses[k] += 1
    ops: list[PushOp] = []

    def push(s: int) -> None:
        t, (k, u) = (r + s) % n, slot_use[s]
        ops.extend([PushOp("wait_free", s, k, t, u), PushOp("push", s, k, t, 0), PushOp("ready", s, k, t, u + 1)])

    for s in range(1, min(n, 3)):
        push(s)
    for s in range(1, n):
        k, u = slot_use[s]
        ops.extend([PushOp("wait_ready", s, k, r, u + 1), PushOp("hand_out", s, k, r, 0), PushOp("release", s, k, r, u + 1)])
        if s + 2 < n:
            push(s + 2)
    return ops, uses


_windows: dict[str, PeerWindow] = {}
"""Each group's window, by group name: one per group and process, never replaced (see
:func:`peer_window`)."""


def slot_bytes(nbytes: int, window_mb: int = DEFAULT_WINDOW_MB) -> int:
    """Size of a slot: ``window_mb`` MiB, or ``nbytes`` if larger."""
    return max(nbytes, window_mb << 20)


def peer_window(group: dist.ProcessGroup, nbytes: int, device: torch.device,
                window_mb: int = DEFAULT_WINDOW_MB) -> PeerWindow | None:
    """The group's window, allocated collectively on first use with two slots of
    :func:`slot_bytes` (``window_mb`` MiB each unless the first block is larger); ``None`` when
    ``nbytes`` does not fit a slot (the caller then uses NCCL).
    Every rank of the group must call it with the same ``nbytes`` (blocks of a ring have one size
    on every rank).

    A window is allocated once per group and never replaced: torch caches rendezvous by address,
    and on the H200 machine with torch 2.11 a third rendezvous on one group hung.
    """
    win = _windows.get(group.group_name)
    if win is None:
        win = _windows[group.group_name] = PeerWindow(group, slot_bytes(nbytes, window_mb), device)
    if nbytes > win.slot_bytes:
        log.info("a %d-byte block exceeds the %d-byte peer window slot: this rotation uses NCCL "
                 "(raise runtime.peer_window_mb / MEGACP_PEER_WINDOW_MB)", nbytes, win.slot_bytes)
        return None
    return win
