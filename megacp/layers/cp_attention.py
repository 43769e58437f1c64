"""The CP attention layer: a drop-in for TE's ``DotProductAttention`` (and megacp's local one).

Prefill steps run the pass-KV or pass-Q ring over the CP group; decode steps (every request adds
one token, with a KV cache) run all-gather decode. With autograd on and inputs that need
gradients (training, no cache), the differentiable pass-KV ring of :mod:`megacp.attention.training`
runs instead. The KV cache, the sharding plan and the
strategies arrive through ``inference_params`` (a :class:`~megacp.layers.step.CPStep`). Without
one, the inputs are taken to be this rank's load-balanced shard of whole sequences whose full
lengths ``cu_seqlens_q`` gives (Transformer Engine's CP convention), prefilled without a cache.

Before any other collective, the CP ranks agree on the step (plan, options, head shapes, dtypes and
each rank's verdict on its inputs; :meth:`CPStep.agree`): once per :class:`CPStep`, at its first
layer, or at every call without ``inference_params``. A mismatch is one ``ValueError`` on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megacp.attention.training import ring_attention
from megacp.attention.decode import allgather_decode, static_decode
from megacp.attention.preconditions import agree, check_inputs
from megacp.attention.prefill import build_kv_block, cp_prefill
from megacp.layers.attention import DotProductAttention, check_dropout, check_format, from_thd, to_thd
from megacp.layers.step import CPStep, StaticDecodeStep, step_fields
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan, seq_lengths


def _check_causal(attn_mask_type: str) -> None:
    if "causal" not in attn_mask_type:
        raise ValueError(f"CP attention needs a causal mask, got attn_mask_type={attn_mask_type!r}")


def _step_error(step: CPStep, q: Tensor, training: bool) -> str | None:
    """What this rank's inputs lack for ``step`` (found before any collective), or ``None``."""
    plan = step.plan
    if training and step.cache is not None:
        return ("the CP layer computes gradients only without a KV cache (training); run cached prefill and "
                "decode under torch.no_grad() or torch.inference_mode()")
    if step.replicated and q.shape[0] != plan.num_requests:
        return f"a decode step of {plan.num_requests} requests needs one query token each on every CP rank; got {q.shape[0]}"
    if not step.replicated and q.shape[0] != plan.num_local():
        return f"CP rank {plan.rank} got {q.shape[0]} tokens but the step's plan gives it {plan.num_local()}"
    return None


