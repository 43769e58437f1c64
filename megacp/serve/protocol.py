"""The OpenAI request bodies the server takes (pydantic), their mapping onto
:class:`~megacp.generate.sampling.SamplingParams`, and OpenAI-style errors."""

from __future__ import annotations

import secrets
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from megacp.generate.sampling import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


UNSUPPORTED_DEFAULTS: dict[str, Any] = {"n": 1, "best_of": 1, "echo": False, "logit_bias": None, "suffix": None,
                                        "user": None}
"""Fields accepted only at these values (anything else is refused, naming the field)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


MAX_BODY_BYTES = 32 << 20
"""Default largest request body (``--max-request-bytes``): a prompt of ~4M characters or ~2M token ids."""


class SamplingFields(BaseModel):
    """The fields completions and chat share (OpenAI's names; ``top_k``, ``min_p``,
    ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos`` as in vLLM)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # OpenAI's types: "5" is no integer, "yes" no boolean
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Union[int, None] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    best_of: int | None = 1
    echo: bool | None = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Any = None
    suffix: Any = None
    user: str | None = None

    def check_supported(self) -> None:
        for name, default in UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, name, default)
            if name != "user" and value is not None and value != default:
                raise APIError(400, f"{name}={value!r} is not supported (only {default!r})", param=name)

    def top_logprobs_asked(self) -> tuple[str, int | None]:
        """The request field that sets the top log-probabilities per token, and its count (``None``:
        no log-probabilities)."""
        raise NotImplementedError

    def sampling(self, max_tokens: int | None, default_max: int, vocab: int) -> SamplingParams:
        """The request's :class:`SamplingParams` (``max_tokens`` default: what the context leaves;
        ``vocab``: the model's vocabulary, which bounds the top log-probabilities)."""
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        field, logprobs = self.top_logprobs_asked()
        most = min(MAX_LOGPROBS, vocab)
        if logprobs is not None and not 0 <= logprobs <= most:
            raise APIError(400, f"{field} must be in [0, {most}], got {logprobs}", param=field)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(max_tokens=max_tokens or default_max, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, min_p=self.min_p,
                                  seed=secrets.randbits(63) if self.seed is None else self.seed, stop=stop,
                                  stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
                                  repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty, logprobs=logprobs)
        except ValueError as err:
            raise APIError(400, str(err), param=str(err).split(" ", 1)[0]) from None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: StrictInt | None = None
    """Per generated token, the log-probabilities of the chosen token and of this many most likely ones."""

    def top_logprobs_asked(self) -> tuple[str, int | None]:
        return "logprobs", self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: Union[str, list[dict[str, Any]]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" for part in self.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: StrictBool | None = None
    """Return the log-probability of each generated token."""
    top_logprobs: StrictInt | None = None
    """With ``logprobs``, the most likely tokens per position returned with theirs."""

    def top_logprobs_asked(self) -> tuple[str, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return "top_logprobs", (self.top_logprobs or 0) if self.logprobs else None
