"""What a request returns (:class:`GenerationOutput`) and the text side of generation: stop strings,
the model's end-of-sequence tokens, detokenised text and streamed text pieces."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from megacp.generate.sampling import SamplingParams


@dataclass
class GenerationOutput:
    """One request's result.

    Attributes:
        prompt_token_ids: the tokens prefilled for it (for a session turn: the turn's new tokens).
        token_ids: the generated tokens (a stop token or the tokens of a stop string included).
        text: their text (special tokens skipped, cut before a stop string), ``None`` without a tokenizer.
        finish_reason: ``"stop"`` (a stop token or string) or ``"length"`` (``max_tokens`` reached).
        ttft_s: seconds from the start of the request to its first token.
        decode_tokens_per_s: tokens after the first per second (``None`` for a single token).
        logprobs: with ``SamplingParams(logprobs=k)``, one ``{token_id: logprob}`` per generated
            token: the chosen token first, then the ``k`` most likely, most likely first (natural
            log, fp32, of the model's logits before penalties and temperature); else ``None``.
        cumulative_logprob: the sum of the chosen tokens' log-probabilities (``None`` without ``logprobs``).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    ttft_s: float
    decode_tokens_per_s: float | None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class GenerationResult:
    """A batch's outcome, per request: generated ids, why it ended (``"stop"``: a stop token or
    string; ``"length"``: ``max_tokens``), time to first token (s) and decode rate (tokens/s after
    the first; ``None`` for a single token), plus the batch report
    (:meth:`~megacp.generate.engine.EngineCore.run`); with ``logprobs`` asked, per generated token
    ``{token: logprob}`` of the chosen token and the top tokens
    (:func:`~megacp.generate.sampling.logprob_dicts`; ``None`` for a request that did not ask)."""

    tokens: list[list[int]]
    finish_reasons: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float | None] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)


def with_eos(params: SamplingParams, eos_token_ids: Sequence[int]) -> SamplingParams:
    """``params`` with the model's end-of-sequence tokens among its stop tokens (unless ``ignore_eos``)."""
    if params.ignore_eos:
        return params
    extra = tuple(t for t in eos_token_ids if t not in params.stop_token_ids)
    return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))


def decode(tokenizer: Any, tokens: Sequence[int]) -> str:
    """``tokens`` as text, special tokens skipped."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to its first stop string, and whether one occurs."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class IncrementalText:
    """The text of a growing token list, decoded piece by piece: :meth:`update` decodes only the
    tokens since the last settled point, with the tokens of the piece before as context (so a piece
    starts as it does in the whole text). A piece that ends in an incomplete UTF-8 character is
    not settled: it is decoded again, longer, with the next token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prefix = self.read = 0  # token offsets: context of the next piece, end of the settled text

    def update(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """The text ``tokens`` add after the settled text, and whether it is settled now."""
        before = decode(self.tokenizer, tokens[self.prefix: self.read])
        now = decode(self.tokenizer, tokens[self.prefix:])
        piece = now[len(before):] if now.startswith(before) else now
        settled = not now.endswith("\ufffd")
        if settled:
            self.prefix, self.read = self.read, len(tokens)
        return piece, settled


class StopStrings:
    """Whether one request's generated tokens contain one of ``stop``, checked incrementally: call
    it with the tokens after each new token. Only the new text (:class:`IncrementalText`) is
    searched, together with the last ``len(longest stop) - 1`` characters before it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.text, self.stop = IncrementalText(tokenizer), tuple(stop)
        self.look_back = max(len(s) for s in self.stop) - 1
        self.tail = ""  # the last look_back characters of the settled text

    def __call__(self, tokens: Sequence[int]) -> bool:
        piece, settled = self.text.update(tokens)
        window = self.tail + piece
        if settled:
            self.tail = window[-self.look_back:] if self.look_back else ""
        return any(s in window for s in self.stop)


def stop_string_check(tokenizer: Any, params: SamplingParams) -> StopStrings | None:
    """A fresh :class:`StopStrings` check of one request's ``params.stop`` strings (``None``
    without stop strings).

    Raises:
        ValueError: stop strings without a tokenizer.
    """
    if not params.stop:
        return None
    if tokenizer is None:
        raise ValueError("stop strings need a model with a tokenizer; use stop_token_ids instead")
    return StopStrings(tokenizer, params.stop)


def outputs_of(result: GenerationResult, prompts: Sequence[Sequence[int]], tokenizer: Any,
               params: Sequence[SamplingParams]) -> list[GenerationOutput]:
    """One :class:`GenerationOutput` per request of ``result`` (``params[i]``: request ``i``'s)."""
    logprobs = result.logprobs or [None] * len(result.tokens)
    return [
        GenerationOutput(list(p), toks, None if tokenizer is None else cut_at_stop(decode(tokenizer, toks), sp.stop)[0],
                         reason, ttft, rate, lps, None if lps is None else sum(d[t] for d, t in zip(lps, toks)))
        for p, sp, toks, reason, ttft, rate, lps in zip(prompts, params, result.tokens, result.finish_reasons,
                                                        result.ttft_s, result.decode_tokens_per_s, logprobs)
    ]


class TextStream:
    """Incremental text of one request's tokens: :meth:`piece` returns the text not returned yet,
    holding back a tail that could still turn into a stop string (released when the request ends)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.text, self.stop = IncrementalText(tokenizer), tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.unsent = ""  # settled text not returned yet
        self.sent = 0
        """Characters returned so far."""
        self.done = False

    def piece(self, tokens: Sequence[int], finished: bool) -> str:
        """The text to show now of a request's generated ``tokens`` (``finished``: its last call)."""
        if self.done:
            return ""
        piece, settled = self.text.update(tokens)
        window, stopped = cut_at_stop(self.unsent + piece, self.stop)
        if finished or stopped:
            self.done, self.unsent, end = True, "", len(window)
        elif settled:
            end = max(0, len(window) - self.hold)
            self.unsent = window[end:]
        else:  # the piece ends in an incomplete UTF-8 character: it is decoded again
            end = min(max(0, len(window) - self.hold), len(self.unsent))
            self.unsent = self.unsent[end:]
        self.sent += end
        return window[:end]


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``) through the
    tokenizer's chat template, ending with the prompt of the assistant's reply.

    Raises:
        ValueError: no tokenizer, or no chat template.
    """
    if tokenizer is None:
        raise ValueError("chat needs a model with a tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])
