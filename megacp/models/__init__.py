"""megacp's model: a Llama-family decoder over packed tokens at global positions.

* :class:`ModelConfig` — the architecture (:mod:`megacp.models.config`).
* :func:`parameter_shapes` — the parameter schema (:mod:`megacp.models.schema`).
* :class:`CausalLM` — the decoder, parameter names as Transformer Engine's ``TransformerLayer``
  (:mod:`megacp.models.llama`; TE-built layers in :mod:`megacp.models.te_model`).
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
