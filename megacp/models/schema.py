"""The model's parameter schema: every parameter's name and full (unsharded) shape, as
:class:`~megacp.models.llama.CausalLM` creates them. Checkpoint readers and writers use it to know
every tensor before the first byte."""

from __future__ import annotations

from megacp.models.config import ModelConfig


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every megacp parameter of ``cfg`` with its full (unsharded) shape, in canonical order.

    The names follow Transformer Engine's ``TransformerLayer`` with ``fuse_qkv_params=False``;
    ``fc1_weight`` stacks the SwiGLU gate rows above the up rows. An MoE layer has ``moe.*`` instead
    of ``layernorm_mlp.*``, its expert tensors stacked over all E experts (E leading). ``lm_head.weight`` is present only
    when the embeddings are not tied.
    """
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        qkv = f"layers.{i}.self_attention.layernorm_qkv"
        shapes[f"{qkv}.layer_norm_weight"] = (h,)
        shapes[f"{qkv}.query_weight"] = (q_out, h)
        shapes[f"{qkv}.key_weight"] = (kv_out, h)
        shapes[f"{qkv}.value_weight"] = (kv_out, h)
        if cfg.attention_bias:
            shapes[f"{qkv}.query_bias"] = (q_out,)
            shapes[f"{qkv}.key_bias"] = (kv_out,)
            shapes[f"{qkv}.value_bias"] = (kv_out,)
        shapes[f"layers.{i}.self_attention.proj.weight"] = (h, q_out)
        if cfg.is_moe_layer(i):
            shapes.update(_moe_shapes(cfg, f"layers.{i}.moe"))
            continue
        mlp = f"layers.{i}.layernorm_mlp"
        shapes[f"{mlp}.layer_norm_weight"] = (h,)
        shapes[f"{mlp}.fc1_weight"] = (2 * f, h)
        shapes[f"{mlp}.fc2_weight"] = (h, f)
    shapes["final_norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _moe_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The full shapes of one :class:`~megacp.models.moe.MoEMLP` (all E experts)."""
    h, e, f, fs = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size or cfg.intermediate_size,
                   cfg.shared_expert_intermediate_size)
    shapes = {
        f"{prefix}.layer_norm_weight": (h,),
        f"{prefix}.router_weight": (e, h),
        f"{prefix}.expert_fc1_weight": (e, 2 * f, h),
        f"{prefix}.expert_fc2_weight": (e, h, f),
    }
    if fs:
        shapes[f"{prefix}.shared_fc1_weight"] = (2 * fs, h)
        shapes[f"{prefix}.shared_fc2_weight"] = (h, fs)
        shapes[f"{prefix}.shared_gate_weight"] = (1, h)
    return shapes
