"""Hugging Face checkpoints: config translation, name mapping, streaming reader and writer.

Supported models are ``LlamaForCausalLM`` (Llama 2/3/3.1, SmolLM), ``MistralForCausalLM`` (without
a sliding window shorter than the context), ``Qwen2ForCausalLM`` (Q/K/V bias) and the
mixture-of-experts ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (shared expert, dense
``mlp_only_layers``), whose experts are stored one tensor per expert and projection, as transformers
saves them (``block_sparse_moe.experts.{e}.w1/w2/w3`` and ``mlp.experts.{e}.gate_proj/up_proj/down_proj``);
megacp stacks them over the experts (:mod:`megacp.models.moe`). Both config
styles occur in the wild and are read: transformers 4 (``rope_theta`` + ``rope_scaling``) and
transformers 5 (``rope_parameters`` holding ``rope_theta``); :func:`config_to_hf` writes both.

The tensor mappings stream: :func:`hf_to_megacp` and :func:`megacp_to_hf` fetch the tensors they need
through a ``get(name)`` callback and yield one converted tensor at a time, so a converter never
holds more than a couple of tensors of the model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megacp.checkpoint.dtypes import dtype_name
from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.safetensors_io import ClosingContext, SafetensorsWriter, WriteSummary
from megacp.checkpoint.staging import staged_directory
from megacp.checkpoint.tokenizer_files import TokenizerSource, write_tokenizer
from megacp.checkpoint.values import check_model_values
from megacp.models.config import ModelConfig
from megacp.models.schema import parameter_shapes

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
_ARCH_OF_CLASS = {cls: arch for arch, cls in _HF_CLASSES.items()}
# The transformers defaults of ``max_position_embeddings`` when a config.json omits it.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "mixtral": 131072, "qwen2_moe": 32768}
_ROPE_PARAMETERS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}

# megacp name suffix inside ``layers.{i}.`` -> Hugging Face suffixes inside ``model.layers.{i}.``;
# two HF tensors are stacked along dim 0 (gate rows first, then up) into one megacp tensor.
_LAYER_NAMES = {
    "self_attention.layernorm_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "self_attention.layernorm_qkv.query_weight": ("self_attn.q_proj.weight",),
    "self_attention.layernorm_qkv.key_weight": ("self_attn.k_proj.weight",),
    "self_attention.layernorm_qkv.value_weight": ("self_attn.v_proj.weight",),
    "self_attention.layernorm_qkv.query_bias": ("self_attn.q_proj.bias",),
    "self_attention.layernorm_qkv.key_bias": ("self_attn.k_proj.bias",),
    "self_attention.layernorm_qkv.value_bias": ("self_attn.v_proj.bias",),
    "self_attention.proj.weight": ("self_attn.o_proj.weight",),
    "layernorm_mlp.layer_norm_weight": ("post_attention_layernorm.weight",),
    "layernorm_mlp.fc1_weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "layernorm_mlp.fc2_weight": ("mlp.down_proj.weight",),
}
# megacp MoE name suffix inside ``layers.{i}.moe.`` -> Hugging Face suffixes inside
# ``model.layers.{i}.`` per architecture; ``{e}`` runs over the experts (expert-major, then the listed
# projections), and the parts are stacked along dim 0 and viewed as the megacp shape.
_MOE_NAMES = {
    "mixtral": {
        "layer_norm_weight": ("post_attention_layernorm.weight",),
        "router_weight": ("block_sparse_moe.gate.weight",),
        "expert_fc1_weight": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
        "expert_fc2_weight": ("block_sparse_moe.experts.{e}.w2.weight",),
    },
    "qwen2_moe": {
        "layer_norm_weight": ("post_attention_layernorm.weight",),
        "router_weight": ("mlp.gate.weight",),
        "expert_fc1_weight": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "expert_fc2_weight": ("mlp.experts.{e}.down_proj.weight",),
        "shared_fc1_weight": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "shared_fc2_weight": ("mlp.shared_expert.down_proj.weight",),
        "shared_gate_weight": ("mlp.shared_expert_gate.weight",),
    },
}
_GLOBAL_NAMES = {
    "embedding.weight": ("model.embed_tokens.weight",),
    "final_norm.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
}

Getter = Callable[[str], torch.Tensor]


# --------------------------------------------------------------------------------------- config


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` (as a dict) into a :class:`ModelConfig`.

    Raises:
        CheckpointError: the architecture, activation, rope type or sliding window is not supported,
            a required key is missing, or a value is out of range
            (:func:`~megacp.checkpoint.values.check_model_values`).
    """
    arch = _architecture(hf_config)
    if hf_config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf_config['hidden_act']!r} is not supported (only 'silu')")
    if hf_config.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported: megacp's MLP has no bias")
    if arch not in ("qwen2", "qwen2_moe") and hf_config.get("attention_bias"):
        raise CheckpointError(
            f"attention_bias=true is not supported for {arch} (it adds an o_proj bias megacp lacks)"
        )
    num_heads = _required(hf_config, "num_attention_heads")
    max_positions = hf_config.get("max_position_embeddings")
    max_positions = _DEFAULT_MAX_POSITIONS[arch] if max_positions is None else max_positions
    windows = _windows_from_hf(arch, hf_config, _required(hf_config, "num_hidden_layers"))
    rope_theta, rope_scaling = _rope_from_hf(hf_config)
    moe = _moe_from_hf(arch, hf_config)
    try:
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=_required(hf_config, "vocab_size"),
            hidden_size=_required(hf_config, "hidden_size"),
            intermediate_size=_required(hf_config, "intermediate_size"),
            num_layers=_required(hf_config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_dim=hf_config.get("head_dim") or _required(hf_config, "hidden_size") // num_heads,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            attention_bias=arch == "qwen2" or (arch == "qwen2_moe" and bool(hf_config.get("qkv_bias", True))),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_id=hf_config.get("eos_token_id"),
            **moe,
            **windows,
        )
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"invalid Hugging Face config: {err}") from None
    return check_model_values(cfg, "the Hugging Face config")


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of ``cfg`` for transformers 5 ``AutoConfig``.

    RoPE is written in both styles (``rope_parameters``, and ``rope_theta`` + ``rope_scaling``) so
    that transformers 4 reads it too.
    """
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope_parameters = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    hf_config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if cfg.architecture == "llama":
        hf_config.update(attention_bias=False, mlp_bias=False)
    elif cfg.architecture in ("mistral", "mixtral"):
        hf_config["sliding_window"] = cfg.sliding_window
    else:
        hf_config.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                         max_window_layers=0)
    if cfg.sliding_window is not None:
        hf_config["layer_types"] = [
            "sliding_attention" if cfg.layer_window(i) is not None else "full_attention" for i in range(cfg.num_layers)]
    if cfg.architecture == "mixtral":
        hf_config.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                         router_jitter_noise=0.0)
    elif cfg.architecture == "qwen2_moe":
        hf_config.update(
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
            qkv_bias=cfg.attention_bias,
        )
    return hf_config


def _moe_from_hf(arch: str, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` expert fields of a Mixtral or Qwen2-MoE config (none for dense ones)."""
    if arch == "mixtral":
        if hf_config.get("router_jitter_noise"):
            raise CheckpointError(
                f"router_jitter_noise={hf_config['router_jitter_noise']} is not supported (only 0)"
            )
        return dict(
            num_experts=_required(hf_config, "num_local_experts"),
            num_experts_per_tok=_required(hf_config, "num_experts_per_tok"),
            norm_topk_prob=True,
        )
    if arch == "qwen2_moe":
        mlp_only = hf_config.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or any(type(i) is not int for i in mlp_only):
            raise CheckpointError(f"the Hugging Face config's 'mlp_only_layers' must list layer indices, got {mlp_only!r}")
        return dict(
            num_experts=_required(hf_config, "num_experts"),
            num_experts_per_tok=_required(hf_config, "num_experts_per_tok"),
            moe_intermediate_size=_required(hf_config, "moe_intermediate_size"),
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=_required(hf_config, "shared_expert_intermediate_size"),
            decoder_sparse_step=hf_config.get("decoder_sparse_step", 1),
            mlp_only_layers=list(mlp_only),
        )
    return {}


