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

Which kernel serves which tile: a tile without ``left`` (inside the window, or no window) runs as
below. cuDNN's SDPA op in torch takes no window, so for fp16/bf16 CUDA tensors ``[L, H, D]`` a
banded tile (``left >= 0``; ``"cudnn"``, and ``"auto"`` for causal bands of at least
:data:`CUDNN_BAND_MIN` keys) runs cuDNN's own band through the cuDNN frontend package where it is
installed (:mod:`~megacp.attention.cudnn_band`), else is built from batched square causal cuDNN
calls (:mod:`~megacp.attention.band`), or runs FlashAttention-2 with its window arguments
(``aten._flash_attention_forward(window_size_left=, window_size_right=)``; ``"flash"``, and
``"auto"`` for narrower causal bands or where cuDNN refuses); everywhere else it takes the reference
path with the band masked by index.

Backends (``backend=``; default ``"auto"``; a job configures it as ``runtime.attention_backend`` or
env ``MEGACP_ATTN_BACKEND``, read once by :func:`megacp.initialize` and handed to the CP layers):

* ``"cudnn"`` — ``aten._scaled_dot_product_cudnn_attention`` (fastest on H100/H200, LSE ``[B,H,S,1]``).
* ``"flash"`` — ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2, LSE ``[B,H,S]``).
* ``"reference"`` — exact blocked computation in fp32 on any device with memory bounded by
  ``block_q × block_k`` scores per head (never an ``Lq × Lk`` matrix).

``"auto"`` tries cuDNN then flash for fp16/bf16 CUDA tensors and falls back to the next backend
for shapes a kernel refuses (the refusal is remembered per dtype, batch dimension, heads, head dim
and mask, not per length; an out-of-memory error is raised, not taken for a refusal); fp32 and CPU
tensors use the reference path. Every kernel's LSE is natural log, fp32 (checked on H200, see docs/GPU_FACTS.md).

cuDNN plans: torch builds a cuDNN execution plan for every shape it meets; a square causal cuDNN
call of at most 16K rows runs padded to one of a few lengths so that tiles of every length share
plans (exact; see :mod:`megacp.attention.plans`).
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar

import torch
from torch import Tensor

from megacp.attention import cudnn_band
from megacp.attention.band import band_attention
from megacp.attention.merge import finite_or_zero, merge_into, merge_states
from megacp.attention.plans import pad_rows, plan_length

BACKENDS = ("auto", "cudnn", "flash", "reference")
_KERNEL_ORDER = ("cudnn", "flash")
_refused: set[tuple] = set()
_R = TypeVar("_R")


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The scores' scale: ``scale``, or ``1 / sqrt(head_dim)`` when ``None``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def resolve_backend(backend: str | None) -> str:
    """``backend`` checked against :data:`BACKENDS` (``None``: ``"auto"``, the backend of a call
    that names none). Raises ``ValueError`` naming the allowed values."""
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return backend


