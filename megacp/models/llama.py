"""A Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, tied-embedding SmolLM, and the
mixture-of-experts Mixtral and Qwen2-MoE) in pure torch.

Parameter names follow Transformer Engine's ``TransformerLayer`` (``fuse_qkv_params=False``,
RMSNorm, SwiGLU), so checkpoints are interchangeable with TE-built models
(:mod:`megacp.models.te_model`)::

    embedding.weight                                               [V, H]
    layers.{i}.self_attention.layernorm_qkv.layer_norm_weight      [H]
    layers.{i}.self_attention.layernorm_qkv.query_weight           [NH*D, H]   (+ query_bias, Qwen2)
    layers.{i}.self_attention.layernorm_qkv.key_weight             [NKV*D, H]  (+ key_bias)
    layers.{i}.self_attention.layernorm_qkv.value_weight           [NKV*D, H]  (+ value_bias)
    layers.{i}.self_attention.proj.weight                          [H, NH*D]
    layers.{i}.layernorm_mlp.layer_norm_weight                     [H]
    layers.{i}.layernorm_mlp.fc1_weight                            [2F, H]  (gate rows, then up)
    layers.{i}.layernorm_mlp.fc2_weight                            [H, F]
    layers.{i}.moe.*   instead of layernorm_mlp in an MoE layer    (:class:`~megacp.models.moe.MoEMLP`)
    final_norm.weight                                              [H]
    lm_head.weight                                                 [V, H]  (absent when tied)

Tokens are packed ("thd"): T tokens of B sequences back to back, described by ``cu_seqlens``, each
with its *global* position in its sequence (under context parallelism a rank holds non-contiguous
tokens). Attention is delegated to ``self_attention.core_attention``, a TE-compatible
:class:`~megacp.layers.attention.DotProductAttention` that the CP machinery may swap.

Tensor parallelism (optional): with a ``tp_group`` of size t > 1 the Q/K/V and ``fc1`` projections
are column-parallel (a rank holds NH/t query heads, NKV/t KV heads and F/t rows of gate stacked over
F/t rows of up), ``proj`` and ``fc2`` are row-parallel and followed by an ``all_reduce`` over the
group; embedding, norms and LM head are replicated. The collectives are differentiable (Megatron's
conjugate pair): :func:`copy_to_tp` in front of each column-parallel projection (forward identity,
backward all-reduce of the input gradient) and :func:`reduce_from_tp` after each row-parallel one
(forward all-reduce, backward identity), so every TP rank computes the full gradient of the
replicated weights and of the residual stream.

Training: :meth:`CausalLM.hidden_states` returns the final-norm hidden states (the LM head is
applied by the loss, chunk by chunk: :mod:`megacp.models.loss`); with
``activation_checkpointing=True`` each decoder layer's activations are recomputed in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megacp.layers.attention import DotProductAttention
from megacp.layers.step import TrainStep
from megacp.models.checkpointing import HostStash, SelfCheckpointed, checkpoint_block, checkpoint_layer
from megacp.models.config import ModelConfig
from megacp.models.moe import MoEMLP
from megacp.models.ops import copy_to_tp, group_size, reduce_from_tp, rms_norm, swiglu, tp_shard
from megacp.models.rope import RotaryEmbedding, apply_rotary
from megacp.models.tiled_layer import TiledLayer, tiled_layer
from megacp.models.tiling import INFERENCE_TILE_TOKENS, tiled_norm_swiglu


def _param(*shape: int, dtype: torch.dtype | None, device: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


class RMSNorm(nn.Module):
    """RMSNorm with a ``weight`` [H] (the final norm); see :func:`rms_norm`."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None, device: Any = None):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]."""
        return rms_norm(x, self.weight, self.eps)


