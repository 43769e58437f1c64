"""The architecture description shared by models, checkpoints and generation.

One :class:`ModelConfig` describes every member of the Llama family megacp runs: Llama 2/3/3.1
(``llama3`` rope scaling), Mistral (sliding window), Qwen2 (QKV bias, windows on some layers), SmolLM-style tied
embeddings, and the mixture-of-experts members Mixtral and Qwen2-MoE (``num_experts > 0``). It is a plain dataclass so that it serialises to JSON in megacp checkpoints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only Llama-family transformer.

    Attributes:
        architecture: one of :data:`ARCHITECTURES` (names the Hugging Face model class on export).
        vocab_size: number of token embeddings.
        hidden_size: model width H.
        intermediate_size: SwiGLU inner width F (``fc1`` has 2F rows: gate then up).
        num_layers: number of transformer layers.
        num_heads: query heads NH.
        num_kv_heads: key/value heads NKV (GQA when NKV < NH).
        head_dim: D, per-head width (``hidden_size // num_heads`` unless given).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: ``None`` or a dict with ``rope_type`` (``"llama3"``, ``"linear"``) and its
            parameters (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``).
        max_position_embeddings: context length the model was trained for.
        attention_bias: Q/K/V projections carry a bias (Qwen2).
        tie_word_embeddings: the LM head reuses the embedding matrix (no ``lm_head.weight``).
        bos_token_id / eos_token_id: special tokens (``eos_token_id`` may list several).
        num_experts: routed experts E of each MoE layer (0: a dense model).
        num_experts_per_tok: experts k each token is routed to (top-k of the router's softmax).
        moe_intermediate_size: SwiGLU inner width of one expert (``intermediate_size`` unless given).
        norm_topk_prob: the k routing weights are renormalised to sum to 1 (always for Mixtral).
        shared_expert_intermediate_size: width of the always-on shared expert whose output is
            scaled by a sigmoid gate (Qwen2-MoE; 0: none).
        decoder_sparse_step / mlp_only_layers: layer i (0-based) is an MoE layer when
            ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers`` (Qwen2-MoE's
            rule; every layer for Mixtral); other layers have the dense MLP of ``intermediate_size``.
        sliding_window: keys a query sees under a sliding window (a query at position ``x`` sees
            ``x - sliding_window + 1 .. x``, transformers' convention); ``None``: full causal.
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"`` (transformers' name:
            Qwen2's ``max_window_layers``, Gemma-style alternation); ``None``: every layer uses
            ``sliding_window``.
        extra: free-form metadata saved and loaded with a megacp checkpoint's config; megacp
            itself reads none of it (every saved manifest has the key, so it stays).
    """

    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = None  # type: ignore[assignment]  # None until __post_init__: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture={self.architecture!r} is not supported; "
                f"allowed: {', '.join(ARCHITECTURES)}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                f"num_experts={self.num_experts}]"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"ModelConfig.decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window={self.sliding_window} must be >= 1 (or None)")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {
                "sliding_attention", "full_attention"}):
            raise ValueError(f"ModelConfig.layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                             f"{self.num_layers} layers; got {self.layer_types}")
        if self.num_experts and self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) has routed experts instead of the dense MLP."""
        return (
            self.num_experts > 0
            and (index + 1) % self.decoder_sparse_step == 0
            and index not in self.mlp_only_layers
        )

    def layer_window(self, index: int) -> int | None:
        """The sliding window of decoder layer ``index`` (0-based), or ``None`` (full causal)."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[index] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def has_dense_layers(self) -> bool:
        """Whether any decoder layer has the dense MLP of ``intermediate_size``."""
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def eos_token_ids(self) -> list[int]:
        """The stop tokens as a list (empty when the model names none)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {', '.join(unknown)}")
        return cls(**data)
