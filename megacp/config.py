"""megacp's sections of a DeepSpeed config file, validated strictly.

megacp reads its own top-level sections from the JSON/hjson file a user already passes to
DeepSpeed as ``--deepspeed_config``; every other top-level key belongs to DeepSpeed, is ignored
here and stays available, untouched, as :attr:`MegacpConfig.deepspeed`::

    "context_parallel":        {"size": 2, "prefill": "auto", "decode": "allgather", "load_balance": true},
    "tensor_model_parallel":   {"size": 1},
    "pipeline_model_parallel": {"size": 1},
    "expert_model_parallel":   {"size": 4, "include_cp": false}

The tensor/pipeline/expert sections carry Megatron's names because DeepSpeed 0.19 already owns
``tensor_parallel`` (its AutoTP section, which rejects unknown keys such as ``size``, so such a
file would fail in ``deepspeed.initialize``) and ``expert_parallel`` (AutoEP). Those two, and
``pipeline_parallel``, are checked for misplaced megacp keys so that a size written there is an
error instead of being silently ignored.

The data-parallel size is not configured: it is what the world size leaves
(:meth:`MegacpConfig.layout`). ``expert_model_parallel.size`` is a check, not a knob: the EP group
is fixed by the mesh (``dp x tp`` ranks, or ``dp x cp x tp`` with ``include_cp``), and a size that
differs from it is an error.

Every problem raises :class:`ConfigError` with a one-line message that starts with the dotted key
(e.g. ``context_parallel.prefill``) and names the allowed values.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
import hjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megacp.parallel.layout import ParallelLayout


class ConfigError(ValueError):
    """An invalid megacp configuration. The message is one line naming the offending key."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, values are never coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ContextParallelConfig(_Section):
    """``context_parallel``: the CP ring and its algorithms.

    Attributes:
        size: CP ranks that shard one sequence.
        prefill: ``"pass_kv"``, ``"pass_q"`` or ``"auto"`` (chosen per request from T, P and the
            measured compute/bandwidth, paper Algorithm 1).
        decode: ``"allgather"`` (replicated query, all-gather of the partial outputs).
        load_balance: causal load-balanced sharding (rank r holds chunks r and 2N-1-r).
    """

    size: int = Field(1, ge=1)
    prefill: Literal["auto", "pass_kv", "pass_q"] = "auto"
    decode: Literal["allgather"] = "allgather"
    load_balance: bool = True


class TensorModelParallelConfig(_Section):
    """``tensor_model_parallel``: ``size`` ranks share every layer's weights (megacp's TP)."""

    size: int = Field(1, ge=1)


class PipelineModelParallelConfig(_Section):
    """``pipeline_model_parallel``: ``size`` pipeline stages."""

    size: int = Field(1, ge=1)


class ExpertModelParallelConfig(_Section):
    """``expert_model_parallel``: the expert-parallel group.

    Attributes:
        size: expected EP group size, checked against the mesh by :meth:`MegacpConfig.layout`
            (``None``: not checked).
        include_cp: the EP group spans ``dp x cp x tp`` ranks instead of ``dp x tp``.
    """

    size: Union[int, None] = Field(None, ge=1)
    include_cp: bool = False


SECTIONS: dict[str, type[_Section]] = {
    "context_parallel": ContextParallelConfig,
    "tensor_model_parallel": TensorModelParallelConfig,
    "pipeline_model_parallel": PipelineModelParallelConfig,
    "expert_model_parallel": ExpertModelParallelConfig,
}
"""megacp's top-level keys and their models."""

_MISPLACED: dict[tuple[str, str | None], str] = {
    ("tensor_parallel", "size"): "tensor_model_parallel.size",
    ("expert_parallel", "size"): "expert_model_parallel.size",
    ("expert_parallel", "include_cp"): "expert_model_parallel.include_cp",
    ("pipeline_parallel", None): "pipeline_model_parallel",
}
"""(top-level key, inner key or None for the whole section) -> where megacp reads it."""


