"""megacp's sections of a DeepSpeed config file, validated strictly.

megacp reads its own top-level sections from the JSON/hjson file a user already passes to
DeepSpeed as ``--deepspeed_config``; every other top-level key belongs to DeepSpeed, is ignored
here and stays available, untouched, as :attr:`MegacpConfig.deepspeed`::

    "context_parallel":        {"size": 2, "prefill": "auto", "decode": "allgather", "load_balance": true},
    "tensor_model_parallel":   {"size": 1},
    "pipeline_model_parallel": {"size": 1},
    "expert_model_parallel":   {"size": null, "include_cp": false},
    "external_data_parallel":  {"size": 1},
    "runtime":                 {"attention_backend": "auto", "ring_transport": "auto", "peer_window_mb": 1024,
                                "calibration_cache_dir": null, "timeout_minutes": 5}

The tensor/pipeline/expert sections carry Megatron's names because DeepSpeed 0.19 already owns
``tensor_parallel`` (its AutoTP section, which rejects unknown keys such as ``size``, so such a
file would fail in ``deepspeed.initialize``) and ``expert_parallel`` (AutoEP). Those two, and
``pipeline_parallel``, are checked for misplaced megacp keys so that a size written there is an
error instead of being silently ignored.

The data-parallel size is not configured: it is what the world size leaves
(:meth:`megacp.parallel.ParallelLayout.from_config`). Sizes of a dimension that no megacp code
uses are refused rather than ignored: no megacp model has pipeline stages
(``pipeline_model_parallel.size`` must be 1). ``expert_model_parallel.size`` > 1 shards the experts
of a mixture-of-experts model over ``ParallelState.group("ep")`` (``include_cp`` decides which ranks
it holds; the size must equal that group's); null keeps every expert on every rank, and a dense
model refuses a size > 1 when it is built (:func:`megacp.models.build.check_ep_size`).

The ``runtime`` section holds the knobs of the running job; :func:`with_env_overrides` applies the
environment variables ``MEGACP_ATTN_BACKEND``, ``MEGACP_RING_TRANSPORT``, ``MEGACP_PEER_WINDOW_MB``
and ``MEGACP_CACHE_DIR`` on top of it (:func:`megacp.initialize` does, once).

DeepSpeed's own sections are read in one place each, into typed views (vLLM's ``VllmConfig``):
precision, ZeRO placement and monitors into :attr:`MegacpConfig.deepspeed_sections` by every
:func:`load_config` (``bf16.enabled`` / ``fp16.enabled`` give the model dtype,
:attr:`MegacpConfig.dtype_name`); what ``megacp.train`` trains with — those, the memory options
(``activation_checkpointing``, ``sequence_tiling``), the optimizer and gradient clipping — into
:attr:`MegacpConfig.training` by ``load_config(..., training=True)``, which checks every rule
across sections there, once (:meth:`TrainingConfig.read`). Only DeepSpeed reads the raw dict.

A top-level key that is a megacp section misspelled (another case, or at most two edits away) is
an error naming the section.

Every problem raises :class:`ConfigError` with a one-line message that starts with the dotted key
(e.g. ``context_parallel.prefill``) and names the allowed values.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import annotated_types
import hjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import core_schema

from megacp.attention.kernels import registry


class ConfigError(ValueError):
    """An invalid megacp configuration. The message is one line naming the offending key."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


@dataclasses.dataclass(frozen=True)
class _OneOf:
    """Field metadata: a string that must be one of ``values``, for choices another module lists
    (the attention backends of :mod:`megacp.attention.kernels.registry`); validated and described
    as a ``Literal`` of them."""

    values: tuple[str, ...]

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.literal_schema(list(self.values))


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, values are never coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ContextParallelConfig(_Section):
    """``context_parallel``: the CP ring and its algorithms.

    Attributes:
        size: CP ranks that shard one sequence.
        prefill: ``"pass_kv"``, ``"pass_q"`` or ``"auto"`` (chosen per request from T, P and the
            measured compute/bandwidth, paper Algorithm 1).
        decode: the decode algorithm of every cached step (:class:`megacp.layers.step.CPStep`);
            ``"allgather"`` (replicated query, all-gather of the partial outputs) is the one megacp has.
        load_balance: causal load-balanced sharding (rank r holds chunks r and 2N-1-r). Read by
            :mod:`megacp.generate` (KV cache and step plans); the functional entry points
            (``cp_attention``, ``ShardPlan``, ``ShardedKVCache``) take it as an argument.
    """

    size: int = Field(1, ge=1)
    prefill: Literal["auto", "pass_kv", "pass_q"] = "auto"
    decode: Literal["allgather"] = "allgather"
    load_balance: bool = True


