"""Loading a model's weights from a checkpoint into a freshly built :class:`CausalLM` (checkpoint
reading only: the TP rank and size come from the model package, nothing here communicates).

:func:`load_model` accepts what users point at: a Hugging Face checkpoint directory, a megacp
checkpoint directory, or a ``.gguf`` file. Weights are streamed into megacp names, sharded for the
caller's tensor-parallel rank, cast to the target dtype/device one tensor at a time, and put into a
model skeleton built on the ``meta`` device (``load_state_dict(assign=True)``), so a Hugging Face
or GGUF model is never held twice. A megacp checkpoint's shard is read whole, then copied to the
target (on CPU the peak holds it twice). TE layers initialise their own tensors on the device and
are filled by copy instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megacp.checkpoint.deepspeed import TRAIN_STATE_FILE, read_deepspeed_checkpoint
from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.hf import hf_to_megacp, open_hf_checkpoint
from megacp.checkpoint.megacp_format import MANIFEST, load_megacp_checkpoint
from megacp.checkpoint.tokenizer_files import TokenizerSource

LOAD_REMEDY = ("only if you trust where it came from, convert it with tools/convert_checkpoint.py deepspeed-to-hf "
               "--trust-checkpoint and load the converted directory")
"""What a refused (not plain data) DeepSpeed checkpoint's message offers where a model is loaded."""
from megacp.checkpoint.tp import check_ep_rank, check_tp_size, shard_experts, shard_tensor
from megacp.checkpoint.values import check_finite, check_model_values
from megacp.models.build import Backend, build_model, resolve_backend
from megacp.models.config import ModelConfig
from megacp.models.llama import CausalLM
from megacp.models.ops import rank_and_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Any of these in a checkpoint directory means a tokenizer can be loaded from it.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: Any,
    tp_group: ProcessGroup | None = None,
    ep_group: ProcessGroup | None = None,
    backend: Backend = "auto",
    allow_non_finite: bool = False,
) -> tuple[CausalLM, ModelConfig, TokenizerSource]:
    """Load a model for inference from a Hugging Face directory, a megacp checkpoint or a GGUF file.

    Args:
        path: a directory with ``config.json`` naming ``architectures`` or ``model_type`` (Hugging Face), a directory
            with ``megacp_checkpoint.json`` (megacp, any stored TP size), a ``megacp.train --save`` directory
            (:func:`~megacp.checkpoint.deepspeed.read_deepspeed_checkpoint`: its latest tag), or a ``.gguf`` file.
        dtype / device: of the parameters.
        tp_group: this rank's tensor-parallel group (weights are sharded for its rank).
        ep_group: this rank's expert-parallel group: an MoE model keeps only its rank's experts
            (:func:`~megacp.models.build.expert_parallel_group`); a dense model refuses a size > 1.
        backend: see :func:`resolve_backend`.
        allow_non_finite: load weights that hold NaN or inf (refused by default).

    Returns:
        ``(model in eval mode, config, tokenizer)``: the tokenizer is the checkpoint directory (as
        a ``str``) when it holds tokenizer files, the Hugging Face tokenizer object that
        :func:`~megacp.checkpoint.gguf.load_gguf` builds from a GGUF file's vocabulary, or ``None``.

    Raises:
        CheckpointError: the path is none of the above, its contents are invalid (a config value
            out of range, a weight holding NaN or inf without ``allow_non_finite``: one line naming it),
            or the model cannot be split over ``tp_group`` / ``ep_group``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    build = dict(dtype=dtype, device=device, backend=backend, tp_group=tp_group, ep_group=ep_group,
                 finite_in=None if allow_non_finite else path)
    if path.is_file() and path.suffix == ".gguf":
        from megacp.checkpoint.gguf import load_gguf  # needs the optional `gguf` package

        cfg, tensors, tokenizer = load_gguf(path)
        check_model_values(cfg, str(path))
        return _load(cfg, tensors, sharded=False, **build), cfg, tokenizer
    if (path / MANIFEST).is_file():
        cfg, shards = load_megacp_checkpoint(path, *rank_and_size(tp_group))
        return _load(cfg, shards.items(), sharded=True, **build), cfg, _tokenizer_dir(path)
    if _is_hf_dir(path):
        with open_hf_checkpoint(path) as checkpoint:
            cfg = checkpoint.config
            tensors = hf_to_megacp(cfg, checkpoint.get, checkpoint.names)
            return _load(cfg, tensors, sharded=False, **build), cfg, _tokenizer_dir(path)
    if (path / TRAIN_STATE_FILE).is_file():  # a megacp.train --save directory: its latest tag
        trained = read_deepspeed_checkpoint(path, remedy=LOAD_REMEDY)
        return _load(trained.config, trained.tensors.items(), sharded=False, **build), trained.config, _tokenizer_dir(path)
    if (path.parent / TRAIN_STATE_FILE).is_file():
        raise CheckpointError(
            f"{path} is one tag of the megacp.train checkpoint {path.parent}: pass {path.parent} (its latest tag) or "
            f"convert this one: python tools/convert_checkpoint.py deepspeed-to-hf --input {path.parent} "
            f"--tag {path.name} --output HF_DIR")
    raise CheckpointError(
        f"{path} is neither a Hugging Face checkpoint directory (config.json with "
        "'architectures' or 'model_type'), a megacp checkpoint (megacp_checkpoint.json), a megacp.train "
        f"checkpoint ({TRAIN_STATE_FILE}) nor a .gguf file"
    )


def _is_hf_dir(path: Path) -> bool:
    """Whether ``path`` has a ``config.json`` naming ``architectures`` or ``model_type`` (what
    :func:`~megacp.checkpoint.hf.config_from_hf` reads the architecture from)."""
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ("architectures" in data or "model_type" in data)


def _tokenizer_dir(path: Path) -> str | None:
    """``path`` when it holds a tokenizer, else ``None``."""
    return str(path) if any((path / name).is_file() for name in _TOKENIZER_FILES) else None


def _load(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    sharded: bool,
    dtype: torch.dtype,
    device: Any,
    backend: Backend,
    tp_group: ProcessGroup | None,
    ep_group: ProcessGroup | None,
    finite_in: Path | None,
) -> CausalLM:
    """Build the model of ``cfg`` and fill it from ``tensors`` (megacp names), in eval mode.

    Args:
        tensors: full tensors (``sharded=False``; this rank's part is cut out of each as it
            arrives) or this TP rank's parts already (``sharded=True``); either way the routed
            experts are cut to this EP rank's as they arrive.
        finite_in: the checkpoint, whose tensors must then be finite (``None``: not checked).

    Raises:
        CheckpointError: a parameter is missing (TE ``_extra_state`` aside) or a name is unexpected.
    """
    tp_rank, tp_size = rank_and_size(tp_group)
    ep_rank, ep_size = rank_and_size(ep_group)
    check_tp_size(cfg, tp_size)
    check_ep_rank(cfg, ep_rank, ep_size)
    if finite_in is not None:
        tensors = ((name, check_finite(name, t, finite_in)) for name, t in tensors)
    if not sharded and tp_size > 1:
        tensors = ((name, shard_tensor(cfg, name, t, tp_rank, tp_size)) for name, t in tensors)
    if ep_size > 1:
        tensors = ((name, shard_experts(name, t, ep_rank, ep_size)) for name, t in tensors)
    if resolve_backend(cfg, device, backend) == "te":
        # TE modules allocate on the device themselves: copy into them one tensor at a time.
        model = build_model(cfg, dtype=dtype, device=device, backend="te", tp_group=tp_group)
        targets = model.state_dict()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in tensors:
            if name not in targets:
                unexpected.append(name)
                continue
            if targets[name].shape != tensor.shape:  # copy_ would broadcast silently
                raise CheckpointError(
                    f"tensor {name!r} has shape {list(tensor.shape)}, the model expects "
                    f"{list(targets[name].shape)}"
                )
            targets[name].copy_(tensor)
            loaded.add(name)
        missing = [name for name in targets if name not in loaded]
    else:
        # A meta skeleton adopts the tensors (assign=True): the weights exist once, on `device`.
        # copy=True also detaches TP parts from the full tensor they were cut from.
        state = {
            name: t.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)
            for name, t in tensors
        }
        model = build_model(cfg, dtype=dtype, device="meta", backend="torch", tp_group=tp_group, ep_group=ep_group)
        result = model.load_state_dict(state, strict=False, assign=True)
        missing, unexpected = result.missing_keys, result.unexpected_keys
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        problem = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"the checkpoint does not fit the model built from its config: {problem}")
    return model.eval()
