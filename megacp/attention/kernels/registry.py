"""The attention backends: the one list of the kernels that compute attention over one KV block.

Each :class:`Backend` names a backend, states what it applies to and where its code is. Everything
that offers, checks or picks a backend reads :data:`BACKENDS`: the ``runtime.attention_backend``
choices of :mod:`megacp.config` (:func:`choices`: ``"auto"`` and every name here), the refusal of a
GPU-only backend on a machine without one (:func:`megacp.parallel.initialize`), the order in which
``"auto"`` tries the fused kernels (the order here), and which kernel runs varlen runs, cache
decode and padded cuDNN plans (:mod:`~megacp.attention.kernels.partial`,
:mod:`~megacp.attention.kernels.partial_backward`, :mod:`~megacp.attention.kernels.varlen`,
:mod:`~megacp.attention.kernels.warmup`).

The table is data only: it imports nothing (not torch), so the config can read it. A fused kernel's
code is the module its entry names, imported on first use
(:func:`~megacp.attention.kernels.partial.kernel_module`). Such a module provides, on ``[B, H, L, D]``
views (``lse`` ``[B, H, Lq]`` fp32, natural log, whatever layout the kernel keeps it in):

* ``forward(q, k, v, causal, scale) -> (out, lse)``: no mask, or a square causal mask;
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``, fed the queries' final
  ``out``/``lse`` (:mod:`~megacp.attention.kernels.partial_backward`);
* ``band_forward(q, k, v, *, causal, scale, left)`` and
  ``band_backward(q, k, v, out, lse, dout, *, causal, scale, left)`` on ``[L, H, D]`` tiles: a
  sliding-window band, or ``None`` where the kernel has none, and the band is then built from its
  square causal calls (:mod:`~megacp.attention.kernels.band`);
* with :attr:`Backend.varlen`: ``varlen_forward`` / ``varlen_backward``
  (:mod:`~megacp.attention.kernels.varlen`); with :attr:`Backend.cache_decode`: ``cache_decode``
  (:func:`~megacp.attention.kernels.partial.cache_decode_states`).

Adding a kernel is one such module and one entry in :data:`BACKENDS`.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
"""The backend that picks per call: the first fused kernel of :data:`BACKENDS` that applies and
accepts the shape, else the reference."""


@dataclass(frozen=True)
class Backend:
    """One attention backend and what it applies to.

    Attributes:
        name: the name a config, an environment variable or a call gives (``backend=``).
        module: the module of a fused kernel (the functions the module docstring lists); ``None``
            for the exact reference of :mod:`~megacp.attention.kernels.partial` /
            :mod:`~megacp.attention.kernels.partial_backward`, which serves every call no kernel takes.
        devices: the device types it runs on (``torch.device.type``).
        dtypes: the dtypes of q/k/v it takes (``torch`` attribute names).
        gqa: it takes fewer KV heads than query heads (never repeating K/V).
        band: how it runs a sliding-window band.
        lse: the layout its kernel returns the LSE in (its module returns ``[B, H, Lq]`` fp32).
        varlen: it runs a run of packed tiles in one call (:mod:`~megacp.attention.kernels.varlen`).
        cache_decode: it decodes over a packed cache with lengths in device memory.
        plan_padding: its square causal calls run padded to a plan length, and a training job
            builds those plans before its first step (:mod:`~megacp.attention.kernels.plans`).
        backward_under_plan_reuse: its backward is exact where torch reuses cuDNN plans across
            lengths (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``); where it is not, ``"auto"`` passes
            over it and naming it is refused.
        auto_band_min: under ``"auto"``, a causal band of fewer keys (``left + 1``) runs on the
            next kernel of the order (mostly masked pairs in the kernel's tiles).
    """

    name: str
    module: str | None
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    gqa: bool
    band: str
    lse: str
    varlen: bool = False
    cache_decode: bool = False
    plan_padding: bool = False
    backward_under_plan_reuse: bool = True
    auto_band_min: int = 0


BACKENDS: tuple[Backend, ...] = (
    Backend(
        "cudnn", "megacp.attention.kernels.cudnn", devices=("cuda",), dtypes=("float16", "bfloat16"), gqa=True,
        band="cuDNN's own band through the cuDNN frontend where installed, else batched square causal calls",
        lse="[B, H, Lq, 1]", plan_padding=True, backward_under_plan_reuse=False, auto_band_min=128),
    Backend(
        "flash", "megacp.attention.kernels.flash", devices=("cuda",), dtypes=("float16", "bfloat16"), gqa=True,
        band="FlashAttention-2's window arguments", lse="[B, H, Lq]", varlen=True, cache_decode=True),
    Backend(
        "reference", None, devices=("cpu", "cuda"), dtypes=("float16", "bfloat16", "float32", "float64"), gqa=True,
        band="masked by index", lse="[Lq, H]"),
)
"""Every backend; the fused kernels in the order ``"auto"`` tries them."""


def choices() -> tuple[str, ...]:
    """Every name a backend may be given: ``"auto"`` and each of :data:`BACKENDS`."""
    return (AUTO, *(b.name for b in BACKENDS))


def get(name: str) -> Backend:
    """The entry of backend ``name`` (not ``"auto"``). Raises ``KeyError`` for another name."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise KeyError(name)


def fused() -> tuple[Backend, ...]:
    """The fused kernels (entries with a module), in the order ``"auto"`` tries them."""
    return tuple(b for b in BACKENDS if b.module is not None)


def resolve_backend(backend: str | None) -> str:
    """``backend`` checked against :func:`choices` (``None``: ``"auto"``, the backend of a call that
    names none). Raises ``ValueError`` naming the allowed values."""
    backend = backend or AUTO
    if backend not in choices():
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(choices())}")
    return backend