class TensorModelParallelConfig(_Section):
    """``tensor_model_parallel``: ``size`` ranks share every layer's weights (megacp's TP)."""

    size: int = Field(1, ge=1)


class PipelineModelParallelConfig(_Section):
    """``pipeline_model_parallel``: ``size`` pipeline stages (only 1: no megacp model has stages)."""

    size: int = Field(1, ge=1)


class ExternalDataParallelConfig(_Section):
    """``external_data_parallel``: ``size`` independent replicas of the whole job (the outermost
    mesh axis ``ext_dp``; no group spans two replicas)."""

    size: int = Field(1, ge=1)


class RuntimeConfig(_Section):
    """``runtime``: how the job runs (no effect on results).

    Attributes:
        attention_backend: partial-attention kernels: ``"auto"`` or a backend of
            :mod:`megacp.attention.kernels.registry` (:mod:`megacp.attention.kernels.partial`).
        ring_transport: how ring blocks travel (:mod:`megacp.parallel.ring`).
        peer_window_mb: MiB of each of the two slots of a CP group's copy-engine window; larger
            blocks rotate over NCCL.
        calibration_cache_dir: directory of ``calibration.json`` (``None``: ``~/.cache/megacp``).
        timeout_minutes: timeout of every process-group collective: a rank that stops answering
            ends the job with an error after this long instead of hanging.
    """

    attention_backend: Annotated[str, _OneOf(registry.choices())] = "auto"
    ring_transport: Literal["auto", "nccl", "copy_engine"] = "auto"
    peer_window_mb: int = Field(1024, ge=1)
    calibration_cache_dir: Union[str, None] = None
    timeout_minutes: float = Field(5.0, gt=0, allow_inf_nan=False)


class SequenceTilingConfig(_Section):
    """``sequence_tiling``: training computations that run over tiles of the sequence.

    Attributes:
        mlp: tokens per tile of each dense layer's RMSNorm + SwiGLU MLP
            (:mod:`megacp.models.tiling`); ``0`` untiled, ``"auto"`` tiled only when the memory plan
            needs it (:mod:`megacp.train.memory`).
        attention: local query rows per tile of each dense layer trained over query tiles
            (:mod:`megacp.models.tiled_layer`: the attention sublayer per tile, K/V projected once,
            only the layer input kept); ``0`` untiled, ``"auto"`` tiled only when the plan needs it.
    """

    mlp: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"
    attention: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"


class ExpertModelParallelConfig(_Section):
    """``expert_model_parallel``: the expert-parallel group.

    Attributes:
        size: the EP group size, checked against the mesh by
            :meth:`megacp.parallel.ParallelLayout.from_config`; > 1 shards the experts of an MoE
            model over the group (``None``: every rank holds every expert).
        include_cp: the EP group spans ``dp x cp x tp`` ranks instead of ``dp x tp``.
    """

    size: Union[int, None] = Field(None, ge=1)
    include_cp: bool = False


SECTIONS: dict[str, type[_Section]] = {
    "context_parallel": ContextParallelConfig,
    "tensor_model_parallel": TensorModelParallelConfig,
    "pipeline_model_parallel": PipelineModelParallelConfig,
    "expert_model_parallel": ExpertModelParallelConfig,
    "external_data_parallel": ExternalDataParallelConfig,
    "runtime": RuntimeConfig,
    "sequence_tiling": SequenceTilingConfig,
}
"""megacp's top-level keys and their models."""

ENV_OVERRIDES: dict[str, str] = {
    "MEGACP_ATTN_BACKEND": "attention_backend",
    "MEGACP_RING_TRANSPORT": "ring_transport",
    "MEGACP_PEER_WINDOW_MB": "peer_window_mb",
    "MEGACP_CACHE_DIR": "calibration_cache_dir",
}
"""Environment variable -> the ``runtime`` key it overrides."""

_UNUSED_SIZES: dict[str, str] = {
    "pipeline_model_parallel": "no megacp model has pipeline stages",
}
"""Sections whose ``size`` must be 1 (or null), and why."""

