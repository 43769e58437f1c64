"""How cuDNN's execution plans are reused: padded lengths, and torch's plan reuse across lengths.

torch builds a cuDNN SDPA execution plan for every distinct shape it meets (tens of milliseconds
each, forward and backward alike) and keeps it for the process. Packed training documents and
prompts come in every length, so without care nearly every step of a packed corpus builds plans.

* **Padded causal squares** (all processes): a fused cuDNN call of a square causal tile of
  ``n <= LONGEST_PADDED`` rows runs at :func:`plan_length` ``(n)`` rows, four lengths per octave,
  the rows past ``n`` zero (:func:`pad_rows`). That is exact: under a causal mask no real query
  sees a key past ``n``, the padded queries' outputs are dropped, and in the backward their
  ``dout`` is zero (and their LSE 0, so their probabilities are finite), so they add nothing to
  dK/dV. Every tile length then shares one of 33 plans; the work grows by at most a quarter of a
  tile, and only for tiles of at most 16K rows, whose kernels are short anyway.
* **torch's own reuse across lengths** (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``): torch rounds
  lengths up to powers of two and runs the plan on the real lengths. Measured on an H100 with
  torch 2.11 / cuDNN 9.19 (``docs/GPU_FACTS.md``): the forward is exact, but the **backward gives
  wrong gradients** (errors of 10-1000× the gradients' size) whenever a plan runs a length other
  than the one it was built for, and for every batched call. megacp therefore sets it only in
  processes that never run a backward (:func:`reuse_plans_across_lengths`: ``megacp.generate``
  and ``megacp.serve``), where it spares the rectangular prefix tiles of each new prompt or chat
  turn a plan; where it is set anyway, the fused backward runs FlashAttention-2 under ``"auto"``
  and a forced ``"cudnn"`` backward is refused (:mod:`~megacp.attention.kernels.partial_backward`).
"""

from __future__ import annotations

import os

from torch import Tensor

CUDNN_PLAN_REUSE = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
"""torch's switch for reusing cuDNN SDPA plans across sequence lengths (``"1"``: on)."""

LONGEST_PADDED = 1 << 14
"""Longest tile padded to a plan length: past it a call's kernels take longer than its plan takes to build."""

SHORTEST_PADDED = 64
"""Shortest plan length (shorter tiles run at this many rows)."""

LENGTHS_PER_OCTAVE = 4


def plan_length(n: int) -> int:
    """Rows a square causal cuDNN call of ``n`` rows runs at: ``n`` past :data:`LONGEST_PADDED`,
    else the next of ``64, 80, 96, 112, 128, 160, ...`` (four per octave) at or above ``n``."""
    if n > LONGEST_PADDED:
        return n
    if n <= SHORTEST_PADDED:
        return SHORTEST_PADDED
    octave = 1 << ((n - 1).bit_length() - 1)  # octave < n <= 2 * octave
    step = octave // LENGTHS_PER_OCTAVE
    return -(-n // step) * step


def plan_lengths(tokens: int) -> list[int]:
    """Every :func:`plan_length` up to that of ``min(tokens, LONGEST_PADDED)`` (``[]`` for ``tokens < 1``)."""
    if tokens < 1:
        return []
    top = plan_length(min(tokens, LONGEST_PADDED))
    lengths, n = [], SHORTEST_PADDED
    while n <= top:
        lengths.append(n)
        n = plan_length(n + 1)
    return lengths


def pad_rows(x: Tensor, rows: int, dim: int = -3) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` along ``dim``, its token dim (``-3`` for
    ``[(B,) L, H, D]``, ``-2`` for an LSE ``[(B,) L, H]``): a new tensor, or ``x`` itself when it
    has ``rows`` already."""
    n = x.shape[dim]
    if n == rows:
        return x
    shape = list(x.shape)
    shape[dim] = rows
    out = x.new_zeros(shape)
    out.narrow(dim, 0, n).copy_(x)
    return out


def plans_reused_across_lengths() -> bool:
    """Whether torch reuses cuDNN plans across lengths in this process (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``)."""
    return os.environ.get(CUDNN_PLAN_REUSE) == "1"


def reuse_plans_across_lengths() -> None:
    """Turn torch's plan reuse across lengths on unless the environment sets it: for processes that
    never run an attention backward (see the module docstring). Call before the first cuDNN call."""
    os.environ.setdefault(CUDNN_PLAN_REUSE, "1")
