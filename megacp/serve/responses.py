"""The server's response writer: a request's engine events as OpenAI's ``/v1/completions`` or
``/v1/chat/completions`` answer — one JSON body, or server-sent events (``stream``) — with its
usage and, when asked, the log-probabilities in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from itertools import accumulate
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from megacp.serve.engine import Event, Request
from megacp.serve.protocol import APIError, SamplingFields

LOGPROB_FLOOR = -9999.0
"""Log-probabilities are shown at least this (OpenAI's value for a very unlikely token; JSON has no -inf)."""

DISCONNECT_POLL_S = 0.1
"""How often a non-streaming request looks whether its client is still there."""


def token_text(tokenizer: Any, token: int) -> str:
    """One token's text as the log-probability fields show it (special tokens included; without a
    tokenizer ``token_id:N``, as vLLM's ``--return-tokens-as-token-ids``)."""
    return f"token_id:{token}" if tokenizer is None else tokenizer.decode([token])


def completion_logprobs(tokenizer: Any, tokens: Sequence[int], logprobs: Sequence[dict[int, float]],
                        offset: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of ``/v1/completions`` for ``tokens`` and their ``{token: logprob}``
    (the chosen token first, then the ``logprobs`` most likely): each token's text, its
    log-probability, a ``{text: logprob}`` of those tokens, and its character offset in the
    generated text (the texts before it, from ``offset``)."""
    texts = [token_text(tokenizer, t) for t in tokens]
    return {"tokens": texts,
            "token_logprobs": [max(lp[t], LOGPROB_FLOOR) for t, lp in zip(tokens, logprobs)],
            "top_logprobs": [{token_text(tokenizer, i): max(v, LOGPROB_FLOOR) for i, v in lp.items()} for lp in logprobs],
            "text_offset": list(accumulate((len(x) for x in texts[:-1]), initial=offset))}


def chat_logprobs(tokenizer: Any, tokens: Sequence[int], logprobs: Sequence[dict[int, float]],
                  top: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of ``/v1/chat/completions`` for ``tokens`` and their ``{token:
    logprob}``: per token its text, log-probability and UTF-8 bytes, and the ``top`` most likely
    tokens alike, most likely first."""

    def entry(token: int, value: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": max(value, LOGPROB_FLOOR), "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(t, lp[t]), top_logprobs=[entry(i, v) for i, v in
                                                              sorted(lp.items(), key=lambda x: -x[1])[:top]])
                        for t, lp in zip(tokens, logprobs)], "refusal": None}


def _logprobs_of(ev: Event) -> list[dict[int, float]]:
    """The event's token's ``{token: logprob}`` as a list of one (empty without log-probabilities)."""
    return [] if ev.logprobs is None else [ev.logprobs]


class ResponseWriter:
    """The answer to one submitted request ``r`` (its body ``req``), written from its events.

    Args:
        r: the engine's request (its events arrive on ``r.events``).
        req: the request body (``stream``, ``stream_options``).
        chat: a chat completion (``chat.completion`` objects, ``message`` / ``delta``), else a
            completion (``text_completion``, ``text``).
        tokenizer: for the log-probabilities' token texts (``None``: ``token_id:N``).
        model_name: the answer's ``model``.
    """

    def __init__(self, r: Request, req: SamplingFields, *, chat: bool, tokenizer: Any, model_name: str) -> None:
        self.r, self.req, self.chat, self.tokenizer, self.model_name = r, req, chat, tokenizer, model_name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.top = r.params.logprobs
        """Top log-probabilities per token asked (``None``: no log-probabilities)."""
        self.offset = 0
        """Character offset of the next token's text in the generated text (completions' ``text_offset``)."""

    async def respond(self, http: HTTPRequest) -> Any:
        """The whole answer as one JSON body, or with ``stream`` its server-sent events."""
        if self.req.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream")
        return await self.body(http)

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage``: prompt, completion and total tokens, and the cached prompt tokens."""
        r = self.r
        return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
                "total_tokens": len(r.prompt) + len(r.tokens), "prompt_tokens_details": {"cached_tokens": r.cached}}

    def choice(self, text: str, tokens: list[int], logprobs: list[dict[int, float]], finish: str | None,
               delta: bool) -> dict[str, Any]:
        """``choices[0]`` of an answer (``delta``: of a stream's chunk) holding ``text``, its
        ``tokens`` and their ``{token: logprob}``; advances :attr:`offset` past their texts."""
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": tokens, "logprobs": None}
        if self.top is not None and tokens:
            if self.chat:
                c["logprobs"] = chat_logprobs(self.tokenizer, tokens, logprobs, self.top)
            else:
                c["logprobs"] = lp = completion_logprobs(self.tokenizer, tokens, logprobs, self.offset)
                self.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if self.chat:
            c["delta" if delta else "message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        return c

    async def body(self, http: HTTPRequest) -> dict[str, Any]:
        """The answer once the request finished; a client gone before it stops the request at
        the next step (an engine error: :class:`APIError` 500)."""
        r = self.r
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []

        async def watch() -> None:
            while not await http.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            r.cancelled = True
            r.events.put_nowait(Event(None, "", error="the client disconnected"))

        watcher = asyncio.create_task(watch())
        try:
            while True:
                ev: Event = await r.events.get()
                if ev.error:
                    raise APIError(500, ev.error, kind="server_error")
                text.append(ev.text)
                if ev.token is not None:
                    tokens.append(ev.token)
                logprobs += _logprobs_of(ev)
                if ev.finish_reason:
                    break
        finally:
            r.cancelled = True
            watcher.cancel()
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.model_name,
                "choices": [self.choice("".join(text), tokens, logprobs, ev.finish_reason, False)], "usage": self.usage()}

    async def events(self) -> AsyncIterator[str]:
        """The answer as server-sent events: a chunk per event, with ``stream_options.include_usage``
        a last chunk of the usage, then ``[DONE]`` (an engine error: its error body, then ``[DONE]``).
        A client that goes away frees the request's slot at the next step."""
        r = self.r
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        try:
            while True:
                ev = await r.events.get()
                if ev.error:
                    yield f"data: {json.dumps(APIError(500, ev.error, kind='server_error').body())}\n\n"
                    break
                chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model_name,
                         "choices": [self.choice(ev.text, [ev.token] if ev.token is not None else [], _logprobs_of(ev),
                                                 ev.finish_reason, True)]}
                yield f"data: {json.dumps(chunk)}\n\n"
                if ev.finish_reason:
                    if include_usage:
                        yield f"data: {json.dumps(dict(chunk, choices=[], usage=self.usage()))}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            r.cancelled = True