_MISPLACED: dict[tuple[str, str | None], str] = {
    ("tensor_parallel", "size"): "tensor_model_parallel.size",
    ("expert_parallel", "size"): "expert_model_parallel.size",
    ("expert_parallel", "include_cp"): "expert_model_parallel.include_cp",
    ("pipeline_parallel", None): "pipeline_model_parallel",
}
"""(top-level key, inner key or None for the whole section) -> where megacp reads it."""


@dataclasses.dataclass(frozen=True)
class DeepSpeedSections:
    """The parts of DeepSpeed's own sections megacp reads, read and checked once (:meth:`read`):
    everything in megacp that depends on precision or ZeRO placement takes them from here.

    Attributes:
        dtype_name: ``"bfloat16"`` when ``bf16.enabled`` (DeepSpeed's alias section ``bfloat16``
            too), ``"float16"`` when ``fp16.enabled``, ``None`` when neither.
        bf16_optimizer_states: ``bf16.bf16_master_weights_and_grads`` and ``bf16_optimizer_states``
            both set (master weights, gradients and Adam moments in bf16).
        zero_stage: ``zero_optimization.stage`` (0 when absent; any integer here, the trainer
            checks the stages it supports).
        offload_optimizer / offload_param: ``zero_optimization.offload_*.device`` is ``"cpu"``.
        reduce_scatter: ``zero_optimization.reduce_scatter`` (DeepSpeed's default true).
        monitors: the monitor sections enabled (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``).
    """

    dtype_name: str | None = None
    bf16_optimizer_states: bool = False
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_scatter: bool = True
    monitors: tuple[str, ...] = ()

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> DeepSpeedSections:
        """Read ``raw`` (the whole DeepSpeed config).

        Raises:
            ConfigError: a section that is not an object, a flag that is not a boolean, a stage that
                is not an integer, or both bf16 and fp16 enabled (one line naming the key).
        """
        def section(*names: str) -> Mapping[str, Any]:
            for name in names:
                value = raw.get(name)
                if value is None:
                    continue
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{name}: expected an object, got {value!r}")
                return value
            return {}

        def flag(where: str, values: Mapping[str, Any], key: str, default: bool = False) -> bool:
            value = values.get(key, default)
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{key}: got {value!r}; allowed values: true, false")
            return value

        bf16, fp16 = section("bf16", "bfloat16"), section("fp16")
        enabled = [name for where, values, name in (("bf16", bf16, "bfloat16"), ("fp16", fp16, "float16"))
                   if flag(where, values, "enabled")]
        if len(enabled) > 1:
            raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
        zero = section("zero_optimization")
        stage = zero.get("stage", 0)
        if type(stage) is not int:
            raise ConfigError(f"zero_optimization.stage: got {stage!r}; allowed values: 0, 1, 2, 3")

        def on_cpu(key: str) -> bool:
            value = zero.get(key) or {}
            if not isinstance(value, Mapping):
                raise ConfigError(f"zero_optimization.{key}: expected an object, got {value!r}")
            return value.get("device", "none") == "cpu"

        monitors = tuple(name for name in ("tensorboard", "csv_monitor", "wandb", "comet")
                         if flag(name, section(name), "enabled"))
        return cls(monitors=monitors, dtype_name=enabled[0] if enabled else None,
                   bf16_optimizer_states=bool(bf16.get("bf16_master_weights_and_grads"))
                   and bool(bf16.get("bf16_optimizer_states")),
                   zero_stage=stage, offload_optimizer=on_cpu("offload_optimizer"), offload_param=on_cpu("offload_param"),
                   reduce_scatter=flag("zero_optimization", zero, "reduce_scatter", True))


Offload = Literal["none", "cpu", "auto"]
"""Where checkpointed layer inputs wait: on the GPU, in pinned host memory, or as the plan decides."""

_DEEPSPEED_CHECKPOINTING_KEYS = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                                 "number_checkpoints", "synchronize_checkpoint_boundary", "profile")


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """What megacp reads for training memory from the DeepSpeed config.

    Attributes:
        activation_checkpointing: checkpoint every decoder layer.
        offload: where the checkpointed inputs wait (``"none"``: on the GPU).
        mlp_tile: tokens per MLP tile, ``0`` untiled, or ``"auto"``.
        attention_tile: local query rows per tile of a layer trained over query tiles, ``0``
            untiled, or ``"auto"``.
        layers_per_checkpoint: consecutive decoder layers checkpointed as one block (``1``: every
            layer; ``k > 1``: a second checkpoint level, one block input kept per ``k`` layers and each
            block's layers checkpointed again while its backward runs), or ``"auto"`` (the plan's
            choice among 1, 2, 4 and 8 per length).
    """

    activation_checkpointing: bool = False
    offload: Offload = "none"
    mlp_tile: int | Literal["auto"] = "auto"
    layers_per_checkpoint: int | Literal["auto"] = 1
    attention_tile: int | Literal["auto"] = "auto"


