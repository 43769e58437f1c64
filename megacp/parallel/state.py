"""The distributed state: this rank's process groups for every mesh axis, the CP ring, and the
validated configuration (environment overrides applied), as one object.

:func:`initialize` brings up ``torch.distributed`` (under the ``deepspeed`` launcher, ``torchrun``,
or as a plain single process) and returns a :class:`ParallelState`, which is passed down to every
layer that communicates.

Per-process memos outside the state object, each harmless because it records a fact of this
process or of a process group, never a setting:

* ``megacp.parallel.peer``: a group's copy-engine window, allocated once per group and never
  replaced (torch caches symmetric-memory rendezvous by address; a second one on a group hung),
  and the CUDA driver's stream memory operations (looked up once).
* ``megacp.parallel.ring.side_stream``: one side stream per device and role.
* ``megacp.attention.strategy``: the calibration numbers a CP group agreed on (so that every
  later strategy choice of the group reads the same numbers).
* ``megacp.attention.kernels.partial`` / ``partial_backward``: shapes a fused kernel refused (so that
  ``auto`` does not retry them), and each fused kernel's module, imported on first use.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import importlib.util
import os
import resource
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megacp.attention.kernels import registry
from megacp.config import ConfigError, MegacpConfig, load_config, with_env_overrides
from megacp.parallel.layout import GROUP_KINDS, ParallelLayout
from megacp.parallel.ring import Ring

ProcessGroup = dist.ProcessGroup


class ParallelState:
    """This rank's view of the mesh: its process group, rank and peers for every group kind.

    Build it with :meth:`build` (or :func:`initialize`), never directly.

    Attributes:
        layout: the mesh.
        config: the megacp configuration the mesh was built from (for a layout built directly:
            its CP, TP, EP and external-DP settings over defaults; the layout is the authority on
            sizes, including pipeline stages that no config may ask for).
        rank: this process's global rank.
        backend: the ``torch.distributed`` backend (``"nccl"``, ``"gloo"``, ...).
        device: ``cuda:<current device>`` under NCCL, else ``cpu``.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        config: MegacpConfig,
        rank: int,
        backend: str,
        device: torch.device,
        groups: Mapping[str, ProcessGroup],
        ranks: Mapping[str, tuple[int, ...]],
        owned: Sequence[ProcessGroup] = (),
    ) -> None:
        self.layout = layout
        self.config = config
        self.rank = rank
        self.backend = backend
        self.device = device
        self._groups = dict(groups)
        self._ranks = dict(ranks)
        self._owned = list(owned)
        self._ring: Ring | None = None

    @classmethod
    def build(cls, layout: ParallelLayout, config: MegacpConfig | None = None) -> ParallelState:
        """Create the process groups of ``layout`` on an initialised default process group.

        Collective: every rank must call it with the same layout. ``dist.new_group`` is called for
        every group of every kind (:data:`~megacp.parallel.layout.GROUP_KINDS` order, groups by
        smallest rank), except that a group spanning the whole world is ``dist.group.WORLD`` and a
        rank list already created for an earlier kind is shared, not created twice. Every group it
        creates times out after ``config.runtime.timeout_minutes``.

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised.
            ConfigError: ``layout.world_size`` differs from the real world size.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call megacp.initialize() first")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if layout.world_size != world_size:
            raise ConfigError(f"layout {layout} needs {layout.world_size} ranks, but the world size is {world_size}")
        if config is None:
            config = MegacpConfig.from_dict({
                "context_parallel": {"size": layout.cp},
                "tensor_model_parallel": {"size": layout.tp},
                "expert_model_parallel": {"include_cp": layout.ep_includes_cp},
                "external_data_parallel": {"size": layout.ext_dp},
            })
        timeout = datetime.timedelta(minutes=config.runtime.timeout_minutes)  # new_group's default: 10 or 30 min
        world = dist.group.WORLD
        assert world is not None  # initialised above
        created: dict[tuple[int, ...], ProcessGroup] = {tuple(range(world_size)): world}
        groups: dict[str, ProcessGroup] = {}
        ranks: dict[str, tuple[int, ...]] = {}
        owned: list[ProcessGroup] = []
        for kind in GROUP_KINDS:
            for members in map(tuple, layout.groups(kind)):
                if members not in created:
                    created[members] = dist.new_group(list(members), timeout=timeout)
                    if rank in members:
                        owned.append(created[members])
                if rank in members:
                    groups[kind], ranks[kind] = created[members], members
        backend = str(dist.get_backend())
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(layout, config, rank, backend, device, groups, ranks, owned)

    def close(self) -> None:
        """Destroy the process groups :meth:`build` created for this rank, newest first (the default
        group stays; :func:`shutdown` ends it). Idempotent; the state's groups and ring must not be
        used afterwards."""
        self._ring = None
        if not dist.is_initialized():  # the default group's end destroyed every group
            self._owned.clear()
        while self._owned:
            dist.destroy_process_group(self._owned.pop())

    def _kind(self, name: str) -> str:
        if name not in self._groups:
            raise ValueError(f"unknown group kind {name!r}; kinds are {list(GROUP_KINDS)}")
        return name

    def group(self, name: str) -> ProcessGroup:
        """This rank's process group of kind ``name`` (``"tp"``, ``"cp"``, ``"pp"``, ``"dp"``,
        ``"dp_cp"``, ``"ep"``, ``"mp"``)."""
        return self._groups[self._kind(name)]

    def ranks(self, name: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of kind ``name``, ascending (for ``"cp"``: the ring)."""
        return self._ranks[self._kind(name)]

    def size(self, name: str) -> int:
        """Number of ranks in this rank's group of kind ``name``."""
        return len(self.ranks(name))

    def rank_in(self, name: str) -> int:
        """This rank's index inside its group of kind ``name`` (its group-local rank)."""
        return self.ranks(name).index(self.rank)

    def ring(self) -> Ring | None:
        """The CP ring (``None`` when CP = 1), built once with the configured transport and window
        size (``runtime.ring_transport`` / ``runtime.peer_window_mb``) and shared by every user."""
        if self.size("cp") == 1:
            return None
        if self._ring is None:
            runtime = self.config.runtime
            self._ring = Ring(self.group("cp"), transport=runtime.ring_transport, window_mb=runtime.peer_window_mb)
        return self._ring

    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh."""
        return self.layout.world_size

    @property
    def coords(self) -> dict[str, int]:
        """This rank's mesh coordinates (keys ``ext_dp, dp, pp, cp, tp``)."""
        return self.layout.coords(self.rank)

    def __repr__(self) -> str:
        return f"ParallelState(rank={self.rank}, {self.layout}, backend={self.backend}, device={self.device})"


