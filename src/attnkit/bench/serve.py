"""A load generator for any OpenAI-compatible server: throughput, time to first token and
inter-token latency under concurrent clients.

``attnkit bench serve --url URL --model M --concurrency N --requests R`` (or
``python -m attnkit.bench.serve``) sends ``R`` streamed completion requests, at most ``N`` at a
time, to ``URL`` (attnkit's own ``attnkit serve``, llama.cpp's ``llama-server``, vLLM, ...) over
HTTP only, and reports:

* throughput: finished requests per second and generated tokens per second over the whole run;
* time to first token (TTFT): from sending a request to its first streamed text;
* inter-token latency (ITL): the gaps between consecutive streamed pieces of a reply;
* end-to-end latency per request;

each as p50/p90/p99 (and the mean). Generated tokens are the server's own count (``usage`` of the
last chunk, asked for with ``stream_options.include_usage``), or the number of streamed pieces
where a server does not send it. ``--ignore-eos`` asks servers that understand it (attnkit,
llama.cpp, vLLM) to generate exactly ``--max-tokens`` tokens, so that servers are compared on
the same work. A run against one server at ``--concurrency 1`` and then at ``N`` gives the gain
of batching on that machine.

Needs ``httpx`` and ``tqdm``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_PROMPT",
    "LoadConfig",
    "RequestResult",
    "add_arguments",
    "format_report",
    "percentile",
    "run_load",
    "summarize",
]

DEFAULT_PROMPT = "Explain in a few sentences how attention lets a model read a long text."
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class LoadConfig:
    """What to send, how often and where.

    Attributes:
        url: The server's base URL (``http://127.0.0.1:8000``; a trailing ``/v1`` is accepted).
        model: The ``model`` every request names.
        concurrency: Most requests in flight at once.
        requests: Requests to send in all.
        max_tokens: ``max_tokens`` of each request.
        prompt: The prompt (a user message for ``chat``).
        distinct_prompts: Start request ``i``'s prompt with ``"Request i: "``, so that no two
            requests share a prefix and no server's prefix cache shortens their prefill.
        endpoint: ``"completions"`` or ``"chat"``.
        temperature: Sampling temperature (0: greedy).
        ignore_eos: Ask the server to ignore end-of-sequence tokens (a server extension).
        api_key: Sent as ``Authorization: Bearer``.
        timeout: Seconds a request may take.

    Raises:
        ValueError: For counts below 1, an unknown endpoint or a negative temperature.
    """

    url: str
    model: str
    concurrency: int = 1
    requests: int = 16
    max_tokens: int = 64
    prompt: str = DEFAULT_PROMPT
    distinct_prompts: bool = False
    endpoint: str = "completions"
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in ("concurrency", "requests", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")

    @property
    def base(self) -> str:
        """The URL up to and including ``/v1``."""
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    def body(self, index: int = 0) -> dict[str, Any]:
        """The JSON body of request ``index``."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        prompt = f"Request {index}: {self.prompt}" if self.distinct_prompts else self.prompt
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


