"""The HTTP side (FastAPI): OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (plain JSON or
server-sent events, written by :class:`~megacp.serve.responses.ResponseWriter`; with ``logprobs``, in
OpenAI's shapes), ``/v1/models``, ``/health`` (503 once the engine's step loop has died) and
``/metrics`` (the engine's counters as JSON). :class:`Handlers` holds the routes' handlers;
:func:`build_app` wires them into the app."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from megacp.generate.outputs import chat_ids, with_eos
from megacp.generate.requests import ModelLimits, check_prompt, check_text_tokens, encode, longest_token
from megacp.serve.engine import Draining, Engine, QueueFull, Request
from megacp.serve.protocol import MAX_BODY_BYTES, APIError, ChatRequest, CompletionRequest, SamplingFields
from megacp.serve.responses import ResponseWriter

Body = TypeVar("Body", bound=SamplingFields)


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (``null``, an array, a string, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, dict) else "a number"


class Handlers:
    """The handlers of the app's routes over ``engine``.

    Request bodies over ``max_body_bytes`` are refused with 413 as they arrive (by their
    ``Content-Length``, else once that many bytes came); a text prompt (or conversation) with more
    characters than the context's tokens can hold — each token covers at most the tokenizer's
    longest token's characters (:func:`~megacp.generate.requests.check_text_tokens`) — is refused
    before it is tokenised, and tokenisation runs off the event loop. With an ``api_key`` every
    route but ``/health`` needs the key.

    Args:
        engine: the server's engine (its tokenizer tokenises the prompts).
        cfg: the model's limits (vocabulary, context, stop tokens).
        model_name: the model's name in the API.
        max_model_len: tokens per request, prompt and output.
        api_key: the key requests must bear (``None``: none).
        max_body_bytes: the largest request body.
    """

    def __init__(self, engine: Engine, cfg: ModelLimits, *, model_name: str, max_model_len: int,
                 api_key: str | None, max_body_bytes: int) -> None:
        self.engine, self.cfg, self.tokenizer = engine, cfg, engine.tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.longest_token = 0 if self.tokenizer is None else longest_token(self.tokenizer)
        """Characters of the tokenizer's longest token (0: no tokenizer, which takes no text)."""

    # ------------------------------------------------------------------ a request's way in
    def authorize(self, request: HTTPRequest) -> None:
        """Raise 401 unless the request bears the API key (when there is one)."""
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise APIError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")

    async def body(self, request: HTTPRequest) -> bytearray:
        """The request's body, refused with 413 past ``max_body_bytes`` (its declared length first)."""
        too_big = APIError(413, f"the request body is larger than {self.max_body_bytes} bytes (--max-request-bytes)",
                           code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        data = bytearray()
        async for chunk in request.stream():
            if len(data) + len(chunk) > self.max_body_bytes:
                raise too_big
            data += chunk
        return data

    async def parse(self, request: HTTPRequest, model: type[Body]) -> Body:
        """The authorised request's body as ``model``, validated (400 naming the field, 404 for
        another model)."""
        self.authorize(request)
        raw = await self.body(request)
        try:  # parsed and validated in one pass (pydantic's JSON parser: a 32K-token prompt in ~1 ms)
            req = model.model_validate_json(raw)
        except ValidationError as err:
            e = err.errors()[0]
            if e["type"] == "json_invalid":
                raise APIError(400, f"the request body is not valid JSON: {e['msg']}") from None
            if e["type"] == "model_type" and not e["loc"]:  # valid JSON, but not an object
                raise APIError(400, f"the request body must be a JSON object, got {json_kind(e['input'])}") from None
            where = ".".join(str(x) for x in e["loc"]) or None
            msg = f"unsupported field {where}" if e["type"] == "extra_forbidden" else f"{where}: {e['msg']}"
            raise APIError(400, msg, param=where) from None
        if req.model != self.model_name:
            raise APIError(404, f"the model `{req.model}` does not exist", param="model", code="model_not_found")
        req.check_supported()
        return req

    def check_text_fits(self, chars: int, what: str, param: str) -> None:
        """Refuse (400) a text of ``chars`` characters too long for the context, before it is tokenised."""
        try:
            check_text_tokens(chars, self.longest_token, self.max_model_len, what)
        except ValueError as err:
            raise APIError(400, str(err), param=param, code="context_length_exceeded") from None

    def submit(self, prompt: list[int], req: SamplingFields, max_tokens: int | None) -> Request:
        """Check ``prompt`` against the model and the context, queue it with ``req``'s sampling
        settings (``max_tokens``: what the request asks, default what the context leaves) and
        return the engine's request (429 when the queue is full, 503 while draining)."""
        cfg, max_model_len = self.cfg, self.max_model_len
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
            self.engine.submit(r)
        except QueueFull as err:
            raise APIError(429, str(err), kind="rate_limit_error", code="queue_full") from None
        except Draining as err:
            raise APIError(503, str(err), kind="server_error", code="shutting_down") from None
        except ValueError as err:
            raise APIError(400, str(err), param="stop") from None
        return r

    def writer(self, r: Request, req: SamplingFields, chat: bool) -> ResponseWriter:
        """The response writer of ``r``."""
        return ResponseWriter(r, req, chat=chat, tokenizer=self.tokenizer, model_name=self.model_name)

    # ------------------------------------------------------------------ the routes
    async def completions(self, request: HTTPRequest) -> Any:
        """``POST /v1/completions``: one prompt, text or token ids (maybe in a list of one)."""
        req = await self.parse(request, CompletionRequest)
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_text_fits(len(prompt), "prompt", "prompt")
        try:  # off the event loop: a long text does not hold up other requests and /health
            ids = await asyncio.to_thread(encode, self.tokenizer, prompt)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from None
        return await self.writer(self.submit(ids, req, req.max_tokens), req, chat=False).respond(request)

    async def chat_completions(self, request: HTTPRequest) -> Any:
        """``POST /v1/chat/completions``: the conversation through the tokenizer's chat template."""
        req = await self.parse(request, ChatRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        self.check_text_fits(sum(len(m["content"]) for m in messages), "conversation", "messages")
        try:
            ids = await asyncio.to_thread(chat_ids, self.tokenizer, messages)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        r = self.submit(ids, req, req.max_completion_tokens or req.max_tokens)
        return await self.writer(r, req, chat=True).respond(request)

    async def models(self, request: HTTPRequest) -> Any:
        """``GET /v1/models``: the one model, with its ``max_model_len``."""
        self.authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "megacp", "max_model_len": self.max_model_len}]}

    async def health(self) -> Any:
        """``GET /health``: ok, or 503 with the reason once the step loop died (a CP rank failed:
        the server is about to exit)."""
        if self.engine.failure is not None:
            return JSONResponse({"status": "error", "error": self.engine.failure}, status_code=503)
        return {"status": "ok"}

    async def metrics(self, request: HTTPRequest) -> Any:
        """``GET /metrics``: the engine's counters (:meth:`Engine.status`)."""
        self.authorize(request)
        return self.engine.status()


async def api_error(_: HTTPRequest, err: Exception) -> JSONResponse:
    """An :class:`APIError` as OpenAI's error body with its status."""
    assert isinstance(err, APIError)
    return JSONResponse(err.body(), status_code=err.status)


def build_app(engine: Engine, cfg: ModelLimits, *, model_name: str, max_model_len: int,
              api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app of :class:`Handlers` over ``engine`` (started and drained with the app's
    lifespan); with an ``api_key`` the interactive docs and the OpenAPI schema are off."""
    handlers = Handlers(engine, cfg, model_name=model_name, max_model_len=max_model_len, api_key=api_key,
                        max_body_bytes=max_body_bytes)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.drain)

    closed = dict(docs_url=None, redoc_url=None, openapi_url=None) if api_key is not None else {}
    app = FastAPI(title="megacp", lifespan=lifespan, **closed)
    app.add_exception_handler(APIError, api_error)
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handlers.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    return app
