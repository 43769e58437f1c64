"""megacp's model: a Llama-family decoder over packed tokens at global positions.

* :class:`ModelConfig` — the architecture (:mod:`megacp.models.config`).
* :class:`CausalLM` — the decoder, parameter names as Transformer Engine's ``TransformerLayer``
  (:mod:`megacp.models.llama`; TE-built layers in :mod:`megacp.models.te_model`).
* :func:`build_model` / :func:`load_model` — a random model, or one loaded from a Hugging Face
  directory, a megacp checkpoint or a GGUF file (:mod:`megacp.models.loading`).
* :class:`RotaryEmbedding` / :func:`apply_rotary` — RoPE at global positions (:mod:`megacp.models.rope`).

Imported lazily, so that ``megacp.models.config`` stays importable without the model code.
"""

from __future__ import annotations

from megacp._lazy import lazy_getattr

_EXPORTS = {
    "ModelConfig": "megacp.models.config",
    "CausalLM": "megacp.models.llama",
    "build_model": "megacp.models.loading",
    "load_model": "megacp.models.loading",
    "RotaryEmbedding": "megacp.models.rope",
    "apply_rotary": "megacp.models.rope",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
