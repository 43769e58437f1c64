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

and the tokenizer files; each tag directory also gets a manifest of its files
(:mod:`megacp.checkpoint.shard_manifest`), checked before anything is merged. What the sidecar
records of the model is one entry its family gives (:meth:`megacp.families.Trainable.record`):
``model_config`` above for megacp's own models, the transformers config for a model trained
through transformers' modules. Read back (:func:`read_record`), each kind megacp knows
(:data:`RECORDS`) writes the trained weights as a Hugging Face directory
(:meth:`ModelRecord.write_hf`, the converter's ``deepspeed-to-hf``).
:func:`read_deepspeed_checkpoint` rebuilds the full weights of megacp's own model: with ZeRO
shards through DeepSpeed's own ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (fp32
master weights, partitions merged), without them from the module states (the training dtype).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from megacp.checkpoint.dtypes import dtype_from_name, dtype_name
from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.safetensors_io import WriteSummary
from megacp.checkpoint.shard_manifest import canonical_sha256, verify_tag
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


Tensors = Iterable[tuple[str, torch.Tensor]]
Progress = Callable[[Tensors, int], AbstractContextManager[Tensors]]
"""``progress(tensors, total)``: the converter's bar (and finiteness check) around a tensor stream."""


class ModelRecord(ABC):
    """A kind of model megacp's readers know in :data:`TRAIN_STATE_FILE`: the sidecar's entry
    ``{key: values}`` that the model's family wrote when it saved (see the module docstring), read back.

    Attributes:
        key: the sidecar's key of this kind of record; values: its JSON values.
    """

    key: ClassVar[str]

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def entry(self) -> dict[str, Any]:
        """The sidecar's entry of this record, ``{key: values}``."""
        return {self.key: self.values}

    @property
    @abstractmethod
    def held(self) -> str:
        """What the checkpoint holds, as a reader of another kind of model refuses it."""

    def model_config(self, path: Path) -> ModelConfig:
        """The megacp :class:`ModelConfig` of the trained model.

        Raises:
            CheckpointError: the model is not one of megacp's own (one line naming what it is).
        """
        raise CheckpointError(f"{path} holds {self.held}")

    @abstractmethod
    def write_hf(self, directory: str | os.PathLike[str], tag: str | None, *, output: str, dtype: torch.dtype | None, force: bool,
                 trust: bool, progress: Progress) -> WriteSummary:
        """Write checkpoint ``tag`` of ``directory`` (``None``: the latest) as a Hugging Face directory
        ``output`` in ``dtype`` (``None``: the one it was trained in)."""


class MegacpRecord(ModelRecord):
    """megacp's own model: ``model_config``, its :class:`ModelConfig` as a dict."""

    key = "model_config"
    held = "one of megacp's own models: read it with read_deepspeed_checkpoint"

    @classmethod
    def of(cls, config: ModelConfig) -> MegacpRecord:
        """The record of a model of ``config``."""
        return cls(config.to_dict())

    def model_config(self, path: Path) -> ModelConfig:
        try:
            return ModelConfig.from_dict(self.values)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path / TRAIN_STATE_FILE}: bad model_config or dtype ({err})") from None

    def write_hf(self, directory: str | os.PathLike[str], tag: str | None, *, output: str, dtype: torch.dtype | None, force: bool,
                 trust: bool, progress: Progress) -> WriteSummary:
        from megacp.checkpoint.hf import hf_parameter_shapes, megacp_to_hf, save_hf_checkpoint

        source = read_deepspeed_checkpoint(directory, tag, trust=trust)
        tensors = megacp_to_hf(source.config, source.tensors.__getitem__, source.tensors)
        with progress(tensors, len(hf_parameter_shapes(source.config))) as stream:
            return save_hf_checkpoint(output, source.config, stream, dtype=dtype or source.dtype,
                                      tokenizer=source.path, force=force)