def own_architectures() -> tuple[str, ...]:
    """The transformers classes whose checkpoints megacp's own models implement (what ``hf-to-megacp``
    converts): Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE."""
    return tuple(_HF_CLASSES.values())


def implements(hf_config: dict[str, Any]) -> bool:
    """Whether megacp's own models implement the architecture a Hugging Face ``config.json`` names
    (its one ``architectures`` class, else its ``model_type``)."""
    classes = hf_config.get("architectures") or []
    return len(classes) == 1 and classes[0] in _ARCH_OF_CLASS if classes else hf_config.get("model_type") in _HF_CLASSES


def transformers_only(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a Hugging Face model directory whose architecture megacp's own models
    do not implement (:class:`megacp.LLM` then runs it through transformers' modules)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        hf_config = json.loads(config.read_text())
    except (OSError, ValueError):  # unreadable: megacp's loader says why
        return False
    return isinstance(hf_config, dict) and not implements(hf_config)


def _architecture(hf_config: dict[str, Any]) -> str:
    classes = hf_config.get("architectures") or []
    if classes:
        if len(classes) != 1 or classes[0] not in _ARCH_OF_CLASS:
            raise CheckpointError(
                f"unsupported architecture {', '.join(map(str, classes))}; "
                f"supported: {', '.join(_ARCH_OF_CLASS)}"
            )
        return _ARCH_OF_CLASS[classes[0]]
    model_type = hf_config.get("model_type")
    if model_type not in _HF_CLASSES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(_HF_CLASSES)}"
        )
    return model_type


