"""CP-sharded training batches: one rank's load-balanced share of a packed batch, labels shifted first.

A packed batch is ``T`` tokens of ``B`` documents back to back, delimited by ``cu_seqlens``
(``[B+1]``). Labels are given unshifted (aligned with the inputs, as Hugging Face takes them;
``-100`` = ignored) and shifted *per document before sharding*: the target of token ``i`` is
label ``i+1`` of the same document, the last token of each document gets ``-100`` (a loss mask is
expressed the same way: ``-100`` where a token's label must not count). Shifting after
sharding would lose the target of every token whose successor sits on another rank (the last
token of each of a rank's chunks).

Every field is then sharded with the :class:`~megacp.placement.ShardPlan` the CP attention uses
for a cacheless step (documents split into ``2N`` chunks, rank ``r`` holding chunks ``r`` and
``2N-1-r``), so row ``i`` of every field of a :class:`TrainShard` is the same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megacp.placement import ShardPlan, seq_lengths

IGNORE_INDEX = -100
"""Label value of a token that has no target (PyTorch's ``cross_entropy`` default)."""


@dataclass(frozen=True)
class TrainShard:
    """This CP rank's share of a packed training batch.

    Attributes:
        input_ids: ``[n_local]`` int64, this rank's tokens in ``plan.q_layout`` order.
        labels: ``[n_local]`` int64, already shifted: ``labels[i]`` is the target of
            ``input_ids[i]``; :data:`IGNORE_INDEX` (-100) where there is none.
        position_ids: ``[n_local]`` int64, each token's position (by default its offset inside
            its document).
        cu_seqlens: ``[B+1]`` int32 boundaries of the *whole* documents (the CP layer's cacheless
            convention, as in Transformer Engine).
        plan: the sharding of the documents over the CP group (the plan the CP attention uses).
        num_valid_tokens: labels other than -100 in the whole batch, over all CP ranks (the
            divisor of every rank's loss).
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    plan: ShardPlan
    num_valid_tokens: int

    @property
    def local_cu_seqlens(self) -> Tensor:
        """int32 ``[B+1]`` boundaries of the documents among this rank's tokens."""
        return self.plan.local_cu_seqlens()


def shift_labels(labels: Tensor, lengths: Sequence[int]) -> Tensor:
    """Per document of ``lengths``: ``out[i] = labels[i+1]``, the last token's label -100.

    ``labels`` ``[T]`` int64 (``T = sum(lengths)``) -> ``[T]`` int64.
    """
    out = labels.roll(-1)
    ends = torch.tensor(lengths, device=labels.device).cumsum(0) - 1
    out[ends] = IGNORE_INDEX
    return out


def document_positions(lengths: Sequence[int], device: torch.device | str | None = None) -> Tensor:
    """Offsets inside each document: ``[0..n0-1, 0..n1-1, ...]`` (``[sum(lengths)]`` int64)."""
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    starts = counts.cumsum(0) - counts
    return torch.arange(int(counts.sum()), device=device) - starts.repeat_interleave(counts)


def _token_tensor(name: str, x: Tensor, total: int | None) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 1:
        shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 1-D tensor [T] of a packed batch; got {shape}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers; got {x.dtype}")
    if total is not None and x.numel() != total:
        raise ValueError(f"{name} has {x.numel()} tokens but input_ids has {total}")
    return x.long()


def shard_batch(
    input_ids: Tensor,
    labels: Tensor | None = None,
    *,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    position_ids: Tensor | None = None,
    cp_size: int,
    cp_rank: int,
    load_balance: bool = True,
) -> TrainShard:
    """This CP rank's share of a packed batch (every rank of the CP group passes the same batch).

    Args:
        input_ids: ``[T]`` integer token ids, the documents back to back.
        labels: ``[T]`` unshifted labels (aligned with ``input_ids``; -100 = ignored); default
            ``input_ids`` (plain language modelling).
        cu_seqlens: ``[B+1]`` document boundaries (0, strictly rising, ending at ``T``); default
            one document.
        position_ids: ``[T]`` positions for RoPE; default each token's offset in its document.
        cp_size, cp_rank: the CP group's size N and this rank.
        load_balance: 2N-chunk load balancing (default; the plan the CP layer builds itself when
            no step is passed) or N contiguous chunks.

    Raises:
        ValueError: one line naming the bad input (shapes, dtypes, boundaries, ranks, labels below
            0 other than -100). Labels and ids beyond the vocabulary are the loss's to check.
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")
    ids = _token_tensor("input_ids", input_ids, None)
    total = ids.numel()
    if total == 0:
        raise ValueError("input_ids is empty: a training batch needs at least one token")
    labels = ids if labels is None else _token_tensor("labels", labels, total).to(ids.device)
    bad = (labels < 0) & (labels != IGNORE_INDEX)
    if bool(bad.any()):
        raise ValueError(f"labels must be >= 0 or {IGNORE_INDEX} (ignored); got {int(labels[bad][0])}")
    if cu_seqlens is None:
        cu_seqlens = [0, total]
    lengths = seq_lengths(cu_seqlens, total)
    positions = (document_positions(lengths, ids.device) if position_ids is None
                 else _token_tensor("position_ids", position_ids, total).to(ids.device))
    if bool((positions < 0).any()):
        raise ValueError("position_ids must be >= 0")
    shifted = shift_labels(labels, lengths)
    plan = ShardPlan([0] * len(lengths), lengths, cp_size, cp_rank, load_balance=load_balance)
    index = plan.local_index().to(ids.device)
    return TrainShard(
        input_ids=ids[index],
        labels=shifted[index],
        position_ids=positions[index],
        cu_seqlens=torch.tensor([0, *lengths], dtype=torch.int32, device=ids.device).cumsum(0, dtype=torch.int32),
        plan=plan,
        num_valid_tokens=int((shifted != IGNORE_INDEX).sum()),
    )
