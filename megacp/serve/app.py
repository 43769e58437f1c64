"""The HTTP side (FastAPI): OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (plain JSON or
server-sent events; with ``logprobs``, in OpenAI's shapes), ``/v1/models``, ``/health`` (503 once the
engine's step loop has died) and ``/metrics`` (the engine's counters as JSON)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from itertools import accumulate
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from megacp.generate.outputs import chat_ids, with_eos
from megacp.generate.requests import ModelLimits, check_prompt, encode
from megacp.serve.engine import Draining, Engine, Event, QueueFull, Request
from megacp.serve.protocol import MAX_BODY_BYTES, APIError, ChatRequest, CompletionRequest, SamplingFields

Body = TypeVar("Body", bound=SamplingFields)

LOGPROB_FLOOR = -9999.0
"""Log-probabilities are shown at least this (OpenAI's value for a very unlikely token; JSON has no -inf)."""


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


DISCONNECT_POLL_S = 0.1
"""How often a non-streaming request looks whether its client is still there."""


def build_app(engine: Engine, cfg: ModelLimits, *, model_name: str, max_model_len: int,
              api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app over ``engine`` (started and drained with the app's lifespan).

    Request bodies over ``max_body_bytes`` are refused with 413 as they arrive (by their
    ``Content-Length``, else once that many bytes came), tokenisation runs off the event loop, and
    with an ``api_key`` the interactive docs and the OpenAPI schema are off (every route but
    ``/health`` needs the key).
    """
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.drain)

    closed = dict(docs_url=None, redoc_url=None, openapi_url=None) if api_key is not None else {}
    app = FastAPI(title="megacp", lifespan=lifespan, **closed)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    def authorize(request: HTTPRequest) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")

    async def body(request: HTTPRequest) -> bytes:
        too_big = APIError(413, f"the request body is larger than {max_body_bytes} bytes (--max-request-bytes)",
                           code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(request: HTTPRequest, model: type[Body]) -> Body:
        authorize(request)
        raw = await body(request)
        try:  # parsed and validated in one pass (pydantic's JSON parser: a 32K-token prompt in ~1 ms)
            req = model.model_validate_json(raw)
        except ValidationError as err:
            e = err.errors()[0]
            if e["type"] == "json_invalid":
                raise APIError(400, f"the request body is not valid JSON: {e['msg']}") from None
            where = ".".join(str(x) for x in e["loc"]) or None
            msg = f"unsupported field {where}" if e["type"] == "extra_forbidden" else f"{where}: {e['msg']}"
            raise APIError(400, msg, param=where) from None
        if req.model != model_name:
            raise APIError(404, f"the model `{req.model}` does not exist", param="model", code="model_not_found")
        req.check_supported()
        return req

    def submit(prompt: list[int], req: Any, max_tokens: int | None) -> Request:
        try:
            check_prompt(cfg, prompt, 1)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from None
        if len(prompt) >= max_model_len:
            raise APIError(400, f"the prompt of {len(prompt)} tokens leaves no room in the context of "
                                f"{max_model_len} tokens", param="prompt", code="context_length_exceeded")
        params = req.sampling(max_tokens, max_model_len - len(prompt), cfg.vocab_size)
        if len(prompt) + params.max_tokens > max_model_len:
            raise APIError(400, f"the prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the "
                                f"context of {max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
        r = Request(prompt, with_eos(params, cfg.eos_token_ids), loop=asyncio.get_running_loop())
        try:
            engine.submit(r)
        except QueueFull as err:
            raise APIError(429, str(err), kind="rate_limit_error", code="queue_full") from None
        except Draining as err:
            raise APIError(503, str(err), kind="server_error", code="shutting_down") from None
        except ValueError as err:
            raise APIError(400, str(err), param="stop") from None
        return r

    def usage(r: Request) -> dict[str, Any]:
        return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
                "total_tokens": len(r.prompt) + len(r.tokens), "prompt_tokens_details": {"cached_tokens": r.cached}}

    async def respond(r: Request, req: Any, chat: bool, http: HTTPRequest) -> Any:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, obj = int(time.time()), "chat.completion" if chat else "text_completion"
        top = r.params.logprobs  # None: no log-probabilities asked
        offset = 0  # of the next token's text in the generated text (completions' text_offset)

        def choice(text: str, tokens: list[int], logprobs: list[dict[int, float]], finish: str | None,
                   delta: bool) -> dict[str, Any]:
            nonlocal offset
            c: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": tokens, "logprobs": None}
            if top is not None and tokens:
                if chat:
                    c["logprobs"] = chat_logprobs(tokenizer, tokens, logprobs, top)
                else:
                    c["logprobs"] = lp = completion_logprobs(tokenizer, tokens, logprobs, offset)
                    offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if chat:
                c["delta" if delta else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            return c

        def logprobs_of(ev: Event) -> list[dict[int, float]]:
            return [] if ev.logprobs is None else [ev.logprobs]

        if not req.stream:
            text: list[str] = []
            tokens: list[int] = []
            logprobs: list[dict[int, float]] = []

            async def watch() -> None:  # a client gone before the answer: its request stops at the next step
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
                    logprobs += logprobs_of(ev)
                    if ev.finish_reason:
                        break
            finally:
                r.cancelled = True
                watcher.cancel()
            return {"id": rid, "object": obj, "created": created, "model": model_name,
                    "choices": [choice("".join(text), tokens, logprobs, ev.finish_reason, False)], "usage": usage(r)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            try:
                while True:
                    ev = await r.events.get()
                    if ev.error:
                        yield f"data: {json.dumps(APIError(500, ev.error, kind='server_error').body())}\n\n"
                        break
                    body = {"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                            "choices": [choice(ev.text, [ev.token] if ev.token is not None else [], logprobs_of(ev),
                                               ev.finish_reason, True)]}
                    yield f"data: {json.dumps(body)}\n\n"
                    if ev.finish_reason:
                        if include_usage:
                            yield f"data: {json.dumps(dict(body, choices=[], usage=usage(r)))}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:  # a client that went away frees its slot at the next step
                r.cancelled = True

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Any:
        req = await parse(request, CompletionRequest)
        prompt: Any = req.prompt  # one prompt: text or token ids, maybe wrapped in a list of one
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        try:  # off the event loop: a long text does not hold up other requests and /health
            ids = await asyncio.to_thread(encode, tokenizer, prompt)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from None
        return await respond(submit(ids, req, req.max_tokens), req, chat=False, http=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Any:
        req = await parse(request, ChatRequest)
        try:
            ids = await asyncio.to_thread(chat_ids, tokenizer, [{"role": m.role, "content": m.text()} for m in req.messages])
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        return await respond(submit(ids, req, req.max_completion_tokens or req.max_tokens), req, chat=True,
                             http=request)

    @app.get("/v1/models")
    async def models(request: HTTPRequest) -> Any:
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "megacp",
                                            "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health() -> Any:
        if engine.failure is not None:  # the step loop died (a CP rank failed): the server is about to exit
            return JSONResponse({"status": "error", "error": engine.failure}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: HTTPRequest) -> Any:
        authorize(request)
        return engine.status()

    return app
