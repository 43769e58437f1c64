"""The FP8 storage format of the KV cache (``kv_cache_dtype="fp8_e4m3"``).

Keys and values are kept as ``torch.float8_e4m3fn`` with one fp32 scale per (layer, request slot,
K or V, KV head), a power of two: a stored value ``x8`` stands for ``x8 * scale``. A request's scales
are fixed at its first step (the step that starts from an empty slot), layer by layer, from the
largest magnitude of that step's keys (values) of each head over **all** CP ranks, with
:data:`FP8_HEADROOM` to spare: the smallest power of two ``s`` with ``amax * FP8_HEADROOM <= 448 * s``.
Later steps (chunks, decode, session turns) reuse them; anything beyond ``448 * s`` is clamped to
``±448`` (never inf or NaN). Since every rank derives the same scales, a KV block needs no scales on
the wire and the FP8 result does not depend on the CP size. Writes quantise (``x / s`` rounds once,
to nearest, in the cast); reads dequantise to the compute dtype, exactly (a power-of-two scale loses
nothing), never more than a tile of rows at a time in a prefill (:data:`FP8_TILE_ROWS`), and not at
all where a decode kernel reads the FP8 rows as stored (:mod:`megacp.attention.kernels.fp8_decode_kernel`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value."""
FP8_HEADROOM = 4.0
"""A request's first step maps its largest key (value) of each head to between ``448 / 8`` and
``448 / 4``: later tokens up to 4-8x larger are stored without clamping."""
FP8_TILE_ROWS = 65536
"""Rows of an FP8 KV block a prefill dequantises at a time (:mod:`megacp.attention.blocks`): a
chunk's transient is O(chunk + this), not O(cached length). 64K rows of the Llama-3.1-8B shape
(8 KV heads of 128) are 256 MiB of bf16 keys and values; a 16K-query chunk spends ~30 ms of
attention on them on an H100, against well under 1 ms to dequantise and merge them."""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""``kv_cache_dtype`` names: ``"auto"`` (the compute dtype; also accepted: its name, e.g.
``"bfloat16"``), ``"fp8_e4m3"`` (``"fp8"`` is its alias, as in vLLM)."""

AmaxReduce = Callable[[Tensor], Tensor]
"""Elementwise max of a tensor over the CP ranks (every rank calls it with the same shape)."""


def kv_cache_format(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The storage format of a cache of compute ``dtype`` asked for as ``kv_cache_dtype``:
    ``"auto"`` (keys and values in ``dtype``) or ``"fp8_e4m3"``.

    Raises:
        ValueError: a name that is not one of :data:`KV_CACHE_DTYPES` or ``dtype``'s own name.
    """
    own = str(dtype).removeprefix("torch.")
    if kv_cache_dtype in ("auto", own):
        return "auto"
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return "fp8_e4m3"
    if kv_cache_dtype in ("float32", "bfloat16", "float16"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} differs from the model's dtype {own}: a cache in another "
                         "unquantised dtype is not implemented; use 'auto' or 'fp8_e4m3'")
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)} "
                     f"(or the model's dtype, {own})")


def fp8_scale(amax: Tensor) -> Tensor:
    """The power-of-two scale (fp32, same shape) that stores magnitudes up to ``amax`` (fp32, >= 0)
    with :data:`FP8_HEADROOM` to spare (an all-zero ``amax`` gets a tiny scale; zeros stay zeros)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(2.0 ** -100) * FP8_HEADROOM / FP8_MAX)))


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x / scale`` clamped to ``±448`` as ``float8_e4m3fn`` (``scale``: power-of-two fp32,
    broadcastable to ``x``; dividing by it is exact, the cast rounds once)."""
    return (x * scale.reciprocal().to(x.dtype)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``x * scale`` in ``dtype`` (``x``: ``float8_e4m3fn`` or its ``uint8`` view; ``scale``:
    power-of-two fp32 broadcastable to ``x``; exact in any float dtype of fp8's range)."""
    if x.dtype == torch.uint8:
        x = x.view(FP8)
    return x.to(dtype) * scale.to(dtype)
