"""Exact merging of partial attention states (out, LSE).

Attention of a query over a union of disjoint key subsets s equals the merge of the partial
results ``(O_s, LSE_s)``::

    LSE = m + log Σ_s exp(LSE_s − m),  m = max_s LSE_s
    O   = Σ_s O_s · exp(LSE_s − LSE)

Layouts: ``out`` is ``[..., H, D]`` and ``lse`` is ``[..., H]`` (natural log, fp32); leading
dimensions (tokens, batch) are arbitrary but must agree. A partial with ``lse == -inf`` (no visible
key) contributes nothing; when every partial is empty the result is ``out = 0, lse = -inf`` (no NaN
is made from empty partials). A NaN in a partial's ``out`` or ``lse`` (NaN inputs, a NaN scale, an
infinite score) makes the merged row NaN, as single-process attention over the same keys would:
nothing here hides it.

The results are computed in fp32 whatever the dtypes of the partials; a running output kept in a
low-precision dtype is rounded once per merge, so long chains of merges keep their running output
in fp32 (:func:`~megacp.attention.pass_kv.ring_pass_kv`) and round once at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megacp.attention.kernels import merge_kernel


def finite_or_zero(m: Tensor) -> Tensor:
    """Replace -inf maxima (or LSEs of rows that see no key) by 0 so that ``x - m`` never evaluates
    ``-inf - (-inf)``."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _use_fused(fused: bool | None, out: Tensor, dims: int) -> bool:
    """Whether to run the Triton merge: where it applies when ``fused`` is ``None``; forced with
    ``True``, in which case a tensor it does not apply to is an error that says why."""
    applies = merge_kernel.available(out, dims)
    if fused and not applies:
        raise ValueError(
            f"fused merge forced but it does not apply: it needs Triton ({'present' if merge_kernel.triton else 'missing'}), "
            f"a CUDA tensor (or TRITON_INTERPRET=1) of {dims} dims with a power-of-two head dim >= 16 and unit "
            f"last stride; got {out.dim()} dims {tuple(out.shape)} on {out.device}"
        )
    return applies if fused is None else bool(fused)


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial states of the same queries.

    Args:
        out_a, out_b: ``[..., H, D]`` partial outputs (any float dtype).
        lse_a, lse_b: ``[..., H]`` fp32 natural-log LSEs.

    Returns:
        ``(out, lse)``: ``out`` fp32 ``[..., H, D]``, ``lse`` fp32 ``[..., H]``.
    """
    m = finite_or_zero(torch.maximum(lse_a, lse_b))  # NaN where either is NaN
    wa = torch.exp(lse_a - m)
    wb = torch.exp(lse_b - m)
    total = wa + wb
    lse = m + torch.log(total)
    inv = torch.where(total == 0, torch.zeros_like(total), 1.0 / total)  # both empty: weights 0; NaN stays NaN
    out = out_a.float() * (wa * inv).unsqueeze(-1) + out_b.float() * (wb * inv).unsqueeze(-1)
    return out, lse


def merge_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, *, fused: bool | None = None) -> None:
    """Online merge: fold one partial ``(out, lse)`` into the running state in place.

    The merge is computed in fp32 and written into ``acc_out`` (rounded once when it is a
    low-precision tensor). The fused kernel does it in one pass over both states (this runs once per
    ring step on every query row, so its memory traffic matters); the torch path is
    :func:`merge_states` plus the copies.

    Args:
        acc_out: ``[..., H, D]`` running output (any float dtype; updated in place; may be a slice).
        acc_lse: fp32 ``[..., H]`` running LSE (updated in place).
        out, lse: the partial to add, same leading shape, ``out`` in any float dtype.
        fused: use the one-kernel Triton merge (:mod:`megacp.attention.kernels.merge_kernel`); ``None`` =
            when it applies (CUDA tensors ``[L, H, D]``, Triton installed).
    """
    if _use_fused(fused, acc_out, 3):
        merge_kernel.merge_into_fused(acc_out, acc_lse, out, lse)
        return
    new_out, new_lse = merge_states(acc_out, acc_lse, out, lse)
    acc_out.copy_(new_out)
    acc_lse.copy_(new_lse)


def merge_stack(outs: Tensor, lses: Tensor, *, fused: bool | None = None) -> tuple[Tensor, Tensor]:
    """Merge N partials stacked on dim 0 (few kernels: this sits on the decode critical path).

    Args:
        outs: ``[N, ..., H, D]`` partial outputs.
        lses: ``[N, ..., H]`` fp32 LSEs.
        fused: use the one-kernel Triton merge (:mod:`megacp.attention.kernels.merge_kernel`); ``None`` =
            when it applies (CUDA tensors ``[N, L, H, D]``, Triton installed).

    Returns:
        ``(out, lse)`` with the leading N removed; ``out`` in ``outs.dtype``.
    """
    if _use_fused(fused, outs, 4):
        return merge_kernel.merge_stack_fused(outs, lses)
    lse = torch.logsumexp(lses, dim=0)  # -inf where every partial is empty, NaN where one is NaN
    w = torch.exp(lses - lse).masked_fill_(torch.isneginf(lses), 0.0)  # empty partials weigh 0, NaN stays
    out = (outs * w.unsqueeze(-1)).sum(dim=0)
    return out.to(outs.dtype), lse


def pack_states(out: Tensor, lse: Tensor, into: Tensor | None = None) -> Tensor:
    """Pack attention states into one byte tensor so that one collective carries both.

    Args:
        out: ``[..., H, D]`` (any dtype); lse: ``[..., H]`` fp32.
        into: optional destination, uint8 ``[..., H*D*itemsize + H*4]`` (e.g. a row range of a
            collective's send buffer); default a new tensor.
    Returns:
        uint8 ``[..., H*D*itemsize + H*4]`` (``into`` when given; two copies, no concatenation temporaries).
    """
    lead, h, d = out.shape[:-2], out.shape[-2], out.shape[-1]
    nb = h * d * out.element_size()
    buf = torch.empty((*lead, nb + h * 4), dtype=torch.uint8, device=out.device) if into is None else into
    if buf.dtype != torch.uint8 or tuple(buf.shape) != (*lead, nb + h * 4):
        raise ValueError(f"pack_states: destination must be uint8 {(*lead, nb + h * 4)}, got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    buf[..., :nb].view(out.dtype).view(*lead, h, d).copy_(out)
    buf[..., nb:].view(torch.float32).copy_(lse)
    return buf


def unpack_states(buf: Tensor, heads: int, head_dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack_states`, as views into ``buf`` (no copies):
    ``(out [..., H, D] dtype, lse [..., H] fp32)``."""
    lead = buf.shape[:-1]
    nb = heads * head_dim * torch.empty((), dtype=dtype).element_size()
    out = buf[..., :nb].view(dtype).view(*lead, heads, head_dim)
    lse = buf[..., nb:].view(torch.float32)
    return out, lse
