"""GGUF (llama.cpp) files: config from metadata, tensors dequantised to float32, tokenizer.

Supported ``general.architecture`` values are ``llama`` (Llama, SmolLM, and Mistral, which
llama.cpp also files as ``llama``) and ``qwen2``. Quantised tensors are dequantised with
``gguf.quants.dequantize``; tensors are mapped to Hugging Face names and then through
:func:`megacp.checkpoint.hf.hf_to_megacp`, so shapes are checked and ``fc1`` is stacked the same way
as for Hugging Face checkpoints.

llama.cpp's converter reorders the rows of each Q and K head of ``llama`` models so that the two
rotary halves interleave (row ``2j + half`` holds Hugging Face row ``half * D/2 + j``); the reader
undoes that per head (query heads for Q, KV heads for K). ``qwen2`` files are stored unpermuted.

Mixture-of-experts files (``llama`` with ``expert_count``, i.e. Mixtral; ``qwen2moe``) are refused:
load their Hugging Face checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.hf import hf_to_megacp
from megacp.models.config import ModelConfig

_ARCHITECTURES = ("llama", "qwen2")
_MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe", "mixtral")  # llama.cpp files Mixtral as llama + expert_count
# GGUF name inside ``blk.{i}.`` -> Hugging Face name inside ``model.layers.{i}.``.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_gguf(
    path: str | os.PathLike[str],
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], Any]:
    """Open a GGUF file as megacp tensors.

    Returns:
        ``(config, tensors, tokenizer)``: the :class:`ModelConfig` from the metadata; a lazy iterator
        of ``(megacp name, float32 tensor)`` that dequantises one tensor (two for ``fc1``) at a
        time; and the Hugging Face tokenizer transformers builds from the file's vocabulary
        (with its chat template) — write it out with ``tokenizer.save_pretrained(directory)``.

    Raises:
        CheckpointError: the file is missing, truncated or not GGUF; unsupported architecture or
            rope scaling (raised by this call); a missing or unexpected tensor (raised when the
            stream is first read, before it yields anything); a shape that does not match the
            metadata (raised while iterating).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except Exception as err:  # the gguf package raises assorted errors for corrupt files
        raise CheckpointError(
            f"cannot read GGUF file {path} (truncated or corrupt?): {err}"
        ) from None
    cfg = config_from_gguf(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    for name, tensor in tensors.items():
        if tensor.data.nbytes != tensor.n_bytes:
            raise CheckpointError(f"GGUF file {path} is truncated (tensor {name!r} is incomplete)")
    gguf_names = {_hf_name(name): name for name in tensors}
    tensor_stream = hf_to_megacp(cfg, _dequantizing_getter(cfg, tensors, gguf_names), gguf_names)
    return cfg, tensor_stream, _tokenizer(path)


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    """The :class:`ModelConfig` described by a GGUF file's metadata."""
    arch = _field(reader, "general.architecture")
    experts = _field(reader, f"{arch}.expert_count", 0)
    if arch in _MOE_ARCHITECTURES or experts:
        raise CheckpointError(
            f"GGUF mixture-of-experts models ({arch}, {experts} experts) are not supported; "
            "convert the Hugging Face checkpoint instead"
        )
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            "GGUF files with a rope_freqs tensor (Llama 3.1 style rope scaling) are not supported; "
            "convert the Hugging Face checkpoint instead"
        )
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rotary_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise CheckpointError(
            f"partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported"
        )
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise CheckpointError(
            f"unsupported GGUF rope scaling type {scaling_type!r}; supported: none, linear"
        )
    rope_scaling = None
    if scaling_type == "linear":
        factor = float(_field(reader, f"{arch}.rope.scaling.factor"))
        rope_scaling = {"rope_type": "linear", "factor": factor}
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else int(_field(reader, f"{arch}.vocab_size"))
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
            num_layers=int(_field(reader, f"{arch}.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
            attention_bias=arch == "qwen2",
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
        )
    except ValueError as err:
        raise CheckpointError(f"invalid GGUF metadata: {err}") from None


_REQUIRED = object()


def _field(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise CheckpointError(f"the GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, index, suffix = (gguf_name.split(".", 2) + ["", ""])[:3]
    if prefix != "blk" or not index.isdigit() or suffix not in _LAYER_NAMES:
        raise CheckpointError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{index}.{_LAYER_NAMES[suffix]}"


def _dequantizing_getter(
    cfg: ModelConfig, tensors: dict[str, Any], gguf_names: dict[str, str]
) -> Callable[[str], torch.Tensor]:
    """``get(hf_name)``: dequantise the GGUF tensor to float32 in Hugging Face row order.

    ``tensors`` maps GGUF names to the reader's tensors, ``gguf_names`` Hugging Face to GGUF names.
    """

    def get(hf_name: str) -> torch.Tensor:
        tensor = tensors[gguf_names[hf_name]]
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = torch.from_numpy(values).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        heads = cfg.num_heads if hf_name.endswith("q_proj.weight") else cfg.num_kv_heads
        if cfg.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            if weight.shape[0] == heads * cfg.head_dim:  # else hf_to_megacp reports the shape
                return _unpermute_rotary_rows(weight, heads)
        return weight

    return get


def _unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the two rotary halves (see the module docstring)."""
    rows = weight.shape[0] // heads
    return weight.reshape(heads, rows // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer  # heavy; only needed here

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:  # transformers' GGUF tokenizer conversion raises assorted errors
        raise CheckpointError(f"cannot build a tokenizer from {path}: {err}") from None
