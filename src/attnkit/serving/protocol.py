"""The OpenAI wire format: request bodies (pydantic models), their checks, and error bodies.

Requests are checked here before anything reaches a model: a bad field becomes a
:class:`RequestError` naming it, which the server answers with a 4xx and an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``. Fields the OpenAI clients send that attnkit
does not act on (``user``, ``metadata``, ``store``, ...) are accepted and ignored; fields whose
meaning attnkit cannot honour (``echo``, ``best_of`` > n, ``suffix``) are refused by name.

Needs ``pydantic`` (installed with the ``serve`` extra's ``fastapi``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "MAX_N",
    "ROLES",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "RequestError",
    "error_body",
    "inputs_of",
    "parse_request",
    "prompts_of",
]

#: The most choices one request may ask for (``n``).
MAX_N = 8
#: The most alternatives per token a request may ask for (``top_logprobs``).
MAX_TOP_LOGPROBS = 20
#: Message roles a chat request may use (``developer`` is read as ``system``).
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = (
            message,
            param,
            status,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    # Unknown fields are accepted and ignored: clients send more than any server reads.
    model_config = ConfigDict(extra="allow", strict=False)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchema(_Request):
    name: str = "response"
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class _Sampling(_Request):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # An extension llama.cpp's and vLLM's servers share: generate max_tokens tokens whatever
    # the model says (for benchmarks that must compare the same work).
    ignore_eos: bool = False

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None

    def token_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (the older name)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        """Alternatives per token to return (``None``: no logprobs at all)."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return self.logprobs


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


def _param(loc: tuple[Any, ...]) -> str:
    """A pydantic location as the field path an OpenAI error names (``messages[1].role``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "list[ContentPart]"):
            continue  # the branch of a union pydantic tried, not a field
        elif "[" in str(part) or str(part).startswith(("function-", "literal[")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _validation_error(err: ValidationError) -> RequestError:
    first = err.errors()[0]
    param = _param(tuple(first["loc"]))
    if first["type"] == "missing":
        return RequestError(f"missing required field {param!r}", param=param)
    given = first.get("input")
    shown = json.dumps(given)[:80] if not isinstance(given, dict) else "an object"
    return RequestError(f"invalid value for {param!r}: {first['msg']} (got {shown})", param=param)


def parse_request(raw: bytes, model: type[_Request]) -> Any:
    """Parse a request body into ``model`` and check the fields every endpoint shares.

    Raises:
        RequestError: For a body that is not JSON, not an object, or with a field missing or
            out of range (naming it).
    """
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # bad JSON or encoding, too deep, huge numbers
        raise RequestError(f"the body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(
            f"the body must be a JSON object, got a JSON {type(data).__name__}",
            code="invalid_body",
        )
    try:
        request = model.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None
    if isinstance(request, _Sampling):
        _check_sampling(request)
    if isinstance(request, ChatRequest):
        _check_chat(request)
    if isinstance(request, CompletionRequest):
        _check_completion(request)
    return request


def _check_sampling(request: _Sampling) -> None:
    limit = request.token_limit()  # type: ignore[attr-defined]
    name = "max_tokens"
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        name = "max_completion_tokens"
    if limit is not None and limit < 1:
        raise RequestError(f"{name} must be >= 1, got {limit}", param=name)
    if request.temperature is not None and not request.temperature >= 0:
        raise RequestError(
            f"temperature must be >= 0, got {request.temperature}", param="temperature"
        )
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {request.top_p}", param="top_p")
    if not 1 <= request.n <= MAX_N:
        raise RequestError(f"n must be in [1, {MAX_N}], got {request.n}", param="n")
    for i, stop in enumerate(request.stop_strings()):
        if not stop:
            raise RequestError(f"stop[{i}] is an empty string", param="stop")
    if len(request.stop_strings()) > 4:
        raise RequestError(
            f"stop holds {len(request.stop_strings())} strings; at most 4", param="stop"
        )
    fmt = request.response_format
    if (
        fmt is not None
        and fmt.type == "json_schema"
        and (fmt.json_schema is None or fmt.json_schema.schema_ is None)
    ):
        raise RequestError(
            "response_format json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )


def _check_chat(request: ChatRequest) -> None:
    if not request.messages:
        raise RequestError("messages is empty: give at least one message", param="messages")
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise RequestError(
                f"messages[{i}].role is {message.role!r}; roles are {', '.join(ROLES)}",
                param=f"messages[{i}].role",
            )
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise RequestError(
                        f"messages[{i}].content[{j}] is of type {part.type!r}; only text parts "
                        "are supported",
                        param=f"messages[{i}].content[{j}].type",
                    )
    if request.top_logprobs is not None:
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}",
                param="top_logprobs",
            )
        if not request.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")


def _check_completion(request: CompletionRequest) -> None:
    prompt = request.prompt
    if isinstance(prompt, list) and not prompt:
        raise RequestError("prompt is an empty list", param="prompt")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs}",
            param="logprobs",
        )
    if request.echo:
        raise RequestError("echo is not supported", param="echo")
    if request.suffix:
        raise RequestError("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise RequestError(
            f"best_of ({request.best_of}) must equal n ({request.n})", param="best_of"
        )


def prompts_of(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one per string or token-id list."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def inputs_of(request: EmbeddingRequest) -> list[str]:
    """The texts of an embedding request.

    Raises:
        RequestError: For token-id input (encoders take text here) or an empty list.
    """
    given = request.input
    if isinstance(given, str):
        return [given]
    if not given:
        raise RequestError("input is an empty list", param="input")
    if not all(isinstance(t, str) for t in given):
        raise RequestError("input must be text (a string or a list of strings)", param="input")
    return list(given)  # type: ignore[arg-type]
