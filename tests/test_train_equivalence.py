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

from megacp.models import CausalLM, ModelConfig
from megacp.train.batch import IGNORE_INDEX, shard_batch
from megacp.train.loss import chunked_cross_entropy, lm_loss, logged_loss
from tests.distributed import run_distributed
from tests.reference import rel_err

STEPS = 20
LR = 1e-3
RTOL = 1e-5
ELEMENT_RTOL = 1e-4
LENGTHS = [[11, 3, 1, 17], [29], [5, 2, 9, 8], [2], [13, 13, 4]]
"""Packed documents, one list per step (cycled): ragged, some shorter than 2N and not divisible
by it; ``[2]`` leaves CP rank 2 of 3 without a token."""


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """This process computes with one thread, as the ranks do (tiny ops: threads only add waiting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)


def _model(cfg: ModelConfig, tp_group: torch.distributed.ProcessGroup | None = None) -> CausalLM:
    """The seeded full model, or this TP rank's shard of it."""
    torch.manual_seed(0)
    full = CausalLM(cfg, dtype=torch.float32)
    if tp_group is None:
        return full
    from megacp.checkpoint.tp import shard_tensor

    tp, rank = torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)
    model = CausalLM(cfg, tp_group, dtype=torch.float32)
    model.load_state_dict({n: shard_tensor(cfg, n, t, rank, tp).clone() for n, t in full.state_dict().items()})
    return model


