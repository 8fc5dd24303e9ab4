"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus-client``.

Counters and histograms are updated as requests run; the engines' gauges (running and waiting
requests, KV blocks used and free, prefix-cache hits) are read from each engine's ``stats()``
when the metrics are scraped. Every metric carries the model's name as the label ``model``.

Needs ``prometheus-client`` (the ``serve`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Time to first token and between tokens: from a fast decode step to a long queue.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    """Gauges and counters read from ``engine.stats()`` of each ``(name, engine)`` at scrape."""

    def __init__(self, engines: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Any]:
        gauges = {
            "running": ("attnkit_requests_running", "requests in the running batch"),
            "waiting": ("attnkit_requests_waiting", "requests queued, not yet running"),
            "kv_blocks_used": ("attnkit_kv_blocks_used", "KV cache blocks in use"),
            "kv_blocks_free": ("attnkit_kv_blocks_free", "KV cache blocks free"),
            "kv_bytes_used": ("attnkit_kv_bytes_used", "bytes of KV cache in use"),
        }
        counters = {
            "prefix_cache_hits": (
                "attnkit_prefix_cache_hits",
                "prompt blocks found in the prefix cache",
            ),
            "prefix_cache_queries": (
                "attnkit_prefix_cache_queries",
                "prompt blocks looked up in the prefix cache",
            ),
            "preemptions": ("attnkit_preemptions", "requests preempted for lack of KV blocks"),
        }
        families: dict[str, Any] = {}
        for key, (name, doc) in gauges.items():
            families[key] = GaugeMetricFamily(name, doc, labels=["model"])
        for key, (name, doc) in counters.items():
            families[key] = CounterMetricFamily(name, doc, labels=["model"])
        for model, engine in self.engines():
            stats = engine.stats()
            for key, family in families.items():
                value = getattr(stats, key, None)
                if value is not None:
                    family.add_metric([model], float(value))
        yield from families.values()


class ServerMetrics:
    """The metrics of one server (its own registry, so that several servers in one process, as
    in tests, do not share counts).

    Args:
        engines: Called at each scrape: ``(model name, engine)`` pairs to read ``stats()`` of.
    """

    def __init__(self, engines: Callable[[], Iterable[tuple[str, Any]]] = lambda: ()) -> None:
        self.registry = CollectorRegistry()
        self.requests = self._counter(
            "attnkit_requests",
            "requests by endpoint and outcome: ok, abort (the client went away), client_error "
            "(a 4xx), error (a 5xx)",
            "endpoint",
            "outcome",
        )
        self.prompt_tokens = self._counter("attnkit_prompt_tokens", "prompt tokens read")
        self.cached_tokens = self._counter(
            "attnkit_prompt_tokens_cached", "prompt tokens served from the prefix cache"
        )
        self.generated_tokens = self._counter("attnkit_generated_tokens", "tokens generated")
        self.ttft = self._histogram(
            "attnkit_time_to_first_token_seconds",
            "time from a request's arrival to its first generated token",
            TTFT_BUCKETS,
        )
        self.token_latency = self._histogram(
            "attnkit_time_per_output_token_seconds",
            "time between consecutive generated tokens of a request",
            TOKEN_BUCKETS,
        )
        self.registry.register(_EngineCollector(engines))

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        """A counter of this server's registry, labelled by ``model`` and then ``labels``."""
        return Counter(name, documentation, ["model", *labels], registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        """A histogram of this server's registry, labelled by ``model``."""
        return Histogram(name, documentation, ["model"], buckets=buckets, registry=self.registry)

    def request(self, model: str, endpoint: str, outcome: str) -> None:
        """Count one finished (or refused) request."""
        self.requests.labels(model, endpoint, outcome).inc()

    def tokens(self, model: str, *, prompt: int, cached: int, generated: int) -> None:
        """Add a finished choice's token counts."""
        self.prompt_tokens.labels(model).inc(prompt)
        self.cached_tokens.labels(model).inc(cached)
        self.generated_tokens.labels(model).inc(generated)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))
