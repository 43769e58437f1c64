"""DeepSpeed checkpoints written by ``python -m megacp.train``: the sidecar that describes the model,
and reading the trained weights back as full megacp tensors.

``engine.save_checkpoint(DIR, tag)`` writes DeepSpeed's files (``DIR/latest``, ``DIR/<tag>/
mp_rank_00_model_states.pt`` and, under ZeRO 1/2, one ``*_optim_states.pt`` per data-parallel
rank holding that rank's partition of the fp32 master weights). DeepSpeed does not record what
model the tensors belong to, so the trainer adds, from rank 0, :data:`TRAIN_STATE_FILE`::

    {"format": "megacp-deepspeed", "version": 1,
     "model_config": {...ModelConfig.to_dict()...},
     "dtype": "bfloat16",          # the dtype the model was trained in
     "tp_size": 1, "zero_stage": 1, "tag": "step100"}

and the tokenizer files. :func:`read_deepspeed_checkpoint` rebuilds the full weights: with ZeRO
shards through DeepSpeed's own ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (fp32
master weights, partitions merged), without them from the module states (the training dtype).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megacp.checkpoint.dtypes import dtype_from_name, dtype_name
from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.tokenizer_files import TokenizerSource, write_tokenizer
from megacp.models.config import ModelConfig
from megacp.models.schema import parameter_shapes

TRAIN_STATE_FILE = "megacp_train.json"
"""The sidecar next to DeepSpeed's files (see the module docstring)."""

FORMAT = "megacp-deepspeed"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """The trained model of a DeepSpeed checkpoint directory.

    Attributes:
        config: the model config.
        tensors: every parameter as a full megacp tensor (fp32 when rebuilt from ZeRO shards).
        dtype: the dtype the model was trained in.
        tag: the checkpoint tag read.
        path: the checkpoint directory (also where the tokenizer files are).
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    dtype: torch.dtype
    tag: str
    path: Path


def write_train_state(directory: str | os.PathLike[str], *, model_config: ModelConfig, dtype: torch.dtype,
                      tp_size: int, zero_stage: int, tag: str, tokenizer: TokenizerSource) -> None:
    """Write :data:`TRAIN_STATE_FILE` (atomically) and the tokenizer files into ``directory``."""
    path = Path(directory)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "model_config": model_config.to_dict(),
            "dtype": dtype_name(dtype), "tp_size": tp_size, "zero_stage": zero_stage, "tag": tag}
    tmp = path / f".{TRAIN_STATE_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    tmp.replace(path / TRAIN_STATE_FILE)
    write_tokenizer(tokenizer, path)


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / TRAIN_STATE_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint written by megacp.train (no {TRAIN_STATE_FILE})")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_file}: cannot be read ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file}: not a {FORMAT} version {FORMAT_VERSION} file")
    return meta


def _latest_tag(path: Path) -> str:
    latest = path / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{path} has no 'latest' file naming a checkpoint tag; pass --tag")
    return latest.read_text(encoding="utf-8").strip()


def _inside(path: Path, root: Path, what: str) -> Path:
    """``path`` with symlinks resolved, refused unless it lies inside ``root`` (no ``..``, absolute
    paths or symlinks leading out of the checkpoint)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise CheckpointError(f"{what} {str(path)!r} leads outside the checkpoint {root}")
    return resolved


TRUST_HINT = "pass --trust-checkpoint only if you trust where it came from"


def _safe_globals() -> list[Any]:
    """The non-tensor types DeepSpeed writes into its ``*.pt`` files, allowed for ``weights_only``
    loading (plain data classes and enums, no callables)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    # ``deepspeed.utils.tensor_fragment`` the attribute is a class shadowing the module of that name
    fragment = importlib.import_module("deepspeed.utils.tensor_fragment")
    return [LossScaler, ZeroStageEnum, fragment.fragment_address]


@contextlib.contextmanager
def _weights_only(trust: bool):
    """Every ``torch.load`` inside (DeepSpeed's own included) loads as ``weights_only=True`` with
    :func:`_safe_globals` allowed, unless ``trust``; an unpickling refusal becomes one line."""
    if trust:
        yield
        return
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            yield
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f"the object type {found.group(1)}" if found else "objects other than tensors and plain data"
        raise CheckpointError(f"holds {what}, refused (loaded as data only); {TRUST_HINT}") from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def _load_pt(file: Path, trust: bool) -> Any:
    """``torch.load`` of one checkpoint file as data (``weights_only=True``) unless ``trust``."""
    try:
        with _weights_only(trust):
            return torch.load(file, map_location="cpu", weights_only=not trust)
    except CheckpointError as err:
        raise CheckpointError(f"{file}: {err}") from None


def read_deepspeed_checkpoint(directory: str | os.PathLike[str], tag: str | None = None, *,
                              trust: bool = False) -> DeepSpeedCheckpoint:
    """Rebuild the full weights of a ``megacp.train`` DeepSpeed checkpoint.

    Args:
        directory: the ``--save`` directory.
        tag: the checkpoint tag (default: the one ``latest`` names); it must name a directory
            inside ``directory``.
        trust: unpickle the ``*.pt`` files with arbitrary objects (runs code a file carries);
            by default they load as data only (``weights_only=True``) and anything else is refused.

    Raises:
        CheckpointError: not such a checkpoint, a missing tag, a TP-sharded checkpoint (not
            supported: the model was trained with tensor parallelism), or tensors that do not
            match the model config.
    """
    path = Path(directory)
    meta = _read_meta(path)
    if meta.get("tp_size", 1) != 1:
        raise CheckpointError(f"{path} was trained with tensor_model_parallel.size {meta['tp_size']}; "
                              "converting TP-sharded DeepSpeed checkpoints is not supported")
    tag = tag or _latest_tag(path)
    tag_dir = _inside(path / tag, path, "checkpoint tag")
    if not tag_dir.is_dir():
        raise CheckpointError(f"{path} has no checkpoint tag {tag!r}")
    for file in tag_dir.iterdir():
        _inside(file, path, "checkpoint file")
    try:
        config = ModelConfig.from_dict(meta["model_config"])
        dtype = dtype_from_name(meta["dtype"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / TRAIN_STATE_FILE}: bad model_config or dtype ({err})") from None
    if any(tag_dir.glob("*_optim_states.pt")):  # ZeRO 1/2 partitions of the fp32 master weights
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            with contextlib.redirect_stdout(io.StringIO()), _weights_only(trust):  # its progress prints
                state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
        except CheckpointError as err:
            raise CheckpointError(f"{tag_dir}: {err}") from None
    else:
        model_file = tag_dir / "mp_rank_00_model_states.pt"
        if not model_file.is_file():
            raise CheckpointError(f"{tag_dir} has neither ZeRO optimizer shards nor {model_file.name}")
        state = _load_pt(model_file, trust)["module"]
    shapes = parameter_shapes(config)
    missing = [name for name in shapes if name not in state]
    if missing:
        raise CheckpointError(f"{tag_dir}: the checkpoint lacks {missing[:3]} of the model in {TRAIN_STATE_FILE}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise CheckpointError(f"{tag_dir}: {name} has shape {list(state[name].shape)}, the model config "
                                  f"expects {list(shape)}")
    return DeepSpeedCheckpoint(config, {name: state[name].detach() for name in shapes}, dtype, tag, path)
