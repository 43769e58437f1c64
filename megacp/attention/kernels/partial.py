"""Partial attention: one block of queries over one block of keys, returning (out, LSE).

Layout (one sequence segment, "thd" without the batch): ``q`` ``[Lq, Hq, D]``, ``k``/``v``
``[Lk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: KV heads are never materialised Hq/Hkv times); or
the same with a leading batch dimension ``B`` (equal lengths, e.g. a batch of decode queries).
Results: ``out`` ``[(B,) Lq, Hq, D]`` in ``q.dtype`` and ``lse`` ``[(B,) Lq, Hq]`` fp32, natural log of
Σ_j exp(q·k_j·scale) over the visible keys (``-inf`` and ``out = 0`` for a query that sees none).

Masks: ``causal=False`` — every key visible. ``causal=True`` — bottom-right aligned: query ``i``
sees key ``j`` iff ``j <= i + (Lk - Lq)``; this is the plain causal mask when ``Lq == Lk`` and
"causal with offset" (queries placed after a cached prefix of ``Lk - Lq`` keys) otherwise.
``left=w`` (a sliding-window band, bottom-right aligned as FlashAttention's ``window_size_left``)
also hides key ``j`` from query ``i`` when ``j < i + (Lk - Lq) - w``.

Backends (``backend=``; default ``"auto"``; a job configures it as ``runtime.attention_backend`` or
env ``MEGACP_ATTN_BACKEND``, read once by :func:`megacp.initialize` and handed to the CP layers) are
the entries of :mod:`~megacp.attention.kernels.registry`:

* ``"cudnn"`` — cuDNN's fused attention (:mod:`~megacp.attention.kernels.cudnn`; fastest on H100/H200).
* ``"flash"`` — FlashAttention-2 (:mod:`~megacp.attention.kernels.flash`).
* ``"reference"`` — exact blocked computation in fp32 on any device with memory bounded by
  ``block_q × block_k`` scores per head (never an ``Lq × Lk`` matrix).

A named kernel serves every call (its errors are raised). ``"auto"`` tries the fused kernels whose
devices and dtypes take the tensors (fp16/bf16 CUDA tensors), in the registry's order, and falls
back to the next for shapes a kernel refuses (the refusal is remembered per dtype, batch dimension,
heads, head dim and mask, not per length; an out-of-memory error is raised, not taken for a
refusal); tensors no fused kernel takes (fp32, CPU) use the reference path. Every kernel's LSE is
natural log, fp32 (checked on H200, see docs/GPU_FACTS.md).

Fused kernels compute no mask or a square causal one: a bottom-right mask with ``Lq != Lk`` runs
as a dense part, a square causal part and their merge (:func:`_kernel_attention`). A kernel whose
entry says ``plan_padding`` (cuDNN: torch builds an execution plan for every shape it meets) runs a
square causal call of at most 16K rows padded to one of a few lengths, so that tiles of every
length share plans (exact; see :mod:`~megacp.attention.kernels.plans`).

Which kernel serves a banded tile (``left >= 0``) of ``[L, H, D]`` tensors a fused kernel takes:
the kernel's own band (``band_forward``: cuDNN's band through the cuDNN frontend package where it
is installed, FlashAttention-2's window arguments), else batched square causal calls of that
kernel (:mod:`~megacp.attention.kernels.band`); under ``"auto"`` a causal band narrower than a
kernel's ``auto_band_min`` keys (cuDNN: 128) runs on the next kernel of the order
(:func:`band_kernel`). Everywhere else it takes the reference path with the band masked by index.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Callable, Protocol, TypeVar, cast

import torch
from torch import Tensor

from megacp.attention.kernels import registry
from megacp.attention.kernels.band import band_attention
from megacp.attention.kernels.merge import finite_or_zero, merge_into, merge_states
from megacp.attention.kernels.plans import pad_rows, plan_length
from megacp.attention.kernels.registry import AUTO, resolve_backend

State = tuple[Tensor, Tensor]
Grads = tuple[Tensor, Tensor, Tensor]
_refused: set[tuple] = set()
_R = TypeVar("_R")


class FusedKernel(Protocol):
    """The functions every fused kernel's module provides (:mod:`~megacp.attention.kernels.registry`
    gives their conventions)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> State: ...

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float) -> Grads: ...

    def band_forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, left: int) -> State | None: ...

    def band_backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
                      causal: bool, scale: float, left: int) -> Grads | None: ...


