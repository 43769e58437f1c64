"""megacp's own models (:mod:`megacp.models`: Llama, Mistral, Qwen2 and their MoE kin) as a family:
a Hugging Face directory of an architecture they implement, a ``.gguf`` file or a megacp
checkpoint, loaded TP/EP-sharded with megacp's CP layers; CUDA-graph decode where the model is dense
without a sliding window; a memory plan from the config; trained with
:func:`~megacp.models.loss.lm_loss` and recorded in checkpoints by its :class:`ModelConfig`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megacp.checkpoint.deepspeed import MegacpRecord
from megacp.checkpoint.front import load_on_mesh, read_model_config
from megacp.config import MemoryOptions
from megacp.families.base import WINDOW_GRAPHS, Loaded, ModelFamily, PlanShape, Trainable, all_layers_dense
from megacp.layers.settings import CPSettings
from megacp.models.build import resolve_backend
from megacp.models.config import ModelConfig
from megacp.models.llama import CausalLM, DecoderLayer, LayerNormMLP
from megacp.models.loss import lm_loss
from megacp.parallel.state import ParallelState


class MegacpTrainable(Trainable):
    """A megacp :class:`~megacp.models.llama.CausalLM` as it trains: its own loss over the chunked LM
    head, checkpointing and MLP tiles set on the model, its :class:`ModelConfig` recorded."""

    module: CausalLM
    config: ModelConfig

    def _plan_shape(self) -> PlanShape:
        layers = self.module.layers
        dense = all(isinstance(getattr(layer, "layernorm_mlp", None), LayerNormMLP) for layer in layers)
        tiled = dense and all(isinstance(layer, DecoderLayer) for layer in layers)  # TE's layers are neither
        return PlanShape(self.config, dense_mlp=dense, tiled_attention=tiled)

    @property
    def head(self) -> nn.Parameter | None:
        weight = self.module.lm_head_weight
        return weight if isinstance(weight, nn.Parameter) else None

    def loss(self) -> Callable[..., torch.Tensor]:
        return lm_loss

    def install_memory(self, options: MemoryOptions, device: torch.device) -> None:
        if options.activation_checkpointing:
            self.module.activation_checkpointing = True

    def apply_plan(self, plan: Any) -> None:
        plan.apply(self.module)

    def _config_eos_ids(self) -> list[int]:
        return self.config.eos_token_ids

    def record(self) -> dict[str, Any]:
        return MegacpRecord.of(self.config).entry()


class MegacpFamily(ModelFamily):
    """megacp's own models (see the module)."""

    kind = "megacp"
    describe = "megacp's model"

    def limits(self) -> ModelConfig | None:
        return read_model_config(self.source)

    def load_for_generation(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                            allow_non_finite: bool = False) -> Loaded:
        loaded = load_on_mesh(self.source, state, dtype=dtype, settings=settings, allow_non_finite=allow_non_finite)
        return Loaded(loaded.model, loaded.config, loaded.tokenizer)

    def load_for_training(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                          backend: Any = "auto", allow_non_finite: bool = False) -> MegacpTrainable:
        loaded = load_on_mesh(self.source, state, dtype=dtype, settings=settings, backend=backend,
                              allow_non_finite=allow_non_finite)
        return MegacpTrainable(loaded.model.train(), loaded.config, loaded.tokenizer)

    def graph_decode_error(self, limits: Any) -> str | None:
        if isinstance(limits, ModelConfig) and limits.sliding_window is not None:
            return WINDOW_GRAPHS
        return super().graph_decode_error(limits)

    def plan_config(self) -> ModelConfig | None:
        config = self.limits()
        return config if isinstance(config, ModelConfig) else None

    def plan_shape(self, *, backend: Any, device: torch.device) -> PlanShape | None:
        cfg = self.plan_config()
        if cfg is None:
            return None
        dense = resolve_backend(cfg, device, backend) == "torch" and all_layers_dense(cfg)  # TE's layers: untiled
        return PlanShape(cfg, dense_mlp=dense, tiled_attention=dense)
