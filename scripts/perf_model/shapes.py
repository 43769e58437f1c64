"""Attention and model shapes of the cost model: heads, bytes, FLOPs; the models it projects."""

from __future__ import annotations

from dataclasses import dataclass

from megacp.models.config import ModelConfig


@dataclass(frozen=True)
class AttnShape:
    """Attention shape on one GPU: query heads NH, KV heads NKV, head dim D, bytes per element e."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int = 2

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int = 1, elem_bytes: int = 2) -> AttnShape:
        """Heads of one of ``tp`` tensor-parallel GPUs (KV heads are replicated when TP > NKV)."""
        if cfg.num_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
            raise ValueError(f"TP={tp} does not divide {cfg.num_heads} query / {cfg.num_kv_heads} KV heads")
        return cls(cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), int(cfg.head_dim), elem_bytes)

    @property
    def pair_flops(self) -> int:
        """FLOPs of one visible (query, key) pair over all heads: QKᵀ and PV, 2 each: 4·NH·D."""
        return 4 * self.num_heads * self.head_dim

    def causal_flops(self, tokens: int) -> float:
        """FLOPs of causal attention over ``tokens`` (the benchmarks' 2·S²·NH·D convention)."""
        return self.pair_flops * tokens * tokens / 2

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of K and V of ``tokens`` tokens."""
        return 2 * tokens * self.num_kv_heads * self.head_dim * self.elem_bytes

    def q_bytes(self, tokens: int) -> int:
        """Bytes of the queries (or the outputs) of ``tokens`` tokens."""
        return tokens * self.num_heads * self.head_dim * self.elem_bytes

    def state_bytes(self, tokens: int) -> int:
        """Bytes of packed (out, fp32 LSE) states of ``tokens`` tokens (``pack_states``)."""
        return tokens * self.num_heads * (self.head_dim * self.elem_bytes + 4)


LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=1 << 20)
"""The Llama-3-8B shape of ``scripts/bench/generate.py`` (32 layers, 32 Q / 8 KV heads, D = 128)."""

LLAMA3_405B = ModelConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126,
                          num_heads=128, num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=1 << 20)
"""Llama3-405B: 126 layers, 128 Q / 8 KV heads, D = 128, FFN 53248."""

PAPER_405B_TTFT_S = {131072: 3.8, 1048576: 77.0}
"""The paper's measured prefill of Llama3-405B on 16 nodes × 8 H100 (CP16 × TP8), in seconds."""


def linear_flops_per_token(cfg: ModelConfig) -> float:
    """FLOPs of the linear layers of all layers for one token (QKV, output projection, SwiGLU)."""
    h, d = cfg.hidden_size, int(cfg.head_dim)
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    return 2.0 * per_layer * cfg.num_layers
