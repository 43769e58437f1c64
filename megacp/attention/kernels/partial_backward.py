"""Backward of partial attention: the gradients one block of keys contributes, given the final state.

Training keeps, for every query, the *final* merged ``(out, lse)`` of the forward (over every key
block). With it the softmax of any block is recomputed exactly as ``P = exp(q·kᵀ·scale − lse)``, so
the gradients of a block need no correction for the other blocks::

    dV = Pᵀ·dO,   dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ out)),   dQ = dS·K·scale,   dK = dSᵀ·Q·scale

(GQA: dK and dV summed over the query heads of a group). The dQ of the blocks of a query add up to
the full attention's dQ; dK/dV of a block are complete once every query that sees it has added its
share. This is what a fused attention backward kernel computes when it is fed the final
``out``/``lse`` instead of those of its own forward.

Layout as :mod:`~megacp.attention.kernels.partial`: ``q``/``out``/``dout`` ``[Lq, Hq, D]``,
``k``/``v`` ``[Lk, Hkv, D]``, ``lse`` ``[Lq, Hq]`` fp32 natural log; ``causal`` is bottom-right
aligned and ``left`` is the forward's sliding-window band
(:func:`~megacp.attention.kernels.partial.partial_attention`).

Backends: the forward's (:mod:`~megacp.attention.kernels.registry`), chosen as in the forward. A
fused kernel's ``backward`` (cuDNN: ``aten._scaled_dot_product_cudnn_attention_backward``; flash:
``aten._scaled_dot_product_flash_attention_backward``) takes fewer KV heads than query heads and
returns dK/dV with the KV head count; ``"reference"`` is exact fp32 math on any device,
``Hq × block_q × Lk`` scores at a time. Kernels return gradients in the input dtype, the reference
in fp32; callers accumulate blocks in fp32.

A banded tile (``left >= 0``) of tensors a fused kernel takes runs the forward's choice of kernel
(:func:`~megacp.attention.kernels.partial.band_kernel`): its band backward (``band_backward``:
cuDNN's band backward where the cuDNN frontend is installed, FlashAttention-2's varlen backward
with its window arguments), else batched square causal backward calls of it
(:func:`~megacp.attention.kernels.band.band_backward`, whose gradients are fp32 sums); the
reference with the band masked everywhere else.

A square causal call of a ``plan_padding`` kernel runs padded to its plan length as in the
forward (zero rows, LSE 0; exact, see :mod:`~megacp.attention.kernels.plans`). Where torch reuses
cuDNN plans across lengths (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``) the cuDNN backward is wrong:
there ``"auto"`` runs the first kernel whose entry says ``backward_under_plan_reuse``
(FlashAttention-2) and naming one that does not is refused (``ValueError``).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from megacp.attention.kernels import registry
from megacp.attention.kernels.band import band_backward
from megacp.attention.kernels.merge import finite_or_zero
from megacp.attention.kernels.partial import (
    Grads,
    band_kernel,
    dense_rows,
    first_kernel,
    heads_first,
    hidden_by_band,
    hidden_by_causal_mask,
    kernel_module,
    kernel_order,
    kernels_apply,
    softmax_scale,
)
from megacp.attention.kernels.plans import CUDNN_PLAN_REUSE, pad_rows, plan_length, plans_reused_across_lengths
from megacp.attention.kernels.registry import AUTO, resolve_backend

_refused: set[tuple] = set()
"""Shape classes a kernel refused under ``"auto"`` (per process, like the forward's: a property of
the installed kernels, not of any job)."""


def partial_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    *, causal: bool, scale: float | None = None, backend: str | None = None, left: int | None = None,
) -> Grads:
    """Gradients of one block's share of attention.

    Args:
        q, out, dout: ``[Lq, Hq, D]`` (``out``: the queries' final output, ``dout``: its gradient).
        k, v: ``[Lk, Hkv, D]`` the block's keys and values.
        lse: ``[Lq, Hq]`` fp32, the queries' final natural-log LSE.
        causal: bottom-right aligned mask (query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``).
        left: the sliding-window band (key ``j`` hidden from query ``i`` when ``j < i + Lk - Lq - left``).

    Returns:
        ``(dq [Lq,Hq,D], dk [Lk,Hkv,D], dv [Lk,Hkv,D])`` — in ``q.dtype`` from a kernel, fp32 from
        the reference (and dK/dV of a band tile whose first rows run dense, :func:`dense_rows`).
    """
    d = q.shape[-1]
    scale = softmax_scale(scale, d)
    backend = _without_wrong_kernels(resolve_backend(backend), q)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if left is not None:
        if kernels_apply(q) and kernel_order(backend, q) and left >= 0:
            a = dense_rows(q.shape[0], k.shape[0], causal=causal, left=left)
            if a:  # as the forward: the rows that see every key without the window
                g1 = partial_attention_backward(q[:a], k, v, out[:a], lse[:a], dout[:a], causal=False, scale=scale,
                                                backend=backend)
                g2 = partial_attention_backward(q[a:], k, v, out[a:], lse[a:], dout[a:], causal=False, scale=scale,
                                                backend=backend, left=left)
                return torch.cat([g1[0], g2[0]]), g1[1].float() + g2[1], g1[2].float() + g2[2]
            dout = dout.contiguous()
            res = first_kernel(band_kernel(backend, causal, left), q, (q.dtype, "band", q.shape[1], k.shape[1], d, causal),
                               lambda name: _band_backward(name, q, k, v, out, lse, dout, causal=causal, scale=scale,
                                                           left=left), _refused)
            if res is not None:
                return res
        return reference_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, left=left)
    if not kernel_order(backend, q):
        return reference_backward(q, k, v, out, lse, dout, causal=causal, scale=scale)
    dout = dout.contiguous()
    res = first_kernel(backend, q, (q.dtype, q.shape[1], k.shape[1], d, causal),
                       lambda name: _kernel_backward(kernel_module(name).backward, q, k, v, out, lse, dout,
                                                     causal=causal, scale=scale, padded=registry.get(name).plan_padding),
                       _refused)
    if res is not None:
        return res
    return reference_backward(q, k, v, out, lse, dout, causal=causal, scale=scale)


def _without_wrong_kernels(backend: str, q: Tensor) -> str:
    """``backend``, where torch reuses cuDNN plans across lengths (the cuDNN backward is wrong
    there), with the kernels whose registry entry lacks ``backward_under_plan_reuse`` left out:
    ``"auto"`` on tensors a kernel takes (``q``) becomes the first kernel that is exact there
    (``"flash"``), and naming a kernel that is not raises ``ValueError``."""
    if not plans_reused_across_lengths():
        return backend
    exact = [b.name for b in registry.fused() if b.backward_under_plan_reuse]
    if backend != AUTO and not registry.get(backend).backward_under_plan_reuse:
        raise ValueError(f"the {backend} attention backward gives wrong gradients under {CUDNN_PLAN_REUSE}=1 "
                         f"(torch 2.11 reuses plans across lengths); unset it, or use attention backend "
                         f"{' or '.join([AUTO, *exact])}")
    return exact[0] if backend == AUTO and kernels_apply(q) and exact else backend


# --------------------------------------------------------------------------- fused kernels


@functools.cache
def zero_seed(device: torch.device) -> Tensor:
    """The (unused, dropout is 0) RNG seed/offset tensor the kernels' signatures require, on ``device``."""
    return torch.zeros((), dtype=torch.int64, device=device)


def _band_backward(name: str, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
                   causal: bool, scale: float, left: int) -> Grads:
    """One banded tile's backward through fused kernel ``name``: its band backward
    (``band_backward``), or where it has none for this tile, batched square causal backward calls
    of it (:func:`band_backward`, fp32 sums)."""
    kernel = kernel_module(name)
    res = kernel.band_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, left=left)
    if res is not None:
        return res
    padded = registry.get(name).plan_padding
    return band_backward(q, k, v, out, lse, dout, causal=causal, left=left,
                         grads=lambda *xs: _kernel_backward(kernel.backward, *xs[:6], causal=xs[6], scale=scale,
                                                            padded=padded))


