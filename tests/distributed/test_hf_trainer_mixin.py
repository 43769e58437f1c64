"""``CPTrainerMixin`` / ``cp_trainer`` over a ``transformers.Trainer`` subclass of its own (a
constructor argument and a ``compute_loss`` of its own, as TRL's ``SFTTrainer`` has): three AdamW steps
of a tiny Qwen3 on packed documents (transformers' ``DataCollatorWithFlattening``: two
prompt + completion documents per row, position-id resets, as TRL's packing makes them) with
completion-only labels (``-100`` on each prompt) give the same losses and parameters at CP 2
(``cp_trainer(SubTrainer)``) as at CP 1 (``class T(CPTrainerMixin, SubTrainer)``) and as a plain
PyTorch loop over the documents one at a time (fp32, gloo, ≤ 1e-5)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Trainer

from megacp.integrations.hf_trainer import CPTrainer, CPTrainerMixin, cp_trainer
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import SMALL, make_model
from tests.helpers.timeouts import HANG_GUARD_S

STEPS = 3
ACCUM = 2
PER_ROW = 2
LR = 2e-3
CLIP = 0.5


class SubTrainer(Trainer):
    """A ``Trainer`` subclass with a constructor argument and a loss of its own (which CP replaces)."""

    def __init__(self, *args: Any, completion_only: bool = True, **kwargs: Any) -> None:
        self.completion_only = completion_only
        super().__init__(*args, **kwargs)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        raise AssertionError("the subclass's own loss ran under CP")


class MixedTrainer(CPTrainerMixin, SubTrainer):
    """The mixin written as a class."""


def _documents() -> list[dict[str, list[int]]]:
    """Prompt + completion documents of ragged lengths; labels ``-100`` on the prompt."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for i in range(PER_ROW * ACCUM * STEPS):
        prompt, completion = 3 + i % 4, 6 + (3 * i) % 7
        ids = torch.randint(3, SMALL["vocab_size"], (prompt + completion,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _train(rank: int, world: int, out_dir: str) -> tuple[list[float], dict[str, torch.Tensor], str]:
    from transformers import DataCollatorWithFlattening, TrainingArguments

    import megacp

    state = megacp.initialize()  # every rank in one CP group
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=PER_ROW,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=LR,
                             lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=CLIP, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0, remove_unused_columns=False)
    trainer_class = cp_trainer(SubTrainer) if world > 1 else MixedTrainer
    trainer = trainer_class(model=make_model("qwen3", attn_implementation="megacp"), args=args,
                            train_dataset=_documents(), data_collator=DataCollatorWithFlattening(), cp_state=state,
                            completion_only=True)
    assert trainer.completion_only
    trainer.train()
    megacp.shutdown()
    return ([h["loss"] for h in trainer.state.log_history if "loss" in h],
            {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, type(trainer).__name__)


def _plain_torch() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, SDPA, ``torch.optim.AdamW``: each step's loss is the mean over the completion
    labels of its ``PER_ROW x ACCUM`` documents, each document run on its own; clipped like the Trainer."""
    model = make_model("qwen3", attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    order = list(torch.utils.data.DistributedSampler(range(len(_documents())), num_replicas=1, rank=0, seed=0))
    docs, losses, per_step = [_documents()[i] for i in order], [], PER_ROW * ACCUM
    for step in range(STEPS):
        rows = docs[step * per_step : (step + 1) * per_step]
        labels = [torch.tensor(r["labels"][1:]) for r in rows]
        total = sum(int(t.ne(-100).sum()) for t in labels)
        loss = sum(torch.nn.functional.cross_entropy(model(torch.tensor(r["input_ids"])[None]).logits[0, :-1], t,
                                                     ignore_index=-100, reduction="sum")
                   for r, t in zip(rows, labels, strict=True)) / total
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_mixin_over_a_trainer_subclass_trains_packed_completions(tmp_path) -> None:
    ref_losses, ref_params = _plain_torch()
    results = {world: run_distributed(_train, world, str(tmp_path / f"cp{world}"), timeout=HANG_GUARD_S)
               for world in (1, 2)}
    assert results[1][0][2] == "MixedTrainer" and results[2][0][2] == "CPSubTrainer"
    for world, ranks in results.items():
        for rank, (losses, params, _) in enumerate(ranks):
            assert losses == pytest.approx(ref_losses, abs=1e-5), f"CP {world} rank {rank}"
            for name, p in params.items():
                err = float((p - ref_params[name]).abs().max())
                assert err <= 1e-5, f"CP {world} rank {rank} {name}: {err}"


def test_cp_trainer_takes_trainer_classes_only() -> None:
    assert cp_trainer(CPTrainer) is CPTrainer
    assert issubclass(cp_trainer(Trainer), CPTrainerMixin)
    with pytest.raises(TypeError, match="cp_trainer takes a transformers.Trainer class, got <class 'dict'>"):
        cp_trainer(dict)  # type: ignore[arg-type]
