"""Rotary position embedding (RoPE) at arbitrary global positions.

Under context parallelism a rank holds non-contiguous tokens of a sequence, so the rotation of
every token is computed from its *global* position id, never from ``arange``. The convention is
"rotate half" (the first and second halves of a head are the two coordinates of each rotated
pair), which is how Hugging Face Llama-family checkpoints store q/k projections.

Numerics follow Hugging Face exactly: inverse frequencies are computed once on the CPU in fp32,
angles are ``position.float() * inv_freq`` in fp32, cos/sin are taken in fp32 and cast to the
activation dtype only when applied.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megacp.models.config import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> torch.Tensor:
    """Inverse frequencies of RoPE, fp32 on the CPU.

    Args:
        head_dim: D, the rotated width of one head (must be even).
        theta: the RoPE base.
        scaling: ``None`` or a dict with ``rope_type`` (or legacy ``type``) in :data:`ROPE_TYPES`:
            ``"linear"`` needs ``factor``; ``"llama3"`` needs ``factor``, ``low_freq_factor``,
            ``high_freq_factor`` and optionally ``original_max_position_embeddings``.
        max_position_embeddings: fallback for ``original_max_position_embeddings`` (llama3).

    Returns:
        inv_freq [D/2] fp32.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default" or scaling is None:
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low = scaling["low_freq_factor"]
        high = scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings") or max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, and the
        # band in between interpolated linearly in old_len / wavelen.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(in_band, blended, scaled)
    raise ValueError(
        f"rope_scaling rope_type={rope_type!r} is not supported; allowed: {', '.join(ROPE_TYPES)}"
    )


class RotaryEmbedding(torch.nn.Module):
    """cos/sin of RoPE at given global positions.

    The inverse frequencies are a plain fp32 tensor, not a buffer: they are therefore absent
    from the state dict, survive building the model on the ``meta`` device and are never cast
    by ``model.to(dtype)``. A copy per device is cached on first use.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: position_ids [T] int64 global positions. Returns (cos, sin), each [T, D] fp32."""
        device = position_ids.device
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[device] = self.inv_freq.to(device)
        angles = position_ids.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] by the per-token angles whose cos/sin [T, D] are given.

    cos/sin are cast to ``x.dtype`` first (as Hugging Face does), then
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]`` over the last dim.
    """
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
