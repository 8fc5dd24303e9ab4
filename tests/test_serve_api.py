"""``attnkit serve``'s HTTP side driven by the real ``openai`` client: answers against the model
run directly, streaming, choices, stop strings, logprobs, constrained JSON, embeddings, metrics,
and every refusal's status and OpenAI error body."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.serve_support import running_server, write_decoder, write_encoder

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from attnkit import TransformerLM  # noqa: E402
from attnkit.chat import ChatTokenizer  # noqa: E402
from attnkit.interop.sentence import SentenceEncoder  # noqa: E402

HI = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.chat_templates import train_tokenizer

    root = tmp_path_factory.mktemp("serve")
    return write_decoder(root / "tiny", train_tokenizer()), write_encoder(root / "enc")


@pytest.fixture(scope="module")
def server(folders: tuple[Path, Path]) -> Iterator[tuple[str, Any]]:
    """The server on a free port and its model registry."""
    from attnkit.serving.app import build_app
    from attnkit.serving.models import ModelRegistry, load_model

    decoder, encoder = folders
    registry = ModelRegistry([load_model(decoder, max_batch=8), load_model(encoder)])
    with running_server(build_app(registry)) as url:
        yield url, registry


@pytest.fixture(scope="module")
def client(server: tuple[str, Any]) -> Any:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def direct(folders: tuple[Path, Path]) -> tuple[Any, Any]:
    """The decoder and its chat tokenizer, run without the server."""
    return TransformerLM.from_pretrained(folders[0]), ChatTokenizer.from_folder(folders[0])


def _greedy(direct: tuple[Any, Any], ids: list[int], new: int) -> list[int]:
    """The greedy reply's ids (ending at a stop id, which is dropped) by ``generate``."""
    lm, chat = direct
    out = lm.generate(torch.tensor([ids]), new, eos_token_id=list(chat.stop_ids))[0, len(ids) :]
    reply = out.tolist()
    for i, token in enumerate(reply):
        if token in chat.stop_ids:
            return reply[:i]
    return reply


def test_health_and_models(server: tuple[str, Any], client: Any) -> None:
    assert httpx.get(server[0] + "/health").status_code == 200
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "enc"}
    assert models["tiny"].max_model_len == 128


def test_chat_greedy_equals_generate_and_counts_tokens(client: Any, direct: Any) -> None:
    chat = direct[1]
    ids = chat.encode(HI)
    reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, temperature=0)
    want = _greedy(direct, ids, 10)
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == chat.decode(want)
    assert choice.finish_reason == ("length" if len(want) == 10 else "stop")
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == min(len(want) + 1, 10)  # a stop token counts
    assert reply.usage.total_tokens == len(ids) + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    # max_completion_tokens is the newer name of the same limit
    again = client.chat.completions.create(
        model="tiny", messages=HI, max_completion_tokens=3, temperature=0
    )
    assert again.choices[0].message.content == chat.decode(_greedy(direct, ids, 3))


def test_completions_from_text_and_token_ids(client: Any, direct: Any) -> None:
    chat = direct[1]
    prompt = "Attention weighs every token"
    ids = chat.tokenizer.encode(prompt).ids
    want = chat.decode(_greedy(direct, ids, 7))
    by_text = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=7, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == want
    assert by_text.usage.prompt_tokens == len(ids)
    both = client.completions.create(
        model="tiny", prompt=[prompt, "Today"], max_tokens=4, temperature=0
    )
    assert [c.index for c in both.choices] == [0, 1]
    unlimited = client.completions.create(model="tiny", prompt=prompt, temperature=0)
    assert unlimited.choices[0].text.startswith(want)  # default: what is left of the context
    generated = unlimited.usage.completion_tokens
    assert unlimited.choices[0].finish_reason == (
        "length" if generated == 128 - len(ids) else "stop"
    )
    assert both.choices[0].text == chat.decode(_greedy(direct, ids, 4))


def test_stream_with_usage_equals_the_whole_answer(client: Any, direct: Any) -> None:
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # completions stream the same way, without usage unless asked
    plain = list(
        client.completions.create(
            model="tiny", prompt="Today", max_tokens=5, temperature=0, stream=True
        )
    )
    want = client.completions.create(model="tiny", prompt="Today", max_tokens=5, temperature=0)
    assert "".join(c.choices[0].text for c in plain) == want.choices[0].text
    assert all(c.usage is None for c in plain)