def read_memory_options(raw: Mapping[str, Any], *, activation_checkpointing: bool = False) -> MemoryOptions:
    """The memory options of a DeepSpeed config dict ``raw``: its ``activation_checkpointing`` and
    ``sequence_tiling`` sections (other keys are ignored); ``activation_checkpointing`` (the CLI
    flag) switches checkpointing on as ``"enabled": true`` does. A whole config's options are
    :attr:`TrainingConfig.memory` (:func:`load_config` with ``training=True``).

    Raises:
        ConfigError: an unknown or DeepSpeed-only key, a bad value, or offload without checkpointing.
    """
    tiling = _read_section("sequence_tiling", raw)
    assert isinstance(tiling, SequenceTilingConfig)
    return _memory_options(raw.get("activation_checkpointing", {}), tiling,
                           activation_checkpointing=activation_checkpointing)


def _memory_options(section: Any, tiling: SequenceTilingConfig, *, activation_checkpointing: bool) -> MemoryOptions:
    """:class:`MemoryOptions` of the ``activation_checkpointing`` section and the ``sequence_tiling`` one."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"activation_checkpointing: expected an object, got {section!r}")
    for key, value in section.items():
        if key in _DEEPSPEED_CHECKPOINTING_KEYS:
            if value in (False, None):
                continue
            hint = ' use "offload": "cpu"' if key == "cpu_checkpointing" else ""
            raise ConfigError(f"activation_checkpointing.{key}: configures deepspeed.checkpointing, which megacp's "
                              f"layers do not use (they checkpoint themselves);{hint or ' remove it'}")
        if key not in ("enabled", "offload", "layers_per_checkpoint"):
            raise ConfigError(f"activation_checkpointing.{key}: unknown key; allowed keys: enabled, offload, "
                              "layers_per_checkpoint")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"activation_checkpointing.enabled: got {enabled!r}; allowed values: true, false")
    offload = section.get("offload", "none")
    if offload not in ("none", "cpu", "auto"):
        raise ConfigError(f"activation_checkpointing.offload: got {offload!r}; allowed values: 'none', 'cpu', 'auto'")
    enabled = enabled or activation_checkpointing
    if offload != "none" and not enabled:
        raise ConfigError(f'activation_checkpointing.offload: "{offload}" needs checkpointing on ("enabled": true '
                          "or --activation-checkpointing)")
    per = section.get("layers_per_checkpoint", 1)
    if per != "auto" and (isinstance(per, bool) or not isinstance(per, int) or per < 1):
        raise ConfigError(f"activation_checkpointing.layers_per_checkpoint: got {per!r}; allowed values: an integer "
                          ">= 1 or 'auto'")
    if per != 1 and not enabled:
        raise ConfigError("activation_checkpointing.layers_per_checkpoint: needs activation checkpointing "
                          '("enabled": true or --activation-checkpointing)')
    return MemoryOptions(activation_checkpointing=enabled, offload=offload, mlp_tile=tiling.mlp,
                         layers_per_checkpoint=per, attention_tile=tiling.attention)


ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages megacp trains with."""

MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
"""DeepSpeed's monitor sections and the package each needs (``csv_monitor`` needs none)."""


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """What ``megacp.train`` trains with, beside the mesh: DeepSpeed's own sections as one typed view,
    built and checked once (:meth:`read`, by :func:`load_config` with ``training=True``), with every
    rule that spans sections. DeepSpeed itself reads the raw dict (:attr:`MegacpConfig.deepspeed`).

    Attributes:
        sections: precision, ZeRO placement and monitors (:class:`DeepSpeedSections`).
        memory: activation checkpointing, offload and sequence tiling (:class:`MemoryOptions`).
        optimizer: ``optimizer.type``.
        gradient_clipping: ``gradient_clipping`` (0: none).
    """

    sections: DeepSpeedSections
    memory: MemoryOptions
    optimizer: str
    gradient_clipping: float = 0.0

    @property
    def zero_stage(self) -> int:
        """``zero_optimization.stage``."""
        return self.sections.zero_stage

    @property
    def dtype(self) -> Any:
        """The parameters' ``torch.dtype``: ``torch.bfloat16`` when ``bf16.enabled``, else fp32."""
        import torch

        return torch.bfloat16 if self.sections.dtype_name == "bfloat16" else torch.float32

    @classmethod
    def read(cls, config: MegacpConfig, *, activation_checkpointing: bool = False) -> TrainingConfig:
        """The training view of ``config`` (``activation_checkpointing``: the CLI flag, which switches
        checkpointing on as ``"enabled": true`` does).

        Raises:
            ConfigError: the first rule broken: fp16 (refused: use bf16), a ZeRO stage not in
                :data:`ZERO_STAGES`, ``offload_param`` below stage 3, a missing or unknown optimizer,
                an enabled monitor whose package (:data:`MONITOR_PACKAGES`) is missing, what ZeRO 3
                cannot train (:func:`_check_zero3`), a bad memory option, or gradient clipping
                with experts sharded over EP at ZeRO 0.
        """
        raw, sections = config.deepspeed, config.deepspeed_sections
        if sections.dtype_name == "float16":
            raise ConfigError("fp16.enabled: fp16 training (loss scaling) is not supported; "
                              'use "bf16": {"enabled": true} or fp32')
        stage = sections.zero_stage
        if stage not in ZERO_STAGES:
            raise ConfigError(f"zero_optimization.stage: got {stage!r}; allowed values: 0, 1, 2, 3")
        if stage < 3 and "offload_param" in _object(raw, "zero_optimization"):
            raise ConfigError(f"zero_optimization.offload_param: needs stage 3 (got stage {stage})")
        optimizer = _optimizer_type(raw)
        _check_monitors(sections)
        if stage == 3:
            _check_zero3(config)
        memory = _memory_options(raw.get("activation_checkpointing", {}), config.sequence_tiling,
                                 activation_checkpointing=activation_checkpointing)
        clipping = _gradient_clipping(raw)
        ep = config.expert_model_parallel.size or 1
        if ep > 1 and stage == 0 and clipping > 0:
            raise ConfigError(f"gradient_clipping with experts sharded over expert_model_parallel.size={ep} ranks "
                              "needs ZeRO 1 or 2 (ZeRO 0's clipping norm leaves out the other ranks' experts)")
        return cls(sections, memory, optimizer, clipping)


def _object(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """DeepSpeed's section ``key`` of ``raw`` (``{}`` when absent).

    Raises:
        ConfigError: it is not an object.
    """
    value = raw.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected an object, got {value!r}")
    return value


def _optimizer_type(raw: Mapping[str, Any]) -> str:
    """``optimizer.type``: one of DeepSpeed's optimizers or a ``torch.optim`` class name.

    Raises:
        ConfigError: missing or unknown, or ``optimizer.params`` not an object.
    """
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    optimizer = _object(raw, "optimizer")
    name = optimizer.get("type")
    if name is None:
        raise ConfigError('optimizer.type: missing; the DeepSpeed config must name the optimizer, e.g. '
                          '"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}')
    candidate = getattr(torch.optim, name, None) if isinstance(name, str) else None
    known = isinstance(name, str) and (name.lower() in DEEPSPEED_OPTIMIZERS or (
        isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer)))
    if not known:
        raise ConfigError(f"optimizer.type: got {name!r}; allowed values: one of DeepSpeed's "
                          f"({', '.join(DEEPSPEED_OPTIMIZERS)}) or a torch.optim class name")
    if not isinstance(optimizer.get("params", {}), Mapping):
        raise ConfigError(f"optimizer.params: expected an object, got {optimizer['params']!r}")
    return name


def _gradient_clipping(raw: Mapping[str, Any]) -> float:
    """``gradient_clipping`` (``0.0`` when absent or null).

    Raises:
        ConfigError: not a number.
    """
    value = raw.get("gradient_clipping") or 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"gradient_clipping: got {value!r}; allowed values: a number >= 0")
    return float(value)


def _check_monitors(sections: DeepSpeedSections) -> None:
    """Refuse an enabled DeepSpeed monitor whose package is missing (DeepSpeed would fail once the
    model is loaded)."""
    for section, package in MONITOR_PACKAGES.items():
        if section in sections.monitors and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{section}.enabled: the {package} package is not installed: pip install {package}, "
                              f"or disable the {section} monitor")


