"""Checkpoints: Hugging Face and GGUF import, megacp's own TP-sharded format, export, reshard and
loading into a model.

* :mod:`megacp.checkpoint.errors` — :class:`CheckpointError`.
* :mod:`megacp.checkpoint.dtypes` — the stored dtype names.
* :mod:`megacp.checkpoint.safetensors_io` — the streaming safetensors writer, tensor checksums.
* :mod:`megacp.checkpoint.staging` — atomic output directories.
* :mod:`megacp.checkpoint.tokenizer_files` — tokenizer files that travel with a checkpoint.
* :mod:`megacp.checkpoint.values` — config values no model runs with, non-finite weights.
* :mod:`megacp.checkpoint.tp` — splitting and merging megacp tensors for tensor parallelism.
* :mod:`megacp.checkpoint.megacp_format` — the megacp checkpoint directory (one safetensors file
  per TP rank plus a checksummed manifest).
* :mod:`megacp.checkpoint.hf` — Hugging Face configs, name mapping, streaming reader and writer.
* :mod:`megacp.checkpoint.gguf` — GGUF files (llama.cpp) dequantised to megacp tensors (needs the
  optional ``gguf`` package; imported on use).
* :mod:`megacp.checkpoint.load` — :func:`load_model`: any of the above into a built model.
* :mod:`megacp.checkpoint.convert` — the ``tools/convert_checkpoint.py`` command line.

Every failure caused by the input (a missing or truncated file, an unsupported architecture, a
shape that does not match the config, ...) raises :class:`CheckpointError` with one clear message.
"""

from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.hf import (
    config_from_hf,
    config_to_hf,
    hf_to_megacp,
    load_hf_state_dict,
    megacp_to_hf,
    open_hf_checkpoint,
    save_hf_checkpoint,
)
from megacp.checkpoint.load import load_model
from megacp.checkpoint.megacp_format import load_megacp_checkpoint, open_megacp_checkpoint, save_megacp_checkpoint
from megacp.checkpoint.tokenizer_files import load_tokenizer
from megacp.checkpoint.tp import check_tp_size, merge_shards, shard_tensor

__all__ = [
    "CheckpointError",
    "check_tp_size",
    "config_from_hf",
    "config_to_hf",
    "hf_to_megacp",
    "load_hf_state_dict",
    "load_megacp_checkpoint",
    "load_model",
    "load_tokenizer",
    "megacp_to_hf",
    "merge_shards",
    "open_hf_checkpoint",
    "open_megacp_checkpoint",
    "save_hf_checkpoint",
    "save_megacp_checkpoint",
    "shard_tensor",
]