def _required(hf_config: dict[str, Any], key: str) -> int:
    """A required size of the config: a positive integer."""
    value = hf_config.get(key)
    if value is None:
        raise CheckpointError(f"the Hugging Face config has no {key!r}")
    if type(value) is not int or value < 1:
        raise CheckpointError(f"the Hugging Face config's {key!r} must be a positive integer, got {value!r}")
    return value


def _windows_from_hf(arch: str, hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The :class:`ModelConfig` window fields: Mistral/Mixtral's ``sliding_window`` (transformers'
    MistralConfig defaults to 4096 tokens when config.json omits the key), Qwen2's under
    ``use_sliding_window`` on the layers from ``max_window_layers`` on, and ``layer_types`` where
    the config lists them."""
    if arch in ("mistral", "mixtral"):
        window = hf_config.get("sliding_window", 4096 if arch == "mistral" else None)
    elif arch in ("qwen2", "qwen2_moe") and hf_config.get("use_sliding_window"):
        window = hf_config.get("sliding_window")
    else:
        window = None
    if window is None:
        return {}
    types = hf_config.get("layer_types")
    if types is None and arch in ("qwen2", "qwen2_moe"):
        first = hf_config.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return {"sliding_window": window, "layer_types": list(types) if types is not None else None}


def _rope_from_hf(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config style; ``None`` scaling for plain RoPE."""
    params = hf_config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or ("rope_theta" not in params and "rope_type" not in params):
            raise CheckpointError(f"unsupported rope_parameters {params!r} (per-layer-type RoPE?)")
        scaling: dict[str, Any] = params
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    else:
        scaling = hf_config.get("rope_scaling") or {}
        theta = hf_config.get("rope_theta", 10000.0)
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in _ROPE_PARAMETERS:
        raise CheckpointError(
            f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(_ROPE_PARAMETERS)}"
        )
    missing = [key for key in _ROPE_PARAMETERS[rope_type] if key not in scaling]
    if missing:
        raise CheckpointError(f"rope_type {rope_type!r} needs {', '.join(missing)} in the config")
    return float(theta), {"rope_type": rope_type, **{k: scaling[k] for k in _ROPE_PARAMETERS[rope_type]}}


# --------------------------------------------------------------------------------- name mapping


def hf_names_of(megacp_name: str, cfg: ModelConfig | None = None) -> tuple[str, ...]:
    """The Hugging Face tensor names that make up one megacp tensor, in stacking order (two for
    ``fc1_weight``; per expert for the expert tensors of an MoE layer, which need ``cfg``)."""
    if megacp_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[megacp_name]
    prefix, index, suffix = (megacp_name.split(".", 2) + ["", ""])[:3]
    if prefix == "layers" and index.isdigit() and suffix.startswith("moe.") and cfg is not None:
        parts = _MOE_NAMES.get(cfg.architecture, {}).get(suffix[len("moe."):])
        if parts is not None:
            experts = range(cfg.num_experts) if "{e}" in parts[0] else [0]
            return tuple(f"model.layers.{index}.{part.format(e=e)}" for e in experts for part in parts)
    if prefix != "layers" or not index.isdigit() or suffix not in _LAYER_NAMES:
        raise CheckpointError(f"{megacp_name!r} is not a megacp parameter name")
    return tuple(f"model.layers.{index}.{part}" for part in _LAYER_NAMES[suffix])


