"""``attn_implementation="megacp"`` refuses, in one line naming the model's feature, what it cannot
compute exactly (attention dropout in training, bidirectional attention, soft-capping, padding and
4-D masks, a cache with past tokens) and architectures whose attention bypasses transformers' attention
interface (Falcon, BLOOM, MPT; a model whose layers drop the step, by the dry forward that counts the
calls), and runs sliding windows (shorter than a document, per layer) as transformers does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.hf_archs import DOCS, REFUSED, SMALL, make_model, make_refused, packed_batch


def _batch(arch: str, **extra: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    from megacp.integrations.transformers import prepare_batch

    model = make_model(arch, **extra)
    model.set_attn_implementation("megacp")
    ids, pos, _ = packed_batch(seed=2)
    return model, prepare_batch(ids, position_ids=pos)


@pytest.mark.parametrize("arch, extra, train, message", [
    ("llama", dict(attention_dropout=0.1), True, "attention dropout 0.1"),
    ("qwen3", dict(is_causal=False), False, r"qwen3 uses bidirectional \(non-causal\) attention"),
])
def test_unsupported_features_are_refused_naming_them(arch: str, extra: dict, train: bool, message: str) -> None:
    model, batch = _batch(arch, **extra)
    with pytest.raises(ValueError, match=message):
        model.train(train)(**batch)


def test_window_covering_every_document_is_exact() -> None:
    model, batch = _batch("mistral", sliding_window=13)  # the longest document: the window changes nothing
    full, _ = _batch("mistral")
    torch.testing.assert_close(model(**batch).logits, full(**batch).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch, extra", [
    ("mistral", dict(sliding_window=4)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),  # layer 1 windowed, layer 0 full
])
def test_sliding_windows_shorter_than_a_document_equal_transformers(arch: str, extra: dict) -> None:
    """Packed documents (9, 13, 5 tokens) under windows of 3-4 tokens: the logits of each document
    equal transformers' eager attention with its own sliding-window mask, one document at a time."""
    model, batch = _batch(arch, **extra)
    ref = make_model(arch, **extra)
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        got = model(**batch).logits[0]
        want = torch.cat([ref(doc.unsqueeze(0)).logits[0] for doc in batch["input_ids"][0].split(DOCS)])
        plain = make_model(arch, **{**extra, "sliding_window": None})(batch["input_ids"], position_ids=batch["position_ids"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain.logits[0]).abs().max() > 1e-3  # the window changes the result


def test_gemma2_soft_capping_is_refused_before_any_work() -> None:
    import transformers

    from megacp.integrations.transformers import check_model

    config = transformers.Gemma2Config(**{**SMALL, "head_dim": 8}, attn_logit_softcapping=50.0)
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(ValueError, match="gemma2 soft-caps attention logits"):
        check_model(model)


def test_masks_and_caches_megacp_cannot_honour_are_refused() -> None:
    model, batch = _batch("llama")
    ids = batch["input_ids"]
    model.eval()
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="padding attention mask"):
        model(ids, attention_mask=padded)
    with pytest.raises(ValueError, match="custom 4-D attention mask"):
        model(ids, attention_mask=torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool))
    with pytest.raises(ValueError, match="a transformers cache with past tokens"):
        model.generate(ids[:, :5], max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_architectures_that_bypass_the_interface_are_refused_everywhere(arch: str) -> None:
    """By its class (check_model), at its first forward (the mask), by the dry forward, and by LLM."""
    from megacp import LLM
    from megacp.integrations.transformers import check_model, prepare_batch, verify_attention_calls

    name = REFUSED[arch][0]
    line = f"{name} ({arch}) computes attention in its own modules"
    model = make_refused(arch)
    for check in (check_model, verify_attention_calls):
        with pytest.raises(ValueError, match=line.replace("(", r"\(").replace(")", r"\)")):
            check(model)
    batch = prepare_batch(torch.arange(3, 13)[None])
    with pytest.raises(ValueError) as err:
        model(**batch)
    assert str(err.value).startswith(line)
    with pytest.raises(ValueError) as err:
        LLM(make_refused(arch, "eager"), dtype="float32")
    assert str(err.value).startswith(line)


def test_a_layer_that_drops_the_step_is_refused_by_the_dry_forward() -> None:
    """A Llama whose second decoder layer calls its attention without the model's keyword arguments:
    its class says it uses the interface, the dry forward finds one of two layers without the step."""
    from megacp.integrations.transformers import check_model, verify_attention_calls

    model = make_model("llama")
    model.set_attn_implementation("megacp")
    layer = model.model.layers[1]
    forward = layer.forward
    layer.forward = lambda hidden_states, **kw: forward(hidden_states, position_embeddings=kw["position_embeddings"])
    check_model(model)  # nothing in its class or config says so
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: only 1 of its 2 layers reached megacp's attention"):
        verify_attention_calls(model)
