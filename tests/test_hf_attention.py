"""transformers models with ``attn_implementation="megacp"``: CP = 2 and 3 (real gloo ranks) give the
logits and the parameter gradients of the same model under transformers' own SDPA attention in one
process, for packed documents of ragged lengths (one shorter than 2N), over six architectures
built from transformers' configs with random weights; models whose features megacp cannot
reproduce are refused in one line naming the feature; 20 AdamW steps at CP = 2 (gradients summed over
the CP ranks, as DeepSpeed's sequence-parallel reduction does) follow transformers' SDPA at CP = 1."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed

_SMALL: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=False)),  # q/k/v bias
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=8)),  # q/k RMS norm
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None, head_dim=12)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),  # fused qkv
    "granite": ("GraniteForCausalLM", "GraniteConfig",  # attention_multiplier: a non-default scale
                dict(attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0)),
}
"""name -> (model class, config class, config arguments beyond :data:`_SMALL`)."""

DOCS = [9, 13, 5]
"""Packed documents: ragged, one shorter than 2N at N = 3."""


def _make(arch: str, seed: int = 0, **extra: Any) -> torch.nn.Module:
    """The tiny fp32 model ``arch`` with random weights (norms around 1, non-zero biases)."""
    import transformers

    model_name, config_name, kw = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**_SMALL, **kw, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    return model


def _packed_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[1, T]`` ids, per-document position ids and per-document shifted labels (-100 at ends)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, _SMALL["vocab_size"], (sum(DOCS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])
    targets, start = [], 0
    for n in DOCS:
        targets += ids[start + 1 : start + n].tolist() + [-100]
        start += n
    return ids.unsqueeze(0), pos.unsqueeze(0), torch.tensor(targets).unsqueeze(0)


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


def _cp_matches_reference(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    import torch.distributed as dist

    import megacp
    from megacp.integrations.transformers import prepare_batch

    state = megacp.initialize()  # every rank in one CP group
    ids, pos, targets = _packed_batch(seed=1)
    worst = {}
    for arch in ARCHS:
        model = _make(arch).train()
        ref_logits, ref_loss, ref_grads = _reference(model, ids, pos, targets)
        model.set_attn_implementation("megacp")
        batch = prepare_batch(ids, position_ids=pos, state=state)
        out = model(**batch)
        out.loss.backward()
        index = batch["megacp_step"].plan.local_index()
        logit_err = float((out.logits[0].detach() - ref_logits[index]).abs().max() / ref_logits.abs().max())
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grad_err = 0.0
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)  # DP x CP reduction: CP ranks' gradients sum to CP = 1's
            grad_err = max(grad_err, float((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max()))
        worst[arch] = (logit_err, abs(float(loss - ref_loss)), grad_err)
    megacp.shutdown()
    return worst


@pytest.mark.parametrize("cp", [2, 3])
def test_hf_models_under_cp_match_one_process(cp: int) -> None:
    for rank, worst in enumerate(run_distributed(_cp_matches_reference, cp, timeout=240)):
        assert set(worst) == set(ARCHS)
        for arch, (logit_err, loss_err, grad_err) in worst.items():
            assert logit_err <= 1e-5 and loss_err <= 1e-5 and grad_err <= 1e-5, (cp, rank, arch, worst[arch])


STEPS = 20
LR = 3e-3


def _reference_training() -> tuple[list[float], torch.Tensor]:
    """CP = 1 without DeepSpeed or megacp: transformers' SDPA attention, ``torch.optim.AdamW``;
    per-step mean token loss and the final weights."""
    model = _make("qwen3").train()
    model.set_attn_implementation("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for i in range(STEPS):
        ids, pos, targets = _packed_batch(seed=100 + i)
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
    model = _make("qwen3").train()
    model.set_attn_implementation("megacp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for i in range(STEPS):
        ids, pos, _ = _packed_batch(seed=100 + i)
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
    for losses in run_distributed(_hand_reduced_training, 2, timeout=240):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)


def _batch(arch: str, **extra: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    from megacp.integrations.transformers import prepare_batch

    model = _make(arch, **extra)
    model.set_attn_implementation("megacp")
    ids, pos, _ = _packed_batch(seed=2)
    return model, prepare_batch(ids, position_ids=pos)


@pytest.mark.parametrize("arch, extra, train, message", [
    ("mistral", dict(sliding_window=8), False, "mistral layer 0 uses a sliding window of 8 tokens, shorter than a 13-token"),
    ("llama", dict(attention_dropout=0.1), True, "attention dropout 0.1"),
    ("qwen3", dict(is_causal=False), False, r"qwen3 uses bidirectional \(non-causal\) attention"),
])
def test_unsupported_features_are_refused_naming_them(arch: str, extra: dict, train: bool, message: str) -> None:
    model, batch = _batch(arch, **extra)
    with pytest.raises(ValueError, match=message):
        model.train(train)(**batch)


def test_window_covering_every_document_is_exact() -> None:
    model, batch = _batch("mistral", sliding_window=13)  # the longest document: the window changes nothing
    full, _ = _batch("mistral")
    torch.testing.assert_close(model(**batch).logits, full(**batch).logits, rtol=0, atol=0)


def test_gemma2_soft_capping_is_refused_before_any_work() -> None:
    import transformers

    from megacp.integrations.transformers import check_model

    config = transformers.Gemma2Config(**{**_SMALL, "head_dim": 8}, attn_logit_softcapping=50.0)
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(ValueError, match="gemma2 soft-caps attention logits"):
        check_model(model)


def test_masks_and_caches_megacp_cannot_honour_are_refused() -> None:
    model, batch = _batch("llama")
    ids = batch["input_ids"]
    model.eval()
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="padding attention mask"):
        model(ids, attention_mask=padded)
    with pytest.raises(ValueError, match="custom 4-D attention mask"):
        model(ids, attention_mask=torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool))
    with pytest.raises(ValueError, match="a transformers cache with past tokens"):
        model.generate(ids[:, :5], max_new_tokens=2, do_sample=False)