def test_raw_stream_is_server_sent_events(server: tuple[str, Any]) -> None:
    body = {"model": "tiny", "prompt": "Today", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_n_choices_sampled_with_a_seed(client: Any) -> None:
    def ask() -> Any:
        return client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=6, temperature=1.0, n=3, seed=11
        )

    first, second = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1  # seed + index per choice
    assert first.usage.prompt_tokens == second.usage.prompt_tokens  # counted once, not n times
    counts = first.usage.completion_tokens
    assert 3 <= counts <= 18


def test_stop_string_cuts_the_text(client: Any) -> None:
    prompt = "Attention weighs every token"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    want = text[: text.index(stop)]
    cut = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "never seen"]
    )
    assert cut.choices[0].text == want
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_equal_the_model_in_float64(client: Any, direct: Any) -> None:
    chat = direct[1]
    ids = chat.encode(HI)
    reply = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = reply.choices[0].logprobs.content
    generated = _greedy(direct, ids, 5)
    assert len(entries) == len(generated) > 0
    lm64 = TransformerLM.from_pretrained(chat_folder(direct), dtype=torch.float64)
    with torch.no_grad():
        logits = lm64(torch.tensor([ids + generated]))[0, len(ids) - 1 : -1]  # (new, V)
    want = torch.log_softmax(logits, dim=-1)
    for k, (entry, token) in enumerate(zip(entries, generated, strict=True)):
        assert entry.token == chat.tokenizer.decode([token], skip_special_tokens=False)
        assert entry.logprob == pytest.approx(float(want[k, token]), abs=1e-4)
        assert len(entry.top_logprobs) == 3
        top = want[k].topk(3)
        got = [t.logprob for t in entry.top_logprobs]
        torch.testing.assert_close(
            torch.tensor(got, dtype=torch.float64), top.values, atol=1e-4, rtol=0
        )
    plain = client.completions.create(
        model="tiny", prompt="Today", max_tokens=3, temperature=0, logprobs=2
    )
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]


def chat_folder(direct: Any) -> Path:
    """The folder the chat tokenizer was read from."""
    return Path(direct[1].source).parent


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"type": "string", "enum": ["red", "green"]},
    },
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(client: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
            },
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # without the grammar the tiny random model writes no JSON at all
    free = client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, seed=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)
    obj = client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].message.content.startswith("{")


def test_embeddings_equal_the_encoder(client: Any, folders: tuple[Path, Path]) -> None:
    texts = ["The cat sat.", "Attention is all you need", ""]
    want = SentenceEncoder.from_pretrained(folders[1]).encode(texts)
    for fmt in ("float", "base64"):
        reply = client.embeddings.create(model="enc", input=texts, encoding_format=fmt)
        got = torch.tensor([d.embedding for d in reply.data]) if fmt == "float" else None
        if fmt == "base64":
            import base64

            import numpy as np

            got = torch.tensor(
                np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in reply.data])
            )
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    single = client.embeddings.create(model="enc", input="The cat sat.")
    torch.testing.assert_close(torch.tensor(single.data[0].embedding), want[0], atol=1e-5, rtol=0)
    encoder = SentenceEncoder.from_pretrained(folders[1])
    assert single.usage.prompt_tokens == len(encoder.tokenize(["The cat sat."])[0].ids)


LONG = "word " * 300
# (path, raw body, status, param, words the message must hold)
BAD: list[tuple[str, Any, int, str | None, str]] = [
    ("/v1/chat/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/chat/completions", b"[" * 100_000, 400, None, "not valid JSON"),
    ("/v1/completions", b"\xff\xfe{", 400, None, "not valid JSON"),
    ("/v1/chat/completions", {"messages": HI}, 400, "model", "missing required field 'model'"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", "missing required field"),
    ("/v1/chat/completions", {"model": "nope", "messages": HI}, 404, "model", "'nope'"),
    ("/v1/chat/completions", {"model": "enc", "messages": HI}, 400, "model", "not a decoder"),
    ("/v1/embeddings", {"model": "tiny", "input": "x"}, 400, "model", "not an encoder"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context is 128",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "Hi", "max_tokens": 500},
        400,
        "max_tokens",
        "500",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "Hi", "max_tokens": -1},
        400,
        "max_tokens",
        "got -1",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "Hi", "temperature": -0.5},
        400,
        "temperature",
        "got -0.5",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_p": 0}, 400, "top_p", "got 0"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
        "'wizard'",
    ),
    ("/v1/chat/completions", {"model": "tiny", "messages": HI, "n": 9}, 400, "n", "got 9"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages", "empty"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages", "invalid"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": HI, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "got 21",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": HI, "response_format": {"type": "xml"}},
        400,
        "response_format.type",
        "invalid value",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": [99999]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "echo": True}, 400, "echo", "echo"),
    ("/v1/embeddings", {"model": "enc", "input": []}, 400, "input", "empty"),
    ("/v1/embeddings", {"model": "enc", "input": "x", "dimensions": 3}, 400, "dimensions", "32"),
    ("/v1/nowhere", {}, 404, None, "/v1/nowhere"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), BAD)
