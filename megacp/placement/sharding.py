"""Which CP rank holds which token: load-balanced prefill sharding, round-robin decode placement,
and the bookkeeping that derives a rank's positions from a request's history.

Placement rules:

* A step that adds ``T > 1`` tokens (prefill, or a chunk of a chunked prefill) at positions
  ``P .. P+T-1`` splits them into ``2N`` chunks of ``c = ceil(T / 2N)`` positions; rank ``r`` holds
  chunks ``r`` and ``2N-1-r`` (causal work is then equal on every rank). Chunks past the end are
  shorter or empty: that is the "padding to a multiple of 2N", except that padded positions are
  never materialised, so they cannot change a result. With ``load_balance=False`` rank ``r`` holds
  the ``r``-th of ``N`` contiguous chunks.
* A step that adds one token (decode) places the token at position ``t`` on rank ``t mod N``.

Every rank computes the same plan from the same host-side integers; no communication is needed.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

Range = tuple[int, int]
"""Positions ``[a, b)`` of one request's tokens."""


def seq_lengths(cu_seqlens: Tensor | Sequence[int], total: int | None = None) -> list[int]:
    """Sequence lengths from packed-batch boundaries ``cu_seqlens`` (``[B+1]``: 0, then strictly
    rising; the last equals ``total`` tokens when given). Raises ``ValueError`` naming the bad input."""
    bounds = [int(x) for x in cu_seqlens]
    end = bounds[-1] if bounds else None
    if len(bounds) < 2 or bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:])) or (
            total is not None and end != total):
        to = f" to T={total}" if total is not None else ""
        raise ValueError(f"cu_seqlens must rise strictly from 0{to}, got {bounds}")
    return [b - a for a, b in zip(bounds, bounds[1:])]


def shard_ranges(start: int, num_new: int, cp_size: int, rank: int, *, load_balance: bool = True) -> list[Range]:
    """Position ranges ``[a, b)`` (ascending, non-empty) of a step's new tokens held by ``rank``.

    Args:
        start: position of the step's first new token (= tokens already computed, P).
        num_new: new tokens in the step (T).
        cp_size: N; rank: this CP rank in ``[0, N)``.
    """
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} outside a CP group of size {cp_size}")
    if num_new <= 0:
        return []
    if num_new == 1:
        return [(start, start + 1)] if start % cp_size == rank else []
    if load_balance:
        c = -(-num_new // (2 * cp_size))
        chunks: tuple[int, ...] = (rank, 2 * cp_size - 1 - rank)
    else:
        c = -(-num_new // cp_size)
        chunks = (rank,)
    end = start + num_new
    out = []
    for idx in chunks:
        a, b = min(start + idx * c, end), min(start + (idx + 1) * c, end)
        if b > a:
            out.append((a, b))
    return out


def held_after(held: Sequence[int], start: int, steps: Sequence[int], cp_size: int, *,
               load_balance: bool = True) -> list[int]:
    """Tokens each CP rank holds of a request after ``steps`` more steps (new-token counts: prefill
    chunks, 1 per decoded token) from position ``start``, given ``held[j]`` before them."""
    out = list(held)
    for t in steps:
        for j in range(cp_size):
            out[j] += sum(b - a for a, b in shard_ranges(start, t, cp_size, j, load_balance=load_balance))
        start += t
    return out


def positions_from_history(history: Sequence[int], cp_size: int, rank: int, *, load_balance: bool = True) -> list[int]:
    """Positions held by ``rank`` after a request's steps.

    Args:
        history: computed-token counts after each step, starting at 0 (e.g. ``[0, 4, 8, 9, 10, 11]``:
            two prefill chunks of 4, then three decoded tokens).

    Example (cp=2): rank 0 → ``[0, 3, 4, 7, 8, 10]``, rank 1 → ``[1, 2, 5, 6, 9]``.
    """
    if len(history) == 0 or history[0] != 0 or any(b < a for a, b in zip(history, history[1:])):
        raise ValueError(f"history must start at 0 and never decrease, got {list(history)}")
    out: list[int] = []
    for a, b in zip(history, history[1:]):
        for lo, hi in shard_ranges(a, b - a, cp_size, rank, load_balance=load_balance):
            out.extend(range(lo, hi))
    return out


def local_counts(histories: Sequence[Sequence[int]], cp_size: int, rank: int, *, load_balance: bool = True) -> list[int]:
    """Number of tokens ``rank`` holds for each request of a batch (a flat list, one int each)."""
    return [len(positions_from_history(h, cp_size, rank, load_balance=load_balance)) for h in histories]