def _kernel_call(kernel: Callable[..., Grads], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 dout: Tensor, causal: bool, scale: float, padded: bool = False) -> Grads:
    """One fused backward on ``[(B,) L, H, D]`` tensors viewed as ``[B, H, L, D]`` (no copies but the
    small LSE, which the kernels want contiguous ``[B, H, Lq]``; with ``padded`` a square causal
    call runs padded to its plan length), per group of KV heads when one call's workspace would be
    large (:func:`head_groups`; the groups' gradients are copied into place)."""
    n = q.shape[-3]
    if padded and causal and k.shape[-3] == n and plan_length(n) != n:
        m = plan_length(n)
        dq, dk, dv = _kernel_call(kernel, pad_rows(q, m), pad_rows(k, m), pad_rows(v, m), pad_rows(out, m),
                                  pad_rows(lse, m, dim=-2), pad_rows(dout, m), causal, scale)
        return dq[..., :n, :, :], dk[..., :n, :, :], dv[..., :n, :, :]
    if q.dim() == 3:
        q1, k1, v1, o1, l1, d1 = (x.unsqueeze(0) for x in (q, k, v, out, lse, dout))
        dq, dk, dv = _kernel_call(kernel, q1, k1, v1, o1, l1, d1, causal, scale)
        return dq[0], dk[0], dv[0]

    def view(x: Tensor) -> Tensor:
        return x.transpose(1, 2)

    lse3 = lse.transpose(1, 2).contiguous()
    groups = head_groups(q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3])
    if groups == 1:
        dq, dk, dv = kernel(view(dout), view(q), view(k), view(v), view(out), lse3, causal, scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for hq, hkv in head_group_slices(q.shape[2], k.shape[2], groups):
        gq, gk, gv = kernel(view(dout[:, :, hq]), view(q[:, :, hq]), view(k[:, :, hkv]), view(v[:, :, hkv]),
                            view(out[:, :, hq]), lse3[:, hq], causal, scale)
        dq[:, :, hq], dk[:, :, hkv], dv[:, :, hkv] = gq.transpose(1, 2), gk.transpose(1, 2), gv.transpose(1, 2)
    return dq, dk, dv


WORKSPACE_BYTES = 1 << 28
"""Bound on the fp32 dQ accumulator of one fused backward call (``4 · Lq · Hq · D`` bytes; the
kernels' workspace is about twice that): longer calls run per group of KV heads."""


def head_groups(lq: int, hq: int, hkv: int, d: int) -> int:
    """Calls one fused backward of ``lq`` queries is split into, over groups of KV heads (with their
    query heads): the fewest that divide ``hkv`` and keep each call's fp32 dQ accumulator within
    :data:`WORKSPACE_BYTES`. The heads are independent, so the gradients are the same; at 1M tokens
    of Llama-3.1-8B's shape (32 / 8 heads of 128) one call's workspace would be ~32 KiB per token."""
    need = 4 * lq * hq * d
    for groups in range(1, hkv + 1):
        if hkv % groups == 0 and need // groups <= WORKSPACE_BYTES:
            return groups
    return hkv


def head_group_slices(hq: int, hkv: int, groups: int) -> list[tuple[slice, slice]]:
    """``(query heads, KV heads)`` of each of ``groups`` calls over consecutive KV heads (``groups``
    divides ``hkv``) with the query heads of their GQA groups."""
    step_kv = hkv // groups
    step_q = step_kv * (hq // hkv)
    return [(slice(i * step_q, (i + 1) * step_q), slice(i * step_kv, (i + 1) * step_kv)) for i in range(groups)]


def _kernel_backward(kernel: Callable[..., Grads], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     dout: Tensor, *, causal: bool, scale: float, padded: bool = False) -> Grads:
    """As the forward's kernels, the fused backward only does square causal masks: a bottom-right
    mask with ``Lq != Lk`` is split into a dense prefix and a square causal block (``[(B,) L, H, D]``
    tensors, ``lse`` ``[(B,) L, H]``; ``padded``: see :func:`_kernel_call`)."""
    if q.dim() == 3:
        q1, k1, v1, o1, l1, d1 = (x.unsqueeze(0) for x in (q, k, v, out, lse, dout))
        dq, dk, dv = _kernel_backward(kernel, q1, k1, v1, o1, l1, d1, causal=causal, scale=scale, padded=padded)
        return dq[0], dk[0], dv[0]
    lq, lk = q.shape[1], k.shape[1]
    if not causal:
        return _kernel_call(kernel, q, k, v, out, lse, dout, False, scale, padded)
    if lq == lk:
        return _kernel_call(kernel, q, k, v, out, lse, dout, True, scale, padded)
    if lq > lk:  # the first lq - lk queries see nothing
        tail = slice(lq - lk, lq)
        dq = torch.zeros_like(q)
        dq[:, tail], dk, dv = _kernel_call(kernel, q[:, tail], k, v, out[:, tail], lse[:, tail], dout[:, tail], True,
                                           scale, padded)
        return dq, dk, dv
    p = lk - lq
    dq1, dk1, dv1 = _kernel_call(kernel, q, k[:, :p], v[:, :p], out, lse, dout, False, scale, padded)
    dq2, dk2, dv2 = _kernel_call(kernel, q, k[:, p:], v[:, p:], out, lse, dout, True, scale, padded)
    return dq1 + dq2, torch.cat([dk1, dk2], dim=1), torch.cat([dv1, dv2], dim=1)


# --------------------------------------------------------------------------- reference


def reference_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    *, causal: bool, scale: float, left: int | None = None, block_q: int = 256,
) -> Grads:
    """Exact fp32 gradients (the module formulas), ``Hq × block_q × Lk`` scores at a time
    (``left``: the sliding-window band).

    Returns fp32 ``(dq [Lq,Hq,D], dk [Lk,Hkv,D], dv [Lk,Hkv,D])``.
    """
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g, offset = hq // hkv, lk - lq
    dq = torch.zeros(lq, hq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(hkv, lk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(hkv, lk, d, dtype=torch.float32, device=q.device)
    kf, vf = heads_first(k, hkv), heads_first(v, hkv)  # [Hkv,1,Lk,D]
    for i0 in range(0, lq, block_q):
        i1 = min(i0 + block_q, lq)
        k_end = min(lk, i1 + offset) if causal else lk
        if k_end <= 0:
            continue
        qb, ob, dob = (heads_first(x[i0:i1], hkv) for x in (q, out, dout))  # [Hkv,G,bq,D]
        lb = finite_or_zero(lse[i0:i1].reshape(i1 - i0, hkv, g).permute(1, 2, 0))  # [Hkv,G,bq]
        scores = (qb @ kf[:, :, :k_end].transpose(-1, -2)) * scale  # [Hkv,G,bq,k_end]
        if causal:
            scores = scores.masked_fill(hidden_by_causal_mask(i0, i1, 0, k_end, offset, q.device), float("-inf"))
        if left is not None:
            scores = scores.masked_fill(hidden_by_band(i0, i1, 0, k_end, offset, left, q.device), float("-inf"))
        p = torch.exp(scores - lb.unsqueeze(-1))
        dv[:, :k_end] += (p.transpose(-1, -2) @ dob).sum(dim=1)
        ds = p * (dob @ vf[:, :, :k_end].transpose(-1, -2) - (dob * ob).sum(-1, keepdim=True))
        dq[i0:i1] = ((ds @ kf[:, :, :k_end]) * scale).permute(2, 0, 1, 3).reshape(i1 - i0, hq, d)
        dk[:, :k_end] += (ds.transpose(-1, -2) @ qb).sum(dim=1) * scale
    return dq, dk.permute(1, 0, 2), dv.permute(1, 0, 2)
