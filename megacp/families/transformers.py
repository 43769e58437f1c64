"""Any transformers causal LM as a family: a Hugging Face directory (or, through
:class:`TransformersObject`, a model object) run by transformers' own modules with
``attn_implementation="megacp"`` under CP (TP and PP sizes 1:
:func:`~megacp.integrations.transformers.check_mesh`, for every load). Its attention is checked,
not guessed: an architecture that does not call the attention interface with its arguments
(Falcon, BLOOM, MPT, ALiBi, its own attention code) is refused in one line before any weight is
read (:func:`~megacp.integrations.transformers.check_config_architecture`), and every load runs a
dry forward that counts the attention calls carrying megacp's step
(:func:`~megacp.integrations.transformers.verify_attention_calls`). It trains with the memory
features of :mod:`megacp.integrations.hf_memory` and is recorded in checkpoints by its own config.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacp.checkpoint.deepspeed import TransformersRecord
from megacp.config import MemoryOptions
from megacp.families.base import Loaded, ModelFamily, PlanShape, Trainable, all_layers_dense
from megacp.integrations.hf_memory import (
    HFMemory,
    apply_memory,
    decoder_layers,
    num_experts,
    plan_config,
    pre_norm_layer,
    training_loss,
)
from megacp.layers.settings import CPSettings
from megacp.models.config import ModelConfig
from megacp.parallel.state import ParallelState


def _check_mesh(state: ParallelState) -> None:
    """Before every load: :func:`~megacp.integrations.transformers.check_mesh` (TP and PP sizes 1)."""
    from megacp.integrations.transformers import check_mesh

    check_mesh(state)


class TransformersTrainable(Trainable):
    """A transformers causal LM as it trains: its RMSNorms fused, decoder layers checkpointed and MLPs
    tiled by :func:`~megacp.integrations.hf_memory.apply_memory`, the tiled LM head + loss where it
    equals the model's own (:func:`~megacp.integrations.hf_memory.training_loss`), its config recorded."""

    def __init__(self, module: nn.Module, tokenizer: Any = None) -> None:
        super().__init__(module, getattr(module, "config", None), tokenizer)
        self.memory: HFMemory | None = None
        """The memory features :meth:`install_memory` applied (a plan sets them; the MLP tiling
        learns each micro-batch's tokens)."""

    def _plan_shape(self) -> PlanShape | None:
        cfg = plan_config(self.config) if self.config is not None else None
        if cfg is None:
            return None
        dense = not num_experts(self.config)  # its MLPs tile unless they route to experts
        tiled = dense and all(pre_norm_layer(layer) for layer in decoder_layers(self.module))
        return PlanShape(cfg, dense_mlp=dense, norm_apart=True, tiled_attention=tiled)

    @property
    def head(self) -> nn.Parameter | None:
        embeddings = getattr(self.module, "get_output_embeddings", None)
        weight = getattr(embeddings(), "weight", None) if callable(embeddings) else None
        return weight if isinstance(weight, nn.Parameter) else None

    def loss(self) -> Callable[..., torch.Tensor]:
        return training_loss(self.module)

    def install_memory(self, options: MemoryOptions, device: torch.device) -> None:
        unplanned = None if self.plan_shape is not None else (
            f"it has no sizes for {type(self.module).__name__} (a mixture of experts megacp's models do not implement)")
        self.memory = apply_memory(self.module, options, device, unplanned=unplanned)

    def apply_plan(self, plan: Any) -> None:
        if self.memory is not None:
            self.memory.apply(plan)

    def step_tokens(self, tokens: int) -> None:
        """The MLP tiling learns the micro-batch's local tokens (every rank cuts as many tiles:
        ZeRO 3 gathers per call)."""
        if self.memory is not None and self.memory.tiling is not None:
            self.memory.tiling.step_tokens = tokens

    def _config_eos_ids(self) -> list[int]:
        eos = getattr(self.config, "eos_token_id", None)
        if not eos:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def record(self) -> dict[str, Any]:
        return TransformersRecord(json.loads(self.config.to_json_string(use_diff=False))).entry()

    def save_model_files(self, directory: str, *, zero_stage: int) -> str:
        if zero_stage == 3:  # partitioned: tools/convert_checkpoint.py deepspeed-to-hf gathers them
            return " (ZeRO 3: deepspeed-to-hf converts it to the model's own files)"
        from megacp.integrations.transformers import save_pretrained

        save_pretrained(self.module, directory, tokenizer=self.tokenizer)
        return f" and the model's own files in {directory}"