class MegacpConfig(BaseModel):
    """megacp's view of one DeepSpeed config file. Build it with :func:`load_config`.

    Attributes:
        context_parallel / tensor_model_parallel / pipeline_model_parallel /
        expert_model_parallel: the validated sections (defaults when absent).
        deepspeed: the whole raw top-level dict, to hand to DeepSpeed unchanged.
        source: the file it was read from, ``None`` for a dict.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    context_parallel: ContextParallelConfig = ContextParallelConfig()
    tensor_model_parallel: TensorModelParallelConfig = TensorModelParallelConfig()
    pipeline_model_parallel: PipelineModelParallelConfig = PipelineModelParallelConfig()
    expert_model_parallel: ExpertModelParallelConfig = ExpertModelParallelConfig()
    deepspeed: dict[str, Any] = Field(default_factory=dict)
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
        sections = {name: raw[name] for name in SECTIONS if name in raw}
        try:
            return cls(**sections, deepspeed=dict(raw), source=source)
        except ValidationError as err:
            raise ConfigError(prefix + _describe(err)) from None

    def layout(self, world_size: int) -> ParallelLayout:
        """The mesh of ``world_size`` ranks: configured tp, cp, pp; dp takes the rest.

        Raises:
            ConfigError: the sizes do not divide ``world_size``, or ``expert_model_parallel.size``
                differs from the EP group this layout implies.
        """
        prefix = f"{self.source}: " if self.source else ""
        cp, tp, pp = self.context_parallel.size, self.tensor_model_parallel.size, self.pipeline_model_parallel.size
        per_replica = cp * tp * pp
        if world_size < 1 or world_size % per_replica != 0:
            raise ConfigError(
                f"{prefix}context_parallel.size x tensor_model_parallel.size x pipeline_model_parallel.size "
                f"= {cp} x {tp} x {pp} = {per_replica} does not divide the world size {world_size}; "
                f"allowed: sizes whose product divides {world_size}"
            )
        expert = self.expert_model_parallel
        layout = ParallelLayout(
            tp=tp, cp=cp, pp=pp, dp=world_size // per_replica, ep_includes_cp=expert.include_cp
        )
        implied = layout.dp * layout.tp * (layout.cp if expert.include_cp else 1)
        if expert.size is not None and expert.size != implied:
            spans = "dp x cp x tp" if expert.include_cp else "dp x tp"
            raise ConfigError(
                f"{prefix}expert_model_parallel.size: {expert.size} does not match the expert-parallel group "
                f"of {layout} ({spans} = {implied} ranks); allowed value: {implied}"
            )
        return layout


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | MegacpConfig) -> MegacpConfig:
    """Read megacp's sections from a DeepSpeed config file (hjson; plain JSON parses too) or dict.

    A :class:`MegacpConfig` is returned as is.

    Raises:
        ConfigError: the file is missing or unparseable, or a megacp section is invalid.
    """
    if isinstance(source, MegacpConfig):
        return source
    if isinstance(source, Mapping):
        return MegacpConfig.from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config: expected a path, a dict or a MegacpConfig, got {type(source).__name__}")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file ({err})") from None
    try:
        raw = hjson.loads(text, object_pairs_hook=_unique_keys)
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON/hjson: {str(err).splitlines()[0]}") from None
    return MegacpConfig.from_dict(raw, source=str(path))


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments every megacp script must accept under ``deepspeed``/``torchrun``.

    ``--local_rank``/``--local-rank`` (int; the DeepSpeed launcher appends it, megacp itself reads
    the ``LOCAL_RANK`` environment variable) and ``--deepspeed_config``/``--deepspeed-config``
    (path of the DeepSpeed JSON holding megacp's sections). Returns ``parser``.
    """
    parser.add_argument(
        "--local_rank", "--local-rank", dest="local_rank", type=int,
        default=int(os.environ.get("LOCAL_RANK", "0")),
        help="local rank passed by the launcher (default: $LOCAL_RANK or 0)",
    )
    parser.add_argument(
        "--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
        help="DeepSpeed JSON/hjson config with megacp's context_parallel section",
    )
    return parser


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """hjson object hook: build a dict, rejecting a key written twice in one object."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _describe(err: ValidationError) -> str:
    """One line for the first error of ``err``: the dotted key, the problem, the allowed values."""
    first = err.errors()[0]
    loc = [str(part) for part in first["loc"]]
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
    annotation = info.annotation
    nullable = False
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        nullable = len(members) < len(typing.get_args(annotation))
        annotation = members[0]
    if typing.get_origin(annotation) is Literal:
        text = ", ".join(repr(value) for value in typing.get_args(annotation))
    elif annotation is bool:
        text = "true, false"
    elif annotation is int:
        bounds = [f">= {meta.ge}" for meta in info.metadata if isinstance(meta, annotated_types.Ge)]
        text = "an integer " + " ".join(bounds) if bounds else "an integer"
    else:
        text = getattr(annotation, "__name__", str(annotation))
    return text + (" or null" if nullable else "")
