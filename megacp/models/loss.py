"""The causal-LM loss of megacp's own models under context parallelism, exact against one process.

Each CP rank sums the cross-entropy (natural log) over the valid labels of its shard and divides
by the valid labels of the *whole* sequence group (:attr:`TrainShard.num_valid_tokens`), so the
sum of the CP ranks' losses, and of their gradients, is the mean loss and gradient of CP = 1
(how DeepSpeed sums them over the CP ranks: :mod:`megacp.train.loss`). The LM head never produces
the logits of a whole shard at once (:func:`~megacp.models.lm_head.chunked_cross_entropy`).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from torch import Tensor, nn

from megacp.layers.settings import CPSettings
from megacp.layers.step import CPStep, plan_step
from megacp.models.lm_head import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from megacp.placement import ShardPlan
from megacp.placement.batch import TrainShard


class _LanguageModel(Protocol):
    """What :func:`lm_loss` uses of a model (:class:`~megacp.models.llama.CausalLM`'s interface)."""

    lm_head_weight: Tensor

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor, *, cu_seqlens: Tensor | None = None,
                      inference_params: Any = None) -> Tensor: ...


def _train_step(settings: CPSettings | None, plan: ShardPlan) -> CPStep | None:
    """The step handed to the model's attention for ``plan``; ``None`` at CP = 1, where the model's
    own attention (local, or CP layers of one rank planning their own step) trains."""
    size = settings.cp_size if settings is not None else 1
    if plan.cp_size != size and size == 1:
        raise ValueError(
            f"the shard is one of {plan.cp_size} CP ranks' but no CP settings were given, so the model has local "
            "attention: call megacp.swap_attention(model, state) first and pass lm_loss(..., "
            "settings=CPSettings.from_state(state))"
        )
    if settings is None or size == 1:
        return None
    if (settings.cp_size, settings.cp_rank) != (plan.cp_size, plan.rank):
        raise ValueError(f"the shard is for CP rank {plan.rank} of {plan.cp_size}, but the settings' CP ring is rank "
                         f"{settings.cp_rank} of {settings.cp_size}")
    return plan_step(settings, plan, training=True)


def lm_loss(model: nn.Module, shard: TrainShard, *, settings: CPSettings | None = None,
            chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """This CP rank's share of the batch's mean causal-LM loss (differentiable fp32 scalar).

    Summed over the CP group, the losses (and the gradients) equal CP = 1's mean token loss of the
    batch. Zero, with zero gradients, when the batch has no valid label.

    Args:
        model: a :class:`~megacp.models.llama.CausalLM` (or anything with its ``hidden_states``
            and ``lm_head_weight``), with CP attention over the shard's CP group
            (:func:`megacp.swap_attention`) unless CP = 1.
        shard: this rank's :class:`TrainShard` (:func:`~megacp.placement.batch.shard_batch`).
        settings: the CP settings the model's attention was swapped with
            (:meth:`~megacp.layers.settings.CPSettings.from_state`): the layers run a
            :class:`~megacp.layers.step.TrainStep` of the shard's plan. ``None``: CP = 1, the
            model's own attention (local, or CP layers of one rank).
        chunk_tokens: rows of logits materialised at once.

    Raises:
        ValueError: an input id or label outside the vocabulary, or settings that do not match the
            shard's CP group.
    """
    lm = cast(_LanguageModel, model)
    weight = lm.lm_head_weight
    vocab = weight.shape[0]
    if shard.input_ids.numel():
        top_id, top_label = int(shard.input_ids.max()), int(shard.labels.max())
        if shard.input_ids.min() < 0 or top_id >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab}) (the vocabulary); got {top_id}")
        if top_label >= vocab:
            raise ValueError(f"labels must be < {vocab} (the vocabulary) or -100; got {top_label}")
    step = _train_step(settings, shard.plan)
    device = weight.device
    hidden = lm.hidden_states(
        shard.input_ids.to(device), shard.position_ids.to(device),
        cu_seqlens=shard.local_cu_seqlens.to(device), inference_params=step,
    )
    total = chunked_cross_entropy(hidden, weight, shard.labels.to(device), chunk_tokens)
    return total / max(shard.num_valid_tokens, 1)