def kernels_apply(x: Tensor) -> bool:
    """Whether ``"auto"`` tries the fused kernels for tensors like ``x`` (fp16/bf16 on CUDA)."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def first_kernel(backend: str, shape_class: tuple, call: Callable[[str], _R], refused: set[tuple]) -> _R | None:
    """``call(name)`` for the kernels ``backend`` names: one forced kernel, or for ``"auto"`` cuDNN
    then flash. Under ``"auto"`` a kernel that raises ``RuntimeError`` (a refused shape) is
    remembered in ``refused`` with ``shape_class`` (never the lengths: they change every step) and
    the next is tried; a forced kernel's error is raised, and so is an out-of-memory error (no
    fallback would fit either). Returns ``None`` when every kernel refused."""
    for name in _KERNEL_ORDER if backend == "auto" else (backend,):
        key = (name, *shape_class)
        if backend == "auto" and key in refused:
            continue
        try:
            return call(name)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            if backend != "auto":
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
        if backend != "reference" and kernels_apply(q) and q.dim() == 3 and left >= 0:
            a = dense_rows(lq, lk, causal=causal, left=left)
            if a:
                o1, l1 = partial_attention(q[:a], k, v, scale=scale, backend=backend)
                o2, l2 = partial_attention(q[a:], k, v, scale=scale, backend=backend, left=left)
                return torch.cat([o1, o2]), torch.cat([l1, l2])
            res = first_kernel(band_kernel(backend, causal, left), (q.dtype, "band", hq, k.shape[-2], d, causal),
                               lambda name: _band(name, q, k, v, causal=causal, scale=scale, left=left), _refused)
            if res is not None:
                return res
        return _reference_batched(q, k, v, causal=causal, scale=scale, left=left)
    if backend == "reference" or (backend == "auto" and not kernels_apply(q)):
        return _reference_batched(q, k, v, causal=causal, scale=scale)
    res = first_kernel(backend, (q.dtype, q.dim(), hq, k.shape[-2], d, causal),
                       lambda name: _kernel_attention(_KERNELS[name], q, k, v, causal=causal, scale=scale), _refused)
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


def _cudnn(q4: Tensor, k4: Tensor, v4: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q4, k4, v4, None, True, 0.0, causal, False, scale=scale
    )
    return res[0], res[1].reshape(res[1].shape[0], res[1].shape[1], -1)


def _flash(q4: Tensor, k4: Tensor, v4: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal, False, scale=scale)
    return res[0], res[1]


_KERNELS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {"cudnn": _cudnn, "flash": _flash}


CUDNN_BAND_MIN = 128
"""Narrowest causal band (``left + 1`` keys) that ``"auto"`` builds from square cuDNN calls: a
narrower one is mostly masked pairs in the kernels' 128-row tiles, and runs FlashAttention-2's window."""


def band_kernel(backend: str, causal: bool, left: int) -> str:
    """The backend a banded tile's kernels are chosen under (:func:`first_kernel`): ``backend``,
    but ``"flash"`` for a causal band narrower than :data:`CUDNN_BAND_MIN` under ``"auto"``."""
    return "flash" if backend == "auto" and causal and left + 1 < CUDNN_BAND_MIN else backend


def dense_rows(lq: int, lk: int, *, causal: bool, left: int) -> int:
    """The first rows of a banded tile that the window kernels are not given: in a non-causal band
    with more queries than keys, the rows whose band starts at or before key 0 (every key visible),
    which run as a dense call (FlashAttention-2's window and cuDNN's band both got them wrong when
    measured, on H100). 0 for every other tile; the rest of the tile has fewer queries than keys."""
    if causal or lq <= lk:
        return 0
    return min(lq, left - (lk - lq) + 1)


def _band(name: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, left: int) -> tuple[Tensor, Tensor]:
    """One banded tile through kernel ``name``: cuDNN's band (:mod:`~megacp.attention.cudnn_band`,
    where the cuDNN frontend is installed) or square causal cuDNN calls (:func:`band_attention`),
    or FlashAttention-2's window."""
    if name == "flash":
        return _flash_band(q, k, v, causal=causal, scale=scale, left=left)
    if cudnn_band.serves(q, k, causal=causal, left=left, backward=False):
        return cudnn_band.band_attention(q, k, v, causal=causal, left=left, scale=scale)
    return band_attention(q, k, v, causal=causal, left=left,
                          attend=lambda a, b, c, mask: _kernel_attention(_cudnn, a, b, c, causal=mask, scale=scale))


def _flash_band(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, left: int) -> tuple[Tensor, Tensor]:
    """One banded tile (``[L, H, D]``) through FlashAttention-2's varlen forward: one sequence,
    ``window_size_left=left``, ``window_size_right`` 0 (causal) or unbounded (-1). Queries that see
    no key get ``out = 0``, ``lse = -inf`` (the kernel writes +inf there)."""
    lq, lk = q.shape[0], k.shape[0]
    cu_q = torch.tensor([0, lq], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, lk], dtype=torch.int32, device=q.device)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, lq, lk, 0.0, causal, False, scale=scale,
                                                  window_size_left=left, window_size_right=0 if causal else -1)
    out, lse = res[0], res[1]
    lse = (lse.transpose(0, 1) if lse.dim() == 2 else lse.reshape(q.shape[1], lq).t()).float()
    empty = ~torch.isfinite(lse)
    return out.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))


