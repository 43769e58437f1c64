"""The causal-LM loss under context parallelism, exact against one process.

Each CP rank sums the cross-entropy (natural log) over the valid labels of its shard and divides
by the valid labels of the *whole* sequence group (:attr:`TrainShard.num_valid_tokens`), so the
sum of the CP ranks' losses, and of their gradients, is the mean loss and gradient of CP = 1.
That is how DeepSpeed combines them when its mpu names a sequence-parallel group (megacp's
:class:`~megacp.parallel.mpu.DeepSpeedMPU`: CP is DeepSpeed's sequence parallelism): gradients
are all-reduced over the sequence-data-parallel group (DP x CP) and divided by
``seq_dp_world_size / sp_world_size`` = the DP size (``DeepSpeedEngine._reduce_non_expert_gradients``
and ZeRO 1/2's ``average_tensor``/``allreduce_bucket`` in DeepSpeed 0.19), i.e. summed over CP and
averaged over DP. The objective is therefore the mean over DP replicas of each sequence group's
mean token loss; :func:`logged_loss` reports that number.

The LM head never produces the logits of a whole shard at once: the final hidden states are
taken ``chunk_tokens`` rows at a time, and each chunk's logits (``[chunk, V]``, fp32) give its loss
and, under autograd, at once its gradients (:func:`chunked_cross_entropy`), so only one chunk's
logits live at a time and the head's matmul never runs twice. What it keeps from the forward to
the backward instead is those gradients: ``d hidden`` ``[n_local, H]`` in the hidden states' dtype
and ``d weight`` ``[V, H]`` (fp32 when the shard spans several chunks; one chunk's single matmul
gives it in the weight's dtype, rounded once as autograd's would be).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megacp.layers.settings import CPSettings
from megacp.layers.step import CPStep, plan_step
from megacp.placement import ShardPlan
from megacp.placement.batch import IGNORE_INDEX, TrainShard

DEFAULT_CHUNK_TOKENS = 8192
"""Rows of hidden states whose logits are materialised at once."""


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with the product accumulated in ``acc``'s dtype (fp32 for bf16/fp16 ``a``,
    ``b``: a per-chunk product rounded to bf16 would lose precision against one full matmul). On
    CUDA cuBLAS writes the fp32 product of the bf16 inputs straight into ``acc`` (``addmm``'s
    ``out_dtype``, where torch has it); elsewhere the inputs are upcast (``addmm`` there takes one dtype only)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out"):  # the out_dtype overload (recent torch)
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif acc.is_cuda:  # no such overload: the chunk's product is rounded once, then added in fp32
        acc += a @ b
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` whose gradients are made in the forward, chunk
    by chunk: a chunk's fp32 log-probabilities become its softmax in place, minus one at the label,
    masked and cast in one pass, and give the chunk's ``d hidden`` and its share of ``d weight``
    before the next chunk is computed (four passes over a chunk's fp32 logits in all). So
    the head costs its three matmuls (``6·T·V·H``) with one chunk of logits alive, and the backward
    only scales the saved gradients by the incoming one."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, grads: bool) -> Tensor:
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        dh = torch.empty_like(hidden) if want_h else None
        # one chunk: its single matmul gives d weight with one rounding, as autograd would; more
        # chunks add up in an fp32 accumulator
        one_chunk = hidden.shape[0] <= chunk_tokens
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if want_w and not one_chunk else None
        for i0 in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[i0:i0 + chunk_tokens], labels[i0:i0 + chunk_tokens]
            logp = torch.log_softmax(F.linear(h, weight), dim=-1, dtype=acc_dtype)  # [c, V]
            keep = (y != IGNORE_INDEX).unsqueeze(1)
            valid, target = keep.to(acc_dtype), y.clamp_min(0).unsqueeze(1)
            total -= torch.where(keep, logp.gather(1, target), 0).sum()
            if want_h or want_w:
                prob = logp.exp_()  # softmax, in place
                prob.scatter_add_(1, target, -valid)
                grad = torch.mul(prob, valid, out=torch.empty_like(prob, dtype=h.dtype))  # masked and cast in one pass
                if dh is not None:
                    torch.mm(grad, weight, out=dh[i0:i0 + chunk_tokens])
                if want_w:
                    if one_chunk:
                        dw = grad.t() @ h
                    else:
                        assert dw is not None  # the accumulator of several chunks
                        _add_matmul(dw, grad.t(), h)
            del logp
        if want_w and dw is None:  # no rows at all (a CP rank without tokens in this step)
            dw = torch.zeros_like(weight)
        ctx.save_for_backward(*(x for x in (dh, dw) if x is not None))
        ctx.have = (want_h, want_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple:
        want_h, want_w = ctx.have
        saved = iter(ctx.saved_tensors)
        dh = next(saved) * grad_total if want_h else None  # stays in the hidden states' dtype
        dw = (next(saved) * grad_total).to(ctx.weight_dtype) if want_w else None
        return dh, dw, None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """Summed cross-entropy (natural log) of the logits ``hidden [n, H] @ weight [V, H].T`` against
    ``labels [n]`` (-100 ignored), ``chunk_tokens`` rows of logits (fp32, or fp64 for fp64 inputs) at
    a time; differentiable scalar in that dtype. Under autograd the gradients are computed with the
    loss (one pass over the chunks, no recompute); ``d weight`` is accumulated over several chunks
    in that dtype (one chunk: a single matmul in the weight's dtype).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, grads)


class _LanguageModel(Protocol):
    """What :func:`lm_loss` uses of a model (:class:`~megacp.models.llama.CausalLM`'s interface)."""

    lm_head_weight: Tensor

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor, *, cu_seqlens: Tensor | None = None,
                      inference_params: Any = None) -> Tensor: ...


