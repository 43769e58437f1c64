"""The model-family seam (:mod:`megacp.families`): which family a source gets, what each
says it can do, and that a refused architecture is refused from its config alone (no weight read)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megacp.families import (
    MOE_GRAPHS,
    WINDOW_GRAPHS,
    MegacpFamily,
    TransformersFamily,
    TransformersObject,
    family_for,
)
from megacp.models.config import ModelConfig
from tests.helpers.hf_archs import make_model
from tests.helpers.train_cli import make_tiny_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch in ("llama", "qwen3", "falcon"):
        out[arch] = tmp_path_factory.mktemp(arch)
        make_tiny_model(out[arch], arch=arch)
    return out


def test_each_source_gets_its_family(dirs: dict[str, Path]) -> None:
    llama = family_for(dirs["llama"])
    assert type(llama) is MegacpFamily and llama.source == str(dirs["llama"])
    limits = llama.limits()
    assert isinstance(limits, ModelConfig) and limits.num_layers == 2 and llama.plan_config() == limits
    assert llama.graph_decode_error(limits) is None and llama.training_error(backend="torch", allow_non_finite=True) is None

    qwen3 = family_for(dirs["qwen3"])  # an architecture megacp's own models do not implement
    assert type(qwen3) is TransformersFamily and qwen3.saved_config() is None
    planned = qwen3.plan_config()  # the memory plan reads its sizes (Llama-shaped)
    assert planned is not None and (planned.num_layers, planned.hidden_size) == (2, 64)
    assert qwen3.limits().num_layers == 2 and qwen3.limits().head_dim == 16
    assert "decodes eagerly" in (qwen3.graph_decode_error(qwen3.limits()) or "")
    assert "--backend and --allow-non-finite do not apply" in (qwen3.training_error(backend="torch", allow_non_finite=False) or "")

    forced = family_for(dirs["llama"], transformers=True)  # --hf-native
    assert type(forced) is TransformersFamily and forced.training_error(backend="auto", allow_non_finite=False) is None

    model = make_model("llama").to(torch.float64)
    obj = family_for(model, tokenizer="tok")
    assert type(obj) is TransformersObject and obj.source == "LlamaForCausalLM" and obj.native_dtype() == torch.float64
    with pytest.raises(ValueError, match="megacp.train loads a model directory"):
        obj.load_for_training(None, dtype=torch.float32, settings=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokenizer= goes with a transformers model object"):
        family_for(dirs["llama"], tokenizer="tok")


def test_capabilities_follow_the_config() -> None:
    family = MegacpFamily("unused")
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                max_position_embeddings=64)
    assert family.graph_decode_error(ModelConfig(**base, sliding_window=8)) == WINDOW_GRAPHS
    assert family.graph_decode_error(ModelConfig(**base, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=16)) == MOE_GRAPHS
    assert family.graph_decode_error(None) is None  # no checkpoint there: the load says why
    assert "needs --model DIR" in (TransformersFamily("missing").training_error(backend="auto", allow_non_finite=False) or "")


def test_a_refused_architecture_is_refused_from_its_config(dirs: dict[str, Path]) -> None:
    falcon = family_for(dirs["falcon"])
    assert type(falcon) is TransformersFamily
    with pytest.raises(ValueError, match="Falcon") as err:
        falcon.limits()
    assert "\n" not in str(err.value)
