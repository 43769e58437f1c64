"""Runs of short tiles in one FlashAttention-2 varlen call (packed documents).

A packed training sequence of many short documents plans one tile per document (and per ring
step); one kernel call per tile makes such a step host-bound: its time grows with the number of
documents while its attention work shrinks. Consecutive tiles whose query rows and keys are each
contiguous in their buffers (tile ``i`` ends where tile ``i + 1`` starts, in both) are exactly the
sequences of one varlen call: ``cu_seqlens_q``/``cu_seqlens_k`` are the tiles' boundaries, the
packed q/k/v are views of the buffers, and FlashAttention-2's causal mask is bottom-right aligned
per sequence as a tile's. So a run of such tiles is one forward call
(``aten._flash_attention_forward``) and one backward call (``aten._flash_attention_backward``,
fed the final merged ``out``/``lse`` as every tile backward is).

Which tiles join a run (:func:`tile_runs`): fp16/bf16 CUDA tensors under backend ``"auto"`` or
``"flash"``; no window band; one mask kind per run; a causal tile only where it has at least as
many keys as queries (no query sees nothing). Under ``"auto"`` only tiles of at most
:data:`VARLEN_MAX_ROWS` queries join (longer ones keep the faster cuDNN call of their own); under
``"flash"`` every tile may. A run has at least two tiles, or is one causal tile with more keys than
queries — a chunk or a chat turn after its cached prefix, which the square-causal cuDNN calls run
as a dense call, a causal call and a merge, each new key length a new cuDNN plan. Such a run's
forward is FlashAttention-2's batched (not varlen) call: with few queries it splits the keys over
the SMs and merges (split-KV), where the varlen call runs each head's queries on one SM over all
the keys (a 96-token turn over 33K cached keys). Layouts as
:mod:`~megacp.attention.partial`: ``q`` ``[Lq, Hq, D]``, ``k``/``v`` ``[Lk, Hkv, D]``, ``lse``
``[Lq, Hq]`` fp32 natural log.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import Tensor

from megacp.attention.partial import kernels_apply
from megacp.attention.partial_backward import zero_seed
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


def tile_runs(tiles: Sequence[Tile], backend: str, x: Tensor) -> list[Unit]:
    """``tiles`` (in order) grouped into :class:`TileRun` s where the varlen kernel serves them
    (``backend`` resolved; ``x`` one of the query/key tensors), the rest left as they are."""
    if backend not in ("auto", "flash") or not kernels_apply(x):
        return list(tiles)
    return group_runs(tiles, VARLEN_MAX_ROWS if backend == "auto" else None)


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


@dataclass(frozen=True)
class _Seqs:
    """A run's sequence boundaries on the device and, where the kernel keeps its LSE as
    ``[B, H, max_q]`` (older FlashAttention layouts) rather than ``[H, total_q]``, the index of each
    query row into that layout."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    padded: tuple[Tensor, Tensor] | None  # ([total_q] sequence of each row, [total_q] its row in it)


@functools.lru_cache(maxsize=256)
def _seqs(run: TileRun, device: torch.device) -> _Seqs:
    """Built once per run and device: a step runs the same tiles in every layer, forward,
    recomputation and backward."""
    lq = [t.q1 - t.q0 for t in run.tiles]
    lk = [t.k1 - t.k0 for t in run.tiles]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    padded = None
    if _padded_lse_layout(device):
        seq = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
        padded = seq.to(device), (torch.arange(int(cu_q[-1])) - cu_q[:-1].long()[seq]).to(device)
    return _Seqs(cu_q.to(device), cu_k.to(device), max(lq), max(lk), padded)


@functools.cache
def _padded_lse_layout(device: torch.device) -> bool:
    """Whether the installed FlashAttention-2 keeps a varlen LSE as ``[B, H, max_q]`` (probed once
    with two sequences; otherwise it is ``[H, total_q]``)."""
    x = torch.zeros(3, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    lse = torch.ops.aten._flash_attention_forward(x, x, x, cu, cu, 2, 2, 0.0, False, False)[1]
    return lse.dim() == 3


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, run: TileRun, *, scale: float) -> tuple[Tensor, Tensor]:
    """Forward of every tile of ``run`` in one call.

    Args:
        q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``: the buffers the run's tiles index (fp16/bf16 CUDA).

    Returns:
        ``out`` ``[q1 - q0, Hq, D]`` (q.dtype) and ``lse`` ``[q1 - q0, Hq]`` fp32 of the run's rows.
    """
    if len(run.tiles) == 1:  # one tile after its prefix: the batched call, whose forward splits the keys
        res = torch.ops.aten._flash_attention_forward(
            q[None, run.q0:run.q1], k[None, run.k0:run.k1], v[None, run.k0:run.k1], None, None, run.q1 - run.q0,
            run.k1 - run.k0, 0.0, run.causal, False, scale=scale)
        return res[0][0], res[1][0].t().float()
    s = _seqs(run, q.device)
    res = torch.ops.aten._flash_attention_forward(
        q[run.q0:run.q1], k[run.k0:run.k1], v[run.k0:run.k1], s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, run.causal,
        False, scale=scale)
    out, lse = res[0], res[1]
    lse = lse.t() if s.padded is None else lse[s.padded[0], :, s.padded[1]]
    return out, lse.float()


def varlen_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, run: TileRun, *,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of every tile of ``run`` in one call, given the queries' final ``out``/``lse``.

    Args:
        q, out, dout ``[Lq, Hq, D]``; lse ``[Lq, Hq]`` fp32; k/v ``[Lk, Hkv, D]``: the whole buffers.

    Returns:
        ``dq`` ``[q1 - q0, Hq, D]`` and ``dk``/``dv`` ``[k1 - k0, Hkv, D]`` in q.dtype, of the run's rows.
    """
    s = _seqs(run, q.device)
    rows = slice(run.q0, run.q1)
    lse_rows = lse[rows]
    if s.padded is None:
        lse_k = lse_rows.t().contiguous()
    else:
        lse_k = lse_rows.new_zeros(len(run.tiles), lse_rows.shape[1], s.max_q)
        lse_k[s.padded[0], :, s.padded[1]] = lse_rows
    seed = zero_seed(q.device)
    keys = slice(run.k0, run.k1)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout[rows], q[rows], k[keys], v[keys], out[rows], lse_k, s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, run.causal,
        seed, seed, scale=scale)
    return dq, dk, dv
