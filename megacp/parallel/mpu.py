"""DeepSpeed's "model parallel unit" (``mpu``) view of a :class:`ParallelState`.

Pass ``DeepSpeedMPU(state)`` as ``deepspeed.initialize(..., mpu=...)``. DeepSpeed then sees megacp's
CP dimension as its sequence-parallel dimension (as for DeepSpeed-Ulysses):

=============================  ===========  =================================================
DeepSpeed name                 megacp kind  DeepSpeed uses it for
=============================  ===========  =================================================
``sequence_parallel``          ``cp``       sequence-parallel size/rank
``sequence_data_parallel``     ``dp_cp``    gradient all-reduce and ZeRO partitioning
``data_parallel``              ``dp``       batch-size accounting, checkpoint peers
``model_parallel``             ``mp``       overflow / grad-norm reduction, checkpoint names
``tensor_model_parallel``      ``tp``       TP rank/size, input broadcast (its rank-0 source)
``slice_parallel``             ``tp``       the same, under DeepSpeed's pipeline-grid names
``pipeline_model_parallel``    ``pp``       pipeline size/rank
``pipe_parallel``              ``pp``       the same, under DeepSpeed's pipeline-grid names
``expert_parallel``            ``ep``       the ranks an MoE layer's experts are sharded over
``expert_data_parallel``       ``edp``      the ranks holding the same experts
=============================  ===========  =================================================

``model_parallel`` is the ``tp x pp`` group (every rank holding a different shard of the
weights), as in Megatron and DeepSpeed's own pipeline grid; it equals ``tp`` when ``pp == 1``.

DeepSpeed 0.19 itself never asks an mpu for expert groups: its own MoE layers build theirs
(``deepspeed.utils.groups``). The expert getters describe megacp's EP mesh; to train experts
sharded over EP (``expert_model_parallel.size`` > 1), :mod:`megacp.train.experts` registers the same
``ep`` / ``edp`` groups in ``deepspeed.utils.groups``. With every expert on every rank, DeepSpeed
reduces their gradients over DP x CP like every other weight.

The class deliberately has no ``initialize_sequence_parallel`` method: DeepSpeed takes an mpu
that has one for Megatron-DeepSpeed's sequence-parallel mpu and then ignores its data- and
model-parallel groups.
"""

from __future__ import annotations

import torch.distributed as dist

from megacp.parallel.state import ParallelState


class DeepSpeedMPU:
    """The ``mpu`` interface DeepSpeed 0.19 calls, answered from one :class:`ParallelState`.

    Every ``*_group`` returns a ``torch.distributed`` process group, ``*_world_size`` its size
    and ``*_rank`` this rank's index inside it.
    """

    def __init__(self, state: ParallelState) -> None:
        self.state = state

    # -- sequence (context) parallel: cp ---------------------------------------------------------
    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("cp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.state.size("cp")

    def get_sequence_parallel_rank(self) -> int:
        return self.state.rank_in("cp")

    # -- sequence x data parallel: dp_cp (gradient reduction) ------------------------------------
    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("dp_cp")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.state.size("dp_cp")

    def get_sequence_data_parallel_rank(self) -> int:
        return self.state.rank_in("dp_cp")

    # -- data parallel: dp -----------------------------------------------------------------------
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.state.size("dp")

    def get_data_parallel_rank(self) -> int:
        return self.state.rank_in("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group, ascending."""
        return list(self.state.ranks("dp"))

    # -- model parallel: mp = tp x pp ------------------------------------------------------------
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("mp")

    def get_model_parallel_world_size(self) -> int:
        return self.state.size("mp")

    def get_model_parallel_rank(self) -> int:
        return self.state.rank_in("mp")

    # -- tensor model parallel: tp ---------------------------------------------------------------
    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.size("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.rank_in("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP index 0 in this rank's TP group (the broadcast source)."""
        return self.state.ranks("tp")[0]

    def get_slice_parallel_group(self) -> dist.ProcessGroup:
        return self.get_tensor_model_parallel_group()

    def get_slice_parallel_world_size(self) -> int:
        return self.get_tensor_model_parallel_world_size()

    def get_slice_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    # -- pipeline parallel: pp -------------------------------------------------------------------
    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.state.size("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.state.rank_in("pp")

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.get_pipeline_model_parallel_group()

    def get_pipe_parallel_world_size(self) -> int:
        return self.get_pipeline_model_parallel_world_size()

    def get_pipe_parallel_rank(self) -> int:
        return self.get_pipeline_model_parallel_rank()

    # -- expert parallel: ep, and the ranks holding the same experts: edp ------------------------
    def get_expert_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("ep")

    def get_expert_parallel_world_size(self) -> int:
        return self.state.size("ep")

    def get_expert_parallel_rank(self) -> int:
        return self.state.rank_in("ep")

    def get_expert_data_parallel_group(self) -> dist.ProcessGroup:
        return self.state.group("edp")

    def get_expert_data_parallel_world_size(self) -> int:
        return self.state.size("edp")

    def get_expert_data_parallel_rank(self) -> int:
        return self.state.rank_in("edp")
