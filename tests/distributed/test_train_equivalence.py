"""Training under CP (and CP x TP) is CP = 1's training: 20 AdamW steps of a tiny Llama give the
same losses and parameters (fp32, real gloo processes), with ignored labels, a label at a shard
edge, packed ragged documents and a rank without tokens; activation checkpointing changes no
gradient, and the replicated weights' gradients agree across TP ranks.

As DeepSpeed does through megacp's mpu, the gradients are summed over the CP group (each rank's
loss is its token-loss sum over the whole group's valid-token count).

Tolerances: losses 1e-5 relative; parameters 1e-5 relative in norm (``||got - want|| / ||want||``)
and 1e-4 in their worst element (relative to the tensor's largest). AdamW divides each gradient
element by its own running RMS, so an element whose gradient is near zero amplifies fp32 rounding:
CP = 1 in fp32 ends the 20 steps 1.2e-5 (worst element) and 1.1e-6 (norm) away from the same run
in fp64; CP 2 / 3 / 2x2 end 1.1e-5 / 3.6e-5 / 5.8e-6 (worst element) and 6.6e-7 / 2.2e-6 / 4.1e-7
(norm) away from CP = 1. A lost or doubled token moves every weight by about 1/num_valid_tokens
(a few percent).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from megacp.layers.settings import CPSettings
from megacp.layers.swap import settings_for
from megacp.models.lm_head import chunked_cross_entropy
from megacp.models.loss import lm_loss
from megacp.placement.batch import IGNORE_INDEX, shard_batch
from megacp.train.loss import logged_loss
from tests.helpers.distributed import run_distributed
from tests.helpers.reference import rel_err
from tests.helpers.training import ELEMENT_RTOL, RTOL, grads_of, seeded_model, step_batch, tiny_config, train_steps


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """This process computes with one thread, as the ranks do (tiny ops: threads only add waiting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cp_worker(rank: int, world_size: int, cp: int, tp: int, tied: bool) -> dict:
    from megacp import swap_attention
    from megacp.parallel.layout import ParallelLayout
    from megacp.parallel.state import ParallelState

    state = ParallelState.build(ParallelLayout(cp=cp, tp=tp))
    cfg = tiny_config(tied)
    model = seeded_model(cfg, state.group("tp") if tp > 1 else None)
    settings = CPSettings.from_state(state)
    swap_attention(model, settings)
    losses, recompute_err, first = train_steps(model, cp, state.rank_in("cp"), state.group("cp"), check_recompute=True,
                                               settings=settings)
    return dict(losses=losses, recompute_err=recompute_err, first=first, tp_rank=state.rank_in("tp"),
                cp_rank=state.rank_in("cp"), params={n: p.detach() for n, p in model.state_dict().items()})


_REFERENCE: dict[bool, tuple] = {}


def _reference(tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """CP = 1 in this process: the losses and final parameters (computed once per config)."""
    if tied not in _REFERENCE:
        model = seeded_model(tiny_config(tied))
        losses, _, _ = train_steps(model, 1, 0, None)
        _REFERENCE[tied] = losses, {n: p.detach() for n, p in model.state_dict().items()}
    return _REFERENCE[tied]


@pytest.mark.parametrize(("cp", "tp", "tied"), [(2, 1, True), (3, 1, False), (2, 2, True)],
                         ids=["cp2-tied", "cp3", "cp2xtp2-tied"])
def test_cp_training_equals_single_process(cp: int, tp: int, tied: bool) -> None:
    from megacp.checkpoint.tp import is_replicated, merge_shards

    ref_losses, ref_params = _reference(tied)
    results = run_distributed(_cp_worker, cp * tp, cp, tp, tied)
    cfg = tiny_config(tied)
    for res in results:
        assert res["recompute_err"] <= 1e-6, (res["cp_rank"], res["tp_rank"], res["recompute_err"])
        losses = torch.tensor(res["losses"], dtype=torch.float64)
        assert rel_err(losses, torch.tensor(ref_losses, dtype=torch.float64)) <= RTOL, (res["losses"], ref_losses)
    by_cp = {}
    for res in results:
        by_cp.setdefault(res["cp_rank"], []).append(res)
    for group in by_cp.values():
        group.sort(key=lambda r: r["tp_rank"])
        for name, grad in group[0]["first"].items():  # replicated weights: one gradient on every TP rank
            if is_replicated(name):
                for other in group[1:]:
                    assert rel_err(other["first"][name], grad) <= 1e-6, name
        for name, want in ref_params.items():
            got = merge_shards(cfg, name, [r["params"][name] for r in group])
            norm_err = float((got - want).norm() / want.norm())
            assert norm_err <= RTOL and rel_err(got, want) <= ELEMENT_RTOL, (name, norm_err, rel_err(got, want))
    assert rel_err(ref_params["layers.0.layernorm_mlp.fc2_weight"], seeded_model(cfg).state_dict()["layers.0.layernorm_mlp.fc2_weight"]) > 1e-2


def _contiguous_worker(rank: int, world_size: int) -> tuple[float, dict[str, torch.Tensor]]:
    from megacp import swap_attention

    model = seeded_model(tiny_config(True))
    settings = settings_for(None).replace(load_balance=False)
    swap_attention(model, settings)
    ids, labels, cu = step_batch(0)
    loss = lm_loss(model, shard_batch(ids, labels, cu_seqlens=cu, cp_size=world_size, cp_rank=rank, load_balance=False),
                   settings=settings)
    loss.backward()
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad)
    return logged_loss(loss, cp_group=torch.distributed.group.WORLD), grads_of(model)


def test_contiguous_sharding_trains_like_single_process() -> None:
    """``load_balance=False`` shards (N contiguous chunks) reach the CP layer through the loss's step."""
    model = seeded_model(tiny_config(True))
    ids, labels, cu = step_batch(0)
    loss = lm_loss(model, shard_batch(ids, labels, cu_seqlens=cu, cp_size=1, cp_rank=0))
    loss.backward()
    for got_loss, grads in run_distributed(_contiguous_worker, 2):
        assert abs(got_loss - float(loss.detach())) <= RTOL * float(loss.detach())
        for name, grad in grads_of(model).items():
            assert rel_err(grads[name], grad) <= RTOL, name


# ------------------------------------------------------------------------- the loss, one process


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_chunked_loss_equals_full_logits_cross_entropy(tied: bool) -> None:
    ids, labels, cu = step_batch(0)
    shard = shard_batch(ids, labels, cu_seqlens=cu, cp_size=1, cp_rank=0)
    model = seeded_model(tiny_config(tied))
    logits = model(shard.input_ids, shard.position_ids, cu_seqlens=shard.cu_seqlens)
    torch.nn.functional.cross_entropy(logits, shard.labels).backward()  # mean over the valid labels
    want = grads_of(model)
    vocab = model.cfg.vocab_size
    for chunk in (1, 7, 4096):
        model.zero_grad()
        saved: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor, saved: list[tuple[int, ...]] = saved) -> torch.Tensor:
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(model, shard, chunk_tokens=chunk)
        # what backward keeps outside the checkpointed chunks: no logits (the only [., V] tensors;
        # V = 80 is no other width of the model), not even one chunk's
        assert saved and not [s for s in saved if s[-1:] == (vocab,)], (chunk, saved)
        loss.backward()
        assert rel_err(loss.detach(), torch.nn.functional.cross_entropy(logits, shard.labels).detach()) <= 1e-6
        for name, grad in grads_of(model).items():
            assert rel_err(grad, want[name]) <= 1e-5, (chunk, name)


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_chunked_loss_in_bf16_is_as_accurate_as_autograd(device: str) -> None:
    """bf16 hidden states and head (fp32 logits and d weight accumulation inside): loss and gradients
    no further from an fp64 reference than autograd through bf16 ``F.linear`` + fp32 cross-entropy."""
    g = torch.Generator().manual_seed(3)
    n, h, v = 300, 64, 1000
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 8
    labels = torch.where(torch.rand(n, generator=g) < 0.1, IGNORE_INDEX, torch.randint(0, v, (n,), generator=g))

    def run(dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:
        x, w = (t.to(device, dtype).requires_grad_() for t in (hidden, weight))
        y = labels.to(device)
        if fused:
            loss = chunked_cross_entropy(x, w, y, chunk_tokens=128)
        else:
            loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), y, reduction="sum")
        loss.backward()
        return [t.detach().double().cpu() for t in (loss, x.grad, w.grad)]

    exact = run(torch.float64, False)
    ours, autograd = run(torch.bfloat16, True), run(torch.bfloat16, False)
    for got, base, want in zip(ours, autograd, exact):
        assert rel_err(got, want) <= 1.2 * rel_err(base, want) + 1e-6, (rel_err(got, want), rel_err(base, want))


