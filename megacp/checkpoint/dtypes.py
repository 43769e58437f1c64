"""The dtype names checkpoints store (``float32``, ``bfloat16``, ``float16``)."""

from __future__ import annotations

import torch

from megacp.checkpoint.errors import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
