"""``megacp.integrations.hf_trainer.CPTrainer``: three AdamW steps of a tiny transformers Qwen3
(fp32, gloo, two sequences per step in gradient accumulation, labels with ignored tokens, gradient
clipping) at CP = 2 give the losses and parameters of a plain PyTorch loop over transformers' SDPA
attention in one process, also with ``memory=`` (megacp's layer checkpoints on the host in blocks of
2, MLP tiles, the tiled LM head + loss) (the loss over the step's valid labels, as ``num_items_in_batch``); a model
without megacp's attention, ``average_tokens_across_devices=False``, and Falcon, BLOOM and MPT (also by
``LLM`` and at a forward of a CP shard) are refused, as is a batch that differs between the CP ranks."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import REFUSED, SMALL, make_model, make_refused

STEPS = 3
ACCUM = 2
LR = 2e-3
CLIP = 0.5  # small enough to act


def _dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(ACCUM * STEPS):
        ids = torch.randint(3, SMALL["vocab_size"], (22,), generator=g)
        labels = ids.clone()
        labels[:5] = -100  # a prompt the loss ignores
        rows.append({"input_ids": ids, "labels": labels})
    return rows


MEMORY = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "layers_per_checkpoint": 2},
          "sequence_tiling": {"mlp": 5}}
"""CPTrainer's memory settings of the second run: layers checkpointed in blocks of 2 with their
inputs on the host, MLPs over tiles of 5 tokens, the tiled LM head + loss."""


def _train(rank: int, world: int, out_dir: str, memory: dict | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import TrainingArguments, default_data_collator

    import megacp
    from megacp.integrations.hf_trainer import CPTrainer

    state = megacp.initialize()  # every rank in one CP group
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=ACCUM,
                             max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", optim="adamw_torch",
                             max_grad_norm=CLIP, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = CPTrainer(model=make_model("qwen3", attn_implementation="megacp"), args=args, train_dataset=_dataset(),
                        data_collator=default_data_collator, cp_state=state, memory=memory)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if memory is not None:
        assert trainer._hidden is not None  # the tiled loss ran
        assert (trainer._tiling is not None) == bool(memory.get("sequence_tiling", {}).get("mlp"))
        megacp.shutdown()
        return losses, params
    with pytest.raises(ValueError, match='attn_implementation="megacp"'):
        CPTrainer(model=make_model("qwen3", attn_implementation="sdpa"), args=args, cp_state=state)
    from megacp import LLM
    from megacp.integrations.transformers import prepare_batch

    for arch in REFUSED:  # at CP 2: by the trainer, by LLM and at a forward of a CP shard
        line = rf"{REFUSED[arch][0]} \({arch}\) computes attention in its own modules"
        for refused in (lambda: CPTrainer(model=make_refused(arch), args=args, cp_state=state),  # noqa: B023
                        lambda: LLM(make_refused(arch, "eager"), dtype="float32", state=state),  # noqa: B023
                        lambda: make_refused(arch)(**prepare_batch(torch.arange(3, 13)[None], state=state))):  # noqa: B023
            with pytest.raises(ValueError, match=line):
                refused()
    with pytest.raises(ValueError, match=r"prepare_batch: the 2 CP ranks must pass the same values but differ in input_ids "):
        prepare_batch(torch.arange(3, 13)[None] + rank, state=state)  # rank-divergent input
    with pytest.raises(ValueError, match=r"differ in labels shape"):
        prepare_batch(torch.arange(3, 13)[None], labels=torch.arange(3, 13)[None] if rank else None, state=state)
    args.average_tokens_across_devices = False
    with pytest.raises(ValueError, match="average_tokens_across_devices=False is not supported"):
        CPTrainer(model=trainer.model, args=args, cp_state=state)
    megacp.shutdown()
    return losses, params


def _plain_torch() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, transformers' SDPA attention, ``torch.optim.AdamW``: each step's loss is the
    mean over the valid (shifted) labels of its ``ACCUM`` sequences, clipped like the Trainer."""
    model = make_model("qwen3", attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    order = list(torch.utils.data.DistributedSampler(range(ACCUM * STEPS), num_replicas=1, rank=0, seed=0))
    data, losses = [_dataset()[i] for i in order], []  # CPTrainer's shuffle (args.seed)
    for step in range(STEPS):
        rows = data[step * ACCUM : (step + 1) * ACCUM]
        total = sum(int(r["labels"][1:].ne(-100).sum()) for r in rows)
        loss = sum(torch.nn.functional.cross_entropy(model(r["input_ids"][None]).logits[0, :-1], r["labels"][1:],
                                                     ignore_index=-100, reduction="sum") for r in rows) / total
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("memory", [None, MEMORY], ids=["as_is", "memory"])
def test_cp2_equals_plain_torch(tmp_path, memory: dict | None) -> None:
    ref_losses, ref_params = _plain_torch()
    with torch.no_grad():
        moved = min(float((p - ref_params[n]).abs().max()) for n, p in make_model("qwen3").named_parameters())
    assert moved > 1e-3, "the reference did not train"
    for rank, (losses, params) in enumerate(run_distributed(_train, 2, str(tmp_path), memory)):
        assert losses == pytest.approx(ref_losses, abs=1e-5), f"rank {rank}"
        for name, p in params.items():
            err = float((p - ref_params[name]).abs().max())
            assert err <= 1e-5, f"rank {rank} {name}: {err}"
