"""The megacp checkpoint format: writing and verified reading.

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
                 ...},
     "manifest_sha256": "..."}             # of every other field (:func:`manifest_sha256`)

Split rules are in :mod:`megacp.checkpoint.tp` (replicated tensors are stored in every rank's file,
so a rank reads exactly one file). Checksums cover each shard's raw bytes and the manifest itself and
are verified on load; so are the model config's values
(:func:`~megacp.checkpoint.values.check_model_values`).

Memory: writers know every tensor's shape before the first byte (from the config), write the
safetensors header first and then each tensor at its precomputed offset as it arrives, in any
order. Saving therefore holds one source tensor at a time plus its dtype-cast copy and one
contiguous shard: a small constant (about 3x) times the largest tensor, never the model. Loading
one rank's shards returns that rank's state dict (the caller asked for it); a reshard on load or a
:meth:`MegacpCheckpoint.get` of a full tensor holds one full tensor plus its parts at a time
(replicated tensors: one copy plus the one being verified).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megacp.checkpoint.dtypes import dtype_from_name, dtype_name
from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.safetensors_io import ClosingContext, SafetensorsWriter, WriteSummary, tensor_sha256
from megacp.checkpoint.shard_manifest import canonical_sha256
from megacp.checkpoint.staging import CHECKPOINT_MARKERS, staged_directory
from megacp.checkpoint.tokenizer_files import TokenizerSource, write_tokenizer
from megacp.checkpoint.tp import (
    check_tp_rank,
    check_tp_size,
    is_replicated,
    merge_shards,
    shard_shape,
    shard_tensor,
)
from megacp.checkpoint.values import check_model_values
from megacp.models.config import ModelConfig
from megacp.models.schema import parameter_shapes

MANIFEST = CHECKPOINT_MARKERS[0]
FORMAT_VERSION = 1


def manifest_sha256(manifest: dict[str, Any]) -> str:
    """Hex SHA-256 of the manifest's fields other than ``manifest_sha256`` (canonical JSON: sorted
    keys, no spaces), so that any edit of a value, order aside, changes it."""
    return canonical_sha256({key: value for key, value in manifest.items() if key != "manifest_sha256"})


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
    check_model_values(cfg, "the model config")
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
        manifest["manifest_sha256"] = manifest_sha256(manifest)
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
            if manifest.get("manifest_sha256") != manifest_sha256(manifest):
                raise CheckpointError(f"{manifest_path}: manifest checksum mismatch: the manifest was edited or is corrupt")
            self.config = check_model_values(ModelConfig.from_dict(manifest["model_config"]), str(manifest_path))
            self.dtype = dtype_from_name(manifest["dtype"])
            self.tp_size = int(manifest["tp_size"])
            self._files = [self.path / name for name in manifest["files"]]
            self._entries: dict[str, dict[str, Any]] = manifest["tensors"]
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
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
