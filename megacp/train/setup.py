"""Setting a training run up around its :class:`~megacp.train.engine.Trainer`: DeepSpeed prepared
for the device (:func:`deepspeed_for`), its batch arithmetic checked on the mesh before any weight
loads (:func:`check_batch_config`), the memory plan from the model's shape alone
(:func:`plan_from_config`, ``--seq-len auto``), and the model built partitioned under ZeRO 3
(:func:`build_for_training`). The training config's own rules are checked when it is read
(:meth:`megacp.config.TrainingConfig.read`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megacp.config import ConfigError, MegacpConfig, TrainingConfig, load_config
from megacp.families import PlanShape
from megacp.parallel.mpu import DeepSpeedMPU
from megacp.parallel.state import ParallelState
from megacp.train.memory import (
    MemoryPlan,
    ZeroSettings,
    count_parameters,
    gpu_capacity,
    host_available,
    longest_fitting,
    plan_memory,
)


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


def training_view(config: MegacpConfig) -> TrainingConfig:
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
    """``build(device)`` for a :class:`~megacp.train.engine.Trainer` of ``config`` (its training view:
    :func:`~megacp.config.load_config` with ``training=True``). Under ZeRO 3 it runs inside
    ``deepspeed.zero.Init`` over the DP x CP group: each module's parameters are created on the GPU
    and partitioned (and moved to the host with ``offload_param``) as soon as the module is built,
    and random init fills each rank's partition (:meth:`~megacp.models.llama.CausalLM.reset_parameters`),
    so no full copy of the model is ever made or initialised on the CPU. Otherwise it builds on
    ``state.device``."""
    config = load_config(config, training=True)
    training = training_view(config)
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
