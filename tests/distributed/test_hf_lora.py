"""PEFT's LoRA adapters under megacp's CP through ``CPTrainer``: three AdamW steps of a tiny
transformers Qwen3 wrapped by ``peft.get_peft_model`` (r 8 on every linear layer, fp32, gloo, two
sequences per step in gradient accumulation, clipping) at CP 1 and CP 2, also with ``memory=`` at
CP 2, give the losses and adapter gradients of PEFT's own single-process run over SDPA attention;
only the adapters train (the base weights are bit-identical afterwards, the optimizer holds only
adapter states), and the adapter ``Trainer.save_model`` writes (``adapter_config.json`` +
``adapter_model.safetensors``) reloads with ``peft.PeftModel.from_pretrained`` to the reference's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import SMALL, make_model
from tests.helpers.timeouts import HANG_GUARD_S

pytest.importorskip("peft", reason="LoRA adapters are PEFT's: pip install peft")

STEPS = 3
ACCUM = 2
LR = 5e-3
CLIP = 0.5
MEMORY = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "layers_per_checkpoint": 2},
          "sequence_tiling": {"mlp": 5, "attention": 0}}
"""The memory settings of the third run: layers checkpointed in blocks of 2 with their inputs on the
host, MLPs over tiles of 5 tokens, the tiled LM head + loss."""


def _lora_model(attn_implementation: str) -> Any:
    """The tiny Qwen3 with PEFT's LoRA (r 8, alpha 16, every linear layer, no dropout); the
    adapters' random start is the same in every process."""
    from peft import LoraConfig, get_peft_model

    model = make_model("qwen3", attn_implementation=attn_implementation)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))


def _dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(ACCUM * STEPS):
        ids = torch.randint(3, SMALL["vocab_size"], (22,), generator=g)
        labels = ids.clone()
        labels[:5] = -100  # a prompt the loss ignores
        rows.append({"input_ids": ids, "labels": labels})
    return rows


PROBE = torch.arange(3, 40) % SMALL["vocab_size"]
"""The sequence whose logits the reloaded adapter must reproduce."""


def _train(rank: int, world: int, out_dir: str, memory: dict | None) -> dict[str, Any]:
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    import megacp
    from megacp.integrations.hf_trainer import CPTrainer

    grads: list[dict[str, torch.Tensor]] = []

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            grads.append({n: p.grad.clone() for n, p in kwargs["model"].named_parameters() if p.grad is not None})

    state = megacp.initialize()  # every rank in one CP group
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=ACCUM,
                             max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", optim="adamw_torch",
                             max_grad_norm=CLIP, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True, dataloader_num_workers=0)
    model = _lora_model("megacp")
    trainer = CPTrainer(model=model, args=args, train_dataset=_dataset(), data_collator=default_data_collator,
                        cp_state=state, memory=memory, callbacks=[Grads()])
    trainer.train()
    trainer.save_model(str(Path(out_dir) / "adapter"))
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    megacp.shutdown()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "grads": grads,
            "optimized": sorted(n for n, p in model.named_parameters() if id(p) in optimized), "trainable": trainable,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _peft_reference() -> dict[str, Any]:
    """PEFT's own run in one process (SDPA, ``torch.optim.AdamW`` over the adapters): each step's
    loss is the mean over the valid (shifted) labels of its ``ACCUM`` sequences, clipped like the
    Trainer; the gradients after clipping, and the trained model's logits of :data:`PROBE`."""
    model = _lora_model("sdpa").train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    order = list(torch.utils.data.DistributedSampler(range(ACCUM * STEPS), num_replicas=1, rank=0, seed=0))
    data, losses, grads = [_dataset()[i] for i in order], [], []
    for step in range(STEPS):
        rows = data[step * ACCUM : (step + 1) * ACCUM]
        total = sum(int(r["labels"][1:].ne(-100).sum()) for r in rows)
        loss = sum(torch.nn.functional.cross_entropy(model(r["input_ids"][None]).logits[0, :-1], r["labels"][1:],
                                                     ignore_index=-100, reduction="sum") for r in rows) / total
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        logits = model.eval()(PROBE[None]).logits
    return {"losses": losses, "grads": grads, "logits": logits,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _peft_reference()


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the larger tensor's largest magnitude."""
    return float((a - b).abs().max() / max(float(a.abs().max()), float(b.abs().max()), 1e-30))


@pytest.mark.parametrize(("world", "memory"), [(1, None), (2, None), (2, MEMORY)], ids=["cp1", "cp2", "cp2_memory"])
def test_lora_equals_peft(tmp_path, reference: dict[str, Any], world: int, memory: dict | None) -> None:
    from peft import PeftModel

    start = {n: p.detach().clone() for n, p in _lora_model("sdpa").named_parameters()}
    assert any(float(g.abs().max()) > 0 for n, g in reference["grads"][1].items() if "lora_A" in n), \
        "the reference's A matrices got no gradient"
    for rank, out in enumerate(run_distributed(_train, world, str(tmp_path), memory, timeout=HANG_GUARD_S)):
        assert out["losses"] == pytest.approx(reference["losses"], abs=1e-5), f"rank {rank}"
        assert out["trainable"] and all(".lora_" in n for n in out["trainable"]), out["trainable"]
        assert out["optimized"] == sorted(out["trainable"]), "the optimizer holds states of frozen weights"
        assert len(out["grads"]) == STEPS
        for step, (got, want) in enumerate(zip(out["grads"], reference["grads"], strict=True)):
            assert sorted(got) == sorted(want) == sorted(out["trainable"])
            for name in want:
                assert _close(got[name], want[name]) <= 1e-5, f"rank {rank} step {step} {name}"
        for name, p in out["params"].items():
            if name in out["trainable"]:
                assert float((p - reference["params"][name]).abs().max()) <= 1e-5, f"rank {rank} {name}"
            else:
                assert torch.equal(p, start[name]), f"rank {rank}: the frozen {name} changed"
    saved = tmp_path / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in saved.iterdir()}
    reloaded = PeftModel.from_pretrained(make_model("qwen3", attn_implementation="sdpa"), str(saved)).eval()
    with torch.no_grad():
        logits = reloaded(PROBE[None]).logits
    assert _close(logits, reference["logits"]) <= 1e-5
