"""Writing one safetensors file whose tensors arrive one at a time, tensor checksums, what a
writer produced, and the ``with``-closing base of the checkpoint readers and writers."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch

from megacp.checkpoint.errors import CheckpointError

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_Closing = TypeVar("_Closing", bound="ClosingContext")


class ClosingContext:
    """``with reader:`` calls ``reader.close()`` on exit (readers and writers owning open files)."""

    def close(self) -> None:
        """Release what the object holds (overridden)."""

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex SHA-256 of a tensor's raw little-endian bytes in row-major order."""
    return hashlib.sha256(_tensor_bytes(tensor)).hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays export the buffer protocol


@dataclass
class WriteSummary:
    """What a checkpoint writer produced."""

    tensors: int
    bytes: int


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
