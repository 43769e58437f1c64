"""A model of any family inside a DeepSpeed engine: the engine built with megacp's mpu from the
typed training config (:class:`~megacp.config.TrainingConfig`; DeepSpeed alone reads the raw dict),
one optimizer step over CP-sharded micro-batches, and evaluation. What a run sets up around it is
:mod:`megacp.train.setup`; saving and resuming, :mod:`megacp.train.saving`.

DeepSpeed owns the optimizer, the LR schedule, gradient clipping and accumulation, bf16 and ZeRO
(all from the user's DeepSpeed JSON). megacp's mpu (:class:`~megacp.parallel.mpu.DeepSpeedMPU`)
names CP as DeepSpeed's sequence-parallel dimension, so DeepSpeed all-reduces gradients over the
DP x CP ranks and divides by the DP size: the CP ranks' gradients are summed and the DP replicas'
averaged, which makes the family's loss (each CP rank's share of the batch's mean token loss,
:mod:`megacp.train.loss`) exact. Experts sharded over EP go through DeepSpeed's MoE gradient path
(:mod:`megacp.train.experts`). Everything that depends on the model's kind — the loss, the memory
features and the plan's sizes, the LM head, what a checkpoint records — comes from its family's
:class:`~megacp.families.Trainable`; the loss applies the LM head matrix itself, chunk by chunk.
Under ZeRO 3 (parameters partitioned over the DP x CP ranks, optionally
offloaded to CPU with ``offload_param`` / ``offload_optimizer``) DeepSpeed gathers a parameter only
around the forward and backward of the module that owns it, so the engine trains a
:class:`LossModule` (the model and its loss as one forward) that registers the LM head matrix as
its external parameter: it stays gathered through the chunked loss. The model is partitioned over
the DP x CP group (``deepspeed.zero.Init`` with megacp's ``dp_cp`` group: DeepSpeed's own conversion
would use the DP group alone and leave the CP ranks' gradients unsummed). ZeRO 3 is refused with TP
or EP sharding when the config is read (:meth:`~megacp.config.TrainingConfig.read`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megacp.attention.kernels.warmup import warm_kernel_plans
from megacp.config import MegacpConfig, load_config
from megacp.families import Trainable, trainable
from megacp.layers.settings import CPSettings
from megacp.parallel.mpu import DeepSpeedMPU
from megacp.parallel.state import ParallelState
from megacp.placement.batch import shard_batch
from megacp.train.data import PackedSequence, StreamPosition
from megacp.train.loss import logged_loss
from megacp.train.memory import (
    MemoryPlan,
    count_parameters,
    host_available,
    plan_memory,
)
from megacp.train.saving import Checkpointing
from megacp.train.setup import deepspeed_for, memory_inputs, training_view


class LossModule(torch.nn.Module):
    """What a ZeRO 3 engine trains: ``model`` and its loss as one forward, with the LM head matrix
    ``head`` (:attr:`~megacp.families.Trainable.head`) registered as an external parameter so that
    DeepSpeed keeps it gathered through the loss (it is read outside the module that owns it). Its
    parameter names are the model's, prefixed with ``model.`` (:data:`~megacp.checkpoint.deepspeed.ZERO3_PREFIX`)."""

    def __init__(self, model: torch.nn.Module, loss: Callable[..., torch.Tensor], cp: CPSettings,
                 head: torch.nn.Parameter | None) -> None:
        super().__init__()
        from deepspeed.runtime.zero.partition_parameters import (
            register_external_parameter,
        )

        self.model, self.loss, self.cp = model, loss, cp
        if head is not None:
            register_external_parameter(self, head)

    def forward(self, shard: Any) -> torch.Tensor:
        """This CP rank's share of the batch's mean token loss (``loss(model, shard, settings=cp)``)."""
        return self.loss(self.model, shard, settings=self.cp)


