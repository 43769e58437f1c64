"""``megacp.integrations.hf_trainer.CPTrainer``: three AdamW steps of a tiny transformers Qwen3
(fp32, gloo, two sequences per step in gradient accumulation, labels with ignored tokens) at CP = 2
give the losses and parameters of transformers' own ``Trainer`` (SDPA attention) at CP = 1."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import SMALL, make_model

STEPS = 3


def _dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(2 * STEPS):
        ids = torch.randint(3, SMALL["vocab_size"], (22,), generator=g)
        labels = ids.clone()
        labels[:5] = -100  # a prompt the loss ignores
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _train(rank: int, world: int, out_dir: str, plain: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import Trainer, TrainingArguments, default_data_collator

    import megacp
    from megacp.integrations.hf_trainer import CPTrainer

    state = megacp.initialize()  # every rank in one CP group
    model = make_model("qwen3", attn_implementation="sdpa" if plain else "megacp")
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                             max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0,
                             weight_decay=0.1, optim="adamw_torch", logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = (Trainer(model=model, args=args, train_dataset=_dataset(), data_collator=default_data_collator) if plain
               else CPTrainer(model=model, args=args, train_dataset=_dataset(), data_collator=default_data_collator,
                              cp_state=state))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    megacp.shutdown()
    return losses, params


def test_cp2_equals_cp1(tmp_path) -> None:
    (ref_losses, ref_params), = run_distributed(_train, 1, str(tmp_path / "plain"), True)
    results = run_distributed(_train, 2, str(tmp_path / "cp2"), False)
    assert len(ref_losses) == STEPS
    with torch.no_grad():
        moved = min(float((p - ref_params[n]).abs().max()) for n, p in make_model("qwen3").named_parameters())
    assert moved > 1e-3, "the reference did not train"
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(ref_losses, abs=1e-5), f"rank {rank}"
        for name, p in params.items():
            err = float((p - ref_params[name]).abs().max())
            assert err <= 1e-5, f"rank {rank} {name}: {err}"