class CacheDecodeKernel(Protocol):
    """A fused kernel that decodes over a packed cache (registry entry ``cache_decode``)."""

    def cache_decode(self, q: Tensor, k: Tensor, v: Tensor, starts: Tensor, used: Tensor, capacity: int,
                     scale: float) -> State: ...


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The scores' scale: ``scale``, or ``1 / sqrt(head_dim)`` when ``None``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


@functools.cache
def kernel_module(name: str) -> FusedKernel:
    """The module of fused kernel ``name`` (its registry entry's ``module``), imported on first use."""
    module = registry.get(name).module
    if module is None:
        raise ValueError(f"attention backend {name!r} is not a fused kernel")
    return cast(FusedKernel, importlib.import_module(module))


@functools.cache
def _order(backend: str, device_type: str, dtype: torch.dtype) -> tuple[str, ...]:
    if backend != AUTO:
        return (backend,) if registry.get(backend).module is not None else ()
    return tuple(b.name for b in registry.fused()
                 if device_type in b.devices and dtype in tuple(getattr(torch, name) for name in b.dtypes))


def kernel_order(backend: str, x: Tensor) -> tuple[str, ...]:
    """The fused kernels a call of ``backend`` (resolved) tries on tensors like ``x``, in order: the
    kernel a fused backend names; under ``"auto"`` every fused kernel whose registry entry takes
    ``x``'s device and dtype; none for the reference."""
    return _order(backend, x.device.type, x.dtype)


def kernels_apply(x: Tensor) -> bool:
    """Whether ``"auto"`` tries a fused kernel for tensors like ``x`` (fp16/bf16 on CUDA)."""
    return bool(kernel_order(AUTO, x))


def first_kernel(backend: str, x: Tensor, shape_class: tuple, call: Callable[[str], _R],
                 refused: set[tuple]) -> _R | None:
    """``call(name)`` for the kernels of :func:`kernel_order` (``backend`` resolved, ``x`` one of the
    call's tensors). Under ``"auto"`` a kernel that raises ``RuntimeError`` (a refused shape) is
    remembered in ``refused`` with ``shape_class`` (never the lengths: they change every step) and
    the next is tried; a named kernel's error is raised, and so is an out-of-memory error (no
    fallback would fit either). Returns ``None`` when every kernel refused."""
    named = backend != AUTO
    for name in kernel_order(backend, x):
        key = (name, *shape_class)
        if not named and key in refused:
            continue
        try:
            return call(name)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            if named:
                raise
            refused.add(key)
    return None


def empty_state(*shape: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The state of queries that see no key, for ``shape = (..., H, D)``: ``out = 0`` ``shape``,
    ``lse = -inf`` ``shape[:-1]``."""
    return (
        torch.zeros(shape, dtype=dtype, device=device),
        torch.full(shape[:-1], float("-inf"), dtype=torch.float32, device=device),
    )


def partial_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    left: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over ``k``/``v`` returning ``(out [Lq,Hq,D], lse [Lq,Hq] fp32)``.

    See the module docstring for layouts, the (bottom-right) causal convention, the ``left`` band
    and backends.
    """
    _check_shapes(q, k, v)
    lq, hq, d = q.shape[-3:]
    lk = k.shape[-3]
    scale = softmax_scale(scale, d)
    backend = resolve_backend(backend)
    if lq == 0 or lk == 0 or q.numel() == 0:
        return empty_state(*q.shape, dtype=q.dtype, device=q.device)
    if left is not None:
        if kernels_apply(q) and kernel_order(backend, q) and q.dim() == 3 and left >= 0:
            a = dense_rows(lq, lk, causal=causal, left=left)
            if a:
                o1, l1 = partial_attention(q[:a], k, v, scale=scale, backend=backend)
                o2, l2 = partial_attention(q[a:], k, v, scale=scale, backend=backend, left=left)
                return torch.cat([o1, o2]), torch.cat([l1, l2])
            res = first_kernel(band_kernel(backend, causal, left), q, (q.dtype, "band", hq, k.shape[-2], d, causal),
                               lambda name: _band(name, q, k, v, causal=causal, scale=scale, left=left), _refused)
            if res is not None:
                return res
        return _reference_batched(q, k, v, causal=causal, scale=scale, left=left)
    res = first_kernel(backend, q, (q.dtype, q.dim(), hq, k.shape[-2], d, causal),
                       lambda name: _fused(name, q, k, v, causal=causal, scale=scale), _refused)
    if res is not None:
        return res
    return _reference_batched(q, k, v, causal=causal, scale=scale)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim() or (q.dim() == 4 and q.shape[0] != k.shape[0]):
        raise ValueError(
            f"partial_attention expects q [(B,)Lq,Hq,D], k/v [(B,)Lk,Hkv,D]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"partial_attention shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)} (need k == v shape, same D, Hq divisible by Hkv)"
        )
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"partial_attention dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype}")


