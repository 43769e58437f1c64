"""A model of any family inside a DeepSpeed engine: the engine built with megacp's mpu from the
typed training config (:class:`~megacp.config.TrainingConfig`; DeepSpeed alone reads the raw dict),
one optimizer step over CP-sharded micro-batches, and saving.

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

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megacp.attention.kernels.warmup import warm_kernel_plans
from megacp.checkpoint.staging import exchange_directories
from megacp.config import ConfigError, MegacpConfig, TrainingConfig, load_config
from megacp.families import PlanShape, Trainable, trainable
from megacp.layers.settings import CPSettings
from megacp.parallel.mpu import DeepSpeedMPU
from megacp.parallel.state import ParallelState
from megacp.placement.batch import shard_batch
from megacp.train.data import PackedSequence, StreamPosition
from megacp.train.loss import logged_loss
from megacp.train.memory import (
    MemoryPlan,
    ZeroSettings,
    count_parameters,
    gpu_capacity,
    host_available,
    longest_fitting,
    plan_memory,
)
from megacp.train.resume import ResumePoint, load_rng_file, prune, rng_file, rng_state, set_rng_state

if TYPE_CHECKING:
    from megacp.checkpoint.shard_manifest import FileDigest, Manifest

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


def deepspeed_for(state: ParallelState) -> Any:
    """The ``deepspeed`` module, prepared for ``state``'s device.

    On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op
    (``deepspeed_shm_comm``: about a minute and a C++ compiler on a machine's first run) when it
    wraps the process group; only its inference all-reduce uses that op (training collectives go
    through ``torch.distributed``), so it is marked unavailable for training.
    """
    import deepspeed

    if state.device.type == "cpu":
        import deepspeed.ops
        from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return deepspeed


def memory_inputs(shape: PlanShape, params: int, training: TrainingConfig, state: ParallelState, *,
                  host: int | None = None) -> dict[str, Any]:
    """What :func:`~megacp.train.memory.plan_memory` and :func:`~megacp.train.memory.longest_fitting`
    take besides the model config and the tokens, for a model of ``shape`` with ``params`` parameters
    on this rank of ``state``: the memory options, where ZeRO keeps the states, the GPU's capacity and
    the host memory the run's states and offloaded activations may use (``host``, else what is free
    now; on a GPU only)."""
    device = state.device
    return dict(params=params, options=training.memory,
                zero=ZeroSettings.of(training.sections, partition=state.size("dp_cp"), dtype=training.dtype),
                capacity=gpu_capacity(device),
                host=None if device.type != "cuda" else host_available() if host is None else host,
                tp=state.size("tp"), cp=state.size("cp"), dense_mlp=shape.dense_mlp, norm_apart=shape.norm_apart,
                tiled_attention=shape.tiled_attention)


def _host_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters (ZeRO 3: this rank's partitions) held in host memory."""
    tensors = (getattr(p, "ds_tensor", p) for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def longest_for(shape: PlanShape, inputs: Mapping[str, Any], state: ParallelState, *, micro_batch: int,
                limit: int | None = None) -> int:
    """``--seq-len auto``: the longest packed-sequence length (a multiple of ``2 x CP``, at most
    ``limit``) whose step of ``micro_batch`` sequences fits this GPU by the memory plan; 0 when none does.

    Raises:
        ConfigError: not on a GPU (there is no capacity to plan against).
    """
    if state.device.type != "cuda":
        raise ConfigError("the longest sequence is planned for megacp's own models on a GPU")
    return longest_fitting(shape.config, multiple=2 * state.size("cp"), batch=micro_batch, limit=limit, **inputs)


def plan_from_config(shape: PlanShape, training: TrainingConfig, state: ParallelState, *, seq_len: int | str,
                     micro_batch: int) -> tuple[int, MemoryPlan]:
    """The memory plan of a run from the model's shape alone (:meth:`~megacp.families.ModelFamily.plan_shape`),
    before any weight is built or read: a Llama skeleton of its sizes is built on ``meta`` (shapes
    only) for the parameter count. ``seq_len="auto"`` becomes the longest that fits (:func:`longest_for`).

    Returns:
        ``(seq_len, plan)``.

    Raises:
        MemoryPlanError: the step does not fit (one line naming what would); ConfigError: ``auto``
        off a GPU.
    """
    from megacp.models import build_model

    cfg = shape.config
    skeleton = build_model(cfg, dtype=training.dtype, device="meta", backend="torch",
                           tp_group=state.group("tp") if state.size("tp") > 1 else None)
    inputs = memory_inputs(shape, count_parameters(skeleton), training, state)
    if seq_len == "auto":
        seq_len = longest_for(shape, inputs, state, micro_batch=micro_batch, limit=cfg.max_position_embeddings)
        if seq_len == 0:
            seq_len = 2 * state.size("cp")  # not even the shortest step fits: the plan below says why
    assert isinstance(seq_len, int)
    tokens = -(-seq_len * micro_batch // state.size("cp"))
    return seq_len, plan_memory(cfg, tokens=tokens, **inputs)


def build_for_training(build: Callable[[torch.device], torch.nn.Module], config: MegacpConfig | Mapping[str, Any],
                       state: ParallelState) -> torch.nn.Module:
    """``build(device)`` for a :class:`Trainer` of ``config`` (its training view:
    :func:`~megacp.config.load_config` with ``training=True``). Under ZeRO 3 it runs inside
    ``deepspeed.zero.Init`` over the DP x CP group: each module's parameters are created on the GPU
    and partitioned (and moved to the host with ``offload_param``) as soon as the module is built,
    and random init fills each rank's partition (:meth:`~megacp.models.llama.CausalLM.reset_parameters`),
    so no full copy of the model is ever made or initialised on the CPU. Otherwise it builds on
    ``state.device``."""
    config = load_config(config, training=True)
    training = _training(config)
    if training.zero_stage != 3:
        return build(state.device)
    deepspeed = deepspeed_for(state)
    # the parameters' dtype comes from the config's bf16/fp16 sections (DeepSpeed reads a ``dtype``
    # argument only where the accelerator supports fp16); F.linear stays torch's own
    with deepspeed.zero.Init(data_parallel_group=state.group("dp_cp"), config_dict_or_path=dict(config.deepspeed),
                             mpu=DeepSpeedMPU(state), mem_efficient_linear=False):
        model = build(state.device)
    if any(p.dtype != training.dtype for p in model.parameters()):
        raise ConfigError(f"DeepSpeed built the model's parameters in {next(model.parameters()).dtype}, "
                          f"not the configured {training.dtype}")
    return model


def _training(config: MegacpConfig) -> TrainingConfig:
    """``config``'s training view (:func:`~megacp.config.load_config` with ``training=True`` built it)."""
    assert config.training is not None, "load_config(..., training=True) builds the training view"
    return config.training


def check_batch_config(config: MegacpConfig, state: ParallelState) -> int:
    """Let DeepSpeed check the batch sizes of ``config`` against the mesh (``train_batch_size`` =
    micro-batch x accumulation x DP size) and parse the rest of its config, without building an
    engine. Needs the process group (:func:`megacp.initialize`). Returns the micro-batch size
    (packed sequences per micro-batch and DP replica).

    Raises:
        ConfigError: DeepSpeed rejects the config (its first message line).
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed_for(state).init_distributed(dist_backend=state.backend)
    try:
        return DeepSpeedConfig(dict(config.deepspeed), mpu=DeepSpeedMPU(state)).train_micro_batch_size_per_gpu
    except (AssertionError, ValueError, TypeError, KeyError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise ConfigError(f"DeepSpeed rejects the config: {lines[0] if lines else type(err).__name__}") from None


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


class Trainer:
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
        self.training = _training(self.config)
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
        attention runs the same kernels), so no later step stalls on building one."""
        shape = self.model.plan_shape
        if self.plans_warmed is not None or shape is None:
            return
        cfg, tp = shape.config, self.state.size("tp")
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

    def save(self, directory: str | Path, *, resume: ResumePoint | None = None, keep_last: int | None = None) -> str:
        """``engine.save_checkpoint(directory)`` (tag ``step<N>``, ZeRO shards included), plus, from
        global rank 0, the model description (what its family records,
        :meth:`~megacp.families.Trainable.record`) and tokenizer files that
        :func:`~megacp.checkpoint.deepspeed.read_deepspeed_checkpoint` needs. With ``resume``, the
        tag also gets what :meth:`load` restores (:mod:`megacp.train.resume`: the point and every
        rank's generator states); with ``keep_last``, only that many ``step<N>`` tags remain. The
        directory's ``zero_to_fp32.py`` is megacp's (:mod:`megacp.checkpoint.zero_to_fp32`: it
        writes a Hugging Face directory), not DeepSpeed's. The tag's manifest
        (:mod:`megacp.checkpoint.shard_manifest`: the run id, the mesh, every file's size and
        SHA-256, hashed by all ranks in parallel, and the checksum of the sidecar) is written into
        the staging directory last.
        Collective; returns the tag."""
        from megacp.checkpoint import zero_to_fp32
        from megacp.checkpoint.deepspeed import train_state, train_state_sha256, write_train_state
        from megacp.checkpoint.shard_manifest import Manifest, Mesh

        if self.sharded_experts:
            from megacp.train.experts import check_expert_saving

            check_expert_saving(self.state.size("ep"))
        tag = f"step{self.steps_done}"
        directory = Path(directory)
        staging = directory / f".{tag}.staging"
        if dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        # every file goes to a staging directory first: a save killed part-way leaves the previous
        # checkpoint (its tag directory and the 'latest' naming it) untouched
        try:
            self.engine.save_checkpoint(str(staging), tag=tag, save_latest=False)
            if resume is not None:
                torch.save(rng_state(), rng_file(staging / tag, dist.get_rank()))
                if dist.get_rank() == 0:
                    resume.write(staging / tag)
        except (OSError, RuntimeError) as err:  # a full disk, say: this rank's write failed
            from megacp.checkpoint.errors import CheckpointError

            shutil.rmtree(staging, ignore_errors=True)
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"saving {tag} into {directory} failed ({reason}); its staging directory is "
                                  "removed and the previous checkpoint is kept") from None
        dist.barrier()
        record = self.model.record()
        meta = train_state(model=record, dtype=self.training.dtype, tp_size=self.state.size("tp"),
                           zero_stage=self.training.zero_stage, tag=tag)
        files = self._digests(staging / tag, None)
        if dist.get_rank() == 0:
            mesh = Mesh(world_size=dist.get_world_size(), dp=self.state.size("dp"), cp=self.state.size("cp"),
                        tp=self.state.size("tp"), ep=self.state.size("ep"), zero_stage=self.training.zero_stage)
            Manifest(self.run_id, tag, mesh, train_state_sha256(meta), files).write(staging / tag)
            old = directory / f".{tag}.old"
            shutil.rmtree(old, ignore_errors=True)
            if not (directory / tag).exists():
                os.replace(staging / tag, directory / tag)
            elif not exchange_directories(staging / tag, directory / tag):  # re-saving a tag: swapped atomically
                os.replace(directory / tag, old)  # where the system cannot swap: a kill here leaves it in .old
                os.replace(staging / tag, directory / tag)
            write_train_state(directory, model=record, dtype=self.training.dtype,
                              tp_size=self.state.size("tp"), zero_stage=self.training.zero_stage, tag=tag,
                              tokenizer=self.model.tokenizer)  # the values ``meta`` holds
            shutil.copyfile(zero_to_fp32.__file__, directory / zero_to_fp32.SCRIPT_NAME)  # HF files, not DeepSpeed's
            latest = directory / ".latest.tmp"
            latest.write_text(tag, encoding="utf-8")
            os.replace(latest, directory / "latest")  # 'latest' moves last
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
            if keep_last is not None:
                prune(directory, keep_last, tag)
        dist.barrier()
        return tag

    def _digests(self, tag_dir: Path, names: list[str] | None) -> dict[str, FileDigest]:
        """The digests of ``names`` in ``tag_dir`` (``None``: every file there as global rank 0 lists
        it), each rank hashing its share. Collective."""
        from megacp.checkpoint.shard_manifest import digest_share, tag_files

        box = [names if names is not None else tag_files(tag_dir) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        shares: list[dict[str, FileDigest] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, digest_share(tag_dir, box[0] or [], dist.get_rank(), dist.get_world_size()))
        return {name: d for share in shares if share for name, d in share.items()}

    def _check_files(self, directory: Path, tag_dir: Path) -> Manifest | None:
        """Before resuming from ``tag_dir``: check it against its manifest, then that its ``.pt``
        files hold only data (DeepSpeed's loader unpickles them unguarded), each rank its share of
        the files; every rank raises the same error. Returns the manifest (``None`` for a tag
        without one). Collective."""
        from megacp.checkpoint.deepspeed import TRAIN_STATE_FILE, check_data_only, train_state_checksum
        from megacp.checkpoint.errors import CheckpointError
        from megacp.checkpoint.shard_manifest import Manifest, warn_unchecked

        manifest = Manifest.read(tag_dir)
        if manifest is None and dist.get_rank() == 0:
            warn_unchecked(tag_dir)
        if manifest is not None:
            manifest.check_layout(tag_dir, directory / TRAIN_STATE_FILE, train_state_checksum(directory))
            manifest.check_digests(tag_dir, self._digests(tag_dir, sorted(manifest.files)))
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            check_data_only(sorted(tag_dir.glob("*.pt"))[rank::world],
                            remedy="megacp.train resumes only from checkpoints of plain data")
            error = None
        except CheckpointError as err:
            error = str(err)
        errors: list[str | None] = [None] * world
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise CheckpointError(first)
        return manifest

    def load(self, directory: str | Path, tag: str) -> ResumePoint:
        """Restore checkpoint ``tag`` of ``directory`` (written by :meth:`save` with ``resume``):
        the model, optimizer and LR scheduler through ``engine.load_checkpoint``, this rank's
        generator states and the step count. Collective; returns the checkpoint's point (its
        ``data`` is where the next batch starts).

        Raises:
            CheckpointError: the tag lacks the resume files, its files do not match its manifest
                or are not plain data (checked by all ranks in parallel) or DeepSpeed finds no
                checkpoint.
        """
        from megacp.checkpoint.errors import CheckpointError

        tag_dir = Path(directory) / tag
        point = ResumePoint.read(tag_dir)
        manifest = self._check_files(Path(directory), tag_dir)
        if manifest is not None:
            self.run_id = manifest.run_id
        rng = load_rng_file(rng_file(tag_dir, dist.get_rank()))
        path, _ = self.engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint {tag} in {directory}")
        set_rng_state(rng)
        self.steps_done = point.step
        return point
