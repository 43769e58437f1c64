"""The tiny-Llama training run that CP, TP, ZeRO and expert-parallel training are compared
against: seeded model, packed batches of ragged documents (with ignored labels and a label at a
shard edge) and 20 AdamW steps (tolerances: tests/distributed/test_train_equivalence.py)."""

from __future__ import annotations

import torch

from megacp.layers.settings import CPSettings
from megacp.models import CausalLM, ModelConfig
from megacp.models.loss import lm_loss
from megacp.placement.batch import IGNORE_INDEX, shard_batch
from megacp.train.loss import logged_loss
from tests.helpers.reference import rel_err

STEPS = 20
LR = 1e-3
RTOL = 1e-5
ELEMENT_RTOL = 1e-4
LENGTHS = [[11, 3, 1, 17], [29], [5, 2, 9, 8], [2], [13, 13, 4]]
"""Packed documents, one list per step (cycled): ragged, some shorter than 2N and not divisible
by it; ``[2]`` leaves CP rank 2 of 3 without a token."""


def tiny_config(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)


def seeded_model(cfg: ModelConfig, tp_group: torch.distributed.ProcessGroup | None = None) -> CausalLM:
    """The seeded full model, or this TP rank's shard of it."""
    torch.manual_seed(0)
    full = CausalLM(cfg, dtype=torch.float32)
    if tp_group is None:
        return full
    from megacp.checkpoint.tp import shard_tensor

    tp, rank = torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)
    model = CausalLM(cfg, tp_group, dtype=torch.float32)
    model.load_state_dict({n: shard_tensor(cfg, n, t, rank, tp).clone() for n, t in full.state_dict().items()})
    return model


def step_batch(step: int, cp_edges: tuple[int, ...] = (2, 3)) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Step ``step``'s packed ids, unshifted labels (about 1 in 5 ignored) and ``cu_seqlens``.

    The target of the last token of CP rank 0's first chunk of document 0 (at every CP size of
    ``cp_edges``) is a valid label: it lives on the next rank.
    """
    g = torch.Generator().manual_seed(1000 + step)
    lengths = LENGTHS[step % len(LENGTHS)]
    total = sum(lengths)
    ids = torch.randint(0, 80, (total,), generator=g)
    labels = torch.where(torch.rand(total, generator=g) < 0.2, IGNORE_INDEX, ids)
    for n in cp_edges:
        edge = -(-lengths[0] // (2 * n))  # first position of rank 1's chunk of document 0
        if edge < lengths[0]:
            labels[edge] = ids[edge]
    return ids, labels, [0, *torch.tensor(lengths).cumsum(0).tolist()]


def grads_of(model: CausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def train_steps(model: CausalLM, cp_size: int, cp_rank: int, cp_group, check_recompute: bool = False,
                settings: CPSettings | None = None) -> tuple:
    """Run the steps (``settings``: the CP settings the model was swapped with); return (logged
    losses, recompute gradient error at step 0, replicated grads at step 0)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, recompute_err, first = [], 0.0, {}
    for step in range(STEPS):
        ids, labels, cu = step_batch(step)
        shard = shard_batch(ids, labels, cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
        if step == 0 and cp_size > 1:  # the edge label is on rank 0 and valid
            assert cp_rank != 0 or shard.labels[-(-cu[1] // (2 * cp_size)) - 1] != IGNORE_INDEX
        loss = lm_loss(model, shard, settings=settings, chunk_tokens=8)
        loss.backward()
        if step == 0 and check_recompute:
            plain = grads_of(model)
            model.zero_grad()
            model.activation_checkpointing = True
            lm_loss(model, shard, settings=settings, chunk_tokens=8).backward()
            model.activation_checkpointing = False
            recompute_err = max(rel_err(p.grad, plain[n]) for n, p in model.named_parameters())
            first = grads_of(model)
        if cp_group is not None:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, group=cp_group)
        opt.step()
        opt.zero_grad()
        losses.append(logged_loss(loss, cp_group=cp_group))
    return losses, recompute_err, first
