"""Training memory options on real gloo processes (fp32): activation checkpointing with the layer
inputs offloaded to host memory, the second checkpoint level (blocks of 2 layers) and the
sequence-tiled MLP change no gradient and no step.

* CP 2, plain ``lm_loss``: the gradients with every layer checkpointed, offloaded and its MLP
  tiled (tiles of 5 tokens, shorter than a rank's shard) equal those without (≤ 1e-6 relative).
* CP 2 under DeepSpeed: 6 AdamW steps configured with ``activation_checkpointing`` (offload cpu)
  and ``sequence_tiling`` equal the same steps without, at ZeRO 1 and at ZeRO 3 with parameters
  partitioned (the tiled MLP's backward reads the weights ZeRO 3 gathers again): losses and
  weights ≤ 1e-6.
"""

from __future__ import annotations

import torch

from megacp.models.config import ModelConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.reference import rel_err

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
STEPS = 6
MEMORY = {"activation_checkpointing": {"enabled": True, "offload": "cpu"}, "sequence_tiling": {"mlp": 5}}


def _grads(rank: int, world_size: int) -> float:
    import megacp
    from megacp.layers.settings import CPSettings
    from megacp.models import CausalLM
    from megacp.models.loss import lm_loss
    from megacp.placement.batch import shard_batch

    state = megacp.initialize({"context_parallel": {"size": world_size}})
    torch.manual_seed(0)
    model = CausalLM(CFG, dtype=torch.float32).train()
    settings = CPSettings.from_state(state, prefill="pass_kv")
    megacp.swap_attention(model, settings)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab_size, (40,), generator=g)
    shard = shard_batch(ids, cu_seqlens=torch.tensor([0, 13, 40], dtype=torch.int32), cp_size=world_size, cp_rank=rank)
    grads = []
    for memory, per in ((False, 1), (True, 1), (True, 2)):  # per 2: blocks of layers 0-1 and 2 (second level)
        model.zero_grad()
        model.activation_checkpointing = memory
        model.layers_per_checkpoint = per
        model.offloaded_layers = frozenset(range(0, CFG.num_layers, per)) if memory else frozenset()
        for layer in model.layers:
            layer.layernorm_mlp.tile_tokens = 5 if memory else 0
        lm_loss(model, shard, settings=settings).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if memory:
            assert model.host_stash is not None and model.host_stash.bytes_offloaded > 0
    return max(rel_err(g[n], grads[0][n]) for g in grads[1:] for n in grads[0])


def test_offload_and_tiling_change_no_gradient():
    errors = run_distributed(_grads, 2)
    assert max(errors) <= 1e-6, errors


def _train(rank: int, world_size: int) -> dict:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    import megacp
    from megacp.models import CausalLM
    from megacp.train.data import PackedSequence
    from megacp.train.engine import Trainer

    out = {}
    g = torch.Generator().manual_seed(5)
    batches = [PackedSequence(torch.randint(0, CFG.vocab_size, (24,), generator=g),
                              torch.tensor([0, 10, 24], dtype=torch.int32))] * STEPS  # the loss visibly falls
    zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    second = {**MEMORY, "activation_checkpointing": {"enabled": True, "offload": "cpu", "layers_per_checkpoint": 2}}
    for name, zero, memory in (("zero1", {"stage": 1}, {}), ("zero1_memory", {"stage": 1}, MEMORY),
                               ("zero3", zero3, {}), ("zero3_memory", zero3, MEMORY), ("zero3_second", zero3, second)):
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.5, "steps_per_print": 10**6,
                  "zero_optimization": zero, "context_parallel": {"size": world_size},
                  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01, "torch_adam": True}},
                  **memory}
        state = megacp.initialize(config)
        torch.manual_seed(0)
        model = CausalLM(CFG, dtype=torch.float32).train()
        megacp.swap_attention(model, state, strategy="pass_kv")
        trainer = Trainer(model, config, state)
        losses = [trainer.step(iter([b])).loss for b in batches]
        params = list(trainer.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            weights = torch.cat([p.detach().flatten().clone() for p in params])
        tiles = {layer.layernorm_mlp.tile_tokens for layer in trainer.module.layers}
        out[name] = (losses, weights, tiles, trainer.module.offloaded_layers, trainer.module.layers_per_checkpoint)
        trainer.engine.destroy()
    return out


def test_trainer_memory_options_equal_plain_steps():
    out = run_distributed(_train, 2)[0]
    for name, memory, blocks, per in (("zero1", "zero1_memory", range(CFG.num_layers), 1),
                                      ("zero3", "zero3_memory", range(CFG.num_layers), 1),
                                      ("zero3", "zero3_second", (0, 2), 2)):
        losses, weights, *_ = out[name]
        l2, w2, tiles, offloaded, layers_per_checkpoint = out[memory]
        assert tiles == {5} and offloaded == frozenset(blocks) and layers_per_checkpoint == per, memory
        assert max(abs(a - b) / abs(a) for a, b in zip(losses, l2)) <= 1e-6, (name, losses, l2)
        assert rel_err(w2, weights) <= 1e-5, name
        assert losses[-1] < losses[0]