@dataclass
class RequestResult:
    """One request's timings (seconds, from the run's start) and counts."""

    start: float
    end: float = math.nan
    first: float | None = None
    pieces: list[float] = field(default_factory=list)  # arrival of each streamed piece of text
    generated_tokens: int = 0
    prompt_tokens: int | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks (numpy's
    default); ``nan`` for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _spread(values: Sequence[float]) -> dict[str, float | int]:
    return {
        "count": len(values),
        "mean": sum(values) / len(values) if values else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def _piece(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk carries (completions' ``text`` or chat's ``delta.content``)."""
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            text += (choice.get("delta") or {}).get("content") or ""
    return text


async def _one(client: Any, config: LoadConfig, t0: float, index: int) -> RequestResult:
    path = "/chat/completions" if config.endpoint == "chat" else "/completions"
    result = RequestResult(start=time.perf_counter() - t0)
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", config.base + path, json=config.body(index)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                piece = _piece(chunk)
                if piece:
                    now = time.perf_counter() - t0
                    result.first = now if result.first is None else result.first
                    result.pieces.append(now)
                    result.text += piece
    except Exception as err:  # a failed request is counted, not fatal to the run
        result.error = f"{type(err).__name__}: {err}"
    result.end = time.perf_counter() - t0
    if usage is not None and usage.get("completion_tokens") is not None:
        result.generated_tokens = int(usage["completion_tokens"])
        result.prompt_tokens = usage.get("prompt_tokens")
    else:
        result.generated_tokens = len(result.pieces)
    return result


async def _run(config: LoadConfig, progress: bool) -> tuple[list[RequestResult], float]:
    try:
        import httpx
        from tqdm import tqdm
    except ImportError as err:
        raise ImportError(
            f"attnkit bench serve needs httpx and tqdm: pip install {err.name}"
        ) from err

    headers = {} if config.api_key is None else {"Authorization": f"Bearer {config.api_key}"}
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=0)
    gate = asyncio.Semaphore(config.concurrency)
    bar = tqdm(total=config.requests, desc="requests", unit="req", disable=not progress)
    async with httpx.AsyncClient(headers=headers, timeout=config.timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def limited(index: int) -> RequestResult:
            async with gate:
                result = await _one(client, config, t0, index)
            bar.update(1)
            return result

        results = await asyncio.gather(*(limited(i) for i in range(config.requests)))
        wall = time.perf_counter() - t0
    bar.close()
    return list(results), wall


def run_load(config: LoadConfig, *, progress: bool = True) -> dict[str, Any]:
    """Send the requests and return the report (see :func:`summarize`)."""
    results, wall = asyncio.run(_run(config, progress))
    return summarize(results, wall, config)


def summarize(
    results: Sequence[RequestResult], wall: float, config: LoadConfig | None = None
) -> dict[str, Any]:
    """The report of a run: counts, throughput and the spread of each latency.

    Returns:
        ``{"config", "requests", "failed", "errors", "wall_s", "requests_per_s",
        "generated_tokens", "tokens_per_s", "ttft_s", "itl_s", "latency_s"}``; each ``*_s``
        spread is ``{"count", "mean", "p50", "p90", "p99"}`` in seconds.
    """
    ok = [r for r in results if r.ok]
    tokens = sum(r.generated_tokens for r in ok)
    gaps = [b - a for r in ok for a, b in zip(r.pieces, r.pieces[1:], strict=False)]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    return {
        "config": None if config is None else asdict(config) | {"api_key": None},
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error is not None})[:5],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else math.nan,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else math.nan,
        "ttft_s": _spread(ttft),
        "itl_s": _spread(gaps),
        "latency_s": _spread([r.end - r.start for r in ok]),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a few aligned lines (latencies in milliseconds)."""
    config = report.get("config") or {}
    lines = []
    if config:
        lines.append(
            f"{config['url']}  model {config['model']}  {config['endpoint']}  "
            f"concurrency {config['concurrency']}  max_tokens {config['max_tokens']}"
        )
    lines.append(
        f"requests {report['requests']} ({report['failed']} failed) in {report['wall_s']:.2f} s: "
        f"{report['requests_per_s']:.2f} req/s, {report['generated_tokens']} tokens, "
        f"{report['tokens_per_s']:.1f} tokens/s"
    )
    lines.append(f"{'':<22}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}")
    for key, name in (
        ("ttft_s", "time to first token"),
        ("itl_s", "inter-token latency"),
        ("latency_s", "request latency"),
    ):
        spread = report[key]
        cells = "".join(f"{spread[q] * 1e3:>10.1f}" for q in ("p50", "p90", "p99", "mean"))
        lines.append(f"{name + ' (ms)':<22}{cells}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``attnkit bench serve`` (and ``python -m attnkit.bench.serve``)."""
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model name requests give")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (1)")
    parser.add_argument("--requests", type=int, default=16, help="requests in all (16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (64)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt of every request")
    parser.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="start each prompt with its request's number (no shared prefix to cache)",
    )
    parser.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="completions",
        help="/v1/completions (default) or /v1/chat/completions",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to generate exactly --max-tokens tokens",
    )
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    parser.add_argument(
        "--json",
        "--out",
        dest="out",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="also write the report as JSON",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The :class:`LoadConfig` of parsed options (``ValueError`` naming a bad one): each field
    is the option of its name (``max_tokens`` is ``--max-tokens``)."""
    return LoadConfig(**{f.name: getattr(args, f.name) for f in fields(LoadConfig)})


def run_from_args(args: argparse.Namespace) -> int:
    """Run, print the report, write JSON if asked; 1 when every request failed."""
    from attnkit.bench.results import machine, write_json

    report = run_load(config_from_args(args), progress=not args.quiet)
    print(format_report(report))
    if args.out is not None:
        write_json(args.out, {"machine": machine(), **report})
        print(f"wrote {args.out}")
    return 1 if report["failed"] == report["requests"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.serve", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
