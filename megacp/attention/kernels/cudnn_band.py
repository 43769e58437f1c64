"""Banded tiles through cuDNN's own sliding-window attention (the cuDNN frontend's Python graphs).

torch's cuDNN SDPA op takes no window; the cuDNN frontend package (``nvidia-cudnn-frontend``,
``import cudnn``; optional, ``pip install megacp[cudnn]``) builds cuDNN SDPA graphs with a diagonal
band: ``diagonal_band_left_bound = L`` lets query ``i`` see key ``j`` iff ``j > i - L`` (``L`` keys
ending at the diagonal) and ``diagonal_band_right_bound = r`` iff ``j <= i + r``, with the
diagonal placed ``TOP_LEFT`` (query ``i``'s diagonal key is ``i``) or ``BOTTOM_RIGHT``. Measured on
H100 (cuDNN 9.19, frontend 1.32): the forward skips the key tiles outside the band under either
alignment, the backward **only** under ``TOP_LEFT`` (a ``BOTTOM_RIGHT`` band's backward visits
every tile: 16x slower at 64K tokens with a 4K window), so every tile is posed ``TOP_LEFT`` here.

A tile in :mod:`~megacp.attention.kernels.partial`'s convention (``q`` ``[Lq, Hq, D]``, ``k``/``v``
``[Lk, Hkv, D]``, bottom-right band ``left = w``: query ``i`` sees keys ``[p - w, p]`` with
``p = i + Lk - Lq`` when causal, ``[p - w, Lk)`` when not) becomes one cuDNN call over queries
``[r0, Lq)`` and keys ``[s0, Lk)``: with ``o = Lk - Lq``, ``r0 = max(0, -o)`` when causal (earlier
queries see nothing: ``out = 0``, ``lse = -inf``) else 0, ``s0 = max(0, r0 + o - w)`` (the first key
any of them sees), the diagonal shifted by ``r = r0 + o - s0`` keys: ``right_bound = r`` (causal;
none otherwise) and ``left_bound = w - r + 1``. The backward takes a causal band with ``r > 0`` as
``r`` dummy query rows (zero queries and output gradients: they add nothing) before the real ones,
which puts the diagonal at ``right_bound = 0`` where its tile skipping works (:meth:`Band.aligned`).

Graphs are built once per shape class (dtype, lengths, heads, head dim, strides, bounds, scale,
device; :func:`_graph`, a bounded cache) and executed on torch's current stream with a workspace
from torch's allocator. Results: ``out`` in ``q.dtype``, ``lse`` fp32 natural log (cuDNN's Stats);
gradients in ``q.dtype``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

State = tuple[Tensor, Tensor]
Grads = tuple[Tensor, Tensor, Tensor]

_DTYPES = (torch.float16, torch.bfloat16)
_Q, _K, _V, _O, _LSE, _DO, _DQ, _DK, _DV = range(1, 10)
"""The cuDNN graph tensors' uids."""


@functools.cache
def installed() -> bool:
    """Whether the cuDNN frontend package (``import cudnn``) is importable."""
    return importlib.util.find_spec("cudnn") is not None


def serves(q: Tensor, k: Tensor, *, causal: bool, left: int, backward: bool) -> bool:
    """Whether a banded tile (``q`` ``[Lq, H, D]``, ``k`` ``[Lk, Hkv, D]``) runs here: fp16/bf16
    CUDA tensors, the cuDNN frontend installed and, for the backward, a call other than one query
    over one key (cuDNN 9.19 refuses ``s_q = s_kv = 1`` there)."""
    if not (q.is_cuda and q.dtype in _DTYPES and q.dim() == 3 and installed()):
        return False
    band = Band.of(q.shape[0], k.shape[0], causal=causal, left=left)
    return not backward or band is None or (q.shape[0] - band.r0, k.shape[0] - band.s0) != (1, 1)


