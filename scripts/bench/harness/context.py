"""This process's place in a benchmark run, on megacp's own bring-up (:func:`megacp.initialize`).

Every rank of the run forms one CP group (the whole world). Collective helpers (barrier, MAX
reduction, agreement, broadcast) work on that group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

import megacp
from megacp.parallel.state import ParallelState

from scripts.bench.harness.cli import DTYPES


@dataclass
class Ctx:
    """Rank, world, device and dtype of this process; ``group`` is the CP group (every rank)."""

    state: ParallelState
    dtype: torch.dtype
    _bar: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._bar = torch.zeros(1, device=self.device)

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world(self) -> int:
        return self.state.world_size

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def backend(self) -> str:
        return self.state.backend

    @property
    def group(self) -> dist.ProcessGroup:
        return self.state.group("cp")

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, *args: Any) -> None:
        """Print on rank 0."""
        if self.rank == 0:
            print(*args, flush=True)


def init(device: str, dtype: str | None) -> Ctx:
    """Join the launcher's world through :func:`megacp.initialize` (a world of one without a
    launcher): NCCL on ``device="cuda"``, gloo on ``"cpu"``.

    ``dtype`` is a :data:`~scripts.bench.harness.cli.DTYPES` name; default bf16 on CUDA, fp32 on
    CPU. TF32 is switched off (fp32 references must be fp32). On CPU each rank gets its share of
    the cores as torch threads.

    Raises:
        SystemExit: ``device="cuda"`` without CUDA (one line, status 2).
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available (use --device cpu for a smoke test)")
    state = megacp.initialize(backend="nccl" if device == "cuda" else "gloo")
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(state.world_size, 1)))
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    default = torch.bfloat16 if device == "cuda" else torch.float32
    return Ctx(state, DTYPES[dtype] if dtype else default)


def finish(ctx: Ctx) -> None:
    """Barrier, then tear the process group down (best effort: the run's results are written)."""
    try:
        barrier(ctx)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def sync(ctx: Ctx) -> None:
    """Wait for this rank's device."""
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def barrier(ctx: Ctx) -> None:
    """Every rank's host and device reach this point before any leaves it."""
    sync(ctx)
    if ctx.world > 1:
        dist.all_reduce(ctx._bar, group=ctx.group)
        sync(ctx)


def all_max(ctx: Ctx, values: Sequence[float]) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks (every rank passes the same length)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    if ctx.world > 1 and t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def agree(ctx: Ctx, ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    return all_max(ctx, [0.0 if ok else 1.0])[0] == 0.0


def bcast_obj(ctx: Ctx, obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (pickled)."""
    if ctx.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ctx.group, device=ctx.device if ctx.cuda else None)
    return box[0]


def free(ctx: Ctx) -> None:
    """Return cached, unused device memory (between measurements of different sizes)."""
    if ctx.cuda:
        torch.cuda.empty_cache()
