"""Sampling the next token: greedy, or temperature with top-k / nucleus (top-p) filtering and a
repetition penalty, seeded alike on every rank.

Everything is computed on the batch's fp32 logits ``[B, V]`` as tensors (no Python work per
request), so the step can stay on the device. Temperatures below :data:`GREEDY_BELOW` are greedy:
dividing by a tiny temperature overflows fp32 and would hand ``multinomial`` NaNs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (argmax); 0 is the documented way to ask for it."""

DEFAULT_MAX_TOKENS = 16


@dataclass
class SamplingParams:
    """How to generate (the names follow vLLM's ``SamplingParams``).

    Attributes:
        max_tokens: tokens to generate at most (``max_new_tokens`` is an alias; give one of them).
        temperature: 0 (or below :data:`GREEDY_BELOW`) = greedy.
        top_p: nucleus sampling, in (0, 1].
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        seed: seed of the sampler (the same on every rank, so every rank draws the same token).
        stop: strings that end a request (found in the decoded text; the text ends before it).
        stop_token_ids: token ids that end a request (kept in ``token_ids``).
        ignore_eos: do not add the model's end-of-sequence tokens to ``stop_token_ids``.
        repetition_penalty: Hugging Face's rule: a token already in the prompt or output has its
            logit divided by it when positive, multiplied when negative (1 = off).

    Raises:
        ValueError: one value out of range (NaN included), naming it.
    """

    max_tokens: int = None  # type: ignore[assignment]  # None until __post_init__: max_new_tokens or the default
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_new_tokens is not None and self.max_tokens != self.max_new_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and its alias max_new_tokens={self.max_new_tokens} differ")
        n = next((v for v in (self.max_tokens, self.max_new_tokens) if v is not None), DEFAULT_MAX_TOKENS)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {n!r}")
        self.max_tokens = self.max_new_tokens = n
        _check_float("temperature", self.temperature, lambda x: x >= 0, ">= 0 (0 = greedy)")
        _check_float("top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1]")
        _check_float("repetition_penalty", self.repetition_penalty, lambda x: x > 0, "> 0 (1 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = all tokens), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        self.stop = tuple(self.stop)
        if not all(type(t) is int and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {list(self.stop_token_ids)!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):  # a string such as 'no' would read as true
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature < GREEDY_BELOW


def _check_float(name: str, value: object, ok, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """``logits [B, V]`` fp32 with Hugging Face's repetition penalty on the tokens marked in
    ``seen [B, V]`` (bool): divided by ``penalty`` where positive, multiplied where negative."""
    if penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def sample(logits: Tensor, params: SamplingParams, gen: torch.Generator, seen: Tensor | None = None) -> Tensor:
    """``logits [B, V]`` → next tokens ``[B]`` int64 (identical on every rank: same logits, same seed).

    ``seen [B, V]`` (bool) marks each request's prompt and output tokens for the repetition penalty.
    Sampling divides the fp32 logits by the temperature and draws from their softmax after top-k
    and top-p filtering (the most likely token always survives).
    """
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)
