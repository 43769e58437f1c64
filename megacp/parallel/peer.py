"""Peer windows: symmetric memory that every GPU of a group can read over NVLink.

A :class:`PeerWindow` is one buffer per rank, allocated collectively with
``torch.distributed._symmetric_memory`` and mapped into every peer's address space. A rank *pulls*
a peer's block with a plain device-to-device copy (``cudaMemcpyAsync``), which the driver runs on a
**copy engine**: no SM is used and no NCCL kernel competes with the attention kernels for SMs
(cuDNN's attention kernel occupies every SM, so an NCCL send/recv launched beside it waits for
SMs and the transfer ends up exposed). Synchronisation is a device-side barrier over the group's
signal pads, ordered on a stream like any kernel: no host synchronisation.

This transport needs CUDA tensors, an NCCL group whose ranks share one host (NVLink / PCIe P2P)
and a torch with symmetric memory; :func:`copy_engine_supported` says whether a group qualifies.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings

import torch
import torch.distributed as dist

log = logging.getLogger("megacp.peer")

TRANSPORTS = ("auto", "nccl", "copy_engine")
_ALIGN = 2 << 20  # window sizes are rounded up to 2 MiB
_BARRIER_TIMEOUT_MS = 600_000  # as NCCL's default collective timeout


def default_transport() -> str:
    """The ring transport named by ``MEGACP_RING_TRANSPORT`` (``"auto"`` when unset)."""
    name = os.environ.get("MEGACP_RING_TRANSPORT", "auto")
    if name not in TRANSPORTS:
        raise ValueError(f"MEGACP_RING_TRANSPORT={name!r} is not one of {', '.join(TRANSPORTS)}")
    return name


def copy_engine_supported(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` can use peer windows: NCCL backend, CUDA available, every rank of the group
    on this host (by the launcher's ``LOCAL_WORLD_SIZE``), and symmetric memory in this torch.
    Decided from local facts only (no collective), identically on every rank of a uniform job."""
    if not torch.cuda.is_available() or dist.get_backend(group) != "nccl":
        return False
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return False
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    ranks = dist.get_process_group_ranks(group)
    return local > 0 and len({r // local for r in ranks}) == 1


class PeerWindow:
    """``nbytes`` of symmetric memory on every rank of ``group`` (collective to create).

    Attributes:
        stream: the side stream (high priority) on which pulls and barriers run.
        nbytes: the size of each rank's buffer.
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by torch < 2.9, a deprecated no-op after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group.group_name)
        self.nbytes = -(-nbytes // _ALIGN) * _ALIGN
        self._buf = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(self._buf, group)
        # torch 2.11 zeroes a new buffer's signal pads with a memset that nothing orders before the
        # peers' first signals: a peer's barrier signal can land first and be erased, and that
        # barrier never returns. Every rank finishes its allocation before any rank signals.
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
        # High priority: the barrier is a small kernel, and on a normal-priority stream the block
        # scheduler dispatches it only after every CTA of the attention kernel queued before it,
        # which would hold the pull (and the next step's compute) until that kernel ends.
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        log.debug("peer window of %d bytes per rank on %s", self.nbytes, device)

    def view(self, rank: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s buffer (group rank) viewed as a contiguous ``shape`` tensor of ``dtype``."""
        return self._handle.get_buffer(rank, list(shape), dtype)

    def barrier(self) -> None:
        """Device-side barrier of the group on the current stream. A peer that never arrives
        stops the job with torch's "failed to receive signal" error after ``_BARRIER_TIMEOUT_MS``
        instead of a silent hang."""
        self._handle.barrier(channel=0, timeout_ms=_BARRIER_TIMEOUT_MS)


_windows: dict[str, PeerWindow] = {}


def window_bytes(nbytes: int) -> int:
    """Size of a group's window: ``MEGACP_PEER_WINDOW_MB`` (default 1024 MiB) or ``nbytes`` if larger."""
    mb = int(os.environ.get("MEGACP_PEER_WINDOW_MB", "1024"))
    return max(nbytes, mb << 20)


def peer_window(group: dist.ProcessGroup, nbytes: int, device: torch.device) -> PeerWindow | None:
    """The group's window, allocated collectively on first use (:func:`window_bytes`); ``None``
    when ``nbytes`` does not fit it (the caller then uses NCCL). Every rank of the group must call
    it with the same ``nbytes`` (blocks of a ring have one size on every rank).

    A window is allocated once per group and never replaced: on the H200 machine with torch 2.11
    the benchmark's third growing window on one group hung (most likely the signal-pad zeroing race
    that :class:`PeerWindow` now guards against, see its constructor), so megacp depends on one
    rendezvous per group only.
    """
    win = _windows.get(group.group_name)
    if win is None:
        win = _windows[group.group_name] = PeerWindow(group, window_bytes(nbytes), device)
    if nbytes > win.nbytes:
        log.info("a %d-byte block exceeds the %d-byte peer window: this rotation uses NCCL "
                 "(raise MEGACP_PEER_WINDOW_MB)", nbytes, win.nbytes)
        return None
    return win