def _kernel_call(kernel: Callable, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One fused call on ``[(B,) L, H, D]`` inputs viewed as ``[B, H, L, D]`` (no copies); a square
    causal cuDNN call runs padded to its :func:`~megacp.attention.plans.plan_length`."""
    n = q.shape[-3]
    if kernel is _cudnn and causal and k.shape[-3] == n and plan_length(n) != n:
        m = plan_length(n)
        out, lse = _kernel_call(kernel, pad_rows(q, m), pad_rows(k, m), pad_rows(v, m), causal, scale)
        return out[..., :n, :, :], lse[..., :n, :]
    if q.dim() == 3:
        out, lse = _kernel_call(kernel, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal, scale)
        return out[0], lse[0]
    out, lse = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _kernel_attention(kernel: Callable, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Fused kernels only do square (top-left == bottom-right) causal masks; a bottom-right mask
    with ``Lq != Lk`` is split into a dense prefix and a square causal block, then merged."""
    lq, lk = q.shape[-3], k.shape[-3]
    if not causal:
        return _kernel_call(kernel, q, k, v, False, scale)
    if lq > lk:  # the first lq - lk queries see nothing
        out, lse = empty_state(*q.shape, dtype=q.dtype, device=q.device)
        o, l = _kernel_call(kernel, q[..., lq - lk:, :, :], k, v, True, scale)
        out[..., lq - lk:, :, :] = o
        lse[..., lq - lk:, :] = l
        return out, lse
    if lq == lk:
        return _kernel_call(kernel, q, k, v, True, scale)
    prefix = lk - lq
    o1, l1 = _kernel_call(kernel, q, k[..., :prefix, :, :], v[..., :prefix, :, :], False, scale)
    o2, l2 = _kernel_call(kernel, q, k[..., prefix:, :, :], v[..., prefix:, :, :], True, scale)
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

    Kernels: fp16/bf16 CUDA tensors use FlashAttention-2's varlen forward
    (``aten._flash_attention_forward`` with ``cum_seq_k = starts`` and ``seqused_k = used``: with
    ``seqused_k`` the kernel reads only each request's start and length); every other case attends
    over each request's whole ``capacity`` rows in fp32 with the rows past ``used`` masked.

    Returns:
        ``(out [B, Hq, D] in q.dtype, lse [B, Hq] fp32 natural log)``; a request with ``used = 0``
        gets ``out = 0``, ``lse = -inf``.
    """
    b, hq, d = q.shape
    scale = softmax_scale(scale, d)
    if kernels_apply(q):
        out, lse = _flash_varlen_decode(q, k, v, starts, used, capacity, scale)
    else:
        out, lse = _masked_decode(q, k, v, starts, used, capacity, scale)
    empty = (used == 0).unsqueeze(-1)  # flash gives an empty request lse = +inf
    return out.masked_fill(empty.unsqueeze(-1), 0), lse.masked_fill(empty, float("-inf"))


def _flash_varlen_decode(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, used: Tensor, capacity: int,
                         scale: float) -> tuple[Tensor, Tensor]:
    b, hq, _ = q.shape
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    cu_k = torch.cat((starts, starts[-1:] + capacity)).to(torch.int32)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 1, capacity, 0.0, False, False,
                                                  scale=scale, seqused_k=used)
    out, lse = res[0], res[1]
    # the varlen LSE is [B, Hq, 1] (padded layout) or [Hq, total_q] (unpadded layout)
    lse = lse.transpose(0, 1) if lse.dim() == 2 else lse.reshape(b, hq)
    return out.reshape(b, hq, -1), lse.float()


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