def _batch(step: int, cp_edges: tuple[int, ...] = (2, 3)) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Step ``step``'s packed ids, unshifted labels (about 1 in 5 ignored) and ``cu_seqlens``.

    The target of the last token of CP rank 0's first chunk of document 0 (at every CP size of
    ``cp_edges``) is a valid label: it lives on the next rank.
    """
    g = torch.Generator().manual_seed(1000 + step)
    lengths = LENGTHS[step % len(LENGTHS)]
    total = sum(lengths)
    ids = torch.randint(0, 80, (total,), generator=g)
    labels = torch.where(torch.rand(total, generator=g) < 0.2, IGNORE_INDEX, ids)
    for n in cp_edges:
        edge = -(-lengths[0] // (2 * n))  # first position of rank 1's chunk of document 0
        if edge < lengths[0]:
            labels[edge] = ids[edge]
    return ids, labels, [0, *torch.tensor(lengths).cumsum(0).tolist()]


def _grads(model: CausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _train(model: CausalLM, cp_size: int, cp_rank: int, cp_group, check_recompute: bool = False) -> tuple:
    """Run the steps; return (logged losses, recompute gradient error at step 0, replicated grads at step 0)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, recompute_err, first = [], 0.0, {}
    for step in range(STEPS):
        ids, labels, cu = _batch(step)
        shard = shard_batch(ids, labels, cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
        if step == 0 and cp_size > 1:  # the edge label is on rank 0 and valid
            assert cp_rank != 0 or shard.labels[-(-cu[1] // (2 * cp_size)) - 1] != IGNORE_INDEX
        loss = lm_loss(model, shard, chunk_tokens=8)
        loss.backward()
        if step == 0 and check_recompute:
            plain = _grads(model)
            model.zero_grad()
            model.activation_checkpointing = True
            lm_loss(model, shard, chunk_tokens=8).backward()
            model.activation_checkpointing = False
            recompute_err = max(rel_err(p.grad, plain[n]) for n, p in model.named_parameters())
            first = _grads(model)
        if cp_group is not None:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, group=cp_group)
        opt.step()
        opt.zero_grad()
        losses.append(logged_loss(loss, cp_group=cp_group))
    return losses, recompute_err, first


def _cp_worker(rank: int, world_size: int, cp: int, tp: int, tied: bool) -> dict:
    from megacp import swap_attention
    from megacp.parallel.layout import ParallelLayout
    from megacp.parallel.state import ParallelState

    state = ParallelState.build(ParallelLayout(cp=cp, tp=tp))
    cfg = _config(tied)
    model = _model(cfg, state.group("tp") if tp > 1 else None)
    swap_attention(model, state)
    losses, recompute_err, first = _train(model, cp, state.rank_in("cp"), state.group("cp"), check_recompute=True)
    return dict(losses=losses, recompute_err=recompute_err, first=first, tp_rank=state.rank_in("tp"),
                cp_rank=state.rank_in("cp"), params={n: p.detach() for n, p in model.state_dict().items()})


_REFERENCE: dict[bool, tuple] = {}


def _reference(tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """CP = 1 in this process: the losses and final parameters (computed once per config)."""
    if tied not in _REFERENCE:
        model = _model(_config(tied))
        losses, _, _ = _train(model, 1, 0, None)
        _REFERENCE[tied] = losses, {n: p.detach() for n, p in model.state_dict().items()}
    return _REFERENCE[tied]


@pytest.mark.parametrize(("cp", "tp", "tied"), [(2, 1, True), (3, 1, False), (2, 2, True)],
                         ids=["cp2-tied", "cp3", "cp2xtp2-tied"])
def test_cp_training_equals_single_process(cp: int, tp: int, tied: bool) -> None:
    from megacp.checkpoint.tp import is_replicated, merge_shards

    ref_losses, ref_params = _reference(tied)
    results = run_distributed(_cp_worker, cp * tp, cp, tp, tied, timeout=300)
    cfg = _config(tied)
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
    assert rel_err(ref_params["layers.0.layernorm_mlp.fc2_weight"], _model(cfg).state_dict()["layers.0.layernorm_mlp.fc2_weight"]) > 1e-2


def _contiguous_worker(rank: int, world_size: int) -> tuple[float, dict[str, torch.Tensor]]:
    from megacp import swap_attention

    model = _model(_config(True))
    swap_attention(model)
    ids, labels, cu = _batch(0)
    loss = lm_loss(model, shard_batch(ids, labels, cu_seqlens=cu, cp_size=world_size, cp_rank=rank, load_balance=False))
    loss.backward()
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad)
    return logged_loss(loss, cp_group=torch.distributed.group.WORLD), _grads(model)


def test_contiguous_sharding_trains_like_single_process() -> None:
    """``load_balance=False`` shards (N contiguous chunks) reach the CP layer through the loss's step."""
    model = _model(_config(True))
    ids, labels, cu = _batch(0)
    loss = lm_loss(model, shard_batch(ids, labels, cu_seqlens=cu, cp_size=1, cp_rank=0))
    loss.backward()
    for got_loss, grads in run_distributed(_contiguous_worker, 2):
        assert abs(got_loss - float(loss.detach())) <= RTOL * float(loss.detach())
        for name, grad in _grads(model).items():
            assert rel_err(grads[name], grad) <= RTOL, name


# ------------------------------------------------------------------------- the loss, one process


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_chunked_loss_equals_full_logits_cross_entropy(tied: bool) -> None:
    ids, labels, cu = _batch(0)
    shard = shard_batch(ids, labels, cu_seqlens=cu, cp_size=1, cp_rank=0)
    model = _model(_config(tied))
    logits = model(shard.input_ids, shard.position_ids, cu_seqlens=shard.cu_seqlens)
    torch.nn.functional.cross_entropy(logits, shard.labels).backward()  # mean over the valid labels
    want = _grads(model)
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
        for name, grad in _grads(model).items():
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
    model = _model(_config(True))
    shard = shard_batch(torch.arange(5), torch.full((5,), IGNORE_INDEX), cp_size=1, cp_rank=0)
    loss = lm_loss(model, shard)
    loss.backward()
    assert shard.num_valid_tokens == 0 and float(loss.detach()) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())


def test_loss_refuses_bad_input() -> None:
    model = _model(_config(True))
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
