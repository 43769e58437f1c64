"""Runs of short tiles in one varlen kernel call (packed documents).

A packed training sequence of many short documents plans one tile per document (and per ring
step); one kernel call per tile makes such a step host-bound: its time grows with the number of
documents while its attention work shrinks. Consecutive tiles whose query rows and keys are each
contiguous in their buffers (tile ``i`` ends where tile ``i + 1`` starts, in both) are exactly the
sequences of one varlen call: ``cu_seqlens_q``/``cu_seqlens_k`` are the tiles' boundaries, the
packed q/k/v are views of the buffers, and FlashAttention-2's causal mask is bottom-right aligned
per sequence as a tile's. So a run of such tiles is one forward call and one backward call (fed the
final merged ``out``/``lse`` as every tile backward is) of the kernel whose registry entry says
``varlen`` (:mod:`~megacp.attention.kernels.registry`; FlashAttention-2's
``aten._flash_attention_forward`` / ``_backward``, :func:`~megacp.attention.kernels.flash.varlen_forward`).

Which tiles join a run (:func:`tile_runs`): tensors a fused kernel takes (fp16/bf16 CUDA) under
``"auto"`` or a backend naming a varlen kernel (``"flash"``); no window band; one mask kind per
run; a causal tile only where it has at least as many keys as queries (no query sees nothing).
Under ``"auto"`` only tiles of at most :data:`VARLEN_MAX_ROWS` queries join (longer ones keep the
faster call of the first kernel of the order, cuDNN's); under a named varlen kernel every tile
may. A run has at least two tiles, or is one causal tile with more keys than queries — a chunk or
a chat turn after its cached prefix, which the square-causal cuDNN calls run as a dense call, a
causal call and a merge, each new key length a new cuDNN plan. Such a run's forward is
FlashAttention-2's batched (not varlen) call: with few queries it splits the keys over the SMs and
merges (split-KV), where the varlen call runs each head's queries on one SM over all the keys (a
96-token turn over 33K cached keys). Layouts as
:mod:`~megacp.attention.kernels.partial`: ``q`` ``[Lq, Hq, D]``, ``k``/``v`` ``[Lk, Hkv, D]``, ``lse``
``[Lq, Hq]`` fp32 natural log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, Union, cast

from torch import Tensor

from megacp.attention.kernels import registry
from megacp.attention.kernels.partial import kernel_module, kernel_order, kernels_apply
from megacp.attention.kernels.registry import AUTO
from megacp.placement.tiles import Tile

VARLEN_MAX_ROWS = 2048
"""Longest tile (query rows) that joins a varlen run under ``"auto"``."""


@dataclass(frozen=True)
class TileRun:
    """Consecutive tiles whose query rows ``[q0, q1)`` and keys ``[k0, k1)`` are each contiguous:
    the sequences of one varlen call."""

    tiles: tuple[Tile, ...]

    @property
    def q0(self) -> int:
        return self.tiles[0].q0

    @property
    def q1(self) -> int:
        return self.tiles[-1].q1

    @property
    def k0(self) -> int:
        return self.tiles[0].k0

    @property
    def k1(self) -> int:
        return self.tiles[-1].k1

    @property
    def causal(self) -> bool:
        return self.tiles[0].causal


Unit = Union[Tile, TileRun]
"""What one kernel call serves: a tile alone or a run of tiles."""


def _joins(t: Tile, max_rows: int | None) -> bool:
    if t.left is not None or (t.causal and t.q1 - t.q0 > t.k1 - t.k0):
        return False
    return max_rows is None or t.q1 - t.q0 <= max_rows


def _after_prefix(t: Tile) -> bool:
    """A causal tile with more keys than queries (new tokens after cached ones): one varlen call
    where the square-causal kernels need two and a merge."""
    return t.causal and t.k1 - t.k0 > t.q1 - t.q0


class VarlenKernel(Protocol):
    """A fused kernel that runs a :class:`TileRun` in one call (registry entry ``varlen``)."""

    def varlen_forward(self, q: Tensor, k: Tensor, v: Tensor, run: TileRun, *,
                       scale: float) -> tuple[Tensor, Tensor]: ...

    def varlen_backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, run: TileRun,
                        *, scale: float) -> tuple[Tensor, Tensor, Tensor]: ...


def varlen_kernel(backend: str, x: Tensor) -> str | None:
    """The kernel that runs runs of tiles for ``backend`` (resolved) on tensors like ``x``: the first
    of :func:`~megacp.attention.kernels.partial.kernel_order` whose registry entry says ``varlen``,
    where a fused kernel takes ``x`` at all; ``None`` where none does (every tile runs alone)."""
    if not kernels_apply(x):
        return None
    return next((name for name in kernel_order(backend, x) if registry.get(name).varlen), None)


def tile_runs(tiles: Sequence[Tile], backend: str, x: Tensor) -> list[Unit]:
    """``tiles`` (in order) grouped into :class:`TileRun` s where a varlen kernel serves them
    (``backend`` resolved; ``x`` one of the query/key tensors), the rest left as they are."""
    if varlen_kernel(backend, x) is None:
        return list(tiles)
    return group_runs(tiles, VARLEN_MAX_ROWS if backend == AUTO else None)


def group_runs(tiles: Sequence[Tile], max_rows: int | None) -> list[Unit]:
    """``tiles`` (in order) with every maximal stretch of consecutive tiles that may share a varlen
    call (contiguous queries and keys, one mask kind, no band, a causal tile with at least as many
    keys as queries, at most ``max_rows`` queries each) as one :class:`TileRun`: a stretch of at
    least two tiles, or one causal tile after a cached prefix."""
    units: list[Unit] = []
    run: list[Tile] = []

    def close() -> None:
        units.extend([TileRun(tuple(run))] if len(run) > 1 or (run and _after_prefix(run[0])) else run)
        run.clear()

    for t in tiles:
        if not _joins(t, max_rows):
            close()
            units.append(t)
            continue
        if run and (t.q0 != run[-1].q1 or t.k0 != run[-1].k1 or t.causal != run[-1].causal):
            close()
        run.append(t)
    close()
    return units


def _kernel(backend: str, x: Tensor) -> VarlenKernel:
    name = varlen_kernel(backend, x)
    if name is None:
        raise ValueError(f"no varlen kernel runs attention backend {backend!r} on {x.dtype} {x.device.type} tensors")
    return cast(VarlenKernel, kernel_module(name))


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, run: TileRun, *, scale: float,
                     backend: str) -> tuple[Tensor, Tensor]:
    """Forward of every tile of ``run`` in one call of the varlen kernel of ``backend`` (resolved;
    the backend :func:`tile_runs` grouped the run under).

    Args:
        q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``: the buffers the run's tiles index (fp16/bf16 CUDA).

    Returns:
        ``out`` ``[q1 - q0, Hq, D]`` (q.dtype) and ``lse`` ``[q1 - q0, Hq]`` fp32 of the run's rows.
    """
    return _kernel(backend, q).varlen_forward(q, k, v, run, scale=scale)


def varlen_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, run: TileRun, *,
                    scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of every tile of ``run`` in one call, given the queries' final ``out``/``lse``
    (``backend`` as :func:`varlen_attention`).

    Args:
        q, out, dout ``[Lq, Hq, D]``; lse ``[Lq, Hq]`` fp32; k/v ``[Lk, Hkv, D]``: the whole buffers.

    Returns:
        ``dq`` ``[q1 - q0, Hq, D]`` and ``dk``/``dv`` ``[k1 - k0, Hkv, D]`` in q.dtype, of the run's rows.
    """
    return _kernel(backend, q).varlen_backward(q, k, v, out, lse, dout, run, scale=scale)
