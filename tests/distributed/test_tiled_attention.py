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
    from megacp.models.loss import lm_loss
    from megacp.placement.batch import shard_batch

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


def _train(rank: int, world_size: int) -> dict:
    """4 AdamW steps through megacp's Trainer at CP 2: plain, and with the layers over query tiles of 4
    rows plus every other memory feature, at ZeRO 0 and ZeRO 3 (parameters partitioned: the tiles'
    gradients reach DeepSpeed once per parameter through ``ds_grad_is_ready``); megacp's Llama and a
    transformers Qwen3."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    import megacp
    from megacp.models import CausalLM
    from megacp.train.data import PackedSequence
    from megacp.train.engine import Trainer
    from tests.helpers.hf_archs import SMALL, make_model

    g = torch.Generator().manual_seed(5)
    batches = [PackedSequence(torch.randint(3, 64, (30,), generator=g), torch.tensor([0, 11, 30], dtype=torch.int32))] * 4
    tiled = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "layers_per_checkpoint": 2},
             "sequence_tiling": {"mlp": 3, "attention": 4}}
    out = {}
    for family in ("megacp", "qwen3"):
        for stage in (0, 3):
            for name, extra in (("plain", {"sequence_tiling": {"mlp": 0, "attention": 0}}), ("tiled", tiled)):
                config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.5, "steps_per_print": 10**6,
                          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                          "context_parallel": {"size": world_size},
                          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01, "torch_adam": True}},
                          **extra}
                state = megacp.initialize(config)
                if family == "megacp":
                    torch.manual_seed(0)
                    model = CausalLM(CFG, dtype=torch.float32).train()
                    megacp.swap_attention(model, state, strategy="pass_kv")
                else:
                    model = make_model("qwen3")
                    model.set_attn_implementation("megacp")
                    model.train()
                trainer = Trainer(model, config, state)
                losses = [trainer.step(iter([b])).loss for b in batches]
                params = list(trainer.module.parameters())
                with deepspeed.zero.GatheredParameters(params):
                    weights = torch.cat([p.detach().flatten().clone() for p in params])
                plan = trainer.planned
                out[family, stage, name] = (losses, weights, plan.attention_tile if plan else None)
                trainer.engine.destroy()
    assert SMALL["vocab_size"] == CFG.vocab_size
    return out


def test_trainer_with_tiled_attention_equals_plain_steps():
    out = run_distributed(_train, 2)[0]
    for family in ("megacp", "qwen3"):
        for stage in (0, 3):
            losses, weights, _ = out[family, stage, "plain"]
            tiled_losses, tiled_weights, rows = out[family, stage, "tiled"]
            assert rows == 4, (family, stage)
            assert max(abs(a - b) / abs(a) for a, b in zip(losses, tiled_losses)) <= 1e-6, (family, stage)
            assert rel_err(tiled_weights, weights) <= 1e-5, (family, stage)
            assert losses[-1] < losses[0]
