"""Long-sequence memory features on transformers models (:mod:`megacp.integrations.hf_memory`) on real gloo
processes at CP = 1 and 2 (fp32): the fused RMSNorms, the sequence-tiled MLP (tiles of 4 tokens),
checkpointed decoder layers with their inputs in host memory, the second checkpoint level (both layers
one block, its input on the host), a memory plan's choice (one layer's input on the host, the other's
on the device, then blocks of two with tiles of 4 set through :class:`HFMemory`) and the tiled LM head +
loss each leave every rank's loss and
every parameter's gradient what the model's own forward and loss give (1e-6 relative), for a Llama, a
Qwen3 (q/k norms) and a Mistral whose window (4 tokens) is shorter than its documents; all three at
once as well. A Granite head (``logits_scaling``) passes the tiled loss's check against the model's own."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import DOCS, SMALL, make_model, packed_batch

VARIANTS = ("fused_norms", "tiled_mlp", "host_offload", "second_level", "planned", "tiled_loss", "all")
ARCHS = {"llama": {}, "qwen3": {}, "mistral": dict(sliding_window=4)}


def _grads(rank: int, world: int) -> dict[str, dict[str, float]]:
    import megacp
    from megacp.integrations import hf_memory
    from megacp.integrations.transformers import shard_loss
    from megacp.layers.settings import CPSettings
    from megacp.models.checkpointing import HostStash
    from megacp.placement.batch import shard_batch
    from megacp.train.memory import MemoryPlan

    state = megacp.initialize()
    settings = CPSettings.from_state(state, prefill="pass_kv") if world > 1 else None
    ids, _, _ = packed_batch(seed=2)
    cu = torch.tensor([0, *DOCS]).cumsum(0).tolist()
    shard = shard_batch(ids.reshape(-1), None, cu_seqlens=cu, cp_size=world, cp_rank=rank)
    errors: dict[str, dict[str, float]] = {}
    for arch, extra in ARCHS.items():
        base = make_model(arch, **extra)
        base.set_attn_implementation("megacp")
        base.train()

        def run(model: torch.nn.Module, loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
            model.zero_grad()
            value = loss(model, shard, settings=settings)
            value.backward()
            return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        ref_loss, ref_grads = run(base, shard_loss)
        for variant in VARIANTS:
            model = copy.deepcopy(base)
            stash = HostStash(torch.device("cpu"))
            if variant in ("fused_norms", "all"):  # every layer's two norms, the final one (and Qwen3's q/k norms)
                assert hf_memory.fuse_norms(model) == (4 if arch == "qwen3" else 2) * SMALL["num_hidden_layers"] + 1
            if variant in ("tiled_mlp", "all"):
                assert hf_memory.tile_mlps(model, 4).tile == 4
            if variant == "host_offload":
                every = frozenset(range(SMALL["num_hidden_layers"]))
                hf_memory.checkpoint_layers(model, hf_memory.LayerCheckpoints(1, every, stash))
            if variant in ("second_level", "all"):  # one block of both layers, its input on the host
                hf_memory.checkpoint_layers(model, hf_memory.LayerCheckpoints(2, frozenset({0}), stash))
            if variant == "planned":  # layer 1's input on the host, layer 0's on the device; then as the plan says
                memory = hf_memory.HFMemory(hf_memory.tile_mlps(model, 8), hf_memory.checkpoint_layers(
                    model, hf_memory.LayerCheckpoints(1, frozenset({1}), stash)))
                run(model, shard_loss)
                memory.apply(MemoryPlan(tokens=1, mlp_tile=4, offloaded_layers=frozenset({0}), gpu_bytes=0,
                                        host_bytes=0, capacity_bytes=None, layers_per_checkpoint=2))
                assert (memory.tiling.tile, memory.checkpoints.layers_per_checkpoint) == (4, 2)
            tiled = variant in ("tiled_loss", "all")
            if tiled:
                assert hf_memory.check_tiled_loss(model, SMALL["vocab_size"])
            loss, grads = run(model, hf_memory.tiled_loss if tiled else shard_loss)
            assert grads.keys() == ref_grads.keys()
            worst = max(float((grads[k] - g).norm() / g.norm().clamp_min(1e-30)) for k, g in ref_grads.items())
            errors[f"{arch}/{variant}"] = {"loss": float((loss - ref_loss).abs() / ref_loss.abs()), "grad": worst}
    granite = make_model("granite")
    granite.set_attn_implementation("megacp")
    errors["granite/check"] = {"loss": 0.0 if hf_memory.check_tiled_loss(granite, SMALL["vocab_size"]) else 1.0,
                               "grad": 0.0}
    megacp.shutdown()
    return errors


@pytest.mark.parametrize("world", [1, 2])
def test_memory_features_leave_losses_and_gradients_unchanged(world: int) -> None:
    for rank, errors in enumerate(run_distributed(_grads, world)):
        bad = {k: v for k, v in errors.items() if v["loss"] > 1e-6 or v["grad"] > 1e-6}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errors) == len(ARCHS) * len(VARIANTS) + 1


def _train(rank: int, world_size: int) -> dict:
    """4 AdamW steps of the tiny Qwen3 through megacp's Trainer at CP 2, plain and with every memory
    feature (host-offloaded blocks of 2 layers, MLP tiles of 4 tokens, the tiled loss), at ZeRO 1 and 3."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    import megacp
    from megacp.integrations.hf_memory import tiled_loss
    from megacp.integrations.transformers import shard_loss
    from megacp.train.data import PackedSequence
    from megacp.train.engine import Trainer

    g = torch.Generator().manual_seed(5)
    batches = [PackedSequence(torch.randint(3, SMALL["vocab_size"], (24,), generator=g),
                              torch.tensor([0, 10, 24], dtype=torch.int32))] * 4
    memory = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "layers_per_checkpoint": 2},
              "sequence_tiling": {"mlp": 4}}
    out = {}
    for stage in (1, 3):
        for name, extra in (("plain", {}), ("memory", memory)):
            config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.5, "steps_per_print": 10**6,
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                      "context_parallel": {"size": world_size},
                      "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01, "torch_adam": True}},
                      **extra}
            state = megacp.initialize(config)
            model = make_model("qwen3")
            model.set_attn_implementation("megacp")
            trainer = Trainer(model.train(), config, state,
                              loss=tiled_loss if extra else shard_loss)
            losses = [trainer.step(iter([b])).loss for b in batches]
            params = list(trainer.module.parameters())
            with deepspeed.zero.GatheredParameters(params):
                weights = torch.cat([p.detach().flatten().clone() for p in params])
            out[(stage, name)] = (losses, weights)
            trainer.engine.destroy()
    megacp.shutdown()
    return out


def test_the_trainer_with_every_memory_feature_equals_plain_steps() -> None:
    """Under DeepSpeed at ZeRO 1 and ZeRO 3 (parameters partitioned: the tiled MLP's backward recomputes
    through the projections' own calls), the memory features change no loss and no weight (1e-5)."""
    out = run_distributed(_train, 2)[0]
    for stage in (1, 3):
        (plain, w0), (memory, w1) = out[(stage, "plain")], out[(stage, "memory")]
        assert max(abs(a - b) / abs(a) for a, b in zip(plain, memory)) <= 1e-5, (stage, plain, memory)
        assert float((w1 - w0).abs().max() / w0.abs().max()) <= 1e-5, stage
        assert plain[-1] < plain[0], stage
