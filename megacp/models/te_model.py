"""The same decoder built from Transformer Engine's ``TransformerLayer`` (optional, GPU only).

The layers are ``te.TransformerLayer(normalization="RMSNorm", activation="swiglu", bias=False,
fuse_qkv_params=False)``, so the state dict keys equal those of :class:`~megacp.models.llama.CausalLM`
built with the torch backend, plus TE's (empty) ``_extra_state`` entries. Embedding, RoPE, final
norm and LM head are megacp's own modules in both backends.

What TE 2.x does (read in its source, ``attention/multi_head_attention.py``, ``attention/rope.py``
and ``transformer.py``, v2.9 and main), and why RoPE is not handed to TE:

* ``TransformerLayer(attn_input_format="thd")`` takes hidden states [T, H]; its
  ``MultiheadAttention`` projects, reshapes q to [T, NH, D] and k/v to [T, NKV, D] and calls
  ``core_attention(q, k, v, qkv_format="thd", cu_seqlens_q=..., cu_seqlens_kv=...,
  attn_mask_type=..., inference_params=..., <TE-only keywords>)`` with q, k, v positional.
* ``rotary_pos_emb`` is applied by TE's fused kernel. In ``thd`` a token's angle is indexed by its
  offset inside its sequence (from ``cu_seqlens``) plus a per-sequence start taken from
  ``inference_params.get_seqlens_pre_step()``: arbitrary per-token global positions (a CP rank's
  non-contiguous tokens) cannot be expressed. In ``sbhd`` the freqs [S, 1, 1, D] are indexed by
  token row, so freqs gathered at each token's global position with the packed tokens as one
  batch-1 sequence [T, 1, H] would rotate correctly — but attention then sees ``qkv_format="sbhd"``
  with one causal mask over all packed sequences, which breaks B > 1.
* From TE 2.16 on, ``MultiheadAttention.forward`` always reads ``core_attention.name`` and sets
  ``core_attention.output_quantizer_role`` / ``grad_input_quantizer_role``: whatever module
  replaces ``core_attention`` must have a ``name`` attribute (``None`` is fine).
* A non-``None`` ``inference_params`` is dereferenced by ``MultiheadAttention`` as TE's own
  ``InferenceParams`` (``cache_manager.cache``, ``allocate_memory``, ``get_seqlens_pre_step``)
  before core attention, so megacp's CP handle cannot be passed through ``TransformerLayer``.

Therefore the TE layers run in ``thd`` without ``rotary_pos_emb`` and with
``inference_params=None``; for the duration of each layer call a forward pre-hook on whatever
module is ``self_attention.core_attention`` at that moment (megacp's local attention, or the CP
layer that replaced it) rotates q and k with megacp's RoPE at the global positions and passes
megacp's ``inference_params``. TE's own ``DotProductAttention`` is replaced at build time by
megacp's, as in the torch backend.

Qwen2's Q/K/V bias is not expressible: ``TransformerLayer(bias=True)`` also adds biases to
``proj``, ``fc1`` and ``fc2``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megacp.layers.attention import DotProductAttention
from megacp.models.config import ModelConfig
from megacp.models.llama import CausalLM
from megacp.models.ops import group_size
from megacp.models.rope import apply_rotary

try:
    import transformer_engine.pytorch as te
except Exception as err:  # noqa: BLE001 — any failure (missing package, CUDA libraries) means "absent"
    te = None
    _TE_IMPORT_ERROR: str | None = f"{type(err).__name__}: {err}"
else:
    _TE_IMPORT_ERROR = None


def te_import_error() -> str | None:
    """Why ``transformer_engine.pytorch`` cannot be used here, or ``None`` when it can."""
    return _TE_IMPORT_ERROR


def check_te_supported(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` when ``cfg`` cannot be built from ``te.TransformerLayer``."""
    if cfg.attention_bias:
        raise ValueError(
            f"backend='te' cannot build {cfg.architecture} with attention_bias=True (Q/K/V bias): "
            "te.TransformerLayer(bias=True) would also add proj/fc1/fc2 biases; use backend='torch'"
        )
    if cfg.num_experts:
        raise ValueError(
            f"backend='te' cannot build {cfg.architecture}: te.TransformerLayer has no expert layers; "
            "use backend='torch'"
        )


def build_te_model(
    cfg: ModelConfig, *, dtype: torch.dtype, device: Any, tp_group: dist.ProcessGroup | None = None
) -> CausalLM:
    """A :class:`CausalLM` whose decoder layers are :class:`TEDecoderLayer` (TE must be importable)."""
    if te is None:
        raise RuntimeError(f"backend='te' needs transformer_engine.pytorch, which is unavailable: {_TE_IMPORT_ERROR}")
    check_te_supported(cfg)
    layers = nn.ModuleList(
        TEDecoderLayer(cfg, i + 1, tp_group, dtype=dtype, device=device) for i in range(cfg.num_layers)
    )
    return CausalLM(cfg, tp_group, dtype=dtype, device=device, layers=layers)


if te is not None:

    class TEDecoderLayer(te.TransformerLayer):
        """``te.TransformerLayer`` with megacp's layer call ``(x, cos, sin, cu_seqlens, inference_params)``."""

        def __init__(
            self, cfg: ModelConfig, layer_number: int, tp_group: dist.ProcessGroup | None,
            *, dtype: torch.dtype, device: Any,
        ):
            tp = group_size(tp_group)
            super().__init__(
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.num_heads,
                num_gqa_groups=cfg.num_kv_heads,
                layernorm_epsilon=cfg.rms_norm_eps,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                layer_number=layer_number,
                kv_channels=cfg.head_dim,
                self_attn_mask_type="causal",
                tp_group=tp_group,
                tp_size=tp,
                set_parallel_mode=tp > 1,
                params_dtype=dtype,
                device=device,
                fuse_qkv_params=False,
                bias=False,
                activation="swiglu",
                normalization="RMSNorm",
                attn_input_format="thd",
            )
            self.self_attention.core_attention = DotProductAttention(
                cfg.num_heads // tp,
                cfg.head_dim,
                num_gqa_groups=cfg.num_kv_heads // tp,
                attn_mask_type="causal",
                qkv_format="thd",
                layer_number=layer_number,
                window_size=None if (w := cfg.layer_window(layer_number - 1)) is None else (w - 1, 0),
            )

        def forward(
            self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
            inference_params: Any = None,
        ) -> torch.Tensor:
            """x [T, H], cos/sin [T, D], cu_seqlens [B+1] int32 -> [T, H]."""

            def rope_and_handle(
                module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
                q, k, v, *rest = args
                rotated = (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, *rest)
                # TE's MultiheadAttention passes the window it was built with (none here: None or
                # (-1, 0)); the layer's window is that of megacp's core attention (window_size=None)
                return rotated, {**kwargs, "inference_params": inference_params, "window_size": None}

            hook = self.self_attention.core_attention.register_forward_pre_hook(
                rope_and_handle, with_kwargs=True
            )
            try:
                return super().forward(x, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
            finally:
                hook.remove()
