"""The model-family seam: one interface over megacp's own Llama-family models and any transformers
causal LM, so the entry points (:class:`megacp.LLM`, ``megacp.generate``, ``megacp.serve``,
``megacp.train``) never ask which kind of model they hold.

:func:`family_for` recognises what the user points at — a transformers model object, a Hugging
Face directory, a ``.gguf`` file or a megacp checkpoint — and returns its :class:`ModelFamily`:

* :class:`MegacpFamily`: the architectures megacp's own models implement (Llama, Mistral, Qwen2,
  their MoE kin; :mod:`megacp.checkpoint`), loaded TP/EP-sharded with megacp's CP layers; CUDA-graph
  decode where the model is dense without a sliding window; a memory plan from the config.
* :class:`TransformersFamily`: any other transformers causal LM (a directory whose architecture
  megacp's models do not implement, ``--hf-native``, or an object), run by transformers' own modules
  with ``attn_implementation="megacp"``. Its attention is checked, not guessed: an architecture that
  does not call the attention interface with its arguments (Falcon, BLOOM, MPT, ALiBi, its own
  attention code) is refused in one line before any weight is read
  (:func:`~megacp.integrations.transformers.check_config_architecture`), and every load runs a
  dry forward that counts the attention calls carrying megacp's step
  (:func:`~megacp.integrations.transformers.verify_attention_calls`).

A family states what the model can do (:meth:`ModelFamily.graph_decode_error`,
:meth:`ModelFamily.plan_config`, :meth:`ModelFamily.training_error`) and does the family-specific
work (:meth:`ModelFamily.limits`, :meth:`ModelFamily.load_for_generation`,
:meth:`ModelFamily.load_for_training`, :meth:`ModelFamily.save_model_files`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from megacp.checkpoint.front import default_model_path, load_on_mesh, read_model_config
from megacp.checkpoint.hf import transformers_only
from megacp.layers.settings import CPSettings
from megacp.models.config import ModelConfig
from megacp.parallel.state import ParallelState

MOE_GRAPHS = ("cuda_graphs=True does not support mixture-of-experts models (token routing needs host-side "
              "counts); pass cuda_graphs=False")
WINDOW_GRAPHS = ("cuda_graphs=True does not support sliding-window attention (the graph's decode step has no "
                 "window); pass cuda_graphs=False")


@dataclass
class Loaded:
    """A model on this rank, as a family loaded it.

    Attributes:
        model: what runs: for generation the module :class:`~megacp.generate.loop.Generator` calls,
            for training the module the :class:`~megacp.train.engine.Trainer` trains.
        config: its sizes (:class:`~megacp.models.config.ModelConfig`; a transformers model's
            :class:`~megacp.integrations.hf_generate.HFModelInfo` for generation, its own config for
            training).
        tokenizer: its tokenizer (``None`` when the checkpoint has none).
    """

    model: nn.Module
    config: Any
    tokenizer: Any


class ModelFamily(ABC):
    """One kind of model behind megacp's entry points (see the module).

    Attributes:
        kind: ``"megacp"`` or ``"transformers"``; describe: what loads, in a progress line.
        norm_apart: the MLP's norm runs outside its sequence tiles, so the training memory plan
            counts its activations (:func:`~megacp.train.memory.working_bytes_per_token`).
        source: the path (or, for an object, its class name).
    """

    kind: ClassVar[str]
    describe: ClassVar[str]
    norm_apart: ClassVar[bool] = False

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
                          backend: Any = "auto", allow_non_finite: bool = False) -> Loaded:
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

    def saved_config(self) -> ModelConfig | None:
        """The config a training checkpoint of this model records as its ``model_config``, which
        ``--save`` compares with a directory's earlier run (``None``: none is recorded)."""
        return self.plan_config()

    def training_error(self, *, backend: str, allow_non_finite: bool) -> str | None:
        """Why ``megacp.train`` cannot train this model with these options (``None``: it can)."""
        return None

    def save_model_files(self, model: nn.Module, directory: str, *, tokenizer: Any, zero_stage: int) -> str:
        """After training, files loadable without megacp besides the DeepSpeed checkpoint; returns
        what the summary line says about them ("" when nothing more is written)."""
        return ""