@dataclass(frozen=True)
class Band:
    """A bottom-right band tile posed as one ``TOP_LEFT`` cuDNN call (module docstring).

    Attributes:
        r0: the first query row of the call (the rows before it see no key).
        s0: the first key of the call (no query of the tile sees an earlier one).
        right: ``diagonal_band_right_bound`` (``None``: no right bound, a non-causal band).
        left: ``diagonal_band_left_bound`` (keys up to and including the diagonal).
    """

    r0: int
    s0: int
    right: int | None
    left: int

    @staticmethod
    def of(lq: int, lk: int, *, causal: bool, left: int) -> Band | None:
        """The call of a tile of ``lq`` queries over ``lk`` keys with band ``left >= 0``, or
        ``None`` when no query sees a key."""
        o = lk - lq
        r0 = max(0, -o) if causal else 0
        if r0 >= lq:
            return None
        s0 = max(0, r0 + o - left)
        r = r0 + o - s0
        return Band(r0, s0, r if causal else None, left - r + 1)


    def aligned(self) -> tuple[int, Band]:
        """The same pairs posed with the diagonal at ``right_bound = 0`` for the backward, which
        skips the tiles outside the band only there (measured: a causal band at ``right_bound =
        4095`` took as long as no skipping): ``(pad, band)``, the call's queries being ``pad`` dummy
        rows (zero queries and output gradients, so they add nothing to dK/dV) before rows
        ``[r0, Lq)``. ``pad = 0`` and the band itself unless it is causal with ``right > 0``."""
        if not self.right:
            return 0, self
        return self.right, Band(self.r0, self.s0, 0, self.left + self.right)


def _cudnn() -> Any:
    import cudnn  # the optional dependency, imported where it is used

    return cudnn


@functools.cache
def _handle(device: int) -> Any:
    """A cuDNN handle of CUDA device ``device`` (one per process and device)."""
    with torch.cuda.device(device):
        return _cudnn().create_handle()


def _dims(x: Tensor) -> tuple[list[int], list[int]]:
    """cuDNN's ``[B, H, S, D]`` dims and strides of a ``[S, H, D]`` tensor (``B = 1``)."""
    s, h, d = x.shape
    return [1, h, s, d], [s * x.stride(0), x.stride(1), x.stride(0), x.stride(2)]


def _lse_dims(h: int, s: int, row_stride: int) -> tuple[list[int], list[int]]:
    """Dims and strides of an fp32 LSE ``[1, H, S, 1]`` stored as ``[H, row_stride]``."""
    return [1, h, s, 1], [h * row_stride, row_stride, 1, 1]


