"""The megacp checkpoint layout, and the streaming safetensors writer the converters share.

A megacp checkpoint is a directory::

    megacp_checkpoint.json          the manifest (below)
    model-tp00-of-02.safetensors    every tensor as TP rank 0 holds it
    model-tp01-of-02.safetensors    ... one self-contained file per TP rank
    tokenizer.json, ...             tokenizer / generation files, copied as they came

The manifest::

    {"format": "megacp", "version": 1,
     "model_config": {...ModelConfig.to_dict()...},
     "dtype": "bfloat16",                  # every tensor has this dtype
     "tp_size": 2,
     "files": ["model-tp00-of-02.safetensors", "model-tp01-of-02.safetensors"],
     "tensors": {"embedding.weight": {"shape": [V, H],            # the full tensor
                                      "shards": [{"shape": [V, H], "sha256": "..."},   # rank 0
                                                 {"shape": [V, H], "sha256": "..."}]}, # rank 1
                 ...}}

Split rules are in :mod:`megacp.checkpoint.tp` (replicated tensors are stored in every rank's file,
so a rank reads exactly one file). Checksums cover each shard's raw bytes and are verified on load.

Memory: writers know every tensor's shape before the first byte (from the config), write the
safetensors header first and then each tensor at its precomputed offset as it arrives, in any
order. Saving therefore holds one source tensor at a time plus its dtype-cast copy and one
contiguous shard: a small constant (about 3x) times the largest tensor, never the model. Loading
one rank's shards returns that rank's state dict (the caller asked for it); a reshard on load or a
:meth:`MegacpCheckpoint.get` of a full tensor holds one full tensor plus its parts at a time
(replicated tensors: one copy plus the one being verified).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar, Union

import torch
from safetensors import safe_open

from megacp.checkpoint import CheckpointError
from megacp.checkpoint.tp import (
    check_tp_rank,
    check_tp_size,
    is_replicated,
    merge_shards,
    shard_shape,
    shard_tensor,
)
from megacp.models.config import ModelConfig


_Closing = TypeVar("_Closing", bound="ClosingContext")


class ClosingContext:
    """``with reader:`` calls ``reader.close()`` on exit (readers and writers owning open files)."""

    def close(self) -> None:
        """Release what the object holds (overridden)."""

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

MANIFEST = "megacp_checkpoint.json"
FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files a tokenizer or generation setup needs; copied between checkpoint directories as they are.
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every megacp parameter of ``cfg`` with its full (unsharded) shape, in canonical order.

    The names follow Transformer Engine's ``TransformerLayer`` with ``fuse_qkv_params=False``;
    ``fc1_weight`` stacks the SwiGLU gate rows above the up rows. ``lm_head.weight`` is present only
    when the embeddings are not tied.
    """
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        qkv = f"layers.{i}.self_attention.layernorm_qkv"
        shapes[f"{qkv}.layer_norm_weight"] = (h,)
        shapes[f"{qkv}.query_weight"] = (q_out, h)
        shapes[f"{qkv}.key_weight"] = (kv_out, h)
        shapes[f"{qkv}.value_weight"] = (kv_out, h)
        if cfg.attention_bias:
            shapes[f"{qkv}.query_bias"] = (q_out,)
            shapes[f"{qkv}.key_bias"] = (kv_out,)
            shapes[f"{qkv}.value_bias"] = (kv_out,)
        shapes[f"layers.{i}.self_attention.proj.weight"] = (h, q_out)
        mlp = f"layers.{i}.layernorm_mlp"
        shapes[f"{mlp}.layer_norm_weight"] = (h,)
        shapes[f"{mlp}.fc1_weight"] = (2 * f, h)
        shapes[f"{mlp}.fc2_weight"] = (h, f)
    shapes["final_norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a checkpoint dtype name (``float32``, ``bfloat16``, ``float16``)."""
    if name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The checkpoint name of a torch dtype (inverse of :func:`dtype_from_name`)."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise CheckpointError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex SHA-256 of a tensor's raw little-endian bytes in row-major order."""
    return hashlib.sha256(_tensor_bytes(tensor)).hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


# -------------------------------------------------------------------------------------- writing


class SafetensorsWriter(ClosingContext):
    """Writes one safetensors file whose tensors arrive one at a time, in any order.

    The header is computed from ``plan`` and written on construction; :meth:`write` puts each
    tensor's bytes at its offset, so memory never holds more than the tensor being written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        plan: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self._shapes = plan
        element_size = torch.empty((), dtype=dtype).element_size()
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._offsets: dict[str, int] = {}
        offset = 0
        for name, shape in plan.items():
            size = element_size * _numel(shape)
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self._offsets[name] = offset
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)
        self._data_start = 8 + len(encoded)
        self.num_bytes = self._data_start + offset
        self._written: set[str] = set()
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(len(encoded).to_bytes(8, "little") + encoded)
        self._file.truncate(self.num_bytes)

    def write(self, name: str, tensor: torch.Tensor) -> str:
        """Write ``tensor`` (cast to the file's dtype) as ``name``; returns its SHA-256."""
        if name not in self._shapes:
            raise CheckpointError(f"unexpected tensor {name!r} for {self.path.name}")
        if name in self._written:
            raise CheckpointError(f"tensor {name!r} was given twice")
        if tuple(tensor.shape) != self._shapes[name]:
            raise CheckpointError(
                f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(self._shapes[name])}"
            )
        data = _tensor_bytes(tensor.to(self.dtype))
        self._file.seek(self._data_start + self._offsets[name])
        self._file.write(data)
        self._written.add(name)
        return hashlib.sha256(data).hexdigest()

    def finish(self) -> None:
        """Close the file; raises :class:`CheckpointError` if a planned tensor was never written."""
        self.close()
        missing = [name for name in self._shapes if name not in self._written]
        if missing:
            raise CheckpointError(f"missing tensor {missing[0]!r} for {self.path.name}")

    def close(self) -> None:
        """Close the file (it is incomplete unless every planned tensor was written)."""
        self._file.close()



def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@contextmanager
def staged_directory(output_dir: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """Yield a fresh staging directory that replaces ``output_dir`` when the block succeeds.

    The staging directory lies next to ``output_dir`` (same file system, so the final step is a
    rename); on any error it is removed and ``output_dir`` is left untouched.

    Raises:
        CheckpointError: ``output_dir`` exists and ``force`` is false, ``force`` would replace
            something that is not a checkpoint directory, or the parent directory does not exist.
    """
    output = Path(output_dir)
    check_output_dir(output, force=force)
    staging = output.parent / f".{output.name}.{uuid.uuid4().hex[:12]}.tmp"
    staging.mkdir()
    try:
        yield staging
        if output.exists():
            retired = staging.with_suffix(".old")
            os.replace(output, retired)
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_output_dir(output_dir: str | os.PathLike[str], *, force: bool = False) -> None:
    """Raise :class:`CheckpointError` unless :func:`staged_directory` may create ``output_dir``.

    With ``force`` an existing ``output_dir`` is replaced only when it is an empty directory or a
    checkpoint (holds ``megacp_checkpoint.json`` or ``config.json``), never any other path.
    """
    output = Path(output_dir)
    if output.exists() or output.is_symlink():
        if not force:
            raise CheckpointError(f"output {output} already exists (use --force to replace it)")
        if not output.is_dir() or output.is_symlink() or not _is_replaceable(output):
            raise CheckpointError(
                f"refusing to replace {output}: it is not an empty or checkpoint directory"
            )
    if not output.parent.is_dir():
        raise CheckpointError(f"the parent directory of {output} does not exist")


def _is_replaceable(directory: Path) -> bool:
    return not any(directory.iterdir()) or any(
        (directory / marker).is_file() for marker in (MANIFEST, "config.json")
    )


class SavesPretrained(Protocol):
    """Anything with a Hugging Face style ``save_pretrained`` (e.g. a tokenizer object)."""

    def save_pretrained(self, save_directory: str) -> Any: ...


TokenizerSource = Union[str, os.PathLike, SavesPretrained, None]


def write_tokenizer(source: TokenizerSource, directory: Path) -> None:
    """Put the tokenizer into ``directory``: copy the :data:`COMPANION_FILES` a source directory
    has, or call ``source.save_pretrained``; nothing for ``None``."""
    if source is None:
        return
    if hasattr(source, "save_pretrained"):
        source.save_pretrained(str(directory))
        return
    for name in COMPANION_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, directory / name)


@dataclass
class WriteSummary:
    """What a checkpoint writer produced."""

    tensors: int
    bytes: int


def rank_file_name(tp_rank: int, tp_size: int) -> str:
    """The weight file of one TP rank, e.g. ``model-tp00-of-02.safetensors``."""
    return f"model-tp{tp_rank:02d}-of-{tp_size:02d}.safetensors"


def save_megacp_checkpoint(
    output_dir: str | os.PathLike[str],
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    tp_size: int = 1,
    tokenizer: TokenizerSource = None,
    force: bool = False,
) -> WriteSummary:
    """Write a megacp checkpoint from a stream of full (unsharded) megacp tensors.

    Args:
        output_dir: the checkpoint directory to create (replaced only with ``force``).
        cfg: the model config; decides the expected names and shapes.
        tensors: ``(name, full tensor)`` pairs, each name of :func:`parameter_shapes` exactly once,
            in any order (e.g. a model's ``state_dict().items()``; TE ``_extra_state`` entries are
            skipped); consumed lazily (see the module docstring for the memory bound).
        dtype: the stored dtype (tensors are cast on the fly).
        tp_size: number of TP ranks to split into.
        tokenizer: a directory to copy tokenizer files from, or an object with ``save_pretrained``.
        force: replace an existing checkpoint directory.

    Raises:
        CheckpointError: bad TP size, unexpected / missing / misshapen tensor, existing output.
            Nothing is left behind on error.
    """
    check_tp_size(cfg, tp_size)
    dtype_text = dtype_name(dtype)
    shapes = parameter_shapes(cfg)
    files = [rank_file_name(rank, tp_size) for rank in range(tp_size)]
    entries: dict[str, dict[str, Any]] = {
        name: {"shape": list(shape), "shards": [None] * tp_size} for name, shape in shapes.items()
    }
    with staged_directory(output_dir, force=force) as staging, ExitStack() as open_files:
        writers = [
            open_files.enter_context(
                SafetensorsWriter(
                    staging / file_name,
                    {name: shard_shape(cfg, name, shape, rank, tp_size) for name, shape in shapes.items()},
                    dtype,
                    metadata={"megacp_tp_rank": str(rank), "megacp_tp_size": str(tp_size)},
                )
            )
            for rank, file_name in enumerate(files)
        ]
        for name, tensor in tensors:
            if name.endswith("._extra_state"):  # Transformer Engine bookkeeping, not a weight
                continue
            if name not in shapes:
                raise CheckpointError(f"unexpected tensor {name!r}: not a parameter of this config")
            if tuple(tensor.shape) != shapes[name]:
                raise CheckpointError(
                    f"tensor {name!r} has shape {list(tensor.shape)} but the config expects "
                    f"{list(shapes[name])}"
                )
            tensor = tensor.to(dtype)
            for rank, writer in enumerate(writers):
                shard = shard_tensor(cfg, name, tensor, rank, tp_size)
                sha256 = writer.write(name, shard)
                entries[name]["shards"][rank] = {"shape": list(shard.shape), "sha256": sha256}
        for writer in writers:
            writer.finish()
        manifest = {
            "format": "megacp",
            "version": FORMAT_VERSION,
            "model_config": cfg.to_dict(),
            "dtype": dtype_text,
            "tp_size": tp_size,
            "files": files,
            "tensors": entries,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        write_tokenizer(tokenizer, staging)
        total = sum((staging / file_name).stat().st_size for file_name in files)
    return WriteSummary(tensors=len(shapes), bytes=total)


# -------------------------------------------------------------------------------------- reading


class MegacpCheckpoint(ClosingContext):
    """Verified read access to a megacp checkpoint directory (see the module docstring).

    Attributes:
        path: the directory.
        config: the model config.
        dtype: the stored dtype.
        tp_size: the number of TP ranks it is split into.
        names: the megacp tensor names, in canonical order.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        self.path = Path(checkpoint_dir)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{self.path} is not a megacp checkpoint (no {MANIFEST})")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            if manifest.get("format") != "megacp" or manifest.get("version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"{manifest_path}: format {manifest.get('format')!r} version "
                    f"{manifest.get('version')!r} is not megacp version {FORMAT_VERSION}"
                )
            self.config = ModelConfig.from_dict(manifest["model_config"])
            self.dtype = dtype_from_name(manifest["dtype"])
            self.tp_size = int(manifest["tp_size"])
            self._files = [self.path / name for name in manifest["files"]]
            self._entries: dict[str, dict[str, Any]] = manifest["tensors"]
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"invalid manifest {manifest_path}: {err!r}") from None
        self._validate()
        self.names = list(parameter_shapes(self.config))
        self._handles = [self._open(path) for path in self._files]

    def _validate(self) -> None:
        check_tp_size(self.config, self.tp_size)
        expected_files = [self.path / rank_file_name(rank, self.tp_size) for rank in range(self.tp_size)]
        if self._files != expected_files:
            raise CheckpointError(
                f"{self.path / MANIFEST}: files {[p.name for p in self._files]} do not match "
                f"tp_size {self.tp_size}"
            )
        for path in self._files:
            if not path.is_file():
                raise CheckpointError(f"{path} is missing")
        shapes = parameter_shapes(self.config)
        missing = [name for name in shapes if name not in self._entries]
        unexpected = [name for name in self._entries if name not in shapes]
        if missing or unexpected:
            which = (
                f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {unexpected[0]!r}"
            )
            raise CheckpointError(f"{self.path / MANIFEST}: {which}")
        for name, shape in shapes.items():
            entry = self._entries[name]
            expected = [
                list(shard_shape(self.config, name, shape, rank, self.tp_size))
                for rank in range(self.tp_size)
            ]
            try:
                stored = [shard["shape"] for shard in entry["shards"] if isinstance(shard["sha256"], str)]
                valid = entry["shape"] == list(shape) and stored == expected
            except (KeyError, TypeError):
                valid = False
            if not valid:
                raise CheckpointError(
                    f"{self.path / MANIFEST}: the entry of tensor {name!r} is malformed or does not "
                    "match the model config"
                )

    @staticmethod
    def _open(path: Path) -> Any:
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors' own error type: truncated or corrupt header
            raise CheckpointError(f"cannot read {path} (truncated or corrupt?): {err}") from None

    def get_shard(self, name: str, tp_rank: int) -> torch.Tensor:
        """The stored part of ``name`` held by ``tp_rank``, checked against the manifest."""
        if name not in self._entries:
            raise CheckpointError(f"missing tensor {name!r} in {self.path}")
        path = self._files[tp_rank]
        try:
            tensor = self._handles[tp_rank].get_tensor(name)
        except Exception as err:  # absent key or unreadable data
            raise CheckpointError(f"cannot read tensor {name!r} from {path}: {err}") from None
        entry = self._entries[name]["shards"][tp_rank]
        if tensor.dtype != self.dtype or list(tensor.shape) != entry["shape"]:
            raise CheckpointError(
                f"tensor {name!r} in {path} is {tensor.dtype} {list(tensor.shape)}, the manifest says "
                f"{self.dtype} {entry['shape']}"
            )
        if tensor_sha256(tensor) != entry["sha256"]:
            raise CheckpointError(f"checksum mismatch for tensor {name!r} in {path}: the file is corrupt")
        return tensor

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (merged from every rank's part; each part verified).

        A replicated tensor is returned from rank 0's file; the other ranks' copies are read one at
        a time only to verify their checksums, which must all be equal.
        """
        if not is_replicated(name):
            return merge_shards(self.config, name, [self.get_shard(name, r) for r in range(self.tp_size)])
        if len({shard["sha256"] for shard in self._entries[name]["shards"]}) != 1:
            raise CheckpointError(f"{self.path / MANIFEST}: the TP copies of replicated {name!r} differ")
        for rank in range(1, self.tp_size):
            self.get_shard(name, rank)
        return self.get_shard(name, 0)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full tensor in canonical order, one at a time."""
        for name in self.names:
            yield name, self.get(name)

    def load(self, tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
        """The state dict of TP rank ``tp_rank`` of ``tp_size`` (resharded if stored otherwise)."""
        check_tp_rank(self.config, tp_rank, tp_size)
        if tp_size == self.tp_size:
            return {name: self.get_shard(name, tp_rank) for name in self.names}
        return {
            name: shard_tensor(self.config, name, self.get(name), tp_rank, tp_size).clone()
            for name in self.names
        }

    def close(self) -> None:
        """Release the open files."""
        self._handles = []



def open_megacp_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> MegacpCheckpoint:
    """Open a megacp checkpoint for verified, streaming reads (use as a context manager)."""
    return MegacpCheckpoint(checkpoint_dir)


def load_megacp_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tp_rank: int = 0, tp_size: int = 1
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and TP rank ``tp_rank``'s state dict (resharded on load if ``tp_size`` differs).

    Every tensor read is checked against the manifest's SHA-256.

    Raises:
        CheckpointError: missing / truncated / corrupt files, a bad manifest, or heads not
            divisible by ``tp_size``.
    """
    with open_megacp_checkpoint(checkpoint_dir) as checkpoint:
        return checkpoint.config, checkpoint.load(tp_rank, tp_size)
