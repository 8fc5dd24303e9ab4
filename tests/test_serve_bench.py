"""``attnkit bench serve`` against a running server: counts, throughput and latency spreads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from attnkit.bench.serve import LoadConfig, RequestResult, percentile, summarize
from attnkit.cli import main
from tests.serve_support import free_port, running_server, write_decoder

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_equals_torch_quantile(q: float) -> None:
    values = torch.rand(37, dtype=torch.float64).tolist()
    want = float(torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100))
    assert percentile(values, q) == pytest.approx(want, abs=1e-12)
    assert math.isnan(percentile([], 50))


def test_summary_counts_only_the_requests_that_finished() -> None:
    good = RequestResult(
        start=0.0, end=1.0, first=0.25, pieces=[0.25, 0.5, 1.0], generated_tokens=3
    )
    bad = RequestResult(start=0.0, end=0.1, error="RuntimeError: HTTP 500")
    report = summarize([good, bad], wall=2.0)
    assert report["requests"] == 2 and report["failed"] == 1
    assert report["generated_tokens"] == 3 and report["tokens_per_s"] == 1.5
    assert report["requests_per_s"] == 0.5
    assert report["ttft_s"]["p50"] == 0.25
    assert report["itl_s"]["count"] == 2 and report["itl_s"]["mean"] == pytest.approx(0.375)
    assert report["errors"] == ["RuntimeError: HTTP 500"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_distinct_prompts_share_no_prefix(endpoint: str) -> None:
    same = LoadConfig(url="http://x", model="m", prompt="Hi", endpoint=endpoint)
    distinct = LoadConfig(
        url="http://x", model="m", prompt="Hi", endpoint=endpoint, distinct_prompts=True
    )

    def text(body: dict) -> str:
        return body["prompt"] if endpoint == "completions" else body["messages"][0]["content"]

    assert text(same.body(0)) == text(same.body(3)) == "Hi"
    assert [text(distinct.body(i)) for i in (0, 3)] == ["Request 0: Hi", "Request 3: Hi"]


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="concurrency must be an int >= 1, got 0"):
        LoadConfig(url="http://x", model="m", concurrency=0)
    with pytest.raises(ValueError, match="url must start with http"):
        LoadConfig(url="localhost:8000", model="m")


@pytest.mark.slow
def test_bench_serve_loads_a_server_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnkit.serving.app import build_app
    from attnkit.serving.models import ModelRegistry, load_model
    from tests.chat_templates import train_tokenizer

    folder = write_decoder(tmp_path / "tiny", train_tokenizer())
    registry = ModelRegistry([load_model(folder, max_batch=4)])
    out = tmp_path / "load.json"
    with running_server(build_app(registry)) as url:
        code = main(
            [
                "bench",
                "serve",
                "--url",
                url,
                "--model",
                "tiny",
                "--concurrency",
                "3",
                "--requests",
                "6",
                "--max-tokens",
                "5",
                "--ignore-eos",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        printed = capsys.readouterr().out
        assert code == 0, printed
        chat = main(
            [
                "bench",
                "serve",
                "--url",
                url + "/v1",
                "--model",
                "tiny",
                "--endpoint",
                "chat",
                "--requests",
                "2",
                "--max-tokens",
                "3",
                "--ignore-eos",
                "--quiet",
            ]
        )
        assert chat == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 6 and report["failed"] == 0
    assert report["generated_tokens"] == 30  # the server's usage: 5 tokens each, eos ignored
    assert report["ttft_s"]["count"] == 6
    for key in ("ttft_s", "itl_s", "latency_s"):
        spread = report[key]
        assert 0 < spread["p50"] <= spread["p90"] <= spread["p99"]
    assert report["tokens_per_s"] == pytest.approx(30 / report["wall_s"])
    assert "machine" in report and report["config"]["concurrency"] == 3
    assert "time to first token" in printed
    # nothing listens there: every request fails, the run says so and exits with 1
    dead = main(
        [
            "bench",
            "serve",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--model",
            "tiny",
            "--requests",
            "2",
            "--quiet",
        ]
    )
    assert dead == 1
    assert "ConnectError" in capsys.readouterr().out