def _train_step(settings: CPSettings | None, plan: ShardPlan) -> CPStep | None:
    """The step handed to the model's attention for ``plan``; ``None`` at CP = 1, where the model's
    own attention (local, or CP layers of one rank planning their own step) trains."""
    size = settings.cp_size if settings is not None else 1
    if plan.cp_size != size and size == 1:
        raise ValueError(
            f"the shard is one of {plan.cp_size} CP ranks' but no CP settings were given, so the model has local "
            "attention: call megacp.swap_attention(model, state) first and pass lm_loss(..., "
            "settings=CPSettings.from_state(state))"
        )
    if settings is None or size == 1:
        return None
    if (settings.cp_size, settings.cp_rank) != (plan.cp_size, plan.rank):
        raise ValueError(f"the shard is for CP rank {plan.rank} of {plan.cp_size}, but the settings' CP ring is rank "
                         f"{settings.cp_rank} of {settings.cp_size}")
    return plan_step(settings, plan, training=True)


def lm_loss(model: nn.Module, shard: TrainShard, *, settings: CPSettings | None = None,
            chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """This CP rank's share of the batch's mean causal-LM loss (differentiable fp32 scalar).

    Summed over the CP group, the losses (and the gradients) equal CP = 1's mean token loss of the
    batch. Zero, with zero gradients, when the batch has no valid label.

    Args:
        model: a :class:`~megacp.models.llama.CausalLM` (or anything with its ``hidden_states``
            and ``lm_head_weight``), with CP attention over the shard's CP group
            (:func:`megacp.swap_attention`) unless CP = 1.
        shard: this rank's :class:`TrainShard` (:func:`~megacp.placement.batch.shard_batch`).
        settings: the CP settings the model's attention was swapped with
            (:meth:`~megacp.layers.settings.CPSettings.from_state`): the layers run a
            :class:`~megacp.layers.step.TrainStep` of the shard's plan. ``None``: CP = 1, the
            model's own attention (local, or CP layers of one rank).
        chunk_tokens: rows of logits materialised at once.

    Raises:
        ValueError: an input id or label outside the vocabulary, or settings that do not match the
            shard's CP group.
    """
    lm = cast(_LanguageModel, model)
    weight = lm.lm_head_weight
    vocab = weight.shape[0]
    if shard.input_ids.numel():
        top_id, top_label = int(shard.input_ids.max()), int(shard.labels.max())
        if shard.input_ids.min() < 0 or top_id >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab}) (the vocabulary); got {top_id}")
        if top_label >= vocab:
            raise ValueError(f"labels must be < {vocab} (the vocabulary) or -100; got {top_label}")
    step = _train_step(settings, shard.plan)
    device = weight.device
    hidden = lm.hidden_states(
        shard.input_ids.to(device), shard.position_ids.to(device),
        cu_seqlens=shard.local_cu_seqlens.to(device), inference_params=step,
    )
    total = chunked_cross_entropy(hidden, weight, shard.labels.to(device), chunk_tokens)
    return total / max(shard.num_valid_tokens, 1)


def logged_loss(loss: Tensor, *, cp_group: dist.ProcessGroup | None = None,
                dp_group: dist.ProcessGroup | None = None) -> float:
    """The loss to report: ``loss`` (this rank's :func:`lm_loss`) summed over the CP group and
    averaged over the DP group, i.e. CP = 1's mean token loss, averaged over the DP replicas.

    Collective over both groups (TP ranks hold equal losses and need no reduction); ``None`` (or a
    group of one) skips that reduction.
    """
    x = loss.detach().float().reshape(1).clone()
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(x, group=cp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(x, group=dp_group)
        x /= dist.get_world_size(dp_group)
    return float(x)
