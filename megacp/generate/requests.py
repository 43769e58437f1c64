"""Checks of a generation request against the model, cheap enough to run before any weight loads.

The model's config comes from :func:`megacp.checkpoint.front.read_model_config` (no weights read);
:func:`encode`, :func:`check_prompt`, :func:`check_text` and :func:`check_text_tokens` raise one
``ValueError`` line naming the problem.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class ModelLimits(Protocol):
    """What the request checks and sessions read of a model: a megacp
    :class:`~megacp.models.config.ModelConfig`, or the
    :class:`~megacp.integrations.hf_generate.HFModelInfo` of a transformers model."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...


def check_prompt(cfg: ModelLimits, prompt: Sequence[int], max_tokens: int, what: str = "prompt") -> None:
    """Raise ``ValueError`` unless ``prompt`` is non-empty, in the vocabulary, and ``prompt`` plus
    ``max_tokens`` new tokens fit the model's context (``max_position_embeddings``)."""
    if len(prompt) == 0:
        raise ValueError(f"{what} is empty; it needs at least one token")
    if not 0 <= min(prompt) <= max(prompt) < cfg.vocab_size:  # C loops; the offender is looked up only then
        bad = next(t for t in prompt if not 0 <= t < cfg.vocab_size)
        raise ValueError(f"{what}: token id {bad} is outside the model's vocabulary [0, {cfg.vocab_size})")
    check_context(cfg, len(prompt), max_tokens, what)


def check_context(cfg: ModelLimits, tokens: int, max_tokens: int, what: str = "prompt") -> None:
    """Raise ``ValueError`` unless ``tokens`` plus ``max_tokens`` fit the model's context."""
    if tokens + max_tokens > cfg.max_position_embeddings:
        raise ValueError(f"{what} of {tokens} tokens + max_tokens {max_tokens} exceeds the model's context of "
                         f"{cfg.max_position_embeddings} tokens (max_position_embeddings)")


def longest_token(tokenizer: Any) -> int:
    """Characters of ``tokenizer``'s longest token (the text of its vocabulary's tokens, added
    tokens included; a byte-level token's text has one character per byte): no token covers more
    characters of a text (:func:`check_text_tokens`)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def check_text_tokens(chars: int, longest: int, context: int, what: str = "prompt") -> None:
    """Raise ``ValueError`` when a text of ``chars`` characters cannot leave room for a new token in
    a context of ``context`` tokens whatever its tokens: each token covers at most ``longest``
    characters (:func:`longest_token`; a tokenizer whose normaliser never shortens text, as
    byte-level BPE and SentencePiece), so the text is at least ``ceil(chars / longest)`` tokens.
    Costs nothing of the text: a prompt is refused before it is tokenised. ``longest`` 0: no check."""
    least = -(-chars // longest) if longest else 0
    if least >= context:
        raise ValueError(f"the {what} of {chars} characters is at least {least} tokens (the tokenizer's longest token "
                         f"has {longest} characters): it leaves no room in the context of {context} tokens")


def check_text(text: str, what: str = "prompt") -> None:
    """Raise ``ValueError`` unless ``text`` is valid Unicode (no undecodable bytes smuggled in as
    surrogates, as a non-UTF-8 command-line argument arrives)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = err.object[err.start:err.end]
        try:
            shown = " ".join(f"0x{b:02x}" for b in bad.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:
            shown = repr(bad)
        raise ValueError(f"{what} is not valid UTF-8 (byte {shown} at character {err.start})") from None


def encode(tokenizer: Any, prompt: str | Sequence[int], what: str = "prompt", *,
           special_tokens: bool = True) -> list[int]:
    """``prompt``'s token ids: text (checked by :func:`check_text`) through ``tokenizer``, with its
    special tokens (e.g. BOS) unless ``special_tokens`` is false; token ids as they are, each an int."""
    if isinstance(prompt, str):
        check_text(prompt, what)
        if tokenizer is None:
            raise ValueError(f"a text {what} needs a model with a tokenizer; pass token ids instead")
        return list(tokenizer(prompt, add_special_tokens=special_tokens)["input_ids"])
    if not isinstance(prompt, Sequence) or set(map(type, prompt)) - {int}:  # None, a number, floats
        raise ValueError(f"{what} must be text or a list of integer token ids")
    return list(map(int, prompt))