def initialize(
    config: str | os.PathLike[str] | Mapping[str, Any] | MegacpConfig | None = None,
    backend: str | None = None,
) -> ParallelState:
    """Bring up ``torch.distributed`` if needed and build the :class:`ParallelState`.

    Works under the ``deepspeed`` launcher and ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
    ``MASTER_ADDR``/``MASTER_PORT`` in the environment) and as a plain process without them (a
    world of one, on a free localhost port). An already initialised default process group is
    reused. The backend is ``backend`` if given, else NCCL when CUDA is available, else gloo;
    under NCCL the CUDA device is set from ``LOCAL_RANK``. Under a launcher the default group is
    built on :func:`launcher_store`, so that a second job started on a busy ``MASTER_PORT`` stops
    with one line and leaves the first job alone; with a backend other than gloo,
    ``deepspeed.init_distributed`` then adopts it when DeepSpeed is installed (under gloo it is
    not called: DeepSpeed's CPU path compiles a shared-memory op on first use, about a minute, and
    ``deepspeed.initialize`` adopts an existing process group later anyway).

    The environment variables of :data:`megacp.config.ENV_OVERRIDES` override the config's
    ``runtime`` section; they are read here, once, and validated before any process group exists.
    Every collective of a process group this creates times out after ``runtime.timeout_minutes``.
    :func:`shutdown` is registered to run at interpreter exit.

    Args:
        config: ``None`` (all ranks form one CP group), a path of a DeepSpeed JSON/hjson file, its
            dict, or a :class:`MegacpConfig`.
        backend: ``torch.distributed`` backend override.

    Raises:
        ConfigError: the config or an environment override is invalid (a CUDA attention backend
            without a GPU too), the sizes do not fit the world size, or rank 0 cannot listen on the
            launcher's ``MASTER_PORT``.
        ValueError: ``backend`` differs from that of an already initialised process group.
    """
    cfg = with_env_overrides(load_config({} if config is None else config), os.environ)
    kernels = cfg.runtime.attention_backend
    if kernels != registry.AUTO and "cpu" not in registry.get(kernels).devices and not torch.cuda.is_available():
        anywhere = [name for name in registry.choices() if name == registry.AUTO or "cpu" in registry.get(name).devices]
        raise ConfigError(f"runtime.attention_backend: {kernels!r} runs on CUDA GPUs and this machine has none; "
                          f"use {' or '.join(map(repr, anywhere))}")
    atexit.unregister(shutdown)  # registered once, however often initialize runs
    atexit.register(shutdown)
    if dist.is_initialized():
        current = str(dist.get_backend())
        if backend is not None and backend != current:
            raise ValueError(f"torch.distributed is already initialised with backend {current!r}, not {backend!r}")
    else:
        timeout = datetime.timedelta(minutes=cfg.runtime.timeout_minutes)
        _init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"), timeout)
    world_size = dist.get_world_size()
    if config is None:
        layout = ParallelLayout(cp=world_size)
        cfg = cfg.model_copy(update={"context_parallel": cfg.context_parallel.model_copy(update={"size": world_size})})
        return ParallelState.build(layout, cfg)
    return ParallelState.build(ParallelLayout.from_config(cfg, world_size), cfg)