def _part_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """The shape of each of ``parts`` Hugging Face tensors stacked into a megacp tensor of ``shape``."""
    if parts == 1 and len(shape) < 3:
        return shape
    return (math.prod(shape[:-1]) // parts, shape[-1])


def hf_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of ``cfg`` with its shape, in megacp's canonical order."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in parameter_shapes(cfg).items():
        sources = hf_names_of(name, cfg)
        for source in sources:
            shapes[source] = _part_shape(shape, len(sources))
    return shapes


def hf_to_megacp(
    cfg: ModelConfig, get: Getter, names: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the megacp tensors of a Hugging Face checkpoint, in canonical order.

    Args:
        cfg: the model's config (decides which tensors exist and their shapes).
        get: returns the Hugging Face tensor of a name; called once per needed name.
        names: every tensor name the checkpoint holds. Rotary ``inv_freq`` buffers and, for tied
            embeddings, a stored ``lm_head.weight`` are ignored; any other unknown name is an error.

    Raises:
        CheckpointError: a tensor is missing, unexpected, or has a shape the config does not allow.
            Missing and unexpected names are reported before the first tensor is yielded.
    """
    shapes = parameter_shapes(cfg)
    _check_names(cfg, shapes, set(names), hf=True)
    hf_shapes = hf_parameter_shapes(cfg)
    for name, shape in shapes.items():
        parts = [_checked(source, get(source), hf_shapes[source]) for source in hf_names_of(name, cfg)]
        yield name, (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)


def megacp_to_hf(
    cfg: ModelConfig, get: Getter, names: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the Hugging Face tensors of a megacp checkpoint (``fc1`` is split into gate and up,
    stacked expert tensors into one tensor per expert).

    ``names`` are the megacp names present; Transformer Engine ``_extra_state`` entries are ignored.

    Raises:
        CheckpointError: as :func:`hf_to_megacp`.
    """
    shapes = parameter_shapes(cfg)
    _check_names(cfg, shapes, set(names), hf=False)
    for name, shape in shapes.items():
        targets = hf_names_of(name, cfg)
        tensor = _checked(name, get(name), shape)
        if len(targets) == 1 and len(shape) < 3:
            yield targets[0], tensor
        else:
            for target, part in zip(targets, tensor.reshape(-1, shape[-1]).chunk(len(targets))):
                yield target, part.clone()


def _check_names(
    cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], present: set[str], *, hf: bool
) -> None:
    expected = [source for name in shapes for source in hf_names_of(name, cfg)] if hf else list(shapes)
    missing = [name for name in expected if name not in present]
    if missing:
        raise CheckpointError(_first_of("missing", missing))
    unexpected = sorted(name for name in present - set(expected) if not _ignorable(cfg, name, hf=hf))
    if unexpected:
        features = (", tied embeddings" if cfg.tie_word_embeddings else "") + (
            ", Q/K/V bias" if cfg.attention_bias else ""
        ) + (f", {cfg.num_experts} experts" if cfg.num_experts else "")
        raise CheckpointError(
            f"{_first_of('unexpected', unexpected)}: not part of a {cfg.architecture} model with "
            f"{cfg.num_layers} layers{features}"
        )


def _first_of(kind: str, names: list[str]) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{kind} tensor {names[0]!r}{more}"


def _ignorable(cfg: ModelConfig, name: str, *, hf: bool) -> bool:
    if hf:
        tied_head = cfg.tie_word_embeddings and name == "lm_head.weight"
        return tied_head or name.endswith("rotary_emb.inv_freq")
    return name.endswith("._extra_state")


def _checked(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"tensor {name!r} has shape {list(tensor.shape)} but the config expects {list(shape)}"
        )
    return tensor


# ------------------------------------------------------------------------------------- reading


class HFCheckpoint(ClosingContext):
    """Streaming read access to a Hugging Face checkpoint directory.

    Weights are read from ``model.safetensors`` (or shards listed in
    ``model.safetensors.index.json``), else from legacy ``pytorch_model.bin`` (or its sharded index).
    safetensors files are memory-mapped and each :meth:`get` copies out one tensor; ``.bin`` shards
    are loaded one at a time (memory-mapped where the file format allows).

    Attributes:
        path: the directory.
        hf_config: the parsed ``config.json``.
        config: the translated :class:`ModelConfig`.
        names: every tensor name in the checkpoint.
    """

    def __init__(self, hf_dir: str | os.PathLike[str]) -> None:
        self.path = Path(hf_dir)
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "does not exist"
            raise CheckpointError(f"Hugging Face checkpoint directory {self.path} {what}")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} does not exist")
        try:
            self.hf_config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {config_path}: {err}") from None
        self.config = config_from_hf(self.hf_config)
        self._safetensors: dict[str, Any] = {}
        self._bin: tuple[str, dict[str, torch.Tensor]] | None = None
        self._file_of = self._locate_weights()
        self.names = list(self._file_of)

    def _locate_weights(self) -> dict[str, str]:
        for index_name, single_name in (
            ("model.safetensors.index.json", "model.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin"),
        ):
            index = self.path / index_name
            if index.is_file():
                try:
                    weight_map = dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
                except (OSError, ValueError, KeyError, TypeError) as err:
                    raise CheckpointError(f"cannot read {index}: {err!r}") from None
                for file_name in sorted(set(weight_map.values())):
                    if not (self.path / file_name).is_file():
                        raise CheckpointError(f"{index} lists {file_name}, which does not exist")
                return weight_map
            if (self.path / single_name).is_file():
                return dict.fromkeys(self._file_keys(single_name), single_name)
        raise CheckpointError(
            f"{self.path} holds no weights (model.safetensors, pytorch_model.bin or their index)"
        )

    def _file_keys(self, file_name: str) -> Iterable[str]:
        if file_name.endswith(".safetensors"):
            return self._open_safetensors(file_name).keys()
        return self._load_bin(file_name).keys()

    def _open_safetensors(self, file_name: str) -> Any:
        if file_name not in self._safetensors:
            try:
                self._safetensors[file_name] = safe_open(str(self.path / file_name), framework="pt")
            except Exception as err:  # safetensors raises its own error type for bad files
                raise CheckpointError(f"cannot read {self.path / file_name}: {err}") from None
        return self._safetensors[file_name]

    def _load_bin(self, file_name: str) -> dict[str, torch.Tensor]:
        if self._bin is None or self._bin[0] != file_name:
            self._bin = None
            path = self.path / file_name
            try:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as err:
                    if "mmap" not in str(err):
                        raise
                    state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # torch raises many types for corrupt or truncated files
                raise CheckpointError(f"cannot read {path}: {err}") from None
            if not isinstance(state, dict):
                raise CheckpointError(f"{path} does not hold a state dict")
            self._bin = (file_name, state)
        return self._bin[1]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (dtype unchanged)."""
        if name not in self._file_of:
            raise CheckpointError(f"missing tensor {name!r} in {self.path}")
        file_name = self._file_of[name]
        try:
            if file_name.endswith(".safetensors"):
                return self._open_safetensors(file_name).get_tensor(name)
            return self._load_bin(file_name)[name]
        except CheckpointError:
            raise
        except Exception as err:  # a key listed in the index but absent from the file, bad data
            raise CheckpointError(
                f"cannot read tensor {name!r} from {self.path / file_name}: {err}"
            ) from None

    def close(self) -> None:
        """Release the open files."""
        self._safetensors.clear()
        self._bin = None



def open_hf_checkpoint(hf_dir: str | os.PathLike[str]) -> HFCheckpoint:
    """Open a Hugging Face checkpoint directory for streaming reads (use as a context manager)."""
    return HFCheckpoint(hf_dir)


def load_hf_state_dict(hf_dir: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the whole megacp-named state dict of a Hugging Face checkpoint."""
    with open_hf_checkpoint(hf_dir) as checkpoint:
        return checkpoint.config, dict(hf_to_megacp(checkpoint.config, checkpoint.get, checkpoint.names))


