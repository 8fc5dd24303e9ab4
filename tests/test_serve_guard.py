"""What stands in front of the routes: the API key (401), the body size limit (413), and
``attnkit serve`` as a process: its options, its models' names, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnkit.cli import main
from tests.serve_support import free_port, running_server, write_decoder, write_encoder

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

KEY = "sk-test-key"
LIMIT = 2000


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_encoder(tmp_path_factory.mktemp("guard") / "enc")


@pytest.fixture(scope="module")
def guarded(encoder: Path) -> Iterator[str]:
    """A server with an API key and a small body limit (an encoder only: no engine needed)."""
    from attnkit.serving.app import build_app
    from attnkit.serving.models import ModelRegistry, load_model

    app = build_app(ModelRegistry([load_model(encoder)]), api_key=KEY, max_request_bytes=LIMIT)
    with running_server(app) as url:
        yield url


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_requests_without_the_key_or_with_another_get_401(guarded: str) -> None:
    body = {"model": "enc", "input": "hello"}
    missing = _error(httpx.post(guarded + "/v1/embeddings", json=body), 401)
    assert "no API key" in missing["message"] and missing["code"] == "invalid_api_key"
    wrong = httpx.post(
        guarded + "/v1/embeddings", json=body, headers={"Authorization": "Bearer sk-other"}
    )
    assert "wrong API key" in _error(wrong, 401)["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded + "/v1", api_key="sk-other", max_retries=0).models.list()
    good = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    assert len(good.embeddings.create(model="enc", input="hello").data) == 1
    assert httpx.get(guarded + "/health").status_code == 200  # health needs no key


def test_bodies_over_the_limit_get_413_before_parsing(guarded: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({"model": "enc", "input": "x" * LIMIT}).encode()
    error = _error(httpx.post(guarded + "/v1/embeddings", content=big, headers=headers), 413)
    assert str(LIMIT) in error["message"]
    # not JSON at all, and larger than the limit: refused for its size, not parsed
    junk = b"{" * (LIMIT + 1)
    assert (
        "larger"
        in _error(httpx.post(guarded + "/v1/embeddings", content=junk, headers=headers), 413)[
            "message"
        ]
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
        for _ in range(LIMIT // 100 + 2):
            yield b" " * 100

    chunked = httpx.post(guarded + "/v1/embeddings", content=chunks(), headers=headers)
    _error(chunked, 413)

    def small() -> Iterator[bytes]:
        yield b'{"model": "enc", '
        yield b'"input": "hi"}'

    assert httpx.post(guarded + "/v1/embeddings", content=small(), headers=headers).is_success


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "nowhere-model"], "model nowhere-model does not exist"),
        (["serve", ".", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["serve", ".", "--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["serve", ".", "--name", "a", "b"], "--name gives 2 names for 1 models"),
        (["serve", ".", "--max-request-bytes", "0"], "--max-request-bytes must be >= 1, got 0"),
    ],
)
def test_bad_options_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_serves_named_models_and_exits_cleanly_on_sigterm(
    tmp_path: Path, encoder: Path
) -> None:
    from tests.chat_templates import train_tokenizer

    decoder = write_decoder(tmp_path / "tiny", train_tokenizer(), max_positions=512)
    port = free_port()
    env = dict(os.environ, ATTNKIT_API_KEY=KEY, PYTHONPATH=os.pathsep.join(sys.path))
    argv = [sys.executable, "-m", "attnkit", "serve", str(decoder), str(encoder)]
    argv += ["--port", str(port), "--name", "chatty", "embed", "--log-level", "warning"]
    process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert {m.id for m in client.models.list().data} == {"chatty", "embed"}
        messages = [{"role": "user", "content": "Hi"}]
        reply = client.chat.completions.create(model="chatty", messages=messages, max_tokens=3)
        assert reply.usage.completion_tokens >= 1
        # a long stream is running when SIGTERM arrives: it ends, and so does the server
        ended: list[str] = []

        def stream() -> None:
            try:
                chunks = client.chat.completions.create(
                    model="chatty",
                    messages=messages,
                    max_tokens=400,
                    stream=True,
                    temperature=1.0,
                )
                ended.extend(c.choices[0].finish_reason or "" for c in chunks if c.choices)
            except Exception as err:  # a cancelled stream may end with a broken connection
                ended.append(type(err).__name__)

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        thread.join(10)
        assert not thread.is_alive() and ended
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_serving_package_needs_only_torch() -> None:
    """``import attnkit.serving`` with the serve extra's packages unimportable."""
    blocked = ["fastapi", "uvicorn", "prometheus_client", "xgrammar", "pydantic", "starlette"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "import attnkit.serving, attnkit.serving.models, attnkit.serving.text\n"
        "print(attnkit.serving.Engine.__name__)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Engine"