class MegacpFamily(ModelFamily):
    """megacp's own models (:mod:`megacp.models`): a Hugging Face directory of an architecture
    they implement, a ``.gguf`` file or a megacp checkpoint."""

    kind = "megacp"
    describe = "megacp's model"

    def limits(self) -> ModelConfig | None:
        return read_model_config(self.source)

    def load_for_generation(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                            allow_non_finite: bool = False) -> Loaded:
        loaded = load_on_mesh(self.source, state, dtype=dtype, settings=settings, allow_non_finite=allow_non_finite)
        return Loaded(loaded.model, loaded.config, loaded.tokenizer)

    def load_for_training(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                          backend: Any = "auto", allow_non_finite: bool = False) -> Loaded:
        loaded = load_on_mesh(self.source, state, dtype=dtype, settings=settings, backend=backend,
                              allow_non_finite=allow_non_finite)
        return Loaded(loaded.model.train(), loaded.config, loaded.tokenizer)

    def graph_decode_error(self, limits: Any) -> str | None:
        if isinstance(limits, ModelConfig) and limits.sliding_window is not None:
            return WINDOW_GRAPHS
        return super().graph_decode_error(limits)

    def plan_config(self) -> ModelConfig | None:
        config = self.limits()
        return config if isinstance(config, ModelConfig) else None


class TransformersFamily(ModelFamily):
    """Any transformers causal LM megacp's attention runs exactly: a Hugging Face directory (or,
    through :class:`TransformersObject`, a model object), its own modules with
    ``attn_implementation="megacp"`` under CP (TP and PP sizes 1)."""

    kind = "transformers"
    describe = "transformers' modules"
    norm_apart = True

    def limits(self) -> Any:
        from megacp.integrations.hf_generate import HFModelInfo

        return HFModelInfo.of_directory(self.source)

    def load_for_generation(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                            allow_non_finite: bool = False) -> Loaded:
        from megacp.integrations import hf_generate

        model, tokenizer = hf_generate.load_for_generation(self.source, dtype=dtype, state=state,
                                                           allow_non_finite=allow_non_finite)
        return self._for_generation(model, tokenizer)

    @staticmethod
    def _for_generation(model: nn.Module, tokenizer: Any) -> Loaded:
        from megacp.integrations import hf_generate

        info = hf_generate.HFModelInfo.of(getattr(model, "config", None), getattr(model, "generation_config", None))
        return Loaded(hf_generate.HFGenerationModel(model), info, tokenizer)

    def load_for_training(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                          backend: Any = "auto", allow_non_finite: bool = False) -> Loaded:
        from megacp.checkpoint.tokenizer_files import load_tokenizer
        from megacp.integrations.transformers import load_pretrained

        model = load_pretrained(self.source, dtype=dtype, state=state)
        return Loaded(model, model.config, load_tokenizer(self.source))

    def plan_config(self) -> ModelConfig | None:
        from megacp.integrations.hf_memory import plan_config

        try:
            with open(Path(self.source) / "config.json", encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):  # not a directory of one: training_error and the load say so
            return None
        return plan_config(raw) if isinstance(raw, dict) else None

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

    def save_model_files(self, model: nn.Module, directory: str, *, tokenizer: Any, zero_stage: int) -> str:
        if zero_stage == 3:  # partitioned: tools/convert_checkpoint.py deepspeed-to-hf gathers them
            return " (ZeRO 3: deepspeed-to-hf converts it to the model's own files)"
        from megacp.integrations.transformers import save_pretrained

        save_pretrained(model, directory, tokenizer=tokenizer)
        return f" and the model's own files in {directory}"


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

        model = hf_generate.prepare_model(self.model, dtype=dtype, state=state, allow_non_finite=allow_non_finite)
        return self._for_generation(model, self.tokenizer)

    def load_for_training(self, state: ParallelState, *, dtype: torch.dtype, settings: CPSettings,
                          backend: Any = "auto", allow_non_finite: bool = False) -> Loaded:
        raise ValueError("megacp.train loads a model directory; train a model object with megacp's CPTrainer")


def family_for(source: str | Path | nn.Module | None, *, transformers: bool = False, tokenizer: Any = None) -> ModelFamily:
    """The family of ``source``: a transformers model object, a path (default: the default model,
    :func:`~megacp.checkpoint.front.default_model_path`), forced to transformers' modules with
    ``transformers=True`` (``--hf-native``). ``tokenizer`` goes with an object only.

    Raises:
        ValueError: a tokenizer with a path (a checkpoint brings its own).
        CheckpointError: no source and the default model is not installed.
    """
    if isinstance(source, nn.Module):
        return TransformersObject(source, tokenizer)
    if tokenizer is not None:
        raise ValueError("tokenizer= goes with a transformers model object; a checkpoint brings its own tokenizer")
    path = str(source or default_model_path())
    if transformers or transformers_only(path):
        return TransformersFamily(path)
    return MegacpFamily(path)
