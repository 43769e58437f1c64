"""Building blocks shared by megacp's dense and mixture-of-experts layers: RMSNorm, SwiGLU and the
differentiable tensor-parallel collectives (Megatron's conjugate pair).

:func:`copy_to_tp` goes in front of each column-parallel projection (forward identity, backward
all-reduce of the input gradient) and :func:`reduce_from_tp` after each row-parallel one (forward
all-reduce, backward identity), so every TP rank computes the full gradient of the replicated
weights and of the residual stream.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] with ``weight`` [H], Hugging Face numerics.

    The statistics are taken in fp32, the normalised activations are cast back to ``x.dtype``
    and only then multiplied by the weight. ``F.rms_norm`` without a weight computes exactly that
    cast (bitwise equal to the fp32 formula) in one fused kernel on CUDA, forward and backward.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of a tensor- or expert-parallel group (1 without one)."""
    return 1 if group is None else dist.get_world_size(group)


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in a tensor- or expert-parallel group and the group's size (``(0, 1)``
    without one)."""
    return (0 if group is None else dist.get_rank(group)), group_size(group)


def tp_shard(total: int, tp_size: int, what: str) -> int:
    """``total // tp_size``; ``ValueError`` naming ``what`` unless ``tp_size`` divides ``total``."""
    if total % tp_size:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {tp_size}")
    return total // tp_size


class _CopyToTP(torch.autograd.Function):
    """Forward identity; backward all-reduce (sum) of the gradient over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
        ctx.tp_group = tp_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.tp_group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce (sum) over the TP group, in place; backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
        dist.all_reduce(x, group=tp_group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The replicated input ``x`` of a column-parallel projection: unchanged, but its gradient is
    summed over the TP group in backward (each rank's projection sees only its own output
    columns). Identity for t = 1 and without autograd."""
    if group_size(tp_group) == 1 or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _CopyToTP.apply(x, tp_group)


def reduce_from_tp(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the row-parallel partial results ``x`` over the TP group (in place; identity for t = 1);
    the gradient passes through unchanged (every rank's partial result feeds the same sum)."""
    if group_size(tp_group) == 1:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _ReduceFromTP.apply(x, tp_group)
    dist.all_reduce(x, group=tp_group)
    return x


def swiglu(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP of ``x`` [T, H]: ``fc1_weight`` [2F, H] (gate rows, then up), ``fc2_weight`` [H, F] -> [T, H]."""
    gate, up = F.linear(x, fc1_weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2_weight)