def _host_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters (ZeRO 3: this rank's partitions) held in host memory."""
    tensors = (getattr(p, "ds_tensor", p) for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def mark_tensor_parallel(model: torch.nn.Module, tp_size: int) -> None:
    """Tag the parameters that differ between TP ranks with ``tensor_model_parallel = True`` (the
    Megatron attribute DeepSpeed reads), so that DeepSpeed's gradient norm counts each of their
    parts once per TP rank and the replicated ones once (on TP rank 0). They are the ones TP
    splits, and the routed experts when they are sharded over an EP group (which spans the TP
    ranks: each holds other experts)."""
    if tp_size == 1:
        return
    from megacp.checkpoint.tp import is_replicated
    from megacp.train.experts import sharded_expert_parameters

    experts = {id(p) for p in sharded_expert_parameters(model)}
    for name, param in model.named_parameters():
        param.tensor_model_parallel = id(param) in experts or not is_replicated(name)  # type: ignore[attr-defined]  # DeepSpeed's tag


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: ``loss`` (CP = 1's mean token loss, averaged over the micro-batches and
    the DP replicas), ``tokens`` (all DP replicas), ``seconds`` (wall clock), ``lr``, and ``data``,
    the stream position after the step's last batch (``None`` for batches made by hand)."""

    loss: float
    tokens: int
    seconds: float
    lr: float
    data: StreamPosition | None = None


class Trainer(Checkpointing):
    """A model of any family (CP attention swapped in) trained by a DeepSpeed engine.

    Args:
        model: the model as its family trains it (:class:`~megacp.families.Trainable`), or a built
            module (its family's, :func:`~megacp.families.trainable`), in training mode, its
            parameters in the config's dtype (:attr:`~megacp.config.TrainingConfig.dtype`).
        config: the config with its training view (:func:`~megacp.config.load_config` with
            ``training=True``; a DeepSpeed config dict gets it here). Only DeepSpeed reads its raw
            dict (:attr:`~megacp.config.MegacpConfig.deepspeed`).
        state: the mesh; its CP group must be the one the model's CP attention uses.
        cp: the CP settings the model's attention was swapped with (default: the state's,
            :meth:`~megacp.layers.settings.CPSettings.from_state`); their ``load_balance`` shards
            the batches.
        loss: ``loss(module, shard, settings=cp)``, this CP rank's share of a shard's mean token
            loss (default: the family's, :meth:`~megacp.families.Trainable.loss`).
    """

    def __init__(self, model: torch.nn.Module | Trainable, config: MegacpConfig | Mapping[str, Any],
                 state: ParallelState, *, cp: CPSettings | None = None,
                 loss: Callable[..., torch.Tensor] | None = None) -> None:
        self.config = load_config(config, training=True)
        self.training = training_view(self.config)
        """What the run trains with (precision, ZeRO, memory options, ...), read and checked once."""
        self.model = trainable(model)
        """The model as its family trains it: loss, memory features, plan sizes, what a save records."""
        module = self.model.module
        deepspeed = deepspeed_for(state)
        mark_tensor_parallel(module, state.size("tp"))
        params = [p for p in module.parameters() if p.requires_grad]
        from megacp.train.experts import expert_parallel, sharded_expert_parameters

        self.sharded_experts = bool(sharded_expert_parameters(module))
        self.zero3 = self.training.zero_stage == 3
        self.planned: MemoryPlan | None = None
        self._params = count_parameters(module)
        self._host = host_available() + _host_parameter_bytes(module) if state.device.type == "cuda" else None
        """Host bytes the plan may give the run's states and offloaded activations: what was free
        before DeepSpeed allocated the host states (the plan counts them), plus parameters already there."""
        self.model.install_memory(self.training.memory, state.device)
        loss = loss or self.model.loss()
        cp = cp or CPSettings.from_state(state)
        trained = module
        if self.zero3:
            trained = LossModule(module, loss, cp, self.model.head)
            if not all(hasattr(p, "ds_id") for p in trained.parameters()):  # not built partitioned (build_for_training)
                # partitioned over DP x CP (DeepSpeed's own conversion would use the mpu's DP group only)
                deepspeed.zero.Init(module=trained, data_parallel_group=state.group("dp_cp"),
                                    config_dict_or_path=dict(self.config.deepspeed), mpu=DeepSpeedMPU(state))
        with expert_parallel(trained, state):
            self.engine, *_ = deepspeed.initialize(model=trained, model_parameters=params,
                                                   config=dict(self.config.deepspeed), mpu=DeepSpeedMPU(state))
        self.state = state
        self.cp, self.loss = cp, loss
        self.cp_group = state.group("cp")
        self.dp_group = state.group("dp")
        self.steps_done = 0
        self.plans_warmed: list[int] | None = None
        """The tile lengths whose kernel plans were built before the first step (``[]``: none
        apply, e.g. on CPU); ``None`` until then."""
        box = [uuid.uuid4().hex[:16]]
        dist.broadcast_object_list(box, src=0)
        self.run_id: str = box[0]
        """This run's identity in its checkpoints' manifests (a resumed run keeps the one it resumes)."""

    @property
    def module(self) -> torch.nn.Module:
        """The trained model (the engine's module; under ZeRO 3 the model inside its
        :class:`LossModule`, whose parameters are partitioned: gather them with
        ``deepspeed.zero.GatheredParameters`` to read them)."""
        return self.engine.module.model if self.zero3 else self.engine.module

    def plan_memory(self, tokens: int) -> MemoryPlan | None:
        """Plan a step of ``tokens`` local tokens per rank (:func:`~megacp.train.memory.plan_memory`)
        and set the model's MLP tiles, checkpoint blocks and offloaded blocks for it (the family's
        :meth:`~megacp.families.Trainable.apply_plan`); ``None`` for a model the plan has no sizes
        for. Checks the GPU's capacity (and the host's memory for what is offloaded).

        Raises:
            MemoryPlanError: the step will not fit (one line naming what would).
        """
        shape = self.model.plan_shape
        if shape is None:
            return None
        if self.planned is not None and self.planned.tokens == tokens:
            return self.planned
        inputs = memory_inputs(shape, self._params, self.training, self.state, host=self._host)
        self.planned = plan_memory(shape.config, tokens=tokens, **inputs)
        self.model.apply_plan(self.planned)
        return self.planned

    def prepare(self, tokens: int) -> MemoryPlan | None:
        """Ready the first step of ``tokens`` local tokens per rank before it runs: the memory plan
        (:meth:`plan_memory`) and the attention kernels' plans of every padded tile length up to
        ``tokens`` (:func:`~megacp.attention.kernels.warmup.warm_kernel_plans`: each length's forward and
        backward run once, seconds at hundreds of thousands of tokens). :meth:`step` does both
        itself when not done; a caller timing its steps calls this first.

        Raises:
            MemoryPlanError: the step will not fit (one line naming what would).
        """
        plan = self.plan_memory(tokens)
        self._warm_plans(tokens)
        return plan

    def _warm_plans(self, tokens: int) -> None:
        """Before the first step: the attention kernels' plans of every padded tile length up to
        ``tokens`` (:func:`~megacp.attention.kernels.warmup.warm_kernel_plans`; a transformers model's
        attention runs the same kernels), so no later step stalls on building one; with layers over
        query tiles, up to the tile's rows (the longest square causal call they make: warming the
        whole shard's length would hold a whole-sequence attention's buffers)."""
        shape = self.model.plan_shape
        if self.plans_warmed is not None or shape is None:
            return
        cfg, tp = shape.config, self.state.size("tp")
        if self.planned is not None and 0 < self.planned.attention_tile < tokens:
            tokens = self.planned.attention_tile  # a layer over query tiles runs no longer square tile
        self.plans_warmed = warm_kernel_plans(cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim,
                                              dtype=self.training.dtype, device=self.state.device, tokens=tokens,
                                              backend=self.cp.backend)

    def step(self, batches: Iterator[PackedSequence]) -> StepResult:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from ``batches``
        (this DP replica's; every CP rank of the replica passes the same ones)."""
        device = self.state.device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        start = time.perf_counter()
        losses, tokens = [], 0
        lr = float(self.engine.optimizer.param_groups[0]["lr"])  # what this step's update uses
        for _ in range(self.engine.gradient_accumulation_steps()):
            batch = next(batches)
            shard = shard_batch(batch.input_ids, cu_seqlens=batch.cu_seqlens, cp_size=self.state.size("cp"),
                                cp_rank=self.state.rank_in("cp"), load_balance=self.cp.load_balance)
            local = -(-batch.input_ids.numel() // self.state.size("cp"))
            self.plan_memory(local)  # the same on every CP rank
            self.model.step_tokens(local)
            self._warm_plans(local)
            loss = self.engine(shard) if self.zero3 else self.loss(self.module, shard, settings=self.cp)
            # ZeRO 3's reduce-scatter averages the gradients over DP x CP; the CP ranks' shares must
            # be summed (averaged over DP only), hence the factor CP
            self.engine.backward(loss * self.state.size("cp") if self.zero3 else loss)
            self.engine.step()
            losses.append(loss.detach())
            tokens += batch.input_ids.numel()
        # one reduction and one host read per step, after the last micro-batch is queued (a read
        # per micro-batch would stall the host between them)
        mean = logged_loss(torch.stack(losses).mean(), cp_group=self.cp_group, dp_group=self.dp_group)
        sync()
        self.steps_done += 1
        return StepResult(loss=mean, tokens=tokens * self.state.size("dp"),
                          seconds=time.perf_counter() - start, lr=lr, data=batch.end)

    def evaluate(self, sequences: Sequence[PackedSequence]) -> tuple[float, int]:
        """The exact mean token loss (natural log) of an evaluation set, without gradients.

        ``sequences`` are this DP replica's part of the set (every CP rank of the replica passes
        the same ones; every replica as many, which ZeRO 3's parameter gathers need). Returns
        ``(loss, tokens)``: the sum of every predicted token's cross-entropy over all replicas
        divided by their number ``tokens``, the same at every CP size. Collective.
        """
        sums = torch.zeros(2, dtype=torch.float64, device=self.state.device)  # [loss sum, tokens]
        first_cp_rank = self.state.rank_in("cp") == 0  # every CP rank sees the whole batch's count
        with torch.no_grad():
            for seq in sequences:
                shard = shard_batch(seq.input_ids, cu_seqlens=seq.cu_seqlens, cp_size=self.state.size("cp"),
                                    cp_rank=self.state.rank_in("cp"), load_balance=self.cp.load_balance)
                self.model.step_tokens(-(-seq.input_ids.numel() // self.state.size("cp")))
                loss = self.engine(shard) if self.zero3 else self.loss(self.module, shard, settings=self.cp)
                sums[0] += loss.double() * shard.num_valid_tokens
                sums[1] += shard.num_valid_tokens if first_cp_rank else 0
        dist.all_reduce(sums, group=self.state.group("dp_cp"))
        return float(sums[0] / sums[1].clamp(min=1)), int(sums[1])