class TransformersFamily(ModelFamily):
    """Any transformers causal LM megacp's attention runs exactly (see the module): a Hugging Face
    directory of it."""

    kind = "transformers"
    describe = "transformers' modules"

    def limits(self) -> Any:
        from megacp.integrations.hf_generate import HFModelInfo

        return HFModelInfo.of_directory(self.source)

    def load_for_generation(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                            allow_non_finite: bool = False) -> Loaded:
        from megacp.integrations import hf_generate

        _check_mesh(state)
        model, tokenizer = hf_generate.load_for_generation(self.source, dtype=dtype, state=state,
                                                           allow_non_finite=allow_non_finite)
        return self._for_generation(model, tokenizer)

    @staticmethod
    def _for_generation(model: nn.Module, tokenizer: Any) -> Loaded:
        from megacp.integrations import hf_generate

        info = hf_generate.HFModelInfo.of(getattr(model, "config", None), getattr(model, "generation_config", None))
        return Loaded(hf_generate.HFGenerationModel(model), info, tokenizer)

    def load_for_training(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                          backend: Any = "auto", allow_non_finite: bool = False) -> Trainable:
        from megacp.checkpoint.tokenizer_files import load_tokenizer
        from megacp.integrations.transformers import load_pretrained

        _check_mesh(state)
        return TransformersTrainable(load_pretrained(self.source, dtype=dtype, state=state),
                                     load_tokenizer(self.source))

    def plan_config(self) -> ModelConfig | None:
        try:
            with open(Path(self.source) / "config.json", encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):  # not a directory of one: training_error and the load say so
            return None
        return plan_config(raw) if isinstance(raw, dict) else None

    def plan_shape(self, *, backend: Any, device: torch.device) -> PlanShape | None:
        cfg = self.plan_config()
        if cfg is None:
            return None
        dense = all_layers_dense(cfg)  # planned as a Llama skeleton of its sizes: its layers' formula is unread
        return PlanShape(cfg, dense_mlp=dense, norm_apart=True, tiled_attention=dense)

    def saved_config(self) -> ModelConfig | None:
        return None  # its checkpoints record transformers' config

    def graph_decode_error(self, limits: Any) -> str | None:
        return ("cuda_graphs=True needs one of megacp's own models; a transformers model decodes eagerly "
                "(leave cuda_graphs unset)")

    def training_error(self, *, backend: str, allow_non_finite: bool) -> str | None:
        if not (Path(self.source) / "config.json").is_file():
            return "needs --model DIR, a Hugging Face model directory with a config.json"
        if backend != "auto" or allow_non_finite:
            return "trains the transformers modules as they are: --backend and --allow-non-finite do not apply"
        return None


class TransformersObject(TransformersFamily):
    """A transformers causal LM object handed to :class:`megacp.LLM` (switched to
    ``attn_implementation="megacp"``, cast, moved and put in eval mode in place) with its tokenizer."""

    def __init__(self, model: nn.Module, tokenizer: Any = None) -> None:
        super().__init__(type(model).__name__)
        self.model, self.tokenizer = model, tokenizer

    def limits(self) -> Any:
        from megacp.integrations.hf_generate import HFModelInfo

        return HFModelInfo.of(getattr(self.model, "config", None), getattr(self.model, "generation_config", None))

    def native_dtype(self) -> torch.dtype | None:
        return next(self.model.parameters()).dtype

    def load_for_generation(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                            allow_non_finite: bool = False) -> Loaded:
        from megacp.integrations import hf_generate

        _check_mesh(state)
        model = hf_generate.prepare_model(self.model, dtype=dtype, state=state, allow_non_finite=allow_non_finite)
        return self._for_generation(model, self.tokenizer)

    def load_for_training(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                          backend: Any = "auto", allow_non_finite: bool = False) -> Trainable:
        raise ValueError("megacp.train loads a model directory; train a model object with megacp's CPTrainer")