# --------------------------------------------------------------------------- fused kernels


def _fused(name: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> State:
    """One tile (``[(B,) L, H, D]``, bottom-right ``causal``) through fused kernel ``name``."""
    return _kernel_attention(kernel_module(name).forward, q, k, v, causal=causal, scale=scale,
                             padded=registry.get(name).plan_padding)


def band_kernel(backend: str, causal: bool, left: int) -> str:
    """The backend a banded tile's kernels are chosen under (:func:`first_kernel`): ``backend``,
    but under ``"auto"`` a causal band of fewer keys (``left + 1``) than a kernel's
    ``auto_band_min`` (mostly masked pairs in its tiles) goes to the first kernel of the order
    that takes it, named (``"flash"`` for a causal band narrower than 128 keys)."""
    if backend != AUTO or not causal:
        return backend
    kernels = registry.fused()
    takes = [b.name for b in kernels if left + 1 >= b.auto_band_min]
    return takes[0] if takes and len(takes) < len(kernels) else backend


def dense_rows(lq: int, lk: int, *, causal: bool, left: int) -> int:
    """The first rows of a banded tile that the window kernels are not given: in a non-causal band
    with more queries than keys, the rows whose band starts at or before key 0 (every key visible),
    which run as a dense call (FlashAttention-2's window and cuDNN's band both got them wrong when
    measured, on H100). 0 for every other tile; the rest of the tile has fewer queries than keys."""
    if causal or lq <= lk:
        return 0
    return min(lq, left - (lk - lq) + 1)


def _band(name: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, left: int) -> State:
    """One banded tile (``[L, H, D]``) through fused kernel ``name``: its own band
    (``band_forward``), or where it has none for this tile, batched square causal calls of it
    (:func:`band_attention`)."""
    kernel = kernel_module(name)
    res = kernel.band_forward(q, k, v, causal=causal, scale=scale, left=left)
    if res is not None:
        return res
    padded = registry.get(name).plan_padding
    return band_attention(q, k, v, causal=causal, left=left,
                          attend=lambda a, b, c, mask: _kernel_attention(kernel.forward, a, b, c, causal=mask,
                                                                         scale=scale, padded=padded))


def _kernel_call(kernel: Callable[..., State], q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                 padded: bool = False) -> State:
    """One fused call on ``[(B,) L, H, D]`` inputs viewed as ``[B, H, L, D]`` (no copies); with
    ``padded`` a square causal call runs padded to its :func:`~megacp.attention.kernels.plans.plan_length`."""
    n = q.shape[-3]
    if padded and causal and k.shape[-3] == n and plan_length(n) != n:
        m = plan_length(n)
        out, lse = _kernel_call(kernel, pad_rows(q, m), pad_rows(k, m), pad_rows(v, m), causal, scale)
        return out[..., :n, :, :], lse[..., :n, :]
    if q.dim() == 3:
        out, lse = _kernel_call(kernel, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal, scale)
        return out[0], lse[0]
    out, lse = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _kernel_attention(kernel: Callable[..., State], q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                      padded: bool = False) -> State:
    """Fused kernels only do square (top-left == bottom-right) causal masks; a bottom-right mask
    with ``Lq != Lk`` is split into a dense prefix and a square causal block, then merged
    (``padded``: see :func:`_kernel_call`)."""
    lq, lk = q.shape[-3], k.shape[-3]
    if not causal:
        return _kernel_call(kernel, q, k, v, False, scale, padded)
    if lq > lk:  # the first lq - lk queries see nothing
        out, lse = empty_state(*q.shape, dtype=q.dtype, device=q.device)
        o, l = _kernel_call(kernel, q[..., lq - lk:, :, :], k, v, True, scale, padded)
        out[..., lq - lk:, :, :] = o
        lse[..., lq - lk:, :] = l
        return out, lse
    if lq == lk:
        return _kernel_call(kernel, q, k, v, True, scale, padded)
    prefix = lk - lq
    o1, l1 = _kernel_call(kernel, q, k[..., :prefix, :, :], v[..., :prefix, :, :], False, scale, padded)
    o2, l2 = _kernel_call(kernel, q, k[..., prefix:, :, :], v[..., prefix:, :, :], True, scale, padded)
    if q.dim() == 3:  # in place: no fp32 copies of the outputs where the fused merge applies
        merge_into(o1, l1, o2, l2)
        return o1, l1
    out, lse = merge_states(o1, l1, o2, l2)
    return out.to(q.dtype), lse


# --------------------------------------------------------------------------- reference


def heads_first(x: Tensor, hkv: int) -> Tensor:
    """``[L, H, D]`` → fp32 ``[Hkv, H/Hkv, L, D]``: the query heads of one KV head side by side
    (GQA without repeating K/V: a K/V tensor, ``H = Hkv``, becomes ``[Hkv, 1, L, D]``)."""
    n, h, d = x.shape
    return x.float().reshape(n, hkv, h // hkv, d).permute(1, 2, 0, 3)


def hidden_by_causal_mask(i0: int, i1: int, j0: int, j1: int, offset: int, device: torch.device) -> Tensor:
    """Bool ``[i1-i0, j1-j0]``: True where query ``i`` may not see key ``j`` under the bottom-right
    causal mask (``j > i + offset``, ``offset = Lk - Lq``)."""
    rows = torch.arange(i0, i1, device=device).unsqueeze(1) + offset
    return torch.arange(j0, j1, device=device).unsqueeze(0) > rows


def hidden_by_band(i0: int, i1: int, j0: int, j1: int, offset: int, left: int, device: torch.device) -> Tensor:
    """Bool ``[i1-i0, j1-j0]``: True where key ``j`` lies before query ``i``'s band
    (``j < i + offset - left``, ``offset = Lk - Lq``)."""
    rows = torch.arange(i0, i1, device=device).unsqueeze(1) + offset - left
    return torch.arange(j0, j1, device=device).unsqueeze(0) < rows


def _reference_batched(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                       left: int | None = None) -> tuple[Tensor, Tensor]:
    if q.dim() == 3:
        return _reference(q, k, v, causal=causal, scale=scale, left=left)
    outs, lses = zip(*(_reference(qb, kb, vb, causal=causal, scale=scale, left=left) for qb, kb, vb in zip(q, k, v)))
    return torch.stack(outs), torch.stack(lses)


def _reference(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, left: int | None = None,
    block_q: int = 256, block_k: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Exact blocked attention with an online softmax, fp32 accumulation (``left``: the band's
    lower bound, see the module docstring).

    Memory: ``Hq × block_q × block_k`` fp32 scores at a time, and each key block is converted to
    fp32 as it is used (never the whole of ``k``/``v``: a long cached prefix costs no copy); key
    blocks that no query of the block can see (after the causal diagonal, before the band) are
    skipped.
    """
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g = hq // hkv
    offset = lk - lq  # query i sees keys j <= i + offset
    out = torch.empty(lq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(lq, hq, dtype=torch.float32, device=q.device)
    for i0 in range(0, lq, block_q):
        i1 = min(i0 + block_q, lq)
        qb = heads_first(q[i0:i1], hkv) * scale  # [Hkv,G,bq,D]
        m = torch.full((hkv, g, i1 - i0), float("-inf"), device=q.device)
        s = torch.zeros(hkv, g, i1 - i0, device=q.device)
        acc = torch.zeros(hkv, g, i1 - i0, d, device=q.device)
        k_end = min(lk, i1 - 1 + offset + 1) if causal else lk
        k_start = 0 if left is None else max(0, i0 + offset - left)
        for j0 in range(k_start, max(k_end, 0), block_k):
            j1 = min(j0 + block_k, k_end)
            kb, vb = heads_first(k[j0:j1], hkv), heads_first(v[j0:j1], hkv)  # [Hkv,1,bk,D]
            scores = qb @ kb.transpose(-1, -2)  # [Hkv,G,bq,bk]
            if causal:
                scores = scores.masked_fill(hidden_by_causal_mask(i0, i1, j0, j1, offset, q.device), float("-inf"))
            if left is not None:
                scores = scores.masked_fill(hidden_by_band(i0, i1, j0, j1, offset, left, q.device), float("-inf"))
            m_new = torch.maximum(m, scores.amax(dim=-1))
            m_safe = finite_or_zero(m_new)
            p = torch.exp(scores - m_safe.unsqueeze(-1))
            corr = torch.exp(m - m_safe)
            s = s * corr + p.sum(dim=-1)
            acc = acc * corr.unsqueeze(-1) + p @ vb
            m = m_new
        seen = s != 0  # rows that see no key (or only -inf scores) have s = 0; NaN rows stay NaN
        ob = torch.where(seen.unsqueeze(-1), acc / torch.where(seen, s, 1.0).unsqueeze(-1), 0.0)
        lb = torch.where(seen, finite_or_zero(m) + torch.log(s), float("-inf"))
        out[i0:i1] = ob.permute(2, 0, 1, 3).reshape(i1 - i0, hq, d).to(q.dtype)
        lse[i0:i1] = lb.permute(2, 0, 1).reshape(i1 - i0, hq)
    return out, lse


# --------------------------------------------------------------------------- static decode over a cache


def cache_decode_states(
    q: Tensor, k: Tensor, v: Tensor, starts: Tensor, used: Tensor, capacity: int, *, scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One decode query per request over that request's rows of a packed cache, with the lengths
    read from device memory (no host synchronisation: a CUDA graph can replay it).

    Args:
        q: ``[B, Hq, D]`` one query token per request.
        k, v: ``[R * capacity, Hkv, D]`` the cache's rows; request ``b`` owns rows
            ``starts[b] .. starts[b] + capacity`` and attends over the first ``used[b]``.
        starts: ``[B]`` int64, multiples of ``capacity``; used: ``[B]`` int32, in ``[0, capacity]``.

    Kernels: the first fused kernel of the registry with ``cache_decode`` that takes ``q``'s device
    and dtype (fp16/bf16 CUDA tensors: FlashAttention-2's varlen forward,
    :func:`~megacp.attention.kernels.flash.cache_decode`); every other case attends over each
    request's whole ``capacity`` rows in fp32 with the rows past ``used`` masked.

    Returns:
        ``(out [B, Hq, D] in q.dtype, lse [B, Hq] fp32 natural log)``; a request with ``used = 0``
        gets ``out = 0``, ``lse = -inf``.
    """
    scale = softmax_scale(scale, q.shape[-1])
    decoders = [name for name in kernel_order(AUTO, q) if registry.get(name).cache_decode]
    if decoders:
        kernel = cast(CacheDecodeKernel, kernel_module(decoders[0]))
        out, lse = kernel.cache_decode(q, k, v, starts, used, capacity, scale)
    else:
        out, lse = _masked_decode(q, k, v, starts, used, capacity, scale)
    empty = (used == 0).unsqueeze(-1)  # a kernel may give an empty request lse = +inf
    return out.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))


def _masked_decode(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, used: Tensor, capacity: int,
                   scale: float) -> tuple[Tensor, Tensor]:
    b, hq, d = q.shape
    hkv = k.shape[-2]
    rows = starts.unsqueeze(1) + torch.arange(capacity, device=q.device)  # [B, C]
    kb = k.index_select(0, rows.flatten()).view(b, capacity, hkv, d).float()
    vb = v.index_select(0, rows.flatten()).view(b, capacity, hkv, d).float()
    qf = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bchd->bhgc", qf, kb) * scale
    hidden = torch.arange(capacity, device=q.device).unsqueeze(0) >= used.unsqueeze(1)  # [B, C]
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G], -inf where no row is used
    p = torch.exp(scores - finite_or_zero(lse).unsqueeze(-1))
    out = torch.einsum("bhgc,bchd->bhgd", p, vb)
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)
