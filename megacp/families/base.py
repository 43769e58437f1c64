"""The interfaces of the model-family seam (:mod:`megacp.families`): what a family is
(:class:`ModelFamily`), a model it loaded for generation (:class:`Loaded`), a model as it trains and
saves it (:class:`Trainable`) and what the training memory plan reads of a model (:class:`PlanShape`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from megacp.config import MemoryOptions
from megacp.layers.settings import CPSettings
from megacp.models.config import ModelConfig
from megacp.parallel.state import ParallelState

MOE_GRAPHS = ("cuda_graphs=True does not support mixture-of-experts models (token routing needs host-side "
              "counts); pass cuda_graphs=False")
WINDOW_GRAPHS = ("cuda_graphs=True does not support sliding-window attention (the graph's decode step has no "
                 "window); pass cuda_graphs=False")


@dataclass
class Loaded:
    """A model on this rank, as a family loaded it for generation.

    Attributes:
        model: the module :class:`~megacp.generate.loop.Generator` calls.
        config: its sizes (:class:`~megacp.models.config.ModelConfig`; a transformers model's
            :class:`~megacp.integrations.hf_generate.HFModelInfo`).
        tokenizer: its tokenizer (``None`` when the checkpoint has none).
    """

    model: nn.Module
    config: Any
    tokenizer: Any


@dataclass(frozen=True)
class PlanShape:
    """What the training memory plan (:mod:`megacp.train.memory`) reads of a model besides its
    parameter count.

    Attributes:
        config: its sizes (megacp's own config; a transformers model's as
            :func:`~megacp.integrations.hf_memory.plan_config` reads them).
        dense_mlp: every decoder layer's MLP runs over sequence tiles (megacp's torch layers without
            experts, a transformers model without experts).
        norm_apart: the MLP's norm runs outside its tiles, so the plan counts its activations
            (:func:`~megacp.train.memory.working_bytes_per_token`).
        tiled_attention: every decoder layer can train over query tiles
            (:mod:`megacp.models.tiled_layer`), so ``sequence_tiling.attention`` may tile them.
    """

    config: ModelConfig
    dense_mlp: bool
    norm_apart: bool = False
    tiled_attention: bool = False


def all_layers_dense(cfg: ModelConfig) -> bool:
    """Whether every decoder layer of ``cfg`` has the dense MLP (no routed experts)."""
    return not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


class Trainable(ABC):
    """A model as its family trains and saves it: the one object :class:`~megacp.train.engine.Trainer`
    and ``megacp.train`` ask about the model (torchtitan's ``ModelSpec`` with its ``TrainSpec.loss_fn``).

    Attributes:
        module: the model (training mode, CP attention): what the DeepSpeed engine trains.
        config: its own config (megacp's :class:`~megacp.models.config.ModelConfig`, or transformers').
        tokenizer: its tokenizer (``None``: none came with it).
        plan_shape: what the memory plan reads of it (``None``: the plan has no sizes for it).
    """

    def __init__(self, module: nn.Module, config: Any, tokenizer: Any = None) -> None:
        self.module, self.config, self.tokenizer = module, config, tokenizer
        self.plan_shape = self._plan_shape()

    @abstractmethod
    def _plan_shape(self) -> PlanShape | None:
        """:attr:`plan_shape`, read once from the built model."""

    @property
    @abstractmethod
    def head(self) -> nn.Parameter | None:
        """The LM head matrix its loss reads outside the module that owns it (a ZeRO 3 engine keeps
        it gathered through the loss), ``None`` when there is none to keep."""

    @abstractmethod
    def loss(self) -> Callable[..., torch.Tensor]:
        """The training loss ``loss(module, shard, settings=cp)``: this CP rank's share of the
        shard's mean token loss (LM head over chunks of tokens: never ``S x vocab`` logits). Called
        once, after :meth:`install_memory`."""

    @abstractmethod
    def install_memory(self, options: MemoryOptions, device: torch.device) -> None:
        """Apply the memory options (activation checkpointing, offload, sequence tiling); ``"auto"``
        values wait for a plan (:meth:`apply_plan`).

        Raises:
            ConfigError: an option this model cannot take.
        """

    @abstractmethod
    def apply_plan(self, plan: Any) -> None:
        """Set the MLP tile, the checkpoint blocks and the offloaded blocks a memory plan
        (:class:`~megacp.train.memory.MemoryPlan`) chose."""

    def step_tokens(self, tokens: int) -> None:  # noqa: B027 - a hook, empty unless a family needs it
        """Told before each micro-batch: its local tokens on this rank (nothing to do by default)."""

    def eos_id(self) -> int | None:
        """The token that separates packed documents: the tokenizer's EOS, else the config's first
        stop token; ``None`` when neither names one."""
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        ids = self._config_eos_ids()
        return int(ids[0]) if ids else None

    @abstractmethod
    def _config_eos_ids(self) -> list[int]:
        """The stop tokens the model's config names."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """What a training checkpoint records of the model: one entry ``{key: values}`` of its sidecar
        (:mod:`megacp.checkpoint.deepspeed`; the converter reads the kinds of its ``RECORDS``)."""

    def save_model_files(self, directory: str, *, zero_stage: int) -> str:
        """After training, files loadable without megacp besides the DeepSpeed checkpoint; returns
        what the summary line says about them ("" when nothing more is written)."""
        return ""


class ModelFamily(ABC):
    """One kind of model behind megacp's entry points (see :mod:`megacp.families`).

    Attributes:
        kind: ``"megacp"`` or ``"transformers"``; describe: what loads, in a progress line.
        source: the path (or, for an object, its class name).
    """

    kind: ClassVar[str]
    describe: ClassVar[str]

    def __init__(self, source: str) -> None:
        self.source = source

    @abstractmethod
    def limits(self) -> Any:
        """The sizes the request checks read (context, vocabulary, attention shape, stop tokens),
        without reading weights; ``None`` when ``source`` holds no checkpoint (the load says why)."""

    @abstractmethod
    def load_for_generation(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                            allow_non_finite: bool = False) -> Loaded:
        """The model ready for :class:`~megacp.generate.loop.Generator` on this rank (eval mode, CP attention)."""

    @abstractmethod
    def load_for_training(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                          backend: Any = "auto", allow_non_finite: bool = False) -> Trainable:
        """The model ready for the :class:`~megacp.train.engine.Trainer` on this rank (train mode, CP attention)."""

    def native_dtype(self) -> torch.dtype | None:
        """The dtype the model already has when none is asked for (``None``: the run's default)."""
        return None

    def graph_decode_error(self, limits: Any) -> str | None:
        """Why CUDA-graph decode cannot run this model (``None``: it can), from :meth:`limits`."""
        if limits is not None and limits.num_experts:
            return MOE_GRAPHS
        return None

    def plan_config(self) -> ModelConfig | None:
        """The config the training memory plan reads before any weight is built (``None``: this
        family has no plan; ``--seq-len auto`` is refused for it)."""
        return None

    def plan_shape(self, *, backend: Any, device: torch.device) -> PlanShape | None:
        """What the training memory plan reads of the model before any weight is built or read, for
        the layers ``backend`` builds on ``device`` (``None``: no plan, :meth:`plan_config`)."""
        return None

    def saved_config(self) -> ModelConfig | None:
        """The config a training checkpoint of this model records as its ``model_config``, which
        ``--save`` compares with a directory's earlier run (``None``: none is recorded)."""
        return self.plan_config()

    def training_error(self, *, backend: str, allow_non_finite: bool) -> str | None:
        """Why ``megacp.train`` cannot train this model with these options (``None``: it can)."""
        return None
