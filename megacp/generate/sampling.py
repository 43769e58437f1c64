"""Sampling the next token: greedy, or temperature + nucleus (top-p), seeded alike on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """Greedy when ``temperature == 0``; else temperature + nucleus (top-p) sampling, seeded."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: Sequence[int] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: Tensor, params: SamplingParams, gen: torch.Generator) -> Tensor:
    """``logits [B, V]`` fp32 → next tokens ``[B]`` (identical on every rank: same logits, same seed)."""
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)
