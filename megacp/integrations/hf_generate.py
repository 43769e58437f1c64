"""Generation with a Hugging Face transformers causal LM under CP: megacp's request loop over the
model's own modules, its attention replaced by ``attn_implementation="megacp"``.

:class:`HFGenerationModel` gives a transformers model the forward megacp's
:class:`~megacp.generate.loop.Generator` calls (this rank's packed new tokens, their global
positions, the step as ``inference_params``); each forward hands the model a :class:`CPCache`, a
transformers ``Cache`` backed by megacp's CP-sharded :class:`~megacp.kv_cache.ShardedKVCache`, and
the step as :data:`~megacp.integrations.transformers.STEP_KWARG`. The step's ``attend`` writes this
rank's new keys and values into the sharded cache and runs the ring prefill (pass-KV or pass-Q) over
the cached prefix and the new tokens, or the all-gather decode: the same steps as megacp's own
models, sessions and chunked prefill included. :class:`megacp.LLM` takes a transformers model
object (:func:`prepare_model`) or a directory whose architecture megacp's own models do not
implement (:func:`megacp.checkpoint.hf.transformers_only`, :func:`load_for_generation`) through it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from megacp.checkpoint.values import all_finite
from megacp.integrations.transformers import (
    NAME,
    STEP_KWARG,
    check_config_architecture,
    check_model,
    verify_attention_calls,
)
from megacp.layers.step import CPStep


class CPCache(Cache):
    """A transformers ``Cache`` for one forward pass of a cached megacp step (prefill chunk or
    decode): the past keys and values live in the step's CP-sharded cache, this rank's share only.

    ``update`` returns the layer's new keys and values ``[B, Hkv, S_new, D]`` as they are: the
    step's attention (which every CP rank runs together) writes them into the sharded cache and
    reads the cached prefix, so the attention function sees as many keys as queries. A model
    called with a ``CPCache`` but without its step as :data:`STEP_KWARG` is refused (it would attend
    over the new tokens only).

    Args:
        step: a cached :class:`~megacp.layers.step.CPStep` (``step.cached``), planned on the cache.
    """

    def __init__(self, step: CPStep) -> None:
        if not step.cached:
            raise ValueError(f"a CPCache needs a step over a KV cache, got a {type(step).__name__}")
        super().__init__(layers=[])
        self.step = step

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: Any = None,
               kwargs: dict[str, Any] | None = None) -> tuple[Tensor, Tensor]:
        """The new keys and values, unchanged (the step writes them when it attends). ``kwargs``:
        the attention's keyword arguments, when transformers hands them to the cache (they must
        then carry this cache's step)."""
        if kwargs is not None and kwargs.get(STEP_KWARG) is not self.step:
            raise ValueError(f"a model called with a CPCache needs its step too: pass {STEP_KWARG}=cache.step")
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached before this step (the longest request's)."""
        return max(self.step.plan.cached)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` as transformers' dynamic cache reports them (megacp's mask
        function builds no mask from them)."""
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """No fixed maximum of all ranks together (each rank's slot holds ``capacity`` tokens)."""
        return -1


@dataclass(frozen=True)
class HFModelInfo:
    """What megacp's generation reads of a transformers model's config (the fields of
    :class:`~megacp.models.config.ModelConfig` the request checks, sessions and the cache use).

    Attributes:
        model_type: the config's ``model_type``; vocab_size, max_position_embeddings: as the config.
        num_layers, num_heads, num_kv_heads, head_dim: the attention's shape (the KV cache's).
        eos_token_id: the stop token(s) of the generation config, else the config's.
        num_experts: 0 (the field the generator's CUDA-graph rule reads; routing runs eagerly).
    """

    model_type: str
    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_id: int | list[int] | None = None
    num_experts: int = 0

    @property
    def eos_token_ids(self) -> list[int]:
        """The stop tokens as a list (empty when the model names none)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def of(cls, config: Any, generation_config: Any = None) -> "HFModelInfo":
        """The info of a transformers ``PretrainedConfig`` (and ``GenerationConfig``).

        Raises:
            ValueError: the config's architecture computes attention its own way
                (:func:`~megacp.integrations.transformers.check_config_architecture`), or the config
                lacks a size generation needs (one line naming it).
        """
        if config is None:
            raise ValueError("megacp.LLM takes a transformers causal LM object (with a config), a directory or a file")
        check_config_architecture(config)
        kind = getattr(config, "model_type", "model")
        sizes = {}
        for key in ("vocab_size", "max_position_embeddings", "num_hidden_layers", "num_attention_heads", "hidden_size"):
            value = getattr(config, key, None)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"the {kind} config has no positive {key} (got {value!r}); megacp cannot size its KV cache")
            sizes[key] = value
        heads = sizes["num_attention_heads"]
        eos = getattr(generation_config, "eos_token_id", None)
        return cls(model_type=kind, vocab_size=sizes["vocab_size"],
                   max_position_embeddings=sizes["max_position_embeddings"], num_layers=sizes["num_hidden_layers"],
                   num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or sizes["hidden_size"] // heads,
                   eos_token_id=eos if eos is not None else getattr(config, "eos_token_id", None))

    @classmethod
    def of_directory(cls, path: str) -> "HFModelInfo":
        """The info of a transformers model directory, from its configs alone (no weights read)."""
        from transformers import GenerationConfig

        from megacp.integrations.transformers import read_transformers_config

        config = read_transformers_config(path)  # CheckpointError (one line) when transformers cannot read it
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: the model config's tokens
            generation = None
        return cls.of(config, generation)


class HFGenerationModel(nn.Module):
    """A transformers causal LM with the forward megacp's :class:`~megacp.generate.loop.Generator`
    calls (the signature of megacp's ``CausalLM``).

    Args:
        model: a transformers ``PreTrainedModel`` with ``attn_implementation="megacp"``, in eval mode.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model
        params = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # transformers renames it

    def forward(self, input_ids: Tensor, positions: Tensor, *, cu_seqlens: Tensor, inference_params: CPStep,
                logits_index: Tensor) -> Tensor:
        """Logits of the tokens ``logits_index`` picks.

        Args:
            input_ids: ``[n]`` int64, this rank's new tokens of the step (packed, the step's order).
            positions: ``[n]`` int64, their global positions (RoPE).
            cu_seqlens: ``[B+1]`` int32 request boundaries among them (the step's plan holds them too).
            inference_params: the cached step (:meth:`Generator._begin`).
            logits_index: ``[k]`` int64 rows of ``input_ids`` whose logits are returned.

        Returns:
            ``[k, V]`` logits in the model's dtype.
        """
        step = inference_params
        if input_ids.numel() == 0:  # this rank holds none of the step's tokens (a prompt shorter than N)
            # transformers' modules cannot reshape zero tokens; a placeholder row goes through them
            # (megacp_attention gives it no keys and a zero output; its logits are never read)
            input_ids, positions = input_ids.new_zeros(1), positions.new_zeros(1)
        out = self.hf(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=True,
                      logits_to_keep=logits_index, **{self._cache_kwarg: CPCache(step), STEP_KWARG: step})
        return out.logits[0]


def prepare_model(model: nn.Module, *, dtype: torch.dtype, state: Any, allow_non_finite: bool = False,
                  verified: bool = False) -> nn.Module:
    """Ready a transformers causal LM (the object itself) for megacp's generation: checked by
    :func:`~megacp.integrations.transformers.check_model`, switched to ``attn_implementation="megacp"``,
    cast to ``dtype``, moved to the state's device, in eval mode, and run once by
    :func:`~megacp.integrations.transformers.verify_attention_calls` (``verified``: it was already,
    by :func:`~megacp.integrations.transformers.load_pretrained`).

    Raises:
        ValueError: the model is no transformers model, has a feature megacp cannot run exactly, or a
            weight holds NaN or inf (unless ``allow_non_finite``); one line, before any work. (The
            transformers family refuses a state that splits it over TP or PP ranks before:
            :func:`~megacp.integrations.transformers.check_mesh`.)
    """
    if not hasattr(model, "set_attn_implementation") or getattr(model, "config", None) is None:
        raise ValueError(f"LLM takes a transformers causal LM object; got a {type(model).__name__}")
    check_model(model, training=False)  # what its class and config state: before anything moves
    if not allow_non_finite:
        bad = next((n for n, p in model.named_parameters() if not all_finite(p)), None)
        if bad is not None:
            raise ValueError(f"the model's weight {bad} holds NaN or inf; pass allow_non_finite=True to load it anyway")
    config: Any = model.config
    if config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)  # type: ignore[operator]  # a transformers PreTrainedModel
    model = model.to(device=state.device, dtype=dtype).eval()
    if not verified:  # a model :func:`load_pretrained` built has had its dry forward
        verify_attention_calls(model)
    return model


def load_for_generation(path: str, *, dtype: torch.dtype, state: Any, allow_non_finite: bool = False) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of a transformers directory, readied by :func:`prepare_model` on the
    state's device (the tokenizer is ``None`` when the directory has none)."""
    from megacp.checkpoint.tokenizer_files import load_tokenizer
    from megacp.integrations.transformers import load_pretrained

    model = load_pretrained(path, dtype=dtype, state=state, training=False)
    has_tokenizer = any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return (prepare_model(model, dtype=dtype, state=state, allow_non_finite=allow_non_finite, verified=True),
            load_tokenizer(path) if has_tokenizer else None)
