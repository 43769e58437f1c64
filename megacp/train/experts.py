"""Training experts sharded over the EP group (``expert_model_parallel.size`` > 1) through
DeepSpeed's own MoE gradient path.

The gradient each weight needs. The loss a rank differentiates is its CP share of its DP replica's
mean token loss (:mod:`megacp.train.loss`: the shares of a replica's CP ranks sum to the replica's
loss), and the step follows the mean over the DP replicas, so every weight θ needs

    g(θ) = (1 / DP) · Σ_{dp, cp} ∂L_{dp,cp} / ∂θ.

Dense weights get it from DeepSpeed: an all-reduce over the ``dp_cp`` group divided by
``|dp_cp| / |cp|`` = DP. An expert's weights live on one rank of each EP group, and the backward
of the dispatch all-to-all (:func:`megacp.models.moe.all_to_all`) has already summed there the
contributions of every token copy routed to that expert from every rank of the EP group: all the
``dp`` (x ``tp``) ranks of one CP index, or every ``dp x cp`` (x ``tp``) rank with
``expert_model_parallel.include_cp``. What is left is the sum over the ranks that hold the same
experts and processed other tokens — the ``edp`` group: the CP ranks of the cell, or this rank alone
with ``include_cp`` — and the division by DP:

    g(expert) = (1 / DP) · all_reduce_sum_{edp}(local expert gradient).

That is exactly what DeepSpeed 0.19 does with a parameter marked ``allreduce = False`` and
``group_name = n`` (``deepspeed.moe.utils.is_moe_param``): ZeRO 0 all-reduces it over
``deepspeed.utils.groups._get_expert_data_parallel_group(n)`` and divides by the mpu's
data-parallel size (``DeepSpeedEngine._reduce_expert_gradients``); ZeRO 1 / 2 put the expert
parameters in their own optimizer parameter groups (``'moe': True``), partition those over the
same group, reduce their buckets over it and divide every bucket by ``|dp_cp| / |cp|`` = DP
(``stage_1_and_2.py``); their gradient norm sums the squares of the expert partitions over
``dp_cp``, which counts every expert once.

DeepSpeed only turns that path on when the module holds a ``deepspeed.moe.layer.MoE``; it then
calls each such layer's ``set_deepspeed_parallelism`` to create its groups. :func:`expert_parallel`
attaches a parameter-free stand-in of that class for the duration of ``deepspeed.initialize``,
whose ``set_deepspeed_parallelism`` registers megacp's ``ep`` and ``edp`` groups under
:data:`EXPERT_GROUP_NAME`; the model is left as it was.

With TP > 1 the EP group spans the TP ranks, which therefore hold different experts: the trainer
tags the expert weights ``tensor_model_parallel`` (:func:`megacp.train.engine.mark_tensor_parallel`)
so that ZeRO's gradient norm sums them over the TP ranks too.

Refused, in one line: ZeRO 0 with ``gradient_clipping`` (DeepSpeed's fp32 clipping averages the
per-rank norms over DP, which differ when the ranks hold different experts; a rule of the training
config, :meth:`megacp.config.TrainingConfig.read`) and saving (:func:`check_expert_saving`: DeepSpeed
writes MoE checkpoints in its own per-expert layout, which :mod:`megacp.checkpoint` does not read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups

from megacp.config import ConfigError
from megacp.models.moe import MoEMLP
from megacp.parallel.state import ParallelState

EXPERT_GROUP_NAME = "megacp_ep"
"""The name megacp's expert groups have in ``deepspeed.utils.groups`` and the ``group_name`` of
every sharded expert weight."""


def sharded_expert_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The routed-expert weights of ``model``'s MoE layers whose experts are sharded over an EP
    group of size > 1 (empty when every rank holds every expert)."""
    return [p for m in model.modules() if isinstance(m, MoEMLP) and m.ep_size > 1
            for p in (m.expert_fc1_weight, m.expert_fc2_weight)]


def check_expert_saving(ep_size: int) -> None:
    """Refuse saving a checkpoint of experts sharded over ``ep_size`` ranks, when more than one
    (see the module docstring). Needs no process group: ``megacp.train`` asks before anything is loaded.

    Raises:
        ConfigError: one line.
    """
    if ep_size > 1:
        raise ConfigError(f"saving a checkpoint of experts sharded over expert_model_parallel.size={ep_size} ranks is "
                          "not supported (DeepSpeed writes its own per-expert layout)")


class _GroupRegistration(MoE):
    """A parameter-free ``deepspeed.moe.layer.MoE`` that turns on DeepSpeed's MoE path and, when
    the engine asks, registers megacp's expert groups (attached only during
    ``deepspeed.initialize``: it never runs a forward)."""

    def __init__(self, state: ParallelState) -> None:
        torch.nn.Module.__init__(self)  # none of MoE's own layers: only the engine's view of one
        self.state = state
        self.ep_size = state.size("ep")
        self.expert_group_name = EXPERT_GROUP_NAME
        self.num_experts = 0

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        for groups_by_name, ranks_by_name, kind in (
            (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, "ep"),
            (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, "edp"),
        ):
            groups_by_name[EXPERT_GROUP_NAME] = self.state.group(kind)
            ranks_by_name[EXPERT_GROUP_NAME] = list(self.state.ranks(kind))


@contextlib.contextmanager
def expert_parallel(model: torch.nn.Module, state: ParallelState) -> Iterator[bool]:
    """Around ``deepspeed.initialize``: when ``model`` has experts sharded over EP ranks, mark
    their weights as DeepSpeed expert parameters of :data:`EXPERT_GROUP_NAME` and attach the
    registration stand-in (removed on exit). Yields whether it did."""
    params = sharded_expert_parameters(model)
    if not params:
        yield False
        return
    for p in params:
        p.allreduce, p.group_name = False, EXPERT_GROUP_NAME  # type: ignore[attr-defined]  # DeepSpeed's MoE tags
    model.add_module("_deepspeed_expert_groups", _GroupRegistration(state))
    try:
        yield True
    finally:
        del model._deepspeed_expert_groups