@functools.lru_cache(maxsize=64)
def _graph(backward: bool, dtype: torch.dtype, device: int, layouts: tuple, band: Band,
           scale: float) -> tuple[Any, int]:
    """A built cuDNN SDPA graph (``backward``: its backward) for the given tensor layouts
    (``(uid, (dims, strides))`` in uid order) and band, and its workspace in bytes."""
    cudnn = _cudnn()
    io = cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16
    g = cudnn.pygraph(handle=_handle(device), io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    lay = dict(layouts)

    def tensor(uid: int, name: str, fp32: bool = False) -> Any:
        dim, stride = lay[uid]
        return g.tensor(name=name, dim=list(dim), stride=list(stride), uid=uid,
                        data_type=cudnn.data_type.FLOAT if fp32 else io)

    def output(t: Any, uid: int, fp32: bool = False) -> None:
        dim, stride = lay[uid]
        t.set_output(True).set_uid(uid).set_dim(list(dim)).set_stride(list(stride))
        t.set_data_type(cudnn.data_type.FLOAT if fp32 else io)

    q, k, v = tensor(_Q, "q"), tensor(_K, "k"), tensor(_V, "v")
    mask = dict(attn_scale=scale, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                diagonal_band_left_bound=band.left)
    if band.right is not None:
        mask["diagonal_band_right_bound"] = band.right
    if backward:
        dq, dk, dv = g.sdpa_backward(name="band_bwd", q=q, k=k, v=v, o=tensor(_O, "o"), dO=tensor(_DO, "dO"),
                                     stats=tensor(_LSE, "stats", fp32=True), **mask)
        for t, uid in ((dq, _DQ), (dk, _DK), (dv, _DV)):
            output(t, uid)
    else:
        o, stats = g.sdpa(name="band", q=q, k=k, v=v, generate_stats=True, **mask)
        output(o, _O)
        output(stats, _LSE, fp32=True)
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except (RuntimeError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # the frontend's "not supported" errors: a refusal, as torch's kernels raise it
        raise RuntimeError(f"cuDNN refused the band graph {band} ({'backward' if backward else 'forward'}): {exc}") from exc
    return g, g.get_workspace_size()


def _run(backward: bool, tensors: dict[int, Tensor], layouts: dict[int, tuple[list[int], list[int]]],
         band: Band, scale: float) -> None:
    """Build (or reuse) the graph and run it on torch's current stream."""
    q = tensors[_Q]
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    uids = sorted(layouts)
    key = tuple((uid, (tuple(layouts[uid][0]), tuple(layouts[uid][1]))) for uid in uids)
    g, workspace_bytes = _graph(backward, q.dtype, device, key, band, scale)
    handle = _handle(device)
    _cudnn().set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
    g.execute([tensors[uid] for uid in uids], workspace, handle=handle, tensor_uids=uids)


def _inner(x: Tensor) -> Tensor:
    """``x`` with a unit stride on the head dim (cuDNN's requirement)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def band_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, left: int, scale: float) -> State:
    """``partial_attention(q, k, v, causal=causal, left=left)`` as one cuDNN band call.

    Args:
        q: ``[Lq, Hq, D]``; k, v: ``[Lk, Hkv, D]`` (fp16/bf16, CUDA); left: the band, ``>= 0``.

    Returns:
        ``(out [Lq, Hq, D] q.dtype, lse [Lq, Hq] fp32)``; ``out = 0``, ``lse = -inf`` where a query
        sees no key.
    """
    lq, hq, _ = q.shape
    band = Band.of(lq, k.shape[0], causal=causal, left=left)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((hq, lq), dtype=torch.float32, device=q.device)
    r0 = lq if band is None else band.r0
    out[:r0].zero_()
    lse[:, :r0].fill_(float("-inf"))
    if band is not None:
        qs, ks, vs = _inner(q[band.r0:]), _inner(k[band.s0:]), _inner(v[band.s0:])
        os_ = out[band.r0:]
        tensors = {_Q: qs, _K: ks, _V: vs, _O: os_, _LSE: lse[:, band.r0:]}
        layouts = {_Q: _dims(qs), _K: _dims(ks), _V: _dims(vs), _O: _dims(os_),
                   _LSE: _lse_dims(hq, lq - band.r0, lq)}
        _run(False, tensors, layouts, band, scale)
    return out, lse.t().contiguous()


def band_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
                  causal: bool, left: int, scale: float, heads: Sequence[tuple[slice, slice]]) -> Grads:
    """The gradients of one banded tile's share of attention, given the queries' final ``out`` /
    ``lse`` (:mod:`~megacp.attention.kernels.partial_backward`), as cuDNN band backward calls: one per
    group of heads (the call's workspace grows with its heads).

    Args:
        q, out, dout: ``[Lq, Hq, D]``; k, v: ``[Lk, Hkv, D]``; lse: ``[Lq, Hq]`` fp32 natural log;
        heads: ``(query heads, KV heads)`` of each call, covering every head once
            (:func:`~megacp.attention.kernels.partial_backward.head_group_slices`).

    Returns:
        ``(dq [Lq, Hq, D], dk [Lk, Hkv, D], dv [Lk, Hkv, D])`` in ``q.dtype`` (zero where no pair of
        the band reaches).
    """
    lq, hq, _ = q.shape
    band = Band.of(lq, k.shape[0], causal=causal, left=left)
    if band is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dq[:band.r0].zero_()
    dk[:band.s0].zero_()
    dv[:band.s0].zero_()
    keys = slice(band.s0, None)
    pad, call = band.aligned()
    qs, os_, dos, dqs = (x[band.r0:] for x in (q, out, dout, dq))
    stats = lse[band.r0:].t()
    if pad:
        qs, os_, dos = (torch.cat([x.new_zeros(pad, *x.shape[1:]), x]) for x in (qs, os_, dos))
        stats = torch.cat([stats.new_zeros(hq, pad), stats], dim=1)
        dqs = torch.empty_like(qs)
    stats = stats.contiguous()  # cuDNN < 9.26 wants the backward's Stats packed [H, S]
    for hs, hkv in heads:
        xs = {_Q: _inner(qs[:, hs]), _K: _inner(k[keys, hkv]), _V: _inner(v[keys, hkv]),
              _O: _inner(os_[:, hs]), _DO: _inner(dos[:, hs]),
              _DQ: dqs[:, hs], _DK: dk[keys, hkv], _DV: dv[keys, hkv]}
        layouts = {uid: _dims(x) for uid, x in xs.items()}
        layouts[_LSE] = _lse_dims(xs[_Q].shape[1], qs.shape[0], qs.shape[0])
        _run(True, {**xs, _LSE: stats[hs]}, layouts, call, scale)
    if pad:
        dq[band.r0:] = dqs[pad:]
    return dq, dk, dv
