"""CP-sharded training batches: labels shifted before sharding, every field sharded with one plan."""

from __future__ import annotations

import pytest
import torch

from megacp.placement import ShardPlan
from megacp.placement.batch import IGNORE_INDEX, shard_batch

X = IGNORE_INDEX


def test_hand_computed_cp2_shards() -> None:
    # documents of 5, 3 and 1 tokens (ragged, shorter than 2N = 4 and not divisible by it); the
    # label of token 3 is ignored. 2N-chunking: document 0 -> rank 0 [0, 2), rank 1 [2, 5);
    # document 1 -> rank 0 [0, 1), rank 1 [1, 3); the one-token document 2 -> rank 0.
    ids = torch.arange(10, 19)
    labels = ids.clone()
    labels[3] = X
    cu = torch.tensor([0, 5, 8, 9], dtype=torch.int32)
    # shifted, whole batch: [11, 12, X, 14, X | 16, 17, X | X]
    want = {
        0: dict(ids=[10, 11, 15, 18], labels=[11, 12, 16, X], positions=[0, 1, 0, 0], local_cu=[0, 2, 3, 4]),
        1: dict(ids=[12, 13, 14, 16, 17], labels=[X, 14, X, 17, X], positions=[2, 3, 4, 1, 2], local_cu=[0, 3, 5, 5]),
    }
    for rank, w in want.items():
        shard = shard_batch(ids, labels, cu_seqlens=cu, cp_size=2, cp_rank=rank)
        assert shard.input_ids.tolist() == w["ids"]
        # rank 0's token 11 ends its chunk of document 0; its target 12 lives on rank 1 and is kept
        assert shard.labels.tolist() == w["labels"]
        assert shard.position_ids.tolist() == w["positions"]
        assert shard.local_cu_seqlens.tolist() == w["local_cu"]
        assert shard.cu_seqlens.tolist() == [0, 5, 8, 9] and shard.cu_seqlens.dtype == torch.int32
        assert shard.num_valid_tokens == 5
        assert (shard.plan.cp_size, shard.plan.rank, shard.plan.new) == (2, rank, [5, 3, 1])
        assert all(t.dtype == torch.int64 for t in (shard.input_ids, shard.labels, shard.position_ids))


def test_defaults_one_document_labels_are_inputs() -> None:
    ids = torch.tensor([4, 5, 6, 7, 8], dtype=torch.int32)
    shard = shard_batch(ids, cp_size=1, cp_rank=0)
    assert shard.input_ids.tolist() == [4, 5, 6, 7, 8]
    assert shard.labels.tolist() == [5, 6, 7, 8, X]
    assert shard.position_ids.tolist() == [0, 1, 2, 3, 4]
    assert shard.num_valid_tokens == 4


def test_contiguous_sharding_and_given_positions() -> None:
    ids = torch.arange(8)
    positions = torch.arange(100, 108)
    shards = [shard_batch(ids, position_ids=positions, cp_size=2, cp_rank=r, load_balance=False) for r in (0, 1)]
    assert [s.input_ids.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [s.labels.tolist() for s in shards] == [[1, 2, 3, 4], [5, 6, 7, X]]
    assert shards[1].position_ids.tolist() == [104, 105, 106, 107]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_union_of_shards_is_the_shifted_batch(cp_size: int) -> None:
    g = torch.Generator().manual_seed(cp_size)
    lengths = [1, 7, 2, 13, 3, 5]
    total = sum(lengths)
    ids = torch.randint(0, 50, (total,), generator=g)
    labels = torch.where(torch.rand(total, generator=g) < 0.2, X, ids)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    shifted = torch.full((total,), X)
    positions = torch.empty(total, dtype=torch.long)
    for a, b in zip(cu, cu[1:]):
        shifted[a : b - 1] = labels[a + 1 : b]
        positions[a:b] = torch.arange(b - a)
    seen = torch.zeros(total, dtype=torch.long)
    for rank in range(cp_size):
        shard = shard_batch(ids, labels, cu_seqlens=cu, cp_size=cp_size, cp_rank=rank)
        index = ShardPlan([0] * len(lengths), lengths, cp_size, rank).local_index()
        assert torch.equal(shard.input_ids, ids[index])
        assert torch.equal(shard.labels, shifted[index])
        assert torch.equal(shard.position_ids, positions[index])
        assert shard.num_valid_tokens == int((shifted != X).sum())
        seen[index] += 1
    assert seen.tolist() == [1] * total


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(input_ids=torch.zeros(2, 3, dtype=torch.long)), "input_ids must be a 1-D tensor"),
        (dict(input_ids=torch.zeros(4)), "input_ids must hold integers"),
        (dict(input_ids=torch.zeros(0, dtype=torch.long)), "input_ids is empty"),
        (dict(labels=torch.zeros(5, dtype=torch.long)), "labels has 5 tokens but input_ids has 6"),
        (dict(labels=torch.tensor([1, 2, -3, 4, 5, 6])), "labels must be >= 0 or -100"),
        (dict(position_ids=torch.arange(7)), "position_ids has 7 tokens"),
        (dict(position_ids=torch.arange(6) - 1), "position_ids must be >= 0"),
        (dict(cu_seqlens=[0, 4, 5]), "cu_seqlens must rise strictly from 0 to T=6"),
        (dict(cu_seqlens=[0, 3, 3, 6]), "cu_seqlens must rise strictly"),
        (dict(cp_size=0), "cp_size must be a positive integer"),
        (dict(cp_rank=2), r"cp_rank must be in \[0, 2\)"),
    ],
)
def test_bad_input_is_refused(kwargs: dict, match: str) -> None:
    args = dict(input_ids=torch.arange(6), cp_size=2, cp_rank=0) | kwargs
    with pytest.raises(ValueError, match=match):
        shard_batch(args.pop("input_ids"), **args)
