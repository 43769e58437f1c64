"""A decoder layer trained over query tiles holds, beyond its input and its input's gradient, only
its KV block, the block's fp32 gradients and one tile's work (:mod:`megacp.models.tiled_layer`):
measured with :class:`~tests.helpers.memory.TensorMemory` on one layer's forward + backward (CPU,
fp32, CP 1), its peak grows with the sequence by at most the plan's per-token bytes of a tiled layer
(:func:`~megacp.train.memory.tiled_layer_bytes_per_token`, plus the incoming gradient) and with the
tile, where the untiled layer's peak grows by several times that per token."""

from __future__ import annotations

import torch

from megacp.layers.settings import CPSettings
from megacp.layers.step import TrainStep
from megacp.layers.swap import swap_attention
from megacp.models.config import ModelConfig
from megacp.models.llama import DecoderLayer
from megacp.models.rope import RotaryEmbedding
from megacp.placement import ShardPlan
from megacp.train.memory import tiled_layer_bytes_per_token
from tests.helpers.memory import TensorMemory

CFG = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=1, num_kv_heads=1,
                  head_dim=64, max_position_embeddings=4096)
"""One query head: the CPU reference kernel's backward holds ``heads x rows x keys`` fp32 scores of a
tile (a fused GPU kernel holds none), small here beside the layer's per-token bytes."""


def _peak(tokens: int, tile: int) -> int:
    torch.manual_seed(0)
    layer = DecoderLayer(CFG, 1, dtype=torch.float32)
    for name, p in layer.named_parameters():
        torch.nn.init.normal_(p, 1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.05)
    swap_attention(layer)
    layer.attention_tile = tile
    step = TrainStep(CPSettings(), ShardPlan([0], [tokens], 1, 0))
    cos, sin = RotaryEmbedding(CFG)(torch.arange(tokens))
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    x = torch.randn(tokens, CFG.hidden_size).requires_grad_()
    dy = torch.randn(tokens, CFG.hidden_size)
    with TensorMemory() as mem:
        layer(x, cos, sin, cu, step).backward(dy)
    assert x.grad is not None
    return mem.peak


def test_a_tiled_layer_grows_with_its_tile_not_its_sequence() -> None:
    short, long = 128, 256
    per_token = tiled_layer_bytes_per_token(CFG, 4)  # input gradient, incoming gradient, KV block, fp32 dK/dV
    tiled = (_peak(long, 8) - _peak(short, 8)) / (long - short)
    untiled = (_peak(long, 0) - _peak(short, 0)) / (long - short)
    assert tiled <= 1.15 * per_token, (tiled, per_token)
    assert untiled >= 3 * tiled, (untiled, tiled)
    wider = _peak(long, 32) - _peak(long, 8)  # one tile's work grows with the tile
    assert wider > 0, wider
