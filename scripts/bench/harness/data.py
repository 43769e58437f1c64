"""Benchmark inputs and outputs across ranks: deterministic data, the same tensor on every rank,
row-sharded outputs gathered back, and the query rows a check samples."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megacp.parallel.ring import Ring
from scripts.bench.harness.context import Ctx


def randn(shape: Sequence[int], ctx: Ctx, seed: int, *, scale: float = 1.0) -> torch.Tensor:
    """Deterministic normal data made on this rank's device (then cast to ``ctx.dtype``)."""
    g = torch.Generator(device=ctx.device)
    g.manual_seed(seed)
    t = torch.randn(*shape, generator=g, device=ctx.device, dtype=torch.float32 if not ctx.cuda else ctx.dtype)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(ctx.dtype)


def shared_randn(shape: Sequence[int], ctx: Ctx, seed: int) -> torch.Tensor:
    """The same tensor on every rank: made on rank 0, broadcast (never relies on equal RNG streams)."""
    t = randn(shape, ctx, seed) if ctx.rank == 0 else torch.empty(*shape, dtype=ctx.dtype, device=ctx.device)
    if ctx.world > 1:
        dist.broadcast(t, src=0, group=ctx.group)
    return t


def gather_rows(ctx: Ctx, local: torch.Tensor, indices: Sequence[torch.Tensor], total: int) -> torch.Tensor:
    """Reassemble a row-sharded tensor on every rank.

    Args:
        local: ``[n_local, ...]`` this rank's rows.
        indices: ``indices[j]`` the global row of each of rank j's rows (any order, possibly
            different counts).
        total: number of global rows.

    Returns:
        ``[total, ...]`` in ``local``'s dtype.
    """
    n_max = max(int(ix.numel()) for ix in indices)
    pad = local.new_zeros((n_max, *local.shape[1:]))
    pad[: local.shape[0]] = local
    out_all = Ring(ctx.group, transport="nccl").all_gather(pad) if ctx.world > 1 else pad.unsqueeze(0)
    full = local.new_empty((total, *local.shape[1:]))
    for j, ix in enumerate(indices):
        full[ix.to(local.device)] = out_all[j, : ix.numel()]
    return full


def sample_rows(n: int, count: int, seed: int, *, edges: Sequence[int] = ()) -> torch.Tensor:
    """``count`` sorted row indices in ``[0, n)``: the given edges (and their neighbours) plus random rows."""
    pick = set()
    for e in list(edges) + [0, n - 1]:
        for x in (e - 1, e, e + 1):
            if 0 <= x < n:
                pick.add(x)
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, n, (max(count - len(pick), 0),), generator=g).tolist()
    pick.update(extra)
    return torch.tensor(sorted(pick), dtype=torch.long)