def _check_zero3(config: MegacpConfig) -> None:
    """Refuse what ZeRO 3 under megacp cannot train: ``reduce_scatter: false`` with CP (the
    trainer's loss factor relies on the reduce-scatter's average), tensor parallelism (DeepSpeed's
    stage 3 would partition the TP shards over DP x CP without TP-aware gathering in megacp's
    layers) and expert parallelism (DeepSpeed's MoE gradient path is a ZeRO 1/2 path)."""
    cp = config.context_parallel.size
    if cp != 1 and not config.deepspeed_sections.reduce_scatter:
        raise ConfigError(f"zero_optimization.reduce_scatter: false with stage 3 and context_parallel.size {cp} "
                          "is not supported; leave reduce_scatter at its default (true)")
    tp = config.tensor_model_parallel.size
    if tp != 1:
        raise ConfigError(f"zero_optimization.stage 3 with tensor_model_parallel.size {tp} is not supported; "
                          "use ZeRO 0-2 with TP, or TP 1 with ZeRO 3")
    ep = config.expert_model_parallel.size
    if ep not in (None, 1):
        raise ConfigError(f"zero_optimization.stage 3 with expert_model_parallel.size {ep} is not supported; "
                          "use ZeRO 0-2 with EP, or EP 1 with ZeRO 3")


class MegacpConfig(BaseModel):
    """megacp's view of one DeepSpeed config file. Build it with :func:`load_config`.

    Attributes:
        context_parallel / tensor_model_parallel / pipeline_model_parallel /
        expert_model_parallel / external_data_parallel / runtime / sequence_tiling: the validated sections
        (defaults when absent).
        deepspeed: the whole raw top-level dict, to hand to DeepSpeed unchanged (megacp reads
            DeepSpeed's sections through the two views below).
        deepspeed_sections: precision, ZeRO placement and monitors, read once
            (:class:`DeepSpeedSections`).
        training: what ``megacp.train`` trains with (:class:`TrainingConfig`), built and checked by
            :func:`load_config` with ``training=True``; ``None`` otherwise (generation and serving
            read no optimizer and take fp16).
        source: the file it was read from, ``None`` for a dict.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    context_parallel: ContextParallelConfig = ContextParallelConfig()
    tensor_model_parallel: TensorModelParallelConfig = TensorModelParallelConfig()
    pipeline_model_parallel: PipelineModelParallelConfig = PipelineModelParallelConfig()
    expert_model_parallel: ExpertModelParallelConfig = ExpertModelParallelConfig()
    external_data_parallel: ExternalDataParallelConfig = ExternalDataParallelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    sequence_tiling: SequenceTilingConfig = SequenceTilingConfig()
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    deepspeed_sections: DeepSpeedSections = DeepSpeedSections()
    training: Union[TrainingConfig, None] = None
    source: Union[str, None] = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str | None = None) -> MegacpConfig:
        """Validate megacp's sections of the top-level config dict ``raw``.

        Raises:
            ConfigError: a megacp key is unknown, misplaced, of the wrong type or out of range.
        """
        prefix = f"{source}: " if source else ""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{prefix}<top level>: expected a JSON object, got {type(raw).__name__}")
        for (section, key), target in _MISPLACED.items():
            value = raw.get(section)
            if key is None and section in raw:
                raise ConfigError(f"{prefix}{section}: megacp reads this section as {target}")
            if key is not None and isinstance(value, Mapping) and key in value:
                raise ConfigError(
                    f"{prefix}{section}.{key}: '{section}' is DeepSpeed's own section; "
                    f"megacp reads this setting as {target}"
                )
        for key in raw:
            near = _near_section(str(key))
            if near is not None:
                raise ConfigError(f"{prefix}{key}: unknown top-level key; did you mean {near}?")
            alias = _cp_size_alias(str(key))
            if alias is not None:
                raise ConfigError(f"{prefix}{key}: {alias}")
        sections = {name: raw[name] for name in SECTIONS if name in raw}
        try:
            config = cls(**sections, deepspeed=dict(raw), source=source)
        except ValidationError as err:
            raise ConfigError(prefix + _describe(err)) from None
        for name, reason in _UNUSED_SIZES.items():
            size = getattr(config, name).size
            if size is not None and size > 1:
                raise ConfigError(f"{prefix}{name}.size: got {size}; {reason}; allowed values: 1")
        try:  # DeepSpeed's precision and ZeRO sections: read here, once
            deepspeed_sections = DeepSpeedSections.read(raw)
        except ConfigError as err:
            raise ConfigError(prefix + str(err)) from None
        return config.model_copy(update={"deepspeed_sections": deepspeed_sections})

    def for_training(self, *, activation_checkpointing: bool = False) -> MegacpConfig:
        """This config with its :attr:`training` view (``activation_checkpointing``: the CLI flag);
        itself when it has one.

        Raises:
            ConfigError: a training rule is broken (:meth:`TrainingConfig.read`).
        """
        if self.training is not None:
            return self
        training = TrainingConfig.read(self, activation_checkpointing=activation_checkpointing)
        return self.model_copy(update={"training": training})

    @property
    def dtype_name(self) -> str | None:
        """The model dtype DeepSpeed's own sections ask for (:attr:`DeepSpeedSections.dtype_name`)."""
        return self.deepspeed_sections.dtype_name