def test_bad_requests_get_a_4xx_naming_the_problem(
    server: tuple[str, Any], path: str, body: Any, status: int, param: str | None, words: str
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        server[0] + path, content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_sees_the_errors_and_the_server_keeps_serving(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        client.chat.completions.create(model="tiny", messages=HI, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="missing", messages=HI)
    ok = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def _idle(registry: Any, timeout: float) -> float:
    """Seconds until the decoder's engine holds no request and no block (or ``inf``)."""
    engine = registry.models["tiny"].engine
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    return float("inf")


@pytest.mark.slow
def test_clients_that_disconnect_mid_stream_free_their_blocks(
    server: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, registry = server
    # 4 clients x 8 choices x 120 tokens: far more than the batch of 8 finishes in a few steps
    body = {
        "model": "tiny",
        "prompt": "Today",
        "max_tokens": 120,
        "n": 8,
        "ignore_eos": True,
        "stream": True,
    }
    aborted = 'attnkit_requests_total{endpoint="completions",model="tiny",outcome="abort"}'

    def aborts() -> float:
        lines = httpx.get(url + "/metrics").text.splitlines()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(aborted))

    before = aborts()
    clients = [httpx.Client(timeout=10) for _ in range(4)]
    streams = []
    for c in clients:
        s = c.stream("POST", url + "/v1/completions", json=body)
        response = s.__enter__()
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generating
        streams.append((s, response))
    assert registry.models["tiny"].engine.stats().running >= 1
    for s, response in streams:
        response.close()
        s.__exit__(None, None, None)
    for c in clients:
        c.close()
    assert _idle(registry, 3.0) <= 3.0
    assert aborts() == before + 4  # cancelled, not finished
    # a client of a whole (not streamed) answer that gives up is noticed too
    # (each step slowed, as on a bigger model, so the answer outlasts the client's patience
    # whatever the machine's speed)
    engine = registry.models["tiny"].engine
    step = engine.step

    def slow_step() -> Any:
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {"model": "tiny", "prompt": "Today", "max_tokens": 120, "n": 8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    # polled every DISCONNECT_POLL_S; the bound leaves room for a loaded machine
    assert _idle(registry, 10.0) <= 10.0
    assert aborts() == before + 5


def test_metrics_count_requests_tokens_and_engine_state(
    server: tuple[str, Any], client: Any
) -> None:
    client.chat.completions.create(model="tiny", messages=HI, max_tokens=3, temperature=0)
    httpx.post(server[0] + "/v1/completions", content=b"{")
    text = httpx.get(server[0] + "/metrics").text

    def value(line_start: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(line_start)]
        assert lines, line_start
        return float(lines[0].rsplit(" ", 1)[1])

    assert value('attnkit_requests_total{endpoint="chat",model="tiny",outcome="ok"}') >= 1
    assert (
        value('attnkit_requests_total{endpoint="completions",model="",outcome="client_error"}') >= 1
    )
    assert value('attnkit_generated_tokens_total{model="tiny"}') >= 3
    assert value('attnkit_prompt_tokens_total{model="tiny"}') >= 1
    assert value('attnkit_time_to_first_token_seconds_count{model="tiny"}') >= 1
    assert value('attnkit_time_per_output_token_seconds_count{model="tiny"}') >= 1
    for gauge in ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_free"):
        assert value(f'attnkit_{gauge}{{model="tiny"}}') >= 0
    assert "attnkit_prefix_cache_hits" in text


def test_a_repeated_prompt_reports_its_cached_tokens(client: Any, server: tuple[str, Any]) -> None:
    system = {"role": "system", "content": "Attention weighs every token by its key. " * 4}
    messages = [system, {"role": "user", "content": "Explain attention."}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0
    )
    second = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0
    )
    block = server[1].models["tiny"].engine.block_size
    prompt = second.usage.prompt_tokens
    assert prompt >= 2 * block
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert block <= cached < prompt and cached % block == 0
    assert first.choices[0].message.content == second.choices[0].message.content