# ------------------------------------------------------------------------------------- writing


def save_hf_checkpoint(
    output_dir: str | os.PathLike[str],
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    tokenizer: TokenizerSource = None,
    force: bool = False,
) -> WriteSummary:
    """Write a Hugging Face checkpoint (``config.json``, ``model.safetensors``, tokenizer files).

    Args:
        output_dir: the directory to create (replaced only with ``force``).
        cfg: the model config.
        tensors: ``(Hugging Face name, tensor)`` pairs, e.g. from :func:`megacp_to_hf`, each name of
            :func:`hf_parameter_shapes` once; streamed into the file one at a time.
        dtype: the stored dtype (tensors are cast on the fly).
        tokenizer: a directory to copy tokenizer files from, or an object with ``save_pretrained``.
        force: replace an existing checkpoint directory.

    Raises:
        CheckpointError: unexpected / missing / misshapen tensor, existing output. Nothing is left
            behind on error.
    """
    hf_config = {**config_to_hf(cfg), "dtype": dtype_name(dtype)}
    shapes = hf_parameter_shapes(cfg)
    with staged_directory(output_dir, force=force) as staging:
        with SafetensorsWriter(staging / "model.safetensors", shapes, dtype) as writer:
            for name, tensor in tensors:
                writer.write(name, tensor)
            writer.finish()
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        write_tokenizer(tokenizer, staging)
        return WriteSummary(tensors=len(shapes), bytes=writer.num_bytes)
