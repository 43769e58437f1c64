"""The training loss as DeepSpeed combines it under context parallelism, and the number to report.

Each CP rank's loss is its share of the batch's mean token loss (megacp's own models:
:func:`~megacp.models.loss.lm_loss`; a transformers model: the tiled loss of
:mod:`megacp.integrations.hf_memory`): the shares of a sequence group's CP ranks, and their
gradients, sum to CP = 1's mean token loss and its gradient. That is how DeepSpeed combines them
when its mpu names a sequence-parallel group (megacp's :class:`~megacp.parallel.mpu.DeepSpeedMPU`:
CP is DeepSpeed's sequence parallelism): gradients are all-reduced over the sequence-data-parallel
group (DP x CP) and divided by ``seq_dp_world_size / sp_world_size`` = the DP size
(``DeepSpeedEngine._reduce_non_expert_gradients`` and ZeRO 1/2's ``average_tensor``/``allreduce_bucket``
in DeepSpeed 0.19), i.e. summed over CP and averaged over DP. The objective is therefore the mean
over DP replicas of each sequence group's mean token loss; :func:`logged_loss` reports that number.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def logged_loss(loss: Tensor, *, cp_group: dist.ProcessGroup | None = None,
                dp_group: dist.ProcessGroup | None = None) -> float:
    """The loss to report: ``loss`` (this rank's share) summed over the CP group and
    averaged over the DP group, i.e. CP = 1's mean token loss, averaged over the DP replicas.

    Collective over both groups (TP ranks hold equal losses and need no reduction); ``None`` (or a
    group of one) skips that reduction.
    """
    x = loss.detach().float().reshape(1).clone()
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(x, group=cp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(x, group=dp_group)
        x /= dist.get_world_size(dp_group)
    return float(x)
