"""The CP attention layer: a drop-in for TE's ``DotProductAttention`` (and megacp's local one).

The layer converts formats and hands its tensors to the step it is given as ``inference_params``
(a :class:`~megacp.layers.step.CPStep`: prefill, cached prefill, decode, static decode or training),
which runs the attention and owns the KV cache reads and writes. Without one, the inputs are this
rank's load-balanced shard of whole sequences whose full lengths ``cu_seqlens_q`` gives
(Transformer Engine's convention), planned by :func:`~megacp.layers.step.cacheless_step`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from megacp.attention.preconditions import agree, check_inputs
from megacp.layers.attention import (
    DotProductAttention,
    check_call_arguments,
    check_dropout,
    check_format,
    from_thd,
    to_thd,
)
from megacp.layers.settings import CPSettings
from megacp.layers.step import CPStep, cacheless_step, step_fields
from megacp.placement import seq_lengths


def _check_causal(attn_mask_type: str) -> None:
    if "causal" not in attn_mask_type:
        raise ValueError(f"CP attention needs a causal mask, got attn_mask_type={attn_mask_type!r}")


class CPDotProductAttention(DotProductAttention):
    """CP attention with TE ``DotProductAttention``'s constructor arguments and forward.

    Args:
        num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format,
        attn_mask_type, layer_number, softmax_scale, window_size: as TE, in TE's order (``layer_number`` is
        1-based and indexes the KV cache; ``attn_mask_type`` must be causal; see
        :class:`~megacp.layers.attention.DotProductAttention` for ``attention_dropout``).
        settings: the CP settings of a step the layer plans itself (no ``inference_params``);
            default: CP = 1 (:class:`~megacp.layers.settings.CPSettings`).
        te_kwargs: TE's other arguments (:func:`~megacp.layers.attention.check_te_arguments`:
            ``cp_group``, ``cp_global_ranks``, ``cp_comm_type`` and unknown names are refused).
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        layer_number: int | None = None,
        softmax_scale: float | None = None,
        window_size: tuple[int, int] | None = None,
        *,
        settings: CPSettings | None = None,
        **te_kwargs: Any,
    ) -> None:
        super().__init__(num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format=qkv_format,
                         attn_mask_type=attn_mask_type, layer_number=layer_number, softmax_scale=softmax_scale,
                         window_size=window_size, **te_kwargs)
        _check_causal(attn_mask_type)
        self.settings = settings or CPSettings()

    def extra_repr(self) -> str:
        cp = self.settings.cp_size
        return f"heads={self.num_attention_heads}, kv_heads={self.num_gqa_groups}, head_dim={self.kv_channels}, cp={cp}, layer={self.layer_number}"

    def forward(
        self,
        query_layer: Tensor,
        key_layer: Tensor,
        value_layer: Tensor,
        attention_mask: Tensor | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: Tensor | None = None,
        cu_seqlens_kv: Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        inference_params: Any = None,
        **te_kwargs: Any,
    ) -> Tensor:
        """CP attention of this rank's tokens; returns heads flattened. ``te_kwargs``: TE's other
        per-call arguments (:func:`~megacp.layers.attention.check_call_arguments`)."""
        fmt = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        check_format(fmt, mask)
        _check_causal(mask)
        check_call_arguments(self, te_kwargs, mask, cu_seqlens_q, cu_seqlens_kv)
        if attention_mask is not None:
            raise ValueError("attention_mask tensors are not supported under CP: delimit sequences with cu_seqlens")
        check_dropout(self)
        q, k, v = (to_thd(x, fmt) for x in (query_layer, key_layer, value_layer))
        step = inference_params if inference_params is not None else self._cacheless_step(q, k, v, fmt, query_layer, cu_seqlens_q)
        if not isinstance(step, CPStep):
            raise TypeError(f"inference_params must be a megacp CPStep (megacp.layers.step), got {type(inference_params).__name__}")
        return from_thd(step.attend(self, q, k, v, self.softmax_scale, self.sliding_window), query_layer, fmt)

    def _cacheless_step(self, q: Tensor, k: Tensor, v: Tensor, fmt: str, like: Tensor, cu_seqlens: Tensor | None) -> CPStep:
        """The layer's own step for TE's convention (the whole sequences' lengths from ``cu_seqlens``
        or the ``bshd``/``sbhd`` shape); a missing ``cu_seqlens`` is one error on every rank."""
        n = self.settings.cp_size
        if fmt == "thd":
            if cu_seqlens is None:
                error = "qkv_format='thd' under CP needs cu_seqlens_q with the full sequence lengths"
                agree(self.settings.ring, step_fields(None, q, k, v, scale=self.softmax_scale), device=q.device,
                      what="CP attention step", local_error=check_inputs(q, k, v, "CP attention") or error)
            assert cu_seqlens is not None  # the agreement above raised on every rank
            lens = seq_lengths(cu_seqlens)
        else:
            b, s = (like.shape[0], like.shape[1]) if fmt == "bshd" else (like.shape[1], like.shape[0])
            lens = [s * n] * b
        return cacheless_step(self.settings, q, k, v, lens)

    @property
    def layer_index(self) -> int:
        """0-based index of the layer's KV cache rows (``layer_number - 1``)."""
        if self.layer_number is None:
            raise ValueError("a CP attention layer used with a KV cache needs layer_number (1-based)")
        return self.layer_number - 1