def with_env_overrides(config: MegacpConfig, environ: Mapping[str, str]) -> MegacpConfig:
    """``config`` with the ``runtime`` keys that the :data:`ENV_OVERRIDES` variables set in
    ``environ`` override (an empty value counts as unset), validated.

    Raises:
        ConfigError: a variable's value is not allowed for its key (the message names the variable).
    """
    updates: dict[str, Any] = {}
    for var, key in ENV_OVERRIDES.items():
        text = environ.get(var, "")
        if not text:
            continue
        if key == "peer_window_mb":
            if not text.strip().isdigit():
                raise ConfigError(f"{var}={text!r}: allowed values: {_allowed(RuntimeConfig, key)}")
            updates[key] = int(text)
        else:
            updates[key] = text
    if not updates:
        return config
    merged = {**config.runtime.model_dump(), **updates}
    try:
        runtime = RuntimeConfig(**merged)
    except ValidationError as err:
        key = str(err.errors()[0]["loc"][0])
        var = next(v for v, k in ENV_OVERRIDES.items() if k == key)
        raise ConfigError(f"{var}={environ[var]!r}: allowed values: {_allowed(RuntimeConfig, key)}") from None
    return config.model_copy(update={"runtime": runtime})


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | MegacpConfig, *, training: bool = False,
                activation_checkpointing: bool = False) -> MegacpConfig:
    """Read megacp's sections from a DeepSpeed config file (hjson; plain JSON parses too) or dict,
    and DeepSpeed's precision and ZeRO sections (:class:`DeepSpeedSections`); with ``training``,
    also the typed training view (:attr:`MegacpConfig.training`, every training rule checked;
    ``activation_checkpointing``: the CLI flag that switches checkpointing on).

    A :class:`MegacpConfig` is returned as is (given its training view when asked and missing).

    Raises:
        ConfigError: the file is missing or unparseable, a megacp section is invalid, or (with
            ``training``) a training rule is broken.
    """
    if isinstance(source, MegacpConfig):
        config = source
    elif isinstance(source, Mapping):
        config = MegacpConfig.from_dict(source)
    else:
        raw, path = _read_file(source)
        config = MegacpConfig.from_dict(raw, source=path)
    return config.for_training(activation_checkpointing=activation_checkpointing) if training else config


def _read_file(source: Any) -> tuple[Any, str]:
    """The parsed top level of the config file ``source``, and its path.

    Raises:
        ConfigError: not a path, missing, unreadable, empty or unparseable.
    """
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config: expected a path, a dict or a MegacpConfig, got {type(source).__name__}")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file ({err})") from None
    if not text.strip():
        raise ConfigError(f"{path}: the config file is empty")
    try:
        raw = hjson.loads(text, object_pairs_hook=_unique_keys)
    except OverflowError as err:  # hjson converts e.g. 1e400 to an int
        raise ConfigError(f"{path}: a number is out of range ({err})") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON/hjson: {str(err).splitlines()[0]}") from None
    return raw, str(path)


def _cp_size_alias(key: str) -> str | None:
    """Why a top-level ``key`` that reads as a CP size (or DeepSpeed's Ulysses size, or a nested megacp
    section) is refused, else ``None``: the CP size is read from ``context_parallel.size`` only, so a
    size under another name would otherwise leave CP at 1 without a word."""
    flat = re.sub(r"[^a-z]", "", key.lower())
    if key in SECTIONS:
        return None
    if flat == "sequenceparallelsize":
        return ("DeepSpeed's Ulysses sequence-parallel size; megacp splits sequences by context parallelism "
                'instead: set {"context_parallel": {"size": N}} and remove this key')
    if flat == "megacp":
        return "megacp's sections sit at the top level of the DeepSpeed config (context_parallel, runtime, ...)"
    if flat in ("cp", "cpsize", "cpdegree") or ("context" in flat and "parallel" in flat):
        return 'megacp reads the CP size only as {"context_parallel": {"size": N}}'
    return None


