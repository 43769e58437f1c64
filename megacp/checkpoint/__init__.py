"""Checkpoints: Hugging Face and GGUF import, megacp's own TP-sharded layout, export and reshard.

Modules (imported lazily, so that ``import megacp.checkpoint`` stays cheap):

* :mod:`megacp.checkpoint.hf` — Hugging Face configs, name mapping, streaming reader and writer.
* :mod:`megacp.checkpoint.gguf` — GGUF files (llama.cpp) dequantised to megacp tensors.
* :mod:`megacp.checkpoint.tp` — splitting and merging megacp tensors for tensor parallelism.
* :mod:`megacp.checkpoint.store` — the megacp checkpoint directory (one safetensors file per TP
  rank plus a checksummed manifest).
* :mod:`megacp.checkpoint.convert` — the ``tools/convert_checkpoint.py`` command line.

Every failure caused by the input (a missing or truncated file, an unsupported architecture, a
shape that does not match the config, ...) raises :class:`CheckpointError` with one clear message.
"""

from __future__ import annotations

from megacp._lazy import lazy_getattr


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be read, converted or written as asked."""


_EXPORTS = {
    "config_from_hf": "megacp.checkpoint.hf",
    "config_to_hf": "megacp.checkpoint.hf",
    "hf_to_megacp": "megacp.checkpoint.hf",
    "megacp_to_hf": "megacp.checkpoint.hf",
    "open_hf_checkpoint": "megacp.checkpoint.hf",
    "load_hf_state_dict": "megacp.checkpoint.hf",
    "save_hf_checkpoint": "megacp.checkpoint.hf",
    "load_gguf": "megacp.checkpoint.gguf",
    "shard_tensor": "megacp.checkpoint.tp",
    "merge_shards": "megacp.checkpoint.tp",
    "check_tp_size": "megacp.checkpoint.tp",
    "parameter_shapes": "megacp.checkpoint.store",
    "open_megacp_checkpoint": "megacp.checkpoint.store",
    "load_megacp_checkpoint": "megacp.checkpoint.store",
    "save_megacp_checkpoint": "megacp.checkpoint.store",
}

__all__ = sorted(_EXPORTS) + ["CheckpointError"]


__getattr__ = lazy_getattr(__name__, _EXPORTS)
