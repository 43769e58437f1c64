"""The model-family seam: one interface over megacp's own Llama-family models and any transformers
causal LM, so the entry points (:class:`megacp.LLM`, ``megacp.generate``, ``megacp.serve``,
``megacp.train``), the trainer and the checkpoints never ask which kind of model they hold.

:func:`family_for` recognises what the user points at — a transformers model object, a Hugging
Face directory, a ``.gguf`` file or a megacp checkpoint — and returns its :class:`ModelFamily`:

* :class:`MegacpFamily` (:mod:`megacp.families.own`): the architectures megacp's own models
  implement (Llama, Mistral, Qwen2, their MoE kin; :mod:`megacp.checkpoint`).
* :class:`TransformersFamily` (:mod:`megacp.families.transformers`): any other transformers causal
  LM (a directory whose architecture megacp's models do not implement, ``--hf-native``, or an
  object), run by transformers' own modules with ``attn_implementation="megacp"``.

A family states what the model can do (:meth:`ModelFamily.graph_decode_error`,
:meth:`ModelFamily.plan_shape`, :meth:`ModelFamily.training_error`) and loads it
(:meth:`ModelFamily.limits`, :meth:`ModelFamily.load_for_generation`,
:meth:`ModelFamily.load_for_training`). A model loaded for training is a :class:`Trainable`: its
loss, its memory applier (plan -> model), the plan's sizes (:class:`PlanShape`), the LM head a
ZeRO 3 engine keeps gathered, its EOS token and what a checkpoint records of it;
:func:`trainable` gives a model built by hand its family's. A new family is one
:class:`ModelFamily` with its :class:`Trainable`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from megacp.checkpoint.front import default_model_path
from megacp.checkpoint.hf import transformers_only
from megacp.families.base import MOE_GRAPHS, WINDOW_GRAPHS, Loaded, ModelFamily, PlanShape, Trainable
from megacp.families.own import MegacpFamily, MegacpTrainable
from megacp.families.transformers import TransformersFamily, TransformersObject, TransformersTrainable
from megacp.models.llama import CausalLM

__all__ = ["MOE_GRAPHS", "WINDOW_GRAPHS", "Loaded", "MegacpFamily", "MegacpTrainable", "ModelFamily", "PlanShape",
           "Trainable", "TransformersFamily", "TransformersObject", "TransformersTrainable", "family_for",
           "trainable"]


def family_for(source: str | Path | nn.Module | ModelFamily | None, *, transformers: bool = False,
               tokenizer: Any = None) -> ModelFamily:
    """The family of ``source``: a transformers model object, a path (default: the default model,
    :func:`~megacp.checkpoint.front.default_model_path`), forced to transformers' modules with
    ``transformers=True`` (``--hf-native``). ``tokenizer`` goes with an object only; a family is
    returned as it is.

    Raises:
        ValueError: a tokenizer with a path (a checkpoint brings its own).
        CheckpointError: no source and the default model is not installed.
    """
    if isinstance(source, ModelFamily):
        return source
    if isinstance(source, nn.Module):
        return TransformersObject(source, tokenizer)
    if tokenizer is not None:
        raise ValueError("tokenizer= goes with a transformers model object; a checkpoint brings its own tokenizer")
    path = str(source or default_model_path())
    if transformers or transformers_only(path):
        return TransformersFamily(path)
    return MegacpFamily(path)


def trainable(model: nn.Module | Trainable, tokenizer: Any = None) -> Trainable:
    """``model`` as its family trains it: megacp's own :class:`~megacp.models.llama.CausalLM`, or a
    transformers causal LM (a :class:`Trainable` is returned as it is)."""
    if isinstance(model, Trainable):
        return model
    if isinstance(model, CausalLM):
        return MegacpTrainable(model, model.cfg, tokenizer)
    return TransformersTrainable(model, tokenizer)
