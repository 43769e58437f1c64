"""A decoder layer trained over query tiles (:mod:`megacp.models.tiled_layer`) on real gloo
processes (fp32): megacp's Llama at CP 1, 2 and 3, with a sliding window shorter than the
sequence, alone and with every other memory feature on (checkpointed and offloaded layer inputs,
blocks of two layers, the tiled MLP) — the loss and every parameter's gradient equal the untiled
step's (<= 1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from megacp.models.config import ModelConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.reference import rel_err

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=128, tie_word_embeddings=False)


def _grads(rank: int, world_size: int, window: int | None) -> tuple[float, float]:
    import dataclasses

    import megacp
    from megacp.layers.settings import CPSettings
    from megacp.models import CausalLM
    from megacp.placement.batch import shard_batch
    from megacp.train.loss import lm_loss

    state = megacp.initialize({"context_parallel": {"size": world_size}})
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, sliding_window=window) if window else CFG
    model = CausalLM(cfg, dtype=torch.float32).train()
    settings = CPSettings.from_state(state, prefill="pass_kv")
    megacp.swap_attention(model, settings)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab_size, (83,), generator=g)
    shard = shard_batch(ids, cu_seqlens=torch.tensor([0, 13, 70, 83], dtype=torch.int32), cp_size=world_size,
                        cp_rank=rank)
    runs = []
    # (attention tile, memory features on, layers per checkpoint)
    for tile, memory, per in ((0, False, 1), (4, False, 1), (7, True, 1), (5, True, 2)):
        model.zero_grad()
        model.activation_checkpointing = memory
        model.layers_per_checkpoint = per
        model.offloaded_layers = frozenset(range(0, CFG.num_layers, per)) if memory else frozenset()
        for layer in model.layers:
            layer.layernorm_mlp.tile_tokens = 3 if memory else 0
            layer.attention_tile = tile
        loss = lm_loss(model, shard, settings=settings)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, grads0), rest = runs[0], runs[1:]
    return (max(rel_err(loss, loss0) for loss, _ in rest),
            max(rel_err(g[n], grads0[n]) for _, g in rest for n in grads0))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_tiled_attention_changes_no_gradient(world_size: int):
    for window in (None, 9):
        results = run_distributed(_grads, world_size, window)
        assert max(loss for loss, _ in results) <= 1e-6, (window, results)
        assert max(grad for _, grad in results) <= 1e-6, (window, results)
