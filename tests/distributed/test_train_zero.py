"""megacp's DeepSpeed trainer (:class:`megacp.train.engine.Trainer`) on 2 real gloo processes
(fp32): at CP = 2, ZeRO 0, 1 and 2 give the per-step losses and final weights of plain PyTorch
training on one process (CP = 1, ``torch.optim.AdamW``, the same gradient clipping and
accumulation), on packed documents of ragged lengths; so does TP = 2 under ZeRO 1 (DeepSpeed's
gradient norm for clipping counts each TP part once and each replicated weight once).

The engines are built in one pair of processes, one after the other (DeepSpeed's import and the
first optimizer, which imports ``torch._dynamo``, cost seconds per process).
"""

from __future__ import annotations

import pytest
import torch

from megacp.models.config import ModelConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.reference import rel_err

STEPS = 4
GRAD_ACCUM = 2
SEQ_LEN = 24
LR = 2e-3
CLIP = 0.05  # small enough that clipping acts on every step
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=True)


def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "context_parallel": {"size": 2},
    }


def _batches() -> list:
    """``STEPS x GRAD_ACCUM`` packed sequences of ragged documents (some pieces shorter than 2N)."""
    from megacp.train.data import pack_documents

    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (9, 1, 30, 3, 17, 5, 40, 2, 11, 60, 7, 23)]
    packed = list(pack_documents(docs, SEQ_LEN))
    assert len(packed) >= STEPS * GRAD_ACCUM
    return packed[: STEPS * GRAD_ACCUM]


def _model(tp_group: torch.distributed.ProcessGroup | None = None) -> torch.nn.Module:
    """The seeded model, or this TP rank's shard of it."""
    from megacp.checkpoint.tp import shard_tensor
    from megacp.models import CausalLM

    torch.manual_seed(0)
    full = CausalLM(CFG, dtype=torch.float32).train()
    if tp_group is None:
        return full
    tp, rank = torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)
    model = CausalLM(CFG, tp_group, dtype=torch.float32).train()
    model.load_state_dict({n: shard_tensor(CFG, n, t, rank, tp).clone() for n, t in full.state_dict().items()})
    return model


def _flat(model: torch.nn.Module, tp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
    """All weights, flattened (TP parts merged into full tensors)."""
    if tp_group is None:
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    from megacp.checkpoint.tp import merge_shards

    tp = torch.distributed.get_world_size(tp_group)
    full = []
    for name, p in model.named_parameters():
        parts = [torch.empty_like(p) for _ in range(tp)]
        torch.distributed.all_gather(parts, p.detach().contiguous(), group=tp_group)
        full.append(merge_shards(CFG, name, parts).flatten())
    return torch.cat(full)


def _plain_torch() -> tuple[list[float], torch.Tensor]:
    """CP = 1 without DeepSpeed: per-step mean micro-batch loss and the final weights."""
    from megacp.models.loss import lm_loss
    from megacp.placement.batch import shard_batch

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    batches, losses = iter(_batches()), []
    for _ in range(STEPS):
        step_losses = []
        for _ in range(GRAD_ACCUM):
            batch = next(batches)
            loss = lm_loss(model, shard_batch(batch.input_ids, cu_seqlens=batch.cu_seqlens, cp_size=1, cp_rank=0))
            (loss / GRAD_ACCUM).backward()
            step_losses.append(float(loss))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / GRAD_ACCUM)
    return losses, _flat(model)


def _zero_stages(rank: int, world_size: int) -> dict:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported: no accelerator probing
    import megacp
    from megacp.train.engine import Trainer

    state = megacp.initialize({"context_parallel": {"size": 2}})
    out: dict = {}
    for stage in (0, 1, 2):
        model = _model()
        megacp.swap_attention(model, state, strategy="pass_kv")
        config = _ds_config(stage)
        trainer = Trainer(model, config, state)
        batches = iter(_batches())
        out[stage] = ([trainer.step(batches).loss for _ in range(STEPS)], _flat(trainer.module))
    tp_config = {**_ds_config(1), "context_parallel": {"size": 1}, "tensor_model_parallel": {"size": 2}}
    tp_state = megacp.initialize(tp_config)
    tp_group = tp_state.group("tp")
    trainer = Trainer(_model(tp_group), tp_config, tp_state)
    batches = iter(_batches())
    out["tp2"] = ([trainer.step(batches).loss for _ in range(STEPS)], _flat(trainer.module, tp_group))
    if rank == 0:
        out["torch"] = _plain_torch()
    return out


@pytest.mark.slow
def test_zero_stages_and_tp_train_like_plain_torch() -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    results = run_distributed(_zero_stages, 2)
    ref_losses, ref_weights = results[0]["torch"]
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for out in results:
        for run in (0, 1, 2, "tp2"):
            losses, weights = out[run]
            assert losses == pytest.approx(ref_losses, rel=1e-5), f"ZeRO {run}"
            assert rel_err(weights, ref_weights) < 1e-5, f"ZeRO {run}"


def _bf16_on_gpu(rank: int, world_size: int) -> dict:
    import megacp
    from megacp.config import load_config
    from megacp.train.engine import Trainer

    config = {**_ds_config(1), "bf16": {"enabled": True}, "context_parallel": {"size": 1}}
    state = megacp.initialize(config)
    config = load_config(config, training=True)
    model = _model().to(device=state.device, dtype=config.training.dtype)
    trainer = Trainer(model, config, state)
    batches = iter(_batches())
    return {"losses": [trainer.step(batches).loss for _ in range(STEPS)], "dtype": str(next(model.parameters()).dtype)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 training under DeepSpeed runs on a CUDA GPU")
def test_bf16_zero1_on_one_gpu_tracks_fp32() -> None:
    """One GPU, bf16 from the DeepSpeed config, ZeRO 1 (fp32 master weights): the per-step losses
    follow plain fp32 training within bf16 rounding."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    out = run_distributed(_bf16_on_gpu, 1, backend="nccl")[0]
    assert out["dtype"] == "torch.bfloat16"
    assert out["losses"] == pytest.approx(_plain_torch()[0], rel=2e-2)
