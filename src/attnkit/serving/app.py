"""The OpenAI-compatible HTTP server: a FastAPI application over the loaded models' engines.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/embeddings`` and ``GET /metrics``. Each completion request
becomes one engine request per choice (``n``); the engine's thread hands each token to the event
loop (``call_soon_threadsafe``), where it is detokenized, cut at stop strings and sent, as one
JSON body or as server-sent events (``stream``). A client that goes away cancels its engine
requests, which frees their KV blocks.

Every refusal is a 4xx with the OpenAI error body ``{"error": {"message", "type", "param",
"code"}}``: bodies over ``max_request_bytes`` are refused (413) before they are read in full,
requests without the API key (when one is set) get 401, and malformed or out-of-range requests
400 (404 for an unknown model).

Needs the ``serve`` extra (``fastapi``, ``uvicorn``, ``prometheus-client``; ``xgrammar`` for
``response_format``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from attnkit.serving import SamplingParams, protocol
from attnkit.serving.metrics import CONTENT_TYPE, ServerMetrics
from attnkit.serving.models import DecoderModel, EncoderModel, ModelRegistry
from attnkit.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    RequestError,
    error_body,
    parse_request,
)
from attnkit.serving.text import TextStream

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "build_app"]

logger = logging.getLogger("attnkit.serve")

#: Bodies larger than this are refused (413) unless the server is told otherwise.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.5


# --------------------------------------------------------------------------------------------
# the guard in front of the routes: body size and API key


def _json_reply(status: int, body: dict[str, Any]) -> tuple[int, bytes]:
    return status, json.dumps(body).encode()


class _Guard:
    """ASGI middleware: 413 for a body over ``max_bytes`` (by its Content-Length, or while it
    arrives), 401 for ``/v1`` requests without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: Any, *, max_bytes: int, api_key: str | None) -> None:
        self.app, self.max_bytes, self.api_key = app, max_bytes, api_key

    async def _refuse(self, send: Any, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.api_key}".encode()
            if not hmac.compare_digest(given.encode("latin-1"), expected):
                what = "no API key" if not given else "a wrong API key"
                unauthorized = error_body(
                    f"the request has {what}; send 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await self._refuse(send, 401, unauthorized)
                return
        too_big = error_body(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, 413, too_big)
            return
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            # A chunked body: read it here, counting, before the route parses anything.
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    await self._refuse(send, 413, too_big)
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> Any:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------------
# one choice of a completion: tokens -> text, logprobs, counts


@dataclass
class _Choice:
    """The state of one engine request (one choice)."""

    index: int
    request_id: str
    text: TextStream
    stop_ids: frozenset[int]
    want_logprobs: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    last_token_at: float | None = None

    def feed(self, event: Any) -> tuple[str, list[dict[str, Any]]]:
        """Take one token event; return the new settled text and the new logprob entries."""
        self.prompt_tokens = event.prompt_tokens
        self.completion_tokens = event.completion_tokens
        self.cached_tokens = event.cached_tokens
        piece, entries = "", []
        # An abort event carries no token of the reply.
        if event.finish_reason != "abort" and event.token_id >= 0:
            is_stop = event.finish_reason == "stop" and event.token_id in self.stop_ids
            if not is_stop:
                piece = self.text.add(event.token_id)
                if self.want_logprobs and event.logprob is not None:
                    entries.append(self._entry(event))
        if self.text.stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            piece += self.text.finish()
        self.logprobs += entries
        return piece, entries

    def _entry(self, event: Any) -> dict[str, Any]:
        token = self.text.token_text(event.token_id)
        top = []
        for i, lp in event.top_logprobs or ():
            text = self.text.token_text(i)
            top.append({"token": text, "logprob": float(lp), "bytes": list(text.encode())})
        return {
            "token": token,
            "logprob": float(event.logprob),
            "bytes": list(token.encode()),
            "top_logprobs": top,
        }


@dataclass
class _Reply:
    """One generation request's reply in the making: what the whole and the streamed answer
    both read."""

    http: Request
    model: DecoderModel
    request: Any
    choices: list[_Choice]
    queue: asyncio.Queue[Any]
    start: float
    rid: str
    created: int
    chat: bool

    @property
    def endpoint(self) -> str:
        """The metrics' endpoint label."""
        return "chat" if self.chat else "completions"

    def body(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A response body (or a chunk's) of object type ``obj`` with these ``choices``."""
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
        }


def _completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """Logprob entries in the legacy completions layout."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


# --------------------------------------------------------------------------------------------
# the application


class _Server:
    """The routes' shared state: models, metrics, limits."""

    def __init__(self, registry: ModelRegistry, metrics: ServerMetrics) -> None:
        self.registry = registry
        self.metrics = metrics

    # ---- prompts ---------------------------------------------------------------------------

    @staticmethod
    def _chat_prompt(model: DecoderModel, request: ChatRequest) -> list[int]:
        from attnkit.chat import ChatTemplateError

        if model.chat is None:
            raise RequestError(
                f"the model {model.name!r} has no chat template; use /v1/completions",
                param="model",
                code="no_chat_template",
            )
        messages = []
        for m in request.messages:
            message: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        try:
            return list(model.chat.encode(messages, tools=request.tools))
        except (ChatTemplateError, TypeError) as err:
            raise RequestError(str(err), param="messages", code="chat_template_error") from None

    @staticmethod
    def _text_prompt(model: DecoderModel, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(model.tokenizer.encode(prompt).ids)
        bad = [i for i in prompt if not 0 <= i < model.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {model.vocab_size})",
                param="prompt",
            )
        return list(prompt)

    @staticmethod
    def _limit(model: DecoderModel, prompt: list[int], max_tokens: int | None, param: str) -> int:
        context = model.max_context
        if not prompt:
            raise RequestError("the prompt gives no tokens", param=param)
        if len(prompt) >= context:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; the model's context is {context} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:  # what is left of the context, and of the whole KV pool
            room = context
            if model.kv_capacity is not None:
                room = min(room, model.kv_capacity)
            if room <= len(prompt):
                raise RequestError(
                    f"the prompt has {len(prompt)} tokens; the KV cache holds {room}",
                    param=param,
                    code="context_length_exceeded",
                )
            return room - len(prompt)
        if len(prompt) + max_tokens > context:
            raise RequestError(
                f"the prompt's {len(prompt)} tokens and max_tokens {max_tokens} exceed the "
                f"model's context of {context} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    # ---- engine requests -------------------------------------------------------------------

    def _processor(self, model: DecoderModel, request: Any) -> Callable[[], Any] | None:
        fmt = request.response_format
        if fmt is None or fmt.type == "text":
            return None
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
        cache = model.grammar_cache()
        try:
            cache.compile(schema)  # a bad schema is refused before anything runs
        except ValueError as err:
            raise RequestError(str(err), param="response_format") from None
        return lambda: cache.processor(schema)

    def _submit(
        self,
        model: DecoderModel,
        prompts: list[list[int]],
        request: Any,
        max_tokens: list[int],
        on_event: Callable[[Any], None],
    ) -> list[_Choice]:
        """Add ``request.n`` engine requests per prompt; return the choices in order."""
        processor = self._processor(model, request)
        want = request.wanted_logprobs()
        choices: list[_Choice] = []
        try:
            for p, prompt in enumerate(prompts):
                for j in range(request.n):
                    index = p * request.n + j
                    try:
                        params = SamplingParams(
                            max_tokens=max_tokens[p],
                            temperature=1.0 if request.temperature is None else request.temperature,
                            top_p=1.0 if request.top_p is None else request.top_p,
                            seed=None if request.seed is None else request.seed + index,
                            stop_token_ids=model.stop_ids,
                            logprobs=want,
                            ignore_eos=request.ignore_eos,
                        )
                    except ValueError as err:
                        raise RequestError(str(err)) from None
                    rid = f"{uuid.uuid4().hex}-{index}"
                    choice = _Choice(
                        index,
                        rid,
                        TextStream(model.tokenizer, stop=request.stop_strings()),
                        frozenset(model.stop_ids),
                        want is not None,
                    )
                    choices.append(choice)
                    try:
                        model.engine.add_request(
                            prompt,
                            params,
                            request_id=rid,
                            logits_processor=None if processor is None else processor(),
                            on_event=on_event,
                        )
                    except ValueError as err:
                        choices.pop()
                        raise RequestError(str(err)) from None
        except BaseException:
            for choice in choices:
                model.engine.abort(choice.request_id)
            raise
        return choices

    async def _events(
        self, reply: _Reply
    ) -> AsyncIterator[tuple[_Choice, str, list[dict[str, Any]]]]:
        """``(choice, new text, new logprob entries)`` until every choice has finished."""
        model, choices, queue, start = reply.model, reply.choices, reply.queue, reply.start
        by_id = {c.request_id: c for c in choices}
        while any(c.finish_reason is None for c in choices):
            event = await queue.get()
            choice = by_id.get(event.request_id)
            if choice is None or choice.finish_reason is not None:
                continue
            now = time.perf_counter()
            if event.finish_reason != "abort":
                if choice.last_token_at is None:
                    self.metrics.ttft.labels(model.name).observe(now - start)
                else:
                    gap = now - choice.last_token_at
                    self.metrics.token_latency.labels(model.name).observe(gap)
                choice.last_token_at = now
            piece, entries = choice.feed(event)
            if choice.finish_reason is not None:
                if event.finish_reason is None:  # cut at a stop string: the engine may stop
                    model.engine.abort(choice.request_id)
                self.metrics.tokens(
                    model.name,
                    prompt=choice.prompt_tokens,
                    cached=choice.cached_tokens,
                    generated=choice.completion_tokens,
                )
            yield choice, piece, entries

    @staticmethod
    def _usage(choices: list[_Choice], n: int) -> dict[str, Any]:
        firsts = choices[::n]  # the prompt is counted once per prompt, not per choice
        prompt = sum(c.prompt_tokens for c in firsts)
        completion = sum(c.completion_tokens for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
        }

    # ---- the two generation endpoints ------------------------------------------------------

    async def generate(self, http: Request, request: Any, *, chat: bool) -> Response:
        model: DecoderModel = self.registry.get(request.model, DecoderModel)
        if chat:
            prompts = [self._chat_prompt(model, request)]
            param = "messages"
        else:
            prompts = [self._text_prompt(model, p) for p in protocol.prompts_of(request)]
            param = "prompt"
        limits = [self._limit(model, p, request.token_limit(), param) for p in prompts]
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def on_event(event: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(queue.put_nowait, event)

        start = time.perf_counter()
        choices = self._submit(model, prompts, request, limits, on_event)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        reply = _Reply(http, model, request, choices, queue, start, rid, created, chat)
        if request.stream:
            return StreamingResponse(self._stream(reply), media_type="text/event-stream")
        return await self._whole(reply)

    def _abort_unfinished(self, model: DecoderModel, choices: list[_Choice]) -> int:
        unfinished = [c for c in choices if c.finish_reason is None]
        for choice in unfinished:
            model.engine.abort(choice.request_id)
        return len(unfinished)

    async def _whole(self, reply: _Reply) -> Response:
        http, model, choices, chat = reply.http, reply.model, reply.choices, reply.chat
        texts = {c.index: "" for c in choices}

        async def collect() -> None:
            async for choice, piece, _ in self._events(reply):
                texts[choice.index] += piece

        async def watch() -> None:  # returns once the client is gone
            while not await http.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        collector, watcher = asyncio.create_task(collect()), asyncio.create_task(watch())
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
            self._abort_unfinished(model, choices)
        if not collector.done() or collector.cancelled():
            self.metrics.request(model.name, reply.endpoint, "abort")
            return Response(status_code=499)
        collector.result()  # re-raise what went wrong while collecting
        self.metrics.request(model.name, reply.endpoint, "ok")
        out_choices = []
        for c in choices:
            if chat:
                out_choices.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": texts[c.index]},
                        "logprobs": {"content": c.logprobs} if c.want_logprobs else None,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out_choices.append(
                    {
                        "index": c.index,
                        "text": texts[c.index],
                        "logprobs": (
                            _completion_logprobs(c.logprobs, 0) if c.want_logprobs else None
                        ),
                        "finish_reason": c.finish_reason,
                    }
                )
        body = reply.body("chat.completion" if chat else "text_completion", out_choices)
        body["usage"] = self._usage(choices, reply.request.n)
        return JSONResponse(body)

    async def _stream(self, reply: _Reply) -> AsyncIterator[bytes]:
        model, request, choices, chat = reply.model, reply.request, reply.choices, reply.chat
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets = {c.index: 0 for c in choices}

        def chunk(choices_json: list[dict[str, Any]], usage: Any = None) -> bytes:
            body = reply.body(obj, choices_json)
            if include_usage:
                body["usage"] = usage
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        finished = False
        try:
            if chat:
                yield chunk(
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for c in choices
                    ]
                )
            async for choice, piece, entries in self._events(reply):
                if not piece and not entries and choice.finish_reason is None:
                    continue
                if chat:
                    delta = {"content": piece} if piece or entries else {}
                    lp = {"content": entries} if choice.want_logprobs and entries else None
                    item = {"index": choice.index, "delta": delta, "logprobs": lp}
                else:
                    lp = None
                    if choice.want_logprobs and entries:
                        lp = _completion_logprobs(entries, offsets[choice.index])
                    item = {"index": choice.index, "text": piece, "logprobs": lp}
                offsets[choice.index] += len(piece)
                item["finish_reason"] = choice.finish_reason
                yield chunk([item])
            if include_usage:
                yield chunk([], self._usage(choices, request.n))
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            # Reached on completion, and when the client goes away (the response task is
            # cancelled): unfinished engine requests are aborted, which frees their blocks.
            self._abort_unfinished(model, choices)
            self.metrics.request(model.name, reply.endpoint, "ok" if finished else "abort")

    # ---- embeddings ------------------------------------------------------------------------

    async def embeddings(self, request: EmbeddingRequest) -> Response:
        model: EncoderModel = self.registry.get(request.model, EncoderModel)
        texts = protocol.inputs_of(request)
        dim = model.encoder.dim
        if request.dimensions is not None and request.dimensions != dim:
            raise RequestError(
                f"dimensions must be {dim} for {model.name!r} (it does not shorten its "
                f"embeddings), got {request.dimensions}",
                param="dimensions",
            )
        tokens = model.count_tokens(texts)
        vectors = await asyncio.to_thread(model.embed, texts)
        data = []
        for i, row in enumerate(vectors.float().cpu()):
            if request.encoding_format == "base64":
                value: Any = base64.b64encode(row.numpy().astype("<f4").tobytes()).decode()
            else:
                value = row.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        self.metrics.request(model.name, "embeddings", "ok")
        self.metrics.prompt_tokens.labels(model.name).inc(tokens)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


def build_app(
    registry: ModelRegistry,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    stop_timeout: float = 5.0,
) -> Any:
    """The ASGI application serving ``registry``'s models.

    The decoders' engines are started when the application starts and stopped (running requests
    cancelled) when it shuts down.

    Args:
        registry: The loaded models.
        api_key: When given, ``/v1`` requests need ``Authorization: Bearer <api_key>``.
        max_request_bytes: Larger bodies are refused with 413 before they are parsed.
        stop_timeout: Seconds to wait for each engine's thread at shutdown.

    Raises:
        ValueError: If ``max_request_bytes`` is not positive or ``api_key`` is empty.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty; leave it out to serve without one")
    metrics = ServerMetrics(lambda: [(m.name, m.engine) for m in registry.decoders()])
    server = _Server(registry, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for model in registry.decoders():
            model.engine.start()
        try:
            yield
        finally:
            for model in registry.decoders():
                model.engine.stop(cancel=True, timeout=stop_timeout)

    app = FastAPI(title="attnkit serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    def reply_error(err: RequestError, endpoint: str, model: str = "") -> JSONResponse:
        metrics.request(model, endpoint, "client_error")
        return JSONResponse(err.body(), status_code=err.status)

    async def handle(
        http: Request, kind: type, endpoint: str, run: Callable[[Any], Awaitable[Response]]
    ) -> Response:
        try:
            request = parse_request(await http.body(), kind)
        except RequestError as err:
            return reply_error(err, endpoint)
        except ClientDisconnect:  # gone before its body arrived: nothing to answer
            metrics.request("", endpoint, "abort")
            return Response(status_code=499)
        try:
            return await run(request)
        except RequestError as err:
            return reply_error(err, endpoint, request.model)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = []
        for model in registry.models.values():
            entry: dict[str, Any] = {
                "id": model.name,
                "object": "model",
                "created": model.created,
                "owned_by": "attnkit",
            }
            if isinstance(model, DecoderModel):
                entry["max_model_len"] = model.max_context
            data.append(entry)
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await handle(
            http, ChatRequest, "chat", lambda r: server.generate(http, r, chat=True)
        )

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await handle(
            http, CompletionRequest, "completions", lambda r: server.generate(http, r, chat=False)
        )

    @app.post("/v1/embeddings")
    async def embeddings(http: Request) -> Response:
        return await handle(http, EmbeddingRequest, "embeddings", server.embeddings)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"{http.method} {http.url.path}: {err.detail}"
        code = "not_found" if err.status_code == 404 else None
        return JSONResponse(error_body(message, code=code), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(http: Request, err: Exception) -> JSONResponse:
        logger.exception("%s %s failed", http.method, http.url.path)
        metrics.request("", http.url.path, "error")
        body = error_body(f"internal error: {type(err).__name__}: {err}", type="server_error")
        return JSONResponse(body, status_code=500)

    return _Guard(app, max_bytes=max_request_bytes, api_key=api_key)
