"""megacp's local (non-CP) core attention with Transformer Engine's ``DotProductAttention`` interface.

Models built from megacp's own modules use this where a TE model has
``transformer_engine.pytorch.DotProductAttention``; :func:`megacp.swap_attention` replaces either
by :class:`~megacp.layers.cp_attention.CPDotProductAttention`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from megacp.attention.kernels.partial import partial_attention
from megacp.attention.training import ring_attention
from megacp.placement import ShardPlan, seq_lengths

QKV_FORMATS = ("thd", "bshd", "sbhd")
MASK_TYPES = ("causal", "no_mask", "padding_causal", "padding")


def to_thd(x: Tensor, qkv_format: str) -> Tensor:
    """``[b,s,h,d]``/``[s,b,h,d]`` → ``[b*s, h, d]`` (batch-major token order); ``thd`` unchanged."""
    if qkv_format == "thd":
        return x
    if qkv_format == "bshd":
        return x.reshape(-1, *x.shape[2:])
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def from_thd(out: Tensor, like: Tensor, qkv_format: str) -> Tensor:
    """Attention output ``[t, h, d]`` → TE's output layout: heads flattened, ``[t, h*d]``,
    ``[b, s, h*d]`` or ``[s, b, h*d]`` following ``like``'s format."""
    flat = out.flatten(1)  # also for a rank that holds no token of the step ([0, h, d])
    width = flat.shape[1]
    if qkv_format == "thd":
        return flat
    if qkv_format == "bshd":
        return flat.view(like.shape[0], like.shape[1], width)
    return flat.view(like.shape[1], like.shape[0], width).transpose(0, 1).contiguous()


def check_format(qkv_format: str, attn_mask_type: str) -> None:
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format={qkv_format!r} is not one of {', '.join(QKV_FORMATS)}")
    if attn_mask_type not in MASK_TYPES:
        raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of {', '.join(MASK_TYPES)}")


def check_dropout(module: nn.Module) -> None:
    """Refuse a training-mode call of an attention module whose ``attention_dropout`` is nonzero
    (megacp's kernels have no dropout: the result would silently differ from the model's)."""
    if module.training and module.attention_dropout:
        raise ValueError(
            f"{type(module).__name__} has attention_dropout={module.attention_dropout} and is in training mode: "
            "attention dropout is not implemented; build the model with attention_dropout=0 (or call eval())"
        )


def sliding_window_of(window_size: tuple[int, int] | None, attn_mask_type: str) -> int | None:
    """The window ``W`` of TE's ``window_size = (W - 1, 0)`` (``None``: no window, also for ``(-1, 0)``
    or ``(-1, -1)``); raises ``ValueError`` for a window megacp cannot run (keys after the query,
    or a window on a non-causal layer)."""
    if window_size is None or tuple(window_size) in ((-1, 0), (-1, -1)):
        return None
    left, right = window_size
    if right not in (0, -1) or left < 0 or "causal" not in attn_mask_type:
        raise ValueError(f"window_size={tuple(window_size)} is not supported: megacp runs causal sliding windows "
                         "(W - 1, 0) only")
    return left + 1


_TE_CP_ARGS = ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type", "ring")
"""Transformer Engine's own CP arguments (and an older ``ring=``): megacp's layers take their ring
from megacp's settings, so a value here would be ignored; it is refused instead."""


def check_te_arguments(layer: str, kwargs: dict[str, Any]) -> None:
    """Refuse the constructor arguments of TE's ``DotProductAttention`` that megacp's layers do not
    honour: TE's CP arguments, a TP size other than 1 (the head counts given are this rank's), a
    cross-attention type, and any unknown name. Accepted and unused: ``sequence_parallel``,
    ``get_rng_state_tracker`` (dropout, refused in training anyway), ``tp_group`` and ``tp_size=1``,
    ``attention_type="self"``, ``softmax_type="vanilla"``.

    Raises:
        TypeError: one line naming the argument.
    """
    for name, value in kwargs.items():
        if name in _TE_CP_ARGS:
            if value is None:
                continue
            raise TypeError(f"{layer}: {name}= is Transformer Engine's own CP; megacp's layer takes its ring from "
                            "megacp (megacp.swap_attention(model, state), or settings=CPSettings.from_state(state))")
        ok = {"sequence_parallel": True, "get_rng_state_tracker": True, "tp_group": True,
              "tp_size": value in (None, 1), "attention_type": value in (None, "self"),
              "softmax_type": value in (None, "vanilla")}.get(name)
        if ok is None:
            raise TypeError(f"{layer}: unexpected keyword argument {name!r}")
        if not ok:
            raise TypeError(f"{layer}: {name}={value!r} is not supported (give this rank's head counts with tp_size=1; "
                            "self-attention with the vanilla softmax only)")