def shutdown() -> None:
    """End this process's ``torch.distributed`` work: destroy the default process group and with it
    every group (if still initialised), then release the GIL for :data:`_GIL_HANDOFF_S` seconds.
    Idempotent.

    :func:`initialize` registers it to run at interpreter exit, also when an exception ends the
    program. Why the pause: a gloo group's worker thread releases a finished collective's tensors
    after the caller's ``wait`` has returned, and releasing a tensor that Python has dropped takes
    the GIL. Destroying a group does not join those threads while Python still references the group
    (a :class:`ParallelState`, a ring, a caller's variable). A thread that takes the GIL while the
    interpreter finalizes is ended by ``pthread_exit``, which unwinds through a ``noexcept``
    destructor into ``std::terminate``: SIGABRT after the program's work is done. The pause lets
    such threads take the GIL before finalization starts.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(_GIL_HANDOFF_S)


_GIL_HANDOFF_S = 0.05
"""How long :func:`shutdown` releases the GIL: time for worker threads waiting for it to run."""


def _init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """Initialise the default process group from the launcher's environment (on the store of
    :func:`launcher_store`), or as a world of one; every collective times out after ``timeout``.

    Under a launcher with a backend other than gloo, ``deepspeed.init_distributed`` then adopts the
    group when DeepSpeed is installed (its communication backend, which ``deepspeed.initialize``
    uses, is set up without a second initialisation). Under NCCL the group is bound to this rank's
    device (``device_id``), as DeepSpeed binds it.

    Raises:
        ConfigError: ``MASTER_ADDR``/``MASTER_PORT`` missing, or rank 0 cannot listen on
            ``MASTER_PORT`` (another job holds it).
    """
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # a collective past the timeout aborts the communicators and ends the process (torchrun's default)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        exit_with_parent()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = launcher_store(os.environ, os.getppid(), timeout)
        device_id = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" and world_size > 1 else None
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
        if backend != "gloo" and importlib.util.find_spec("deepspeed") is not None:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        return
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


def launcher_store(environ: Mapping[str, str], launcher_pid: int, timeout: datetime.timedelta) -> dist.Store:
    """The key-value store of a launched job's default process group: a ``TCPStore`` on
    ``MASTER_ADDR:MASTER_PORT`` (rank 0 hosts it; under ``torchrun``, whose agent hosts it
    (``TORCHELASTIC_USE_AGENT_STORE=True``), every rank is a client), seen through a prefix that
    names the job.

    Two jobs started on one port (the launchers' default 29500, say): the second job's rank 0
    cannot listen there and stops with one line, but its other ranks reach the first job's store.
    The prefix keeps them out of the first job's keys. A single-node job (the local world size,
    ``LOCAL_WORLD_SIZE`` from ``torchrun`` or ``LOCAL_SIZE`` from the ``deepspeed`` launcher,
    equals ``WORLD_SIZE``) is named by its launcher's process id, the parent of all its ranks
    (and ``TORCHELASTIC_RESTART_COUNT``, the attempt, where ``torchrun`` sets it). Ranks on several
    nodes have no such common name: a multi-node job uses the prefix ``megacp/``, so two
    multi-node jobs on one master port still share keys.

    Args:
        environ: the launcher's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``; ``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``).
        launcher_pid: the process id of the process that started this rank (``os.getppid()``).
        timeout: how long rank 0 waits for the others to connect and a client retries connecting.

    Raises:
        ConfigError: ``MASTER_ADDR`` or ``MASTER_PORT`` is missing, or rank 0 cannot listen on
            ``MASTER_PORT`` because the address is in use.
    """
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        raise ConfigError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not; a launcher sets all four")
    rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    addr, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    hosts = rank == 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=hosts, timeout=timeout, multi_tenant=True)
    except dist.DistNetworkError as err:
        if hosts and "address already in use" in str(err).lower():
            raise ConfigError(
                f"MASTER_PORT={port}: the port is in use on {addr} (another job?); start this job on a free "
                "port: deepspeed --master_port P ... or torchrun --master-port P ...") from None
        raise
    local_size = environ.get("LOCAL_WORLD_SIZE", environ.get("LOCAL_SIZE"))
    job = "megacp/"
    if local_size is not None and int(local_size) == world_size:
        job += f"{launcher_pid}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return dist.PrefixStore(job, store)


def exit_with_parent() -> None:
    """Have Linux send this process SIGTERM when its parent (the launcher that started it) ends, as
    ``torchrun``'s agent ends its workers (``prctl(PR_SET_PDEATHSIG)``). A no-op on other systems."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory in MiB: the CUDA caching allocator's peak on a GPU, the peak
    resident set size (``ru_maxrss``) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