class TransformersRecord(ModelRecord):
    """A model trained through transformers' modules: its config's ``to_json_string`` values."""

    key = "transformers_config"

    @property
    def held(self) -> str:
        kind = (self.values.get("architectures") or ["a transformers model"])[0]
        return (f"{kind} trained through transformers' modules, not one of megacp's models: "
                "tools/convert_checkpoint.py deepspeed-to-hf writes it as a Hugging Face directory")

    def write_hf(self, directory: str | os.PathLike[str], tag: str | None, *, output: str, dtype: torch.dtype | None, force: bool,
                 trust: bool, progress: Progress) -> WriteSummary:
        """The model's own ``save_pretrained`` directory, built from its config with the weights
        loaded strictly (``progress`` is not shown: ``save_pretrained`` writes them)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from megacp.checkpoint.staging import staged_directory

        values, state, trained = read_transformers_checkpoint(directory, tag, trust=trust)
        dtype = dtype or trained
        values = dict(values)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            model: Any = AutoModelForCausalLM.from_config(config)
        try:
            model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        except RuntimeError as err:
            raise CheckpointError(f"{directory}: the weights do not match the model of its config "
                                  f"({str(err).splitlines()[0]})") from None
        with staged_directory(output, force=force) as staging:
            model.save_pretrained(staging)
            write_tokenizer(directory, staging)
        return WriteSummary(tensors=len(state),
                            bytes=sum(t.numel() * t.element_size() for t in model.state_dict().values()))


RECORDS: tuple[type[ModelRecord], ...] = (MegacpRecord, TransformersRecord)
"""Every kind of :class:`ModelRecord` a sidecar may hold."""


def train_state(*, model: dict[str, Any], dtype: torch.dtype, tp_size: int, zero_stage: int,
                tag: str) -> dict[str, Any]:
    """The contents of :data:`TRAIN_STATE_FILE` (see the module docstring); ``model`` is what the
    model's family records of it, one entry ``{key: values}`` (megacp's readers know the keys of
    :data:`RECORDS`)."""
    return {"format": FORMAT, "version": FORMAT_VERSION, **model,
            "dtype": dtype_name(dtype), "tp_size": tp_size, "zero_stage": zero_stage, "tag": tag}


def train_state_sha256(meta: dict[str, Any]) -> str:
    """The checksum of :data:`TRAIN_STATE_FILE`'s values (canonical JSON) other than ``tag`` (which
    names the newest save, while every tag's manifest records this checksum)."""
    return canonical_sha256({key: value for key, value in meta.items() if key != "tag"})


def write_train_state(directory: str | os.PathLike[str], *, model: dict[str, Any], dtype: torch.dtype,
                      tp_size: int, zero_stage: int, tag: str, tokenizer: TokenizerSource) -> None:
    """Write :data:`TRAIN_STATE_FILE` (atomically) and the tokenizer files into ``directory``."""
    path = Path(directory)
    meta = train_state(model=model, dtype=dtype, tp_size=tp_size, zero_stage=zero_stage, tag=tag)
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


def _record(path: Path, meta: dict[str, Any]) -> ModelRecord:
    """The :class:`ModelRecord` of the sidecar ``meta`` of ``path``."""
    for kind in RECORDS:
        if kind.key in meta:
            return kind(meta[kind.key])
    known = ", ".join(kind.key for kind in RECORDS)
    raise CheckpointError(f"{path / TRAIN_STATE_FILE}: records no model megacp reads (none of {known})")


def read_record(directory: str | os.PathLike[str]) -> ModelRecord:
    """What the checkpoints of ``directory`` record of their model.

    Raises:
        CheckpointError: no readable :data:`TRAIN_STATE_FILE`, or none of :data:`RECORDS` in it.
    """
    path = Path(directory)
    return _record(path, _read_meta(path))


def _config_and_dtype(path: Path, meta: dict[str, Any]) -> tuple[ModelConfig, torch.dtype]:
    config = _record(path, meta).model_config(path)
    try:
        return config, dtype_from_name(meta["dtype"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / TRAIN_STATE_FILE}: bad model_config or dtype ({err})") from None


def read_transformers_checkpoint(directory: str | os.PathLike[str], tag: str | None = None, *,
                                 trust: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor], torch.dtype]:
    """The transformers config (as a dict), full weights (under the model's own names; fp32 when
    rebuilt from ZeRO shards) and training dtype of a checkpoint ``megacp.train`` wrote for a model
    trained through transformers' modules.

    Raises:
        CheckpointError: as :func:`read_deepspeed_checkpoint`, or a checkpoint of megacp's own model.
    """
    path = Path(directory)
    meta = _read_meta(path)
    record = _record(path, meta)
    if not isinstance(record, TransformersRecord):
        raise CheckpointError(f"{path} holds {record.held}")
    tag = tag or _latest_tag(path)
    state = _merged_state(path, tag, meta, trust=trust)
    return record.values, state, dtype_from_name(meta["dtype"])


