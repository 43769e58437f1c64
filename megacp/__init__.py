"""megacp: context parallelism for long-context LLMs.

Public entry points:

* :class:`ParallelLayout`, :func:`initialize`, :class:`ParallelState`, :func:`shutdown` — the process mesh.
* :func:`load_config`, :class:`ConfigError`, :class:`MegacpConfig` — megacp's sections of a
  DeepSpeed config.
* :func:`swap_attention` — replace a model's attention modules by CP attention layers.
* :class:`ModelConfig` — a Llama-family model's hyper-parameters.
* :class:`LLM`, :class:`SamplingParams` — load a model and generate (sessions: :meth:`LLM.session`).
* ``attn_implementation="megacp"`` for any transformers causal LM (:mod:`megacp.integrations.transformers`),
  registered when transformers' modeling code is imported.

Subpackages, bottom layer first (each imports only the ones before it): ``config``, ``parallel``,
``placement``, ``kv_cache``, ``attention``, ``layers``, ``models``, then ``checkpoint``,
``generate`` and ``train``.
"""

from megacp.config import ConfigError, MegacpConfig, load_config
from megacp.generate.llm import LLM
from megacp.generate.sampling import SamplingParams
from megacp.layers.swap import swap_attention
from megacp.models.config import ModelConfig
from megacp.parallel import ParallelLayout, ParallelState, initialize, shutdown
from megacp.integrations import install_transformers_hook

install_transformers_hook()  # attn_implementation="megacp" once transformers' modeling code loads

__version__ = "0.1.0"

__all__ = [
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