def _near_section(key: str) -> str | None:
    """The megacp section ``key`` misspells (same letters in another case, or at most two edits
    away), else ``None`` (``key`` itself a section, or unrelated)."""
    if key in SECTIONS:
        return None
    lowered = key.lower()
    for name in SECTIONS:
        if lowered == name or _edit_distance(lowered, name) <= 2:
            return name
    return None


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions) between ``a`` and ``b``."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """hjson object hook: build a dict, rejecting a key written twice in one object."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _read_section(name: str, raw: Mapping[str, Any]) -> _Section:
    """megacp's section ``name`` of the config dict ``raw`` on its own, validated (defaults when absent).

    Raises:
        ConfigError: as :meth:`MegacpConfig.from_dict` for that section.
    """
    try:
        return SECTIONS[name].model_validate(raw.get(name, {}))
    except ValidationError as err:
        raise ConfigError(_describe(err, (name,))) from None


def _describe(err: ValidationError, within: tuple[str, ...] = ()) -> str:
    """One line for the first error of ``err`` (of the section ``within`` names, or of a whole
    :class:`MegacpConfig`): the dotted key, the problem, the allowed values."""
    first = err.errors()[0]
    loc = [*within, *(str(part) for part in first["loc"])]
    path = ".".join(loc)
    model, field = _resolve(loc)
    got = first.get("input")
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(model.model_fields) if model is not None else ""
        return f"{path}: unknown key; allowed keys: {allowed}"
    if model is None or field is None:
        return f"{path}: {first['msg']}"
    annotation = model.model_fields[field].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        keys = ", ".join(annotation.model_fields)
        return f"{path}: expected an object with keys {keys}, got {got!r}"
    path = ".".join(loc[:loc.index(field) + 1])  # not the union member pydantic appends
    return f"{path}: got {got!r}; allowed values: {_allowed(model, field)}"


def _resolve(loc: list[str]) -> tuple[type[BaseModel] | None, str | None]:
    """The model class and field name that the error location ``loc`` points at."""
    model: type[BaseModel] = MegacpConfig
    for depth, part in enumerate(loc):
        if part not in model.model_fields:
            return (model, None)
        if depth == len(loc) - 1:
            return (model, part)
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return (model, part)
        model = annotation
    return (None, None)


def _allowed(model: type[BaseModel], field: str) -> str:
    """Human description of the values ``model.field`` accepts, e.g. ``'auto', 'pass_kv'``."""
    info = model.model_fields[field]
    members, nullable = [info.annotation], False
    if typing.get_origin(info.annotation) in (Union, types.UnionType):
        members = [arg for arg in typing.get_args(info.annotation) if arg is not type(None)]
        nullable = len(members) < len(typing.get_args(info.annotation))
    text = (_describe_type(members[0], info.metadata) if len(members) == 1
            else " or ".join(_describe_type(m) for m in members))  # e.g. 'auto' or an integer >= 0
    return text + (" or null" if nullable else "")


def _describe_type(annotation: Any, metadata: list[Any] | None = None) -> str:
    """Human description of one type's values (``Annotated`` bounds included)."""
    if typing.get_origin(annotation) is Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata = [m for e in extra for m in getattr(e, "metadata", [e])]
    metadata = metadata or []
    choices = [meta.values for meta in metadata if isinstance(meta, _OneOf)]
    if choices:
        text = ", ".join(repr(value) for value in choices[0])
    elif typing.get_origin(annotation) is Literal:
        text = ", ".join(repr(value) for value in typing.get_args(annotation))
    elif annotation is bool:
        text = "true, false"
    elif annotation is int:
        bounds = [f">= {meta.ge}" for meta in metadata if isinstance(meta, annotated_types.Ge)]
        text = "an integer " + " ".join(bounds) if bounds else "an integer"
    elif annotation is float:
        bounds = [f"> {meta.gt}" for meta in metadata if isinstance(meta, annotated_types.Gt)]
        text = "a finite number " + " ".join(bounds) if bounds else "a finite number"
    else:
        text = getattr(annotation, "__name__", str(annotation))
    return text