def _merged_state(path: Path, tag: str, meta: dict[str, Any], *, trust: bool, remedy: str = "") -> dict[str, Any]:
    """The full state of tag ``tag`` of ``path``, checked against its manifest and (unless ``trust``)
    for plain data: ZeRO shards merged to fp32, else the module states (names without ZeRO 3's prefix)."""
    directory = tag_dir(path, tag)
    if not directory.is_dir():
        raise CheckpointError(f"{path} has no checkpoint tag {tag!r}")
    verify_tag(directory, path / TRAIN_STATE_FILE, train_state_sha256(meta))
    if not trust:
        check_data_only(sorted(directory.glob("*.pt")), remedy or TRUST_REMEDY)
    if any(directory.glob("*_optim_states.pt")):  # ZeRO 1/2/3 partitions of the fp32 master weights
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()):  # its progress prints
            state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=str(directory.relative_to(path.resolve())))
    else:
        model_file = directory / "mp_rank_00_model_states.pt"
        if not model_file.is_file():
            raise CheckpointError(f"{directory} has neither ZeRO optimizer shards nor {model_file.name}")
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            state = torch.load(model_file, map_location="cpu", weights_only=not trust)["module"]
    return _model_names(state, int(meta.get("zero_stage", 0)))


def read_zero_stage(directory: str | os.PathLike[str]) -> int:
    """The ZeRO stage the checkpoints of ``directory`` (a ``--save`` directory) were written under.

    Raises:
        CheckpointError: no readable :data:`TRAIN_STATE_FILE`, or no stage in it.
    """
    path = Path(directory)
    stage = _read_meta(path).get("zero_stage")
    if not isinstance(stage, int):
        raise CheckpointError(f"{path / TRAIN_STATE_FILE}: no zero_stage")
    return stage


def read_train_config(directory: str | os.PathLike[str]) -> ModelConfig:
    """The model config of a ``megacp.train`` checkpoint directory (its :data:`TRAIN_STATE_FILE`
    only: no weights read).

    Raises:
        CheckpointError: not such a checkpoint, or a bad config.
    """
    path = Path(directory)
    return _config_and_dtype(path, _read_meta(path))[0]


def train_state_checksum(directory: str | os.PathLike[str]) -> str:
    """:func:`train_state_sha256` of ``directory``'s :data:`TRAIN_STATE_FILE` as it is now.

    Raises:
        CheckpointError: not a ``megacp.train`` checkpoint directory, or an unreadable sidecar.
    """
    return train_state_sha256(_read_meta(Path(directory)))


def _latest_tag(path: Path) -> str:
    latest = path / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{path} has no 'latest' file naming a checkpoint tag; pass --tag")
    try:
        tag = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{latest} cannot be read ({err}); pass --tag") from None
    if not tag:
        raise CheckpointError(f"{latest} is empty: it names no checkpoint tag; pass --tag")
    return tag


def tag_dir(path: Path, tag: str) -> Path:
    """The directory of checkpoint ``tag`` (from ``latest`` or ``--tag``), which must lie inside ``path``
    (a tag like ``../other`` or an absolute path is refused: nothing outside the checkpoint is read)."""
    root = path.resolve()
    tag_dir = (root / tag).resolve()
    if tag_dir == root or root not in tag_dir.parents:
        raise CheckpointError(f"{path}: checkpoint tag {tag!r} points outside the checkpoint directory")
    return tag_dir


def _deepspeed_safe_globals() -> list[Any]:
    """The DeepSpeed types its checkpoint files hold beside tensors and containers (loss scaler state,
    the ZeRO stage enum, fp32 fragment addresses): allow-listed for ``torch.load(weights_only=True)``."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


TRUST_REMEDY = "pass --trust-checkpoint only if you trust where it came from"
"""What the converters' refusal of a file that is not plain data offers."""


