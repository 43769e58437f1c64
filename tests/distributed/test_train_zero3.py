"""ZeRO 3 on real gloo processes (fp32): the per-step losses and final weights after 20 AdamW
steps equal ZeRO 0's, with and without ``offload_param`` / ``offload_optimizer`` to CPU, on one
process, at CP 2 and at CP 2 x DP 2 (parameters really partitioned: no persistence threshold).
"""

from __future__ import annotations

import pytest
import torch

from megacp.models.config import ModelConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.reference import rel_err

STEPS = 20
SEQ_LEN = 16
LR = 2e-3
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


def _ds_config(zero: dict, cp: int, dp: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": dp,
        "gradient_clipping": 0.5,
        "steps_per_print": 10**6,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW on the offloaded fp32 master weights
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "context_parallel": {"size": cp},
    }


def _batches(dp_rank: int) -> list:
    """``STEPS`` packed sequences for DP replica ``dp_rank``: its 4 packed sequences of ragged
    documents, over and over (so that the loss visibly falls)."""
    from megacp.train.data import pack_documents

    g = torch.Generator().manual_seed(11 + dp_rank)
    docs = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (9, 1, 30, 3, 17, 5)]
    packed = list(pack_documents(docs, SEQ_LEN))[:4]
    return packed * (STEPS // len(packed))


def _weights(trainer) -> torch.Tensor:
    """All weights of ``trainer``'s model, flattened (gathered when ZeRO 3 partitions them)."""
    import deepspeed

    params = list(trainer.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().flatten().clone() for p in params])


def _train(rank: int, world_size: int, cp: int, save_dir: str) -> dict:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported: no accelerator probing
    import megacp
    from megacp.models import CausalLM
    from megacp.train.engine import Trainer

    dp = world_size // cp
    out: dict = {}
    for name, zero in (("zero0", {"stage": 0}), ("zero3", ZERO3), ("zero3_offload", {**ZERO3, **OFFLOAD})):
        config = _ds_config(zero, cp, dp)
        state = megacp.initialize(config)
        torch.manual_seed(0)
        model = CausalLM(CFG, dtype=torch.float32).train()
        if cp > 1:
            megacp.swap_attention(model, state, strategy="pass_kv")
        trainer = Trainer(model, config, state)
        batches = iter(_batches(state.rank_in("dp")))
        out[name] = ([trainer.step(batches).loss for _ in range(STEPS)], _weights(trainer))
        if name == "zero3":  # the saved ZeRO 3 shards convert back to the trained weights
            from megacp.checkpoint.deepspeed import read_deepspeed_checkpoint

            trainer.save(save_dir)
            converted = read_deepspeed_checkpoint(save_dir).tensors
            out["zero3_converted"] = torch.cat([converted[n].flatten() for n, _ in trainer.module.named_parameters()])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "cp"), [(1, 1), (2, 2), (4, 2)], ids=["cp1", "cp2", "cp2xdp2"])
def test_zero3_trains_like_zero0(world_size: int, cp: int, tmp_path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    results = run_distributed(_train, world_size, cp, str(tmp_path / "zero3"))
    ref_losses, ref_weights = results[0]["zero0"]
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for rank, out in enumerate(results):
        for run in ("zero3", "zero3_offload"):
            losses, weights = out[run]
            assert losses == pytest.approx(ref_losses, rel=1e-5), f"{run} rank {rank}"
            assert rel_err(weights, ref_weights) < 1e-5, f"{run} rank {rank}"
            assert weights.shape == ref_weights.shape, f"{run} rank {rank}"
        assert rel_err(out["zero3_converted"], ref_weights) < 1e-5, f"converted ZeRO 3 checkpoint, rank {rank}"



def _built_partitioned(rank: int, world_size: int, cp: int) -> dict:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    import megacp
    from megacp.config import load_config
    from megacp.families import PlanShape
    from megacp.models import CausalLM, build_model
    from megacp.train.engine import Trainer
    from megacp.train.setup import build_for_training, plan_from_config

    dp = world_size // cp
    config = _ds_config({**ZERO3, **OFFLOAD}, cp, dp)
    state = megacp.initialize(config)
    config = load_config(config, training=True)
    torch.manual_seed(rank)
    model = build_for_training(lambda device: build_model(CFG, dtype=torch.float32, device=device, backend="torch"),
                               config, state)
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if cp > 1:
        megacp.swap_attention(model, state, strategy="pass_kv")
    trainer = Trainer(model.train(), config, state)
    shape = PlanShape(CFG, dense_mlp=True, tiled_attention=True)  # megacp's torch layers
    early = plan_from_config(shape, config.training, state, seq_len=SEQ_LEN, micro_batch=1)[1].describe()
    planned = trainer.plan_memory(SEQ_LEN // cp)
    losses = [trainer.step(iter(_batches(state.rank_in("dp")))).loss for _ in range(4)]
    # the same weights in a plain (ZeRO 0) model train to the same losses
    plain_config = _ds_config({"stage": 0}, cp, dp)
    state = megacp.initialize(plain_config)
    plain = CausalLM(CFG, dtype=torch.float32)
    plain.load_state_dict(weights)
    if cp > 1:
        megacp.swap_attention(plain, state, strategy="pass_kv")
    ref = Trainer(plain.train(), plain_config, state)
    ref_losses = [ref.step(iter(_batches(state.rank_in("dp")))).loss for _ in range(4)]
    return {"partitioned": partitioned, "weights": weights, "losses": losses, "ref_losses": ref_losses,
            "plans": (early, planned.describe() if planned else None)}


@pytest.mark.parametrize(("world_size", "cp"), [(2, 2)], ids=["cp2"])
def test_zero3_builds_partitioned_and_initialised(world_size: int, cp: int) -> None:
    """``build_for_training`` under ZeRO 3 (with ``offload_param``): every parameter is partitioned
    as it is built; the gathered weights are initialised as ``CausalLM.reset_parameters`` says
    (norm weights 1, matrices N(0, 0.02²)) and are the same on every rank; the model trains to the
    losses a plain ZeRO 0 model with those weights reaches; the plan from the config alone is the
    Trainer's."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    results = run_distributed(_built_partitioned, world_size, cp)
    for out in results:
        assert out["partitioned"]
        for name, w in out["weights"].items():
            assert torch.isfinite(w).all(), name
            if name.endswith(("norm_weight", "norm.weight")):
                assert (w == 1).all(), name
            else:
                assert abs(float(w.std()) - 0.02) < 0.004 and abs(float(w.mean())) < 0.004, (name, float(w.std()))
            assert torch.equal(w, results[0]["weights"][name]), name
        assert out["losses"] == pytest.approx(out["ref_losses"], rel=1e-5)
        assert out["plans"][0] == out["plans"][1]
