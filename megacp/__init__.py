"""megacp: context parallelism for long-context LLMs.

Public entry points:

* :class:`ParallelLayout`, :func:`initialize`, :class:`ParallelState`, :func:`shutdown` — the process mesh.
* :func:`load_config`, :class:`ConfigError`, :class:`MegacpConfig` — megacp's sections of a
  DeepSpeed config.
* :func:`swap_attention`, :class:`CPSettings` — replace a model's attention modules by CP attention
  layers, and the CP settings they and every step run with.
* :class:`ModelConfig` — a Llama-family model's hyper-parameters.
* :class:`LLM`, :class:`SamplingParams` — load a model and generate (sessions: :meth:`LLM.session`).
* ``attn_implementation="megacp"`` for any transformers causal LM (:mod:`megacp.integrations.transformers`),
  registered when transformers' modeling code is imported.

Subpackages, bottom layer first (each imports only the ones before it): ``config``, ``parallel``,
``placement``, ``kv_cache``, ``attention``, ``layers``, ``models``, then ``checkpoint``,
``generate`` and ``train``.
"""

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "ConfigError": "megacp.config",
    "MegacpConfig": "megacp.config",
    "load_config": "megacp.config",
    "LLM": "megacp.generate.llm",
    "SamplingParams": "megacp.generate.sampling",
    "CPSettings": "megacp.layers.settings",
    "swap_attention": "megacp.layers.swap",
    "ModelConfig": "megacp.models.config",
    "ParallelLayout": "megacp.parallel",
    "ParallelState": "megacp.parallel",
    "initialize": "megacp.parallel",
    "shutdown": "megacp.parallel",
}
"""Public name -> the module that defines it, imported on first use (PEP 562): ``import megacp`` and
``import megacp.placement`` load no torch-heavy module they do not need."""

if TYPE_CHECKING:
    from megacp.config import ConfigError, MegacpConfig, load_config
    from megacp.generate.llm import LLM
    from megacp.generate.sampling import SamplingParams
    from megacp.layers.settings import CPSettings
    from megacp.layers.swap import swap_attention
    from megacp.models.config import ModelConfig
    from megacp.parallel import ParallelLayout, ParallelState, initialize, shutdown


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megacp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


from megacp.integrations import install_transformers_hook  # noqa: E402 - standard library only

install_transformers_hook()  # attn_implementation="megacp" once transformers' modeling code loads


from megacp.version import __version__  # noqa: E402

__all__ = [
    "CPSettings",
    "ConfigError",
    "LLM",
    "MegacpConfig",
    "ModelConfig",
    "ParallelLayout",
    "ParallelState",
    "SamplingParams",
    "__version__",
    "initialize",
    "load_config",
    "shutdown",
    "swap_attention",
]