def check_data_only(files: Iterable[Path], remedy: str = TRUST_REMEDY) -> None:
    """Every one of ``files`` (a tag's ``.pt`` files) must unpickle as data (``torch.load(weights_only=True)``
    with :func:`_deepspeed_safe_globals`, tensors memory-mapped): a file that would run code is refused
    before DeepSpeed's own loader (which unpickles without that guard) reads it.

    Raises:
        CheckpointError: a symbolic link, a file that is not plain data (naming it, the type it
            holds and ``remedy``), or one that cannot be read at all (truncated or corrupt).
    """
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        for file in files:
            if file.is_symlink():
                raise CheckpointError(f"{file} is a symbolic link; a checkpoint's files must be its own")
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError as err:  # the weights-only unpickler's refusal
                found = re.search(r"GLOBAL (\S+)", str(err))  # the type the unpickler refused
                why = f"it holds the object type {found.group(1)}" if found else _first_line(err)
                raise CheckpointError(f"{file} is not plain tensor data ({why}); {remedy}") from None
            except Exception as err:  # noqa: BLE001 - no torch.save archive: truncated, empty or corrupt
                raise CheckpointError(f"cannot read {file} ({file.stat().st_size} bytes; truncated or corrupt?): "
                                      f"{_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (at most 160 characters), else its type's name."""
    text = str(err).strip()
    return text.splitlines()[0][:160] if text else type(err).__name__


ZERO3_PREFIX = "model."
"""What ZeRO 3 checkpoints put before megacp's parameter names (the engine trains the model inside
:class:`~megacp.train.engine.LossModule`, attribute ``model``)."""


def _model_names(state: dict[str, Any], zero_stage: int) -> dict[str, Any]:
    """``state`` under megacp's parameter names (ZeRO 3: without :data:`ZERO3_PREFIX`)."""
    if zero_stage != 3:
        return state
    return {k[len(ZERO3_PREFIX):] if k.startswith(ZERO3_PREFIX) else k: v for k, v in state.items()}


def read_deepspeed_checkpoint(directory: str | os.PathLike[str], tag: str | None = None, *,
                              trust: bool = False, remedy: str = "") -> DeepSpeedCheckpoint:
    """Rebuild the full weights of a ``megacp.train`` DeepSpeed checkpoint.

    Args:
        directory: the ``--save`` directory.
        tag: the checkpoint tag (default: the one ``latest`` names); it must lie inside ``directory``.
        trust: unpickle the files without checking that they hold only data (they could run code).
        remedy: what the refusal of a file that is not plain data offers (default :data:`TRUST_REMEDY`,
            the converters' flag).

    Raises:
        CheckpointError: not such a checkpoint, a missing tag, files that do not match the tag's
            manifest (:func:`~megacp.checkpoint.shard_manifest.verify_tag`: shards of another
            run, swapped, missing or extra, an edited :data:`TRAIN_STATE_FILE`), a TP-sharded
            checkpoint (not supported: the model was trained with tensor parallelism), or tensors
            that do not match the model config.
    """
    path = Path(directory)
    meta = _read_meta(path)
    if meta.get("tp_size", 1) != 1:
        raise CheckpointError(f"{path} was trained with tensor_model_parallel.size {meta['tp_size']}; "
                              "converting TP-sharded DeepSpeed checkpoints is not supported")
    tag = tag or _latest_tag(path)
    config, dtype = _config_and_dtype(path, meta)
    state = _merged_state(path, tag, meta, trust=trust, remedy=remedy)
    directory = tag_dir(path, tag)
    shapes = parameter_shapes(config)
    missing = [name for name in shapes if name not in state]
    if missing:
        raise CheckpointError(f"{directory}: the checkpoint lacks {missing[:3]} of the model in {TRAIN_STATE_FILE}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise CheckpointError(f"{directory}: {name} has shape {list(state[name].shape)}, the model config "
                                  f"expects {list(shape)}")
    return DeepSpeedCheckpoint(config, {name: state[name].detach() for name in shapes}, dtype, tag, path)