def test_loss_without_valid_labels_is_zero() -> None:
    model = seeded_model(tiny_config(True))
    shard = shard_batch(torch.arange(5), torch.full((5,), IGNORE_INDEX), cp_size=1, cp_rank=0)
    loss = lm_loss(model, shard)
    loss.backward()
    assert shard.num_valid_tokens == 0 and float(loss.detach()) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())


def test_loss_refuses_bad_input() -> None:
    model = seeded_model(tiny_config(True))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 80\)"):
        lm_loss(model, shard_batch(torch.tensor([1, 80, 2]), cp_size=1, cp_rank=0))
    with pytest.raises(ValueError, match="labels must be < 80"):
        lm_loss(model, shard_batch(torch.tensor([1, 2, 3]), torch.tensor([0, 90, 1]), cp_size=1, cp_rank=0))
    with pytest.raises(ValueError, match="the model has local attention: call megacp.swap_attention"):
        lm_loss(model, shard_batch(torch.arange(8), cp_size=2, cp_rank=0))
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        lm_loss(model, shard_batch(torch.arange(8), cp_size=1, cp_rank=0), chunk_tokens=0)


def _logged_worker(rank: int, world_size: int) -> float:
    from megacp.parallel.layout import ParallelLayout
    from megacp.parallel.state import ParallelState

    state = ParallelState.build(ParallelLayout(dp=2, cp=2))
    return logged_loss(torch.tensor(float(rank + 1)), cp_group=state.group("cp"), dp_group=state.group("dp"))


def test_logged_loss_sums_over_cp_and_averages_over_dp() -> None:
    # ranks (dp, cp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1); losses 1, 2, 3, 4
    assert run_distributed(_logged_worker, 4) == [5.0] * 4  # ((1 + 2) + (3 + 4)) / 2
