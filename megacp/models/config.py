"""The architecture description shared by models, checkpoints and generation.

One :class:`ModelConfig` describes every member of the Llama family megacp runs: Llama 2/3/3.1
(``llama3`` rope scaling), Mistral (no sliding window), Qwen2 (QKV bias) and SmolLM-style tied
embeddings. It is a plain dataclass so that it serialises to JSON in megacp checkpoints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2")


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
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
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
