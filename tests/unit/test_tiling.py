"""The sequence-tiled MLP and the checkpointed layers against plain autograd (fp64, one process):
outputs and every gradient equal; frozen weights get none; inference tiles long inputs alike."""

from __future__ import annotations

import pytest
import torch

from megacp.models import build_model
from megacp.models.config import ModelConfig
from megacp.models.llama import LayerNormMLP

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)


def _mlp() -> LayerNormMLP:
    torch.manual_seed(0)
    mlp = LayerNormMLP(CFG, dtype=torch.float64)
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    return mlp


@pytest.mark.parametrize("tile", [1, 7, 36])
def test_tiled_mlp_equals_untiled(tile):
    mlp = _mlp()
    x = torch.randn(37, CFG.hidden_size, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    results = []
    for t in (0, tile):
        mlp.tile_tokens = t
        x.grad = None
        mlp.zero_grad()
        y = mlp(x)
        y.backward(dy)
        results.append([y.detach(), x.grad] + [p.grad for p in mlp.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_tiled_mlp_frozen_weights_and_gradcheck():
    mlp = _mlp()
    mlp.tile_tokens = 4
    mlp.fc1_weight.requires_grad_(False)
    x = torch.randn(10, CFG.hidden_size, dtype=torch.float64, requires_grad=True)
    mlp(x).sum().backward()
    assert mlp.fc1_weight.grad is None and mlp.fc2_weight.grad is not None
    assert torch.autograd.gradcheck(mlp, (x.detach().requires_grad_(),))


def test_checkpointed_offloaded_layers_equal_plain_autograd():
    torch.manual_seed(1)
    model = build_model(CFG, dtype=torch.float64, device="cpu")
    ids, pos = torch.randint(0, CFG.vocab_size, (40,)), torch.arange(40)

    def grads(checkpoint: bool, offloaded: frozenset[int], frozen_embedding: bool = False) -> dict:
        model.zero_grad()
        model.embedding.weight.requires_grad_(not frozen_embedding)
        model.activation_checkpointing, model.offloaded_layers = checkpoint, offloaded
        model.hidden_states(ids, pos).square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(False, frozenset())
    for offloaded in (frozenset(), frozenset({1}), frozenset(range(CFG.num_layers))):
        got = grads(True, offloaded)
        assert got.keys() == plain.keys()
        assert all(torch.allclose(got[n], plain[n], rtol=1e-12, atol=1e-12) for n in plain)
    frozen = grads(True, frozenset({0}), frozen_embedding=True)  # the layers still get their gradients
    assert "embedding.weight" not in frozen and frozen.keys() == plain.keys() - {"embedding.weight"}


def test_inference_tiles_long_inputs(monkeypatch):
    import megacp.models.llama as llama

    torch.manual_seed(2)
    model = build_model(CFG, dtype=torch.float64, device="cpu")
    ids, pos = torch.randint(0, CFG.vocab_size, (50,)), torch.arange(50)
    with torch.no_grad():
        plain = model(ids, pos)
    monkeypatch.setattr(llama, "INFERENCE_TILE_TOKENS", 8)
    calls = []
    monkeypatch.setattr(llama, "tiled_norm_swiglu", lambda m, x, t: calls.append(t) or
                        __import__("megacp.models.tiling", fromlist=["x"]).tiled_norm_swiglu(m, x, t))
    with torch.inference_mode():
        tiled = model(ids, pos)
    assert calls == [8] * CFG.num_layers
    assert torch.allclose(plain, tiled, rtol=1e-12, atol=1e-12)
