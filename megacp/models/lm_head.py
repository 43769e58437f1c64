"""The LM head and cross-entropy over chunks of tokens: the logits of a whole sequence shard
(``S x vocab``) are never materialised.

The final hidden states are taken ``chunk_tokens`` rows at a time, and each chunk's logits
(``[chunk, V]``, fp32) give its loss and, under autograd, at once its gradients
(:func:`chunked_cross_entropy`), so only one chunk's logits live at a time and the head's matmul
never runs twice. What it keeps from the forward to the backward instead is those gradients:
``d hidden`` ``[n_local, H]`` in the hidden states' dtype and ``d weight`` ``[V, H]`` (fp32 when the
shard spans several chunks; one chunk's single matmul gives it in the weight's dtype, rounded once
as autograd's would be). Used by megacp's own models' loss (:func:`megacp.models.loss.lm_loss`) and
a transformers model's tiled loss (:func:`megacp.integrations.hf_memory.tiled_loss`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megacp.placement.batch import IGNORE_INDEX

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
