"""megacp: context parallelism for long-context LLMs.

Public entry points (imported lazily so that ``import megacp`` stays cheap):

* :class:`ParallelLayout`, :func:`initialize`, :class:`ParallelState` — the process mesh.
* :func:`load_config`, :class:`ConfigError` — the ``context_parallel`` section of a DeepSpeed config.
* :func:`swap_attention` — replace a model's attention modules by CP attention layers.
* :class:`ModelConfig` — a Llama-family model's hyper-parameters.

Subpackages are imported explicitly (``from megacp.attention import cp_attention``):
:mod:`megacp.attention` (partial attention, merge, sharding, ring prefill, decode), ``layers``,
``models``, ``checkpoint``, ``parallel``.
"""

from __future__ import annotations

from megacp._lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "ParallelLayout": "megacp.parallel.layout",
    "ParallelState": "megacp.parallel.state",
    "initialize": "megacp.parallel.state",
    "load_config": "megacp.config",
    "ConfigError": "megacp.config",
    "MegacpConfig": "megacp.config",
    "swap_attention": "megacp.layers.swap",
    "ModelConfig": "megacp.models.config",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__ = lazy_getattr(__name__, _EXPORTS)