class CPDotProductAttention(DotProductAttention):
    """CP attention with TE ``DotProductAttention``'s constructor arguments and forward.

    Args:
        num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format,
        attn_mask_type, layer_number, softmax_scale: as TE, in TE's order (``layer_number`` is
        1-based and indexes the KV cache; ``attn_mask_type`` must be causal; see
        :class:`~megacp.layers.attention.DotProductAttention` for ``attention_dropout``).
        ring: the CP ring used when a step brings none.
        strategy: default prefill strategy when a step brings none.
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
        *,
        ring: Ring | None = None,
        strategy: str = "auto",
        **_: Any,
    ) -> None:
        super().__init__(num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format=qkv_format,
                         attn_mask_type=attn_mask_type, layer_number=layer_number, softmax_scale=softmax_scale)
        _check_causal(attn_mask_type)
        self.ring = ring
        self.strategy = strategy

    def extra_repr(self) -> str:
        cp = self.ring.size if self.ring else 1
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
        **_: Any,
    ) -> Tensor:
        fmt = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        check_format(fmt, mask)
        _check_causal(mask)
        if attention_mask is not None:
            raise ValueError("attention_mask tensors are not supported under CP: delimit sequences with cu_seqlens")
        check_dropout(self)
        q, k, v = (to_thd(x, fmt) for x in (query_layer, key_layer, value_layer))
        if isinstance(inference_params, StaticDecodeStep):
            return from_thd(self._static_decode(inference_params, q, k, v), query_layer, fmt)
        if inference_params is not None and not isinstance(inference_params, CPStep):
            raise TypeError(f"inference_params must be a megacp CPStep or StaticDecodeStep, got {type(inference_params).__name__}")
        error, step = check_inputs(q, k, v, "CP attention"), inference_params
        if step is None:
            try:
                step = self._cacheless_step(q, fmt, query_layer, cu_seqlens_q)
            except ValueError as exc:  # raised on every rank by the agreement below
                error = error or str(exc)
        training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        backend = (step.backend if step else None) or self.backend
        if step is None:  # raises on every rank (this one's error is set)
            agree(self.ring, step_fields(None, q, k, v, scale=self.softmax_scale, backend=backend, training=training),
                  device=q.device, what="CP attention step", local_error=error)
        step.agree(q, k, v, scale=self.softmax_scale, backend=backend, training=training,
                   local_error=error or _step_error(step, q, training))
        out = self._decode(step, q, k, v) if step.replicated else self._prefill(step, q, k, v)
        return from_thd(out, query_layer, fmt)

    def _cacheless_step(self, q: Tensor, fmt: str, like: Tensor, cu_seqlens: Tensor | None) -> CPStep:
        n, r = (self.ring.size, self.ring.rank) if self.ring else (1, 0)
        if fmt == "thd":
            if cu_seqlens is None:
                raise ValueError("qkv_format='thd' under CP needs cu_seqlens_q with the full sequence lengths")
            lens = seq_lengths(cu_seqlens)
        else:
            b, s = (like.shape[0], like.shape[1]) if fmt == "bshd" else (like.shape[1], like.shape[0])
            lens = [s * n] * b
        plan = ShardPlan([0] * len(lens), lens, n, r)
        if plan.num_local() != q.shape[0]:
            raise ValueError(
                f"CP rank {r} got {q.shape[0]} tokens but the load-balanced shard of sequences {lens} has {plan.num_local()}"
            )
        return CPStep(plan, self.ring, strategy=self.strategy)

    @property
    def _layer(self) -> int:
        if self.layer_number is None:
            raise ValueError("a CP attention layer used with a KV cache needs layer_number (1-based)")
        return self.layer_number - 1

    def _prefill(self, step: CPStep, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        plan = step.plan
        if step.cache is None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            # training: the differentiable pass-KV ring (K/V gradients travel back around the ring)
            return ring_attention(q, k, v, plan, step.ring, scale=self.softmax_scale, backend=step.backend or self.backend)
        cached = None
        if step.cache is not None:
            cache, slots, layer = step.cache, step.slots, self._layer
            cache.write(layer, slots, plan, k, v)
            prefix = plan.prefix_counts[plan.rank]
            cached = lambda i: cache.kv(layer, slots[i], prefix[i])  # noqa: E731
        block = build_kv_block(plan, k, v, cached)
        strategy = step.prefill_strategy(q.shape[1], k.shape[1], k.element_size(), q.device)
        return cp_prefill(q, block, plan, step.ring, strategy=strategy, scale=self.softmax_scale, backend=step.backend or self.backend)

    def _decode(self, step: CPStep, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        plan, cache, slots, layer = step.plan, step.cache, step.slots, self._layer
        owned = plan.local_index().to(k.device)
        cache.write(layer, slots, plan, k[owned], v[owned])
        lens = [plan.prefix_counts[plan.rank][i] + lay.num_new for i, lay in enumerate(plan.q_layout(plan.rank))]
        s0 = slots[0]
        if len(set(lens)) == 1 and slots == list(range(s0, s0 + len(slots))):
            kv = (cache.k[layer, s0 : s0 + len(slots), : lens[0]], cache.v[layer, s0 : s0 + len(slots), : lens[0]])
        else:
            kv = [cache.kv(layer, s, n) for s, n in zip(slots, lens)]
        return allgather_decode(q, kv, step.ring, scale=self.softmax_scale, backend=step.backend or self.backend)

    def _static_decode(self, step: StaticDecodeStep, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write the new keys/values at ``step.rows`` and attend with lengths from device memory."""
        cache, b = step.cache, step.rows.shape[0]
        error = check_inputs(q, k, v, "CP attention")
        if error is None and (q.shape[0] != b or k.dtype != cache.k.dtype or tuple(k.shape[1:]) != tuple(cache.k.shape[3:])):
            error = (f"a static decode step of {b} requests needs q [{b}, Hq, D] and k/v [{b}, "
                     f"{', '.join(map(str, cache.k.shape[3:]))}] {cache.k.dtype}; got q {tuple(q.shape)}, "
                     f"k {tuple(k.shape)} {k.dtype}")
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            error = error or "a static decode step runs without autograd (torch.inference_mode())"
        step.agree(q, k, v, scale=self.softmax_scale, local_error=error)
        kf, vf = cache.flat_kv(self._layer)
        kf.index_copy_(0, step.rows, k)
        vf.index_copy_(0, step.rows, v)
        return static_decode(q, kf, vf, step.starts, step.used, cache.capacity, step.ring, scale=self.softmax_scale)