_CALL_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "checkpoint_core_attention": ((False, None), "recomputing core attention in the backward is not implemented"),
    "core_attention_bias_type": (("no_bias", None), "attention biases are not implemented"),
    "core_attention_bias": ((None,), "attention biases are not implemented"),
    "alibi_slopes": ((None,), "ALiBi is not implemented"),
    "pad_between_seqs": ((False, None), "padding between sequences is not supported"),
    "fp8_output": ((False, None), "FP8 attention is not implemented (the output has the inputs' dtype)"),
    "num_splits": ((1, None), "the kernels choose their own splits"),
    "fast_zero_fill": ((True, False, None), ""),
}
"""Per-call arguments of TE's ``DotProductAttention.forward`` that the layers' own signature does
not name: the values a call may give (those that leave the result unchanged) and why others are refused."""


def _is_one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``allowed`` (same type and equal; never compares a tensor elementwise)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


def _shown(value: Any) -> str:
    return f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, Tensor) else repr(value)


def _call_argument_problem(layer: DotProductAttention, name: str, value: Any, attn_mask_type: str,
                           cu_seqlens: dict[str, Tensor | None]) -> str | None:
    """Why the layer cannot honour ``name=value`` in a call, or ``None`` when it does."""
    if name == "window_size":
        if value is None:
            return None
        try:
            window = sliding_window_of(value, attn_mask_type)
        except ValueError as err:
            return str(err)
        if window == layer.sliding_window:
            return None
        return (f"window_size={tuple(value)} differs from the layer's own window_size={layer.window_size}: a layer's "
                "window is set when it is built")
    if name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        unpadded = cu_seqlens[name.removesuffix("_padded")]
        if value is None or (unpadded is not None and torch.equal(value.to(unpadded.device), unpadded)):
            return None
        return (f"{name}={_shown(value)}: padding between sequences is not supported "
                f"(allowed: None or {name.removesuffix('_padded')})")
    if name not in _CALL_ARGS:
        return f"unexpected keyword argument {name!r}"
    allowed, reason = _CALL_ARGS[name]
    if _is_one_of(value, allowed):
        return None
    return f"{name}={_shown(value)}: {reason} (allowed: {', '.join(map(repr, allowed))})"


def check_call_arguments(layer: DotProductAttention, te_kwargs: dict[str, Any], attn_mask_type: str,
                         cu_seqlens_q: Tensor | None, cu_seqlens_kv: Tensor | None) -> None:
    """Refuse the per-call arguments of TE's ``DotProductAttention.forward`` that ``layer`` does not
    honour. Accepted: ``window_size`` ``None`` or equal to the layer's own; ``cu_seqlens_*_padded``
    ``None`` or equal to the unpadded ``cu_seqlens_*``; ``checkpoint_core_attention=False``,
    ``core_attention_bias_type="no_bias"``, ``core_attention_bias=None``, ``alibi_slopes=None``,
    ``pad_between_seqs`` ``None``/``False``, ``fp8_output=False``, ``num_splits=1`` and any
    ``fast_zero_fill`` (outputs hold no padding to fill); ``None`` for each of these as well.

    Raises:
        ValueError: one line naming every argument refused (an unknown name included).
    """
    cu_seqlens = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_kv": cu_seqlens_kv}
    problems = [p for name, value in te_kwargs.items()
                if (p := _call_argument_problem(layer, name, value, attn_mask_type, cu_seqlens)) is not None]
    if problems:
        raise ValueError(f"{type(layer).__name__}.forward: " + "; ".join(problems))


