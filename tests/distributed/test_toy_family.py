"""A model family megacp does not ship, added through the seam as one class: a toy language model
(token and position embeddings, a tanh, an LM head; no attention) whose
:class:`~megacp.families.Trainable` gives its loss, memory features, head and checkpoint record.
megacp's Trainer trains it at CP 2 under DeepSpeed (ZeRO 1) exactly as plain torch trains it in one
process, saves it (its own sidecar entry, the manifest, the weights) and resumes from that save."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from megacp.config import MemoryOptions
from megacp.families import Trainable
from megacp.placement.batch import IGNORE_INDEX, TrainShard
from tests.helpers.distributed import run_distributed
from tests.helpers.timeouts import HANG_GUARD_S

VOCAB, HIDDEN, CONTEXT, STEPS, LR = 48, 16, 64, 4, 1e-2
CONFIG = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
          "context_parallel": {"size": 2}}


class ToyLM(nn.Module):
    """The toy model: each token's logits from its embedding plus its position's, through a tanh."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(CONTEXT, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embedding(input_ids) + self.positions(position_ids)))


def toy_loss(module: nn.Module, shard: TrainShard, *, settings: Any = None) -> torch.Tensor:
    """This CP rank's share of the batch's mean token loss: its tokens' summed cross-entropy over
    the valid labels of the whole batch (no attention: each token needs only itself)."""
    logits = module(shard.input_ids, shard.position_ids).float()
    total = nn.functional.cross_entropy(logits, shard.labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / max(shard.num_valid_tokens, 1)


class ToyFamily(Trainable):
    """The whole family, as the trainer and the checkpoints see it."""

    def _plan_shape(self) -> None:
        return None  # no Llama sizes: no memory plan

    @property
    def head(self) -> nn.Parameter:
        return self.module.head.weight

    def loss(self) -> Any:
        return toy_loss

    def install_memory(self, options: MemoryOptions, device: torch.device) -> None:
        if options.activation_checkpointing:
            raise ValueError("the toy model has no layers to checkpoint")

    def apply_plan(self, plan: Any) -> None:
        raise AssertionError("a model without a plan shape gets no plan")

    def _config_eos_ids(self) -> list[int]:
        return [self.config["eos"]]

    def record(self) -> dict[str, Any]:
        return {"toy_config": dict(self.config)}


def _batches() -> list[Any]:
    from megacp.train.data import PackedSequence

    ids = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(3))
    return [PackedSequence(ids, torch.tensor([0, 9, 23], dtype=torch.int32))] * STEPS  # learnt by heart


def _plain_torch() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, CP 1, torch's AdamW: the losses and final weights the CP 2 run must give."""
    from megacp.placement.batch import shard_batch

    model = ToyLM(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for batch in _batches():
        loss = toy_loss(model, shard_batch(batch.input_ids, cu_seqlens=batch.cu_seqlens, cp_size=1, cp_rank=0))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def _train_save_resume(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    import json
    import os
    from pathlib import Path

    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported: no accelerator probing
    import megacp
    from megacp.checkpoint import CheckpointError
    from megacp.checkpoint.deepspeed import TRAIN_STATE_FILE, read_record, train_state_checksum
    from megacp.checkpoint.shard_manifest import verify_tag
    from megacp.train.data import StreamPosition
    from megacp.train.engine import Trainer
    from megacp.train.resume import ResumePoint

    state = megacp.initialize(CONFIG)
    toy = ToyFamily(ToyLM(seed=0).train(), {"eos": 1})
    trainer = Trainer(toy, CONFIG, state)
    losses = [trainer.step(iter([batch])).loss for batch in _batches()]
    trained = {n: p.detach().clone() for n, p in trainer.module.state_dict().items()}
    point = ResumePoint(step=STEPS, data=StreamPosition(), seq_len=23, micro_batch=1, dp_size=1, world_size=world_size)
    tag = trainer.save(directory, resume=point)
    root = Path(directory)
    sidecar = json.loads((root / TRAIN_STATE_FILE).read_text())
    verify_tag(root / tag, root / TRAIN_STATE_FILE, train_state_checksum(root))  # its manifest holds
    saved = torch.load(root / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    try:
        read_record(root)
        refusal = ""
    except CheckpointError as err:
        refusal = str(err)
    fresh = Trainer(ToyFamily(ToyLM(seed=1).train(), {"eos": 1}), CONFIG, state)
    resumed = fresh.load(root, tag)
    return {"losses": losses, "trained": trained, "tag": tag, "sidecar": sidecar, "refusal": refusal,
            "saved": {n: t.clone() for n, t in saved.items()}, "eos": toy.eos_id(), "resumed_step": resumed.step,
            "loaded": {n: p.detach().clone() for n, p in fresh.module.state_dict().items()}}


def test_a_toy_family_trains_saves_and_resumes_at_cp2(tmp_path) -> None:
    ref_losses, ref_weights = _plain_torch()
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for out in run_distributed(_train_save_resume, 2, str(tmp_path / "toy"), timeout=HANG_GUARD_S):
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for name, want in ref_weights.items():
            assert torch.allclose(out["trained"][name], want, rtol=1e-5, atol=1e-6), name
            assert torch.equal(out["saved"][name], out["trained"][name]), name
            assert torch.equal(out["loaded"][name], out["trained"][name]), name
        assert out["tag"] == f"step{STEPS}" and out["resumed_step"] == STEPS and out["eos"] == 1
        assert out["sidecar"]["toy_config"] == {"eos": 1} and out["sidecar"]["zero_stage"] == 1
        assert "records no model megacp reads" in out["refusal"] and "\n" not in out["refusal"]
