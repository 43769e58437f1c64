"""megacp's model: a Llama-family decoder (dense or mixture-of-experts) over packed tokens at global
positions.

* :class:`ModelConfig` — the architecture (:mod:`megacp.models.config`).
* :func:`parameter_shapes` — the parameter schema (:mod:`megacp.models.schema`).
* :class:`CausalLM` — the decoder, parameter names as Transformer Engine's ``TransformerLayer``
  (:mod:`megacp.models.llama`; TE-built layers in :mod:`megacp.models.te_model`).
* :class:`~megacp.models.moe.MoEMLP` — the Mixtral / Qwen2-MoE expert layer, experts sharded over an
  expert-parallel group (:mod:`megacp.models.moe`); RMSNorm, SwiGLU and the TP collectives both
  layer kinds use: :mod:`megacp.models.ops`.
* :func:`build_model` — a random model or a ``meta`` skeleton (:mod:`megacp.models.build`);
  loading weights into it is :func:`megacp.checkpoint.load_model`.
* :class:`RotaryEmbedding` / :func:`apply_rotary` — RoPE at global positions (:mod:`megacp.models.rope`).
"""

from megacp.models.build import build_model
from megacp.models.config import ModelConfig
from megacp.models.llama import CausalLM
from megacp.models.rope import RotaryEmbedding, apply_rotary
from megacp.models.schema import parameter_shapes

__all__ = ["CausalLM", "ModelConfig", "RotaryEmbedding", "apply_rotary", "build_model", "parameter_shapes"]