class DotProductAttention(nn.Module):
    """Local attention, TE-compatible constructor and forward.

    Args:
        num_attention_heads: query heads NH; kv_channels: head dim D;
        num_gqa_groups: KV heads NKV (default NH); attention_dropout: kept for TE's signature; a
        module with a nonzero value refuses to run in training mode (dropout is not implemented);
        attn_mask_type: ``"causal"`` or ``"no_mask"`` (``padding*`` variants accepted: sequences are
        delimited by ``cu_seqlens``); qkv_format: default layout of inputs; layer_number: 1-based
        index (TE convention); softmax_scale: default ``1/sqrt(D)``; window_size: TE's sliding
        window ``(left, right)`` of a causal layer: ``(W - 1, 0)`` lets a query at position ``x``
        see keys ``x - W + 1 .. x`` (:attr:`sliding_window` ``= W``); ``None`` or ``(-1, 0)``: full causal.
        te_kwargs: TE's other constructor arguments, checked by :func:`check_te_arguments` (TE's CP
            arguments and unknown names are refused).
    """

    # TE >= 2.16's MultiheadAttention reads and sets `core_attention.name` (quantizer roles)
    name: str | None = None

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
        **te_kwargs: Any,
    ) -> None:
        super().__init__()
        check_te_arguments(type(self).__name__, te_kwargs)
        check_format(qkv_format, attn_mask_type)
        self.window_size = window_size
        self.sliding_window = sliding_window_of(window_size, attn_mask_type)
        self.num_attention_heads = num_attention_heads
        self.kv_channels = kv_channels
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.attention_dropout = attention_dropout
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.backend: str | None = None

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
        """Causal (or unmasked) attention within each sequence; returns heads flattened.
        ``te_kwargs``: TE's other per-call arguments, checked by :func:`check_call_arguments`."""
        fmt = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        check_format(fmt, mask)
        check_call_arguments(self, te_kwargs, mask, cu_seqlens_q, cu_seqlens_kv)
        if inference_params is not None:
            raise TypeError(
                f"{type(self).__name__} is local attention and takes no inference_params; "
                "call megacp.swap_attention(model, state) to get CP attention with a KV cache"
            )
        if attention_mask is not None:
            raise ValueError("attention_mask tensors are not supported: delimit sequences with cu_seqlens")
        check_dropout(self)
        causal = "causal" in mask
        if causal and torch.is_grad_enabled() and any(x.requires_grad for x in (query_layer, key_layer, value_layer)):
            # training: the CP = 1 ring, whose backward takes the fused kernels fed the final out/LSE
            # with the exact path for shapes a kernel refuses (a kernel's own autograd has no fallback)
            q, k, v = (to_thd(x, fmt) for x in (query_layer, key_layer, value_layer))
            if fmt == "thd":
                lens = [q.shape[0]] if cu_seqlens_q is None else seq_lengths(cu_seqlens_q, q.shape[0])
            else:
                b, s = (query_layer.shape[0], query_layer.shape[1]) if fmt == "bshd" else query_layer.shape[1::-1]
                lens = [s] * b
            plan = ShardPlan([0] * len(lens), lens, 1, 0).with_window(self.sliding_window)
            out = ring_attention(q, k, v, plan, None, scale=self.softmax_scale, backend=self.backend)
            return from_thd(out, query_layer, fmt)
        if fmt == "thd":
            bounds = [0, query_layer.shape[0]] if cu_seqlens_q is None else cu_seqlens_q.tolist()
            outs = [
                partial_attention(query_layer[a:b], key_layer[a:b], value_layer[a:b], causal=causal,
                                  scale=self.softmax_scale, backend=self.backend, left=self._left(b - a))[0]
                for a, b in zip(bounds, bounds[1:])
            ]
            return from_thd(torch.cat(outs), query_layer, fmt)
        q, k, v = (x if fmt == "bshd" else x.transpose(0, 1) for x in (query_layer, key_layer, value_layer))
        dense, _lse = partial_attention(q, k, v, causal=causal, scale=self.softmax_scale, backend=self.backend,
                                        left=self._left(q.shape[1]))
        return from_thd(to_thd(dense, "bshd"), query_layer, fmt)

    def _left(self, length: int) -> int | None:
        """The band of a causal sequence of ``length`` tokens under the window (``None``: it covers all)."""
        w = self.sliding_window
        return w - 1 if w is not None and w < length else None