class LayerNormQKV(nn.Module):
    """RMSNorm followed by the Q, K and V projections (TE ``LayerNormLinear`` names).

    Holds this rank's ``nh`` query heads and ``nkv`` KV heads of width ``d`` (column-parallel over
    ``tp_group``).
    """

    def __init__(
        self, hidden_size: int, nh: int, nkv: int, d: int, eps: float, bias: bool,
        tp_group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None, device: Any = None,
    ):
        super().__init__()
        self.eps = eps
        self.tp_group = tp_group
        self.layer_norm_weight = _param(hidden_size, dtype=dtype, device=device)
        self.query_weight = _param(nh * d, hidden_size, dtype=dtype, device=device)
        self.key_weight = _param(nkv * d, hidden_size, dtype=dtype, device=device)
        self.value_weight = _param(nkv * d, hidden_size, dtype=dtype, device=device)
        if bias:
            self.query_bias = _param(nh * d, dtype=dtype, device=device)
            self.key_bias = _param(nkv * d, dtype=dtype, device=device)
            self.value_bias = _param(nkv * d, dtype=dtype, device=device)
        else:
            self.query_bias = self.key_bias = self.value_bias = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, nh*d], k [T, nkv*d], v [T, nkv*d]."""
        x = copy_to_tp(rms_norm(x, self.layer_norm_weight, self.eps), self.tp_group)
        return (
            F.linear(x, self.query_weight, self.query_bias),
            F.linear(x, self.key_weight, self.key_bias),
            F.linear(x, self.value_weight, self.value_bias),
        )


class SelfAttention(nn.Module):
    """``layernorm_qkv`` -> RoPE at global positions -> ``core_attention`` (thd) -> ``proj``."""

    def __init__(
        self, cfg: ModelConfig, layer_number: int, tp_group: dist.ProcessGroup | None = None,
        *, dtype: torch.dtype | None = None, device: Any = None,
    ):
        super().__init__()
        tp = group_size(tp_group)
        self.tp_group = tp_group
        self.num_heads = tp_shard(cfg.num_heads, tp, "num_heads")
        self.num_kv_heads = tp_shard(cfg.num_kv_heads, tp, "num_kv_heads")
        self.head_dim = cfg.head_dim
        self.layernorm_qkv = LayerNormQKV(
            cfg.hidden_size, self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
            cfg.attention_bias, tp_group, dtype=dtype, device=device,
        )
        self.core_attention = DotProductAttention(
            self.num_heads,
            cfg.head_dim,
            num_gqa_groups=self.num_kv_heads,
            attn_mask_type="causal",
            qkv_format="thd",
            layer_number=layer_number,
            window_size=None if (w := cfg.layer_window(layer_number - 1)) is None else (w - 1, 0),
        )
        self.proj = nn.Linear(
            self.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, dtype=dtype, device=device
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
        inference_params: Any = None,
    ) -> torch.Tensor:
        """x [T, H], cos/sin [T, D] (RoPE at each token's global position), cu_seqlens [B+1] int32 -> [T, H]."""
        t = x.shape[0]
        q, k, v = self.layernorm_qkv(x)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        context = self.core_attention(
            q, k, v,
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            attn_mask_type="causal",
            inference_params=inference_params,
        )
        return reduce_from_tp(self.proj(context), self.tp_group)


class LayerNormMLP(nn.Module):
    """RMSNorm followed by the SwiGLU MLP (TE ``LayerNormMLP`` names; ``fc1`` = [gate; up]).

    ``tile_tokens`` (a plain attribute, 0 = untiled): inputs longer than that run over sequence
    tiles of that many tokens (:func:`~megacp.models.tiling.tiled_norm_swiglu`: only the input is
    kept for the backward). Without autograd (``torch.inference_mode()`` or ``torch.no_grad()``:
    generation) inputs longer than :data:`~megacp.models.tiling.INFERENCE_TILE_TOKENS` always run
    in such tiles: a long prefill chunk then never holds its whole ``[T, 2F]`` gate/up, at no extra
    compute.
    """

    tile_tokens: int = 0

    def __init__(
        self, cfg: ModelConfig, tp_group: dist.ProcessGroup | None = None,
        *, dtype: torch.dtype | None = None, device: Any = None,
    ):
        super().__init__()
        ffn = tp_shard(cfg.intermediate_size, group_size(tp_group), "intermediate_size")
        self.tp_group = tp_group
        self.eps = cfg.rms_norm_eps
        self.layer_norm_weight = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.fc1_weight = _param(2 * ffn, cfg.hidden_size, dtype=dtype, device=device)
        self.fc2_weight = _param(cfg.hidden_size, ffn, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]."""
        tile = self.tile_tokens or (0 if torch.is_grad_enabled() else INFERENCE_TILE_TOKENS)
        if 0 < tile < x.shape[0]:
            return reduce_from_tp(tiled_norm_swiglu(self, x, tile), self.tp_group)
        x = copy_to_tp(rms_norm(x, self.layer_norm_weight, self.eps), self.tp_group)
        return reduce_from_tp(swiglu(x, self.fc1_weight, self.fc2_weight), self.tp_group)


class DecoderLayer(nn.Module):
    """One pre-norm transformer layer: ``x + self_attention(x)``, then ``+ layernorm_mlp(.)`` (a dense
    layer) or ``+ moe(.)`` (an MoE layer of ``cfg``, :class:`~megacp.models.moe.MoEMLP`, its experts
    sharded over ``ep_group``).

    ``attention_tile`` (a plain attribute, 0 = untiled): in training (a
    :class:`~megacp.layers.step.TrainStep` under autograd), a dense layer whose ranks hold more
    local tokens than that runs over query tiles of that many rows, keeping only its input
    (:func:`~megacp.models.tiled_layer.tiled_layer`: the layer is then its own activation checkpoint).
    """

    attention_tile: int = 0

    def __init__(
        self, cfg: ModelConfig, layer_number: int, tp_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None, device: Any = None,
    ):
        super().__init__()
        self.self_attention = SelfAttention(cfg, layer_number, tp_group, dtype=dtype, device=device)
        if cfg.is_moe_layer(layer_number - 1):
            self.moe = MoEMLP(cfg, tp_group, ep_group, dtype=dtype, device=device)
        else:
            self.layernorm_mlp = LayerNormMLP(cfg, tp_group, dtype=dtype, device=device)
        self.mlp_name = "moe" if cfg.is_moe_layer(layer_number - 1) else "layernorm_mlp"

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
        inference_params: Any = None,
    ) -> torch.Tensor:
        """x [T, H], cos/sin [T, D] (RoPE at each token's global position), cu_seqlens [B+1] int32 -> [T, H]."""
        tiled = self.tiled(cos, sin, cu_seqlens, inference_params)
        if tiled is not None:
            return tiled_layer(tiled, x)
        x = x + self.self_attention(x, cos, sin, cu_seqlens, inference_params)
        return x + getattr(self, self.mlp_name)(x)

    def tiled(self, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, step: Any) -> TiledLayer | None:
        """The layer over query tiles for a training ``step`` (``None`` where it runs untiled: no
        ``attention_tile``, no autograd, not a training step, an MoE layer, or a step whose ranks
        hold at most ``attention_tile`` tokens)."""
        if not (self.attention_tile > 0 and torch.is_grad_enabled() and isinstance(step, TrainStep)
                and self.mlp_name == "layernorm_mlp" and step.plan.max_local > self.attention_tile):
            return None

        def sublayer(x: torch.Tensor, tile_step: Any, rows: slice) -> torch.Tensor:
            return self.self_attention(x, cos[rows], sin[rows], cu_seqlens, tile_step)

        def rest(h: torch.Tensor) -> torch.Tensor:
            return h + self.layernorm_mlp(h)

        return TiledLayer(step, sublayer, rest, list(self.parameters()), self.attention_tile)


def _bound(layer: nn.Module, *args: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> layer(x, *args)``; a layer trained over query tiles as a run that keeps its input itself."""
    tiled = layer.tiled(*args) if isinstance(layer, DecoderLayer) else None
    if tiled is not None:
        return SelfCheckpointed(lambda x, stash: tiled_layer(tiled, x, stash))
    return lambda x: layer(x, *args)


class CausalLM(nn.Module):
    """Llama-family causal language model over packed tokens at global positions.

    Args:
        cfg: the architecture.
        tp_group: optional tensor-parallel group (parameter shapes are then per rank).
        ep_group: optional expert-parallel group of an MoE model: each rank holds its share of
            every MoE layer's experts (:mod:`megacp.models.moe`).
        dtype / device: where the parameters are created (``device="meta"`` for a skeleton that
            :meth:`~torch.nn.Module.load_state_dict` fills with ``assign=True``).
        layers: the decoder layers to use instead of :class:`DecoderLayer` (the TE backend passes
            its own); each is called as ``layer(x [T,H], cos, sin, cu_seqlens, inference_params)``.
        activation_checkpointing: under autograd, checkpoint each decoder layer
            (:func:`~megacp.models.checkpointing.checkpoint_layer`): only its input is kept and its
            forward runs again in backward (CP ring and TP collectives included, in the same order
            on every rank). A plain attribute: it may also be set after construction.

    Attributes:
        offloaded_layers: indices of the checkpointed layers (of the first layers of the checkpoint
            blocks) whose inputs wait for the backward in pinned host memory
            (:class:`~megacp.models.checkpointing.HostStash`) rather than on the device; empty by
            default (only with ``activation_checkpointing``).
        layers_per_checkpoint: consecutive layers checkpointed as one block (a second checkpoint
            level, :func:`~megacp.models.checkpointing.checkpoint_block`); 1 by default.
    """

    offloaded_layers: frozenset[int] = frozenset()
    layers_per_checkpoint: int = 1
    host_stash: HostStash | None = None

    def __init__(
        self, cfg: ModelConfig, tp_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None, device: Any = None,
        layers: nn.ModuleList | None = None, activation_checkpointing: bool = False,
    ):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg)
        self.layers = layers if layers is not None else nn.ModuleList(
            DecoderLayer(cfg, i + 1, tp_group, ep_group, dtype=dtype, device=device) for i in range(cfg.num_layers)
        )
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        self._owns_layers = layers is None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init: norm weights 1, biases 0, matrices N(0, std²) (a no-op on ``meta``).

        Layers passed in by the caller (TE) keep their own initialisation. A model built inside
        ``deepspeed.zero.Init`` (:func:`megacp.train.setup.build_for_training`) has its parameters
        partitioned by the time this runs: each rank initialises its partition (``ds_tensor``) in
        place, on the device DeepSpeed keeps it on, and no full copy is made.
        """
        for name, param in self.named_parameters():
            if name.startswith("layers.") and not self._owns_layers:
                continue
            data = getattr(param, "ds_tensor", param)  # ZeRO 3: this rank's flat partition
            if name.endswith(("norm_weight", "norm.weight")):
                data.fill_(1.0)
            elif len(getattr(param, "ds_shape", param.shape)) == 1:
                data.zero_()
            else:
                data.normal_(0.0, std)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head matrix [V, H] (the embedding matrix when the embeddings are tied)."""
        return self.embedding.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        inference_params: Any = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, H] of packed tokens (the arguments of :meth:`forward`);
        the logits are ``hidden_states(...) @ lm_head_weight.T``."""
        return self.final_norm(self._decode(input_ids, position_ids, cu_seqlens, inference_params))

    def _decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                inference_params: Any) -> torch.Tensor:
        """The decoder layers' output [T, H] (before the final norm) of :meth:`hidden_states`' arguments."""
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must both be [T]; got {list(input_ids.shape)} and "
                f"{list(position_ids.shape)}"
            )
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, input_ids.numel()], dtype=torch.int32, device=input_ids.device)
        elif cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cu_seqlens must be a 1-D int32 tensor; got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
            )
        x = self.embedding(input_ids)
        cos, sin = (c.to(x.dtype) for c in self.rotary(position_ids))
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        if not recompute:
            for layer in self.layers:
                x = layer(x, cos, sin, cu_seqlens, inference_params)
            return x
        stash = self._stash(x.device) if self.offloaded_layers else None
        per = self.layers_per_checkpoint
        for i in range(0, len(self.layers), per):
            runs = [_bound(layer, cos, sin, cu_seqlens, inference_params) for layer in self.layers[i:i + per]]
            x = checkpoint_layer(runs[0] if per == 1 else checkpoint_block(runs), x, stash if i in self.offloaded_layers else None)
        return x

    def _stash(self, device: torch.device) -> HostStash:
        """The host stash of the offloaded layer inputs, started for a new step."""
        if self.host_stash is None or self.host_stash.device != device:
            self.host_stash = HostStash(device)
        self.host_stash.begin()
        return self.host_stash

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        inference_params: Any = None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of packed tokens.

        Args:
            input_ids: [T] int64, B sequences back to back.
            position_ids: [T] int64, each token's global position in its sequence.
            cu_seqlens: [B+1] int32 prefix sums of the sequence lengths (``None``: one sequence).
            inference_params: the CP layer's cache/plan handle, passed to every ``core_attention``
                untouched.
            logits_index: [N] int64 rows of T to compute logits for (e.g. each sequence's last
                token during prefill); only these rows go through the final norm and the LM head,
                so a prefill chunk of T tokens makes no ``[T, V]`` logits; ``None`` for all rows.

        Returns:
            [T, V] logits (``[N, V]`` with ``logits_index``) in the parameter dtype.
        """
        x = self._decode(input_ids, position_ids, cu_seqlens, inference_params)
        if logits_index is not None:
            x = x.index_select(0, logits_index)
        return F.linear(self.final_norm(x), self.lm_head_weight)
