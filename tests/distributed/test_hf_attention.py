"""transformers models with ``attn_implementation="megacp"``: CP = 2 and 3 (real gloo ranks) give the
logits and the parameter gradients of the same model under transformers' own SDPA attention in one
process, for packed documents of ragged lengths (one shorter than 2N), over six architectures
built from transformers' configs with random weights; models whose features megacp cannot
reproduce are refused (tests/unit/test_hf_attention_refusals.py); 20 AdamW steps at CP = 2 (gradients summed over
the CP ranks, as DeepSpeed's sequence-parallel reduction does) follow transformers' SDPA at CP = 1."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import ARCHS, make_model, packed_batch


def _reference(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor,
               targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' SDPA attention in this process (packed documents from position-id resets):
    logits ``[T, V]``, mean token loss and every parameter's gradient."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    logits = ref(ids, position_ids=pos, use_cache=False).logits[0]
    loss = torch.nn.functional.cross_entropy(logits.float(), targets[0], ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


WINDOWED = {f"mistral_w{w}": ("mistral", dict(sliding_window=w)) for w in (1, 4, 7)}
"""Sliding windows of 1, 4 and 7 tokens: shorter than the documents of 9 and 13 tokens (which lie
between the window and 4 x window for 4 and 7), longer than the one of 5 at 7; the per-layer windows of Qwen2
(``max_window_layers``) are checked at CP 1 in ``tests/unit/test_hf_attention_refusals.py``."""


def _cp_matches_reference(rank: int, world: int, cases: dict | None = None) -> dict[str, tuple[float, float, float]]:
    import torch.distributed as dist

    import megacp
    from megacp.integrations.transformers import prepare_batch

    state = megacp.initialize()  # every rank in one CP group
    ids, pos, targets = packed_batch(seed=1)
    worst = {}
    for case, (arch, extra) in (cases or {a: (a, {}) for a in ARCHS}).items():
        model = make_model(arch, **extra).train()
        ref_logits, ref_loss, ref_grads = _reference(model, ids, pos, targets)
        model.set_attn_implementation("megacp")
        batch = prepare_batch(ids, position_ids=pos, state=state)
        out = model(**batch)
        out.loss.backward()
        index = batch["megacp_step"].plan.local_index()
        logit_err = float((out.logits[0].detach() - ref_logits[index]).abs().max() / ref_logits.abs().max())
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grad_err, largest = 0.0, max(float(g.abs().max()) for g in ref_grads.values())
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)  # DP x CP reduction: CP ranks' gradients sum to CP = 1's
            # a gradient that is zero in exact arithmetic (q and k under a window of 1: the softmax
            # over one key) is rounding noise in both: compared against the largest gradient instead
            ref_max = float(ref_grads[name].abs().max())
            scale = ref_max if ref_max >= 1e-6 * largest else largest
            grad_err = max(grad_err, float((g - ref_grads[name]).abs().max()) / scale)
        worst[case] = (logit_err, abs(float(loss - ref_loss)), grad_err)
    megacp.shutdown()
    return worst


@pytest.mark.parametrize("cp", [2, 3])
def test_hf_models_under_cp_match_one_process(cp: int) -> None:
    for rank, worst in enumerate(run_distributed(_cp_matches_reference, cp)):
        assert set(worst) == set(ARCHS)
        for arch, (logit_err, loss_err, grad_err) in worst.items():
            assert logit_err <= 1e-5 and loss_err <= 1e-5 and grad_err <= 1e-5, (cp, rank, arch, worst[arch])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_hf_sliding_windows_under_cp_match_one_process(cp: int) -> None:
    """Logits, loss and every parameter's gradient of windowed models at CP 2-4 = transformers' SDPA
    with its own sliding-window mask in one process."""
    for rank, worst in enumerate(run_distributed(_cp_matches_reference, cp, WINDOWED)):
        assert set(worst) == set(WINDOWED)
        for name, (logit_err, loss_err, grad_err) in worst.items():
            assert logit_err <= 1e-5 and loss_err <= 1e-5 and grad_err <= 1e-5, (rank, name, worst[name])


STEPS = 20
LR = 3e-3


def _reference_training() -> tuple[list[float], torch.Tensor]:
    """CP = 1 without DeepSpeed or megacp: transformers' SDPA attention, ``torch.optim.AdamW``;
    per-step mean token loss and the final weights."""
    model = make_model("qwen3").train()
    model.set_attn_implementation("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for i in range(STEPS):
        ids, pos, targets = packed_batch(seed=100 + i)
        loss = torch.nn.functional.cross_entropy(model(ids, position_ids=pos, use_cache=False).logits[0], targets[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


def _hand_reduced_training(rank: int, world: int) -> list[float]:
    """:data:`STEPS` AdamW steps of Qwen3 with ``attn_implementation="megacp"`` at CP = ``world``,
    the CP ranks' gradients summed by hand (DeepSpeed's sequence-parallel reduction); the logged
    (CP-summed) losses."""
    import torch.distributed as dist

    import megacp
    from megacp.integrations.transformers import prepare_batch

    state = megacp.initialize()
    model = make_model("qwen3").train()
    model.set_attn_implementation("megacp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for i in range(STEPS):
        ids, pos, _ = packed_batch(seed=100 + i)
        loss = model(**prepare_batch(ids, position_ids=pos, state=state)).loss
        loss.backward()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    megacp.shutdown()
    return losses


def test_adamw_steps_at_cp2_follow_one_process() -> None:
    ref_losses, _ = _reference_training()
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learns: the comparison is not between two idle runs
    for losses in run_distributed(_hand_reduced_training, 2):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
