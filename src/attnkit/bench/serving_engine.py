"""The serving engine on the 135M Llama shape: batching, paged memory and the prefix cache.

Random fp32 weights (speed and memory do not depend on their values), measured in this process,
side by side:

* **throughput**: the same requests (mixed prompt lengths, greedy) sent to one
  :class:`attnkit.serving.Engine` one at a time, then all at once (continuous batching),
  interleaved rounds; the ratio of aggregate generated tokens/s (median over the rounds), and how
  many of the concurrent answers equal their one-at-a-time answers;
* **memory**: during the concurrent run, at the step holding the most tokens, the bytes of the
  KV blocks held over the tokens held times the bytes a token takes (1 is no waste), next to
  what a static cache of the model's context per request would hold;
* **prefix cache**: time to first token of a request whose long system prompt was already read
  by the previous request, over that of the first one (each round a fresh system prompt).

Usage:
    python -m attnkit.bench.serving_engine --out benchmarks/results/serving-engine.json
    python -m attnkit.bench.serving_engine --quick      # a tiny model, seconds
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from attnkit.bench.decoding.models import DECODE_MODELS
from attnkit.bench.results import bench_parser, parse_with_threads, write_report
from attnkit.models import TransformerLM
from attnkit.serving import Engine, SamplingParams, TokenEvent

__all__ = ["main", "measure"]

T = TypeVar("T")

#: The model of the full run, and its context (long enough for the system prompt).
MODEL, CONTEXT = "llama-135m", 2048


def _progress(items: Sequence[T], desc: str) -> Iterable[T]:
    """``items`` with a tqdm bar on stderr (plain iteration without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, file=sys.stderr, leave=False)


def _drain(engine: Engine, on_step: Any = None) -> None:
    while engine.has_work():
        engine.step()
        if on_step is not None:
            on_step()


def _throughput(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, rounds: int
) -> dict[str, Any]:
    """One-at-a-time against concurrent rounds, the answers and the memory record."""
    ratios, alone_tps, together_tps = [], [], []
    alone: list[list[int]] = []
    together: list[list[int]] = []
    peak: dict[str, int] = {"kv_tokens": 0}

    def record() -> None:
        s = engine.stats()
        if s.running == len(prompts) and s.kv_tokens > peak["kv_tokens"]:
            peak.update(kv_tokens=s.kv_tokens, kv_bytes=s.kv_bytes_used)

    outputs: dict[str, list[int]] = {}

    def collect(event: TokenEvent) -> None:
        outputs[event.request_id].append(event.token_id)

    for _ in _progress(range(rounds), "throughput rounds"):
        start = time.perf_counter()
        alone = [engine.generate([p], params)[0] for p in prompts]
        t_alone = time.perf_counter() - start
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            outputs[str(i)] = []
            engine.add_request(p, params, request_id=str(i), on_event=collect)
        _drain(engine, record)
        t_together = time.perf_counter() - start
        together = [outputs[str(i)] for i in range(len(prompts))]
        tokens = sum(map(len, together))
        alone_tps.append(sum(map(len, alone)) / t_alone)
        together_tps.append(tokens / t_together)
        ratios.append(together_tps[-1] / alone_tps[-1])
    per_token = engine.cache.bytes_per_token
    held = peak["kv_tokens"] * per_token
    return {
        "requests": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": params.max_tokens,
        "alone_tokens_per_s": statistics.median(alone_tps),
        "concurrent_tokens_per_s": statistics.median(together_tps),
        "concurrent_over_alone": statistics.median(ratios),
        "round_ratios": ratios,
        "greedy_equal": sum(a == b for a, b in zip(alone, together, strict=True)),
        "memory": {
            "tokens_held": peak["kv_tokens"],
            "bytes_per_token": per_token,
            "kv_bytes_held": peak.get("kv_bytes", 0),
            "held_over_tokens": peak.get("kv_bytes", 0) / held if held else None,
            "static_cache_bytes": len(prompts) * engine.max_context * per_token,
        },
    }


def _first_token_time(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding a request (engine idle) to its first token, and its cached tokens."""
    first: list[TokenEvent] = []
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), on_event=first.append)
    while not first:
        engine.step()
    elapsed = time.perf_counter() - start
    _drain(engine)
    return elapsed, first[0].cached_tokens


def _prefix(engine: Engine, vocab: int, system_tokens: int, rounds: int) -> dict[str, Any]:
    cold, warm, ratios = [], [], []
    cached = 0
    for _ in _progress(range(rounds), "prefix rounds"):
        system = torch.randint(0, vocab, (system_tokens,)).tolist()
        t_cold, _ = _first_token_time(engine, [*system, *torch.randint(0, vocab, (12,)).tolist()])
        t_warm, cached = _first_token_time(
            engine, [*system, *torch.randint(0, vocab, (12,)).tolist()]
        )
        cold.append(t_cold)
        warm.append(t_warm)
        ratios.append(t_warm / t_cold)
    return {
        "system_tokens": system_tokens,
        "first_ttft_s": statistics.median(cold),
        "repeat_ttft_s": statistics.median(warm),
        "repeat_over_first": statistics.median(ratios),
        "cached_tokens": cached,
    }


def measure(
    *,
    model: str = MODEL,
    context: int = CONTEXT,
    requests: int = 16,
    max_tokens: int = 32,
    rounds: int = 2,
    system_tokens: int = 1500,
    seed: int = 0,
) -> dict[str, Any]:
    """Build the model and run the three measurements (see the module docstring)."""
    torch.manual_seed(seed)
    config = DECODE_MODELS[model][0].replace(max_seq_len=context)
    lm = TransformerLM(config).eval()
    vocab = int(config.vocab_size or 0)
    lengths = torch.randint(16, 4 * max_tokens, (requests,)).tolist()
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in lengths]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    # Random prompts share no prefix: the cache is off so that both sides compute everything.
    batching = Engine(lm, max_batch=requests, prefix_caching=False)
    engine = Engine(lm, max_batch=requests)
    engine.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    return {
        "model": model,
        "config": {
            "dim": config.dim,
            "layers": config.num_layers,
            "heads": config.num_heads,
            "kv_heads": config.num_kv_heads,
            "vocab": vocab,
            "context": context,
            "dtype": "float32",
            "block_size": engine.block_size,
            "prefill_chunk": engine.prefill_chunk,
        },
        "throughput": _throughput(batching, prompts, params, rounds),
        "prefix_cache": _prefix(engine, vocab, system_tokens, rounds + 1),
        "targets": {
            "concurrent_over_alone": 4.0,
            "greedy_equal": requests - 1,
            "held_over_tokens": 1.25,
            "repeat_over_first": 0.4,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("attnkit.bench.serving_engine", __doc__)
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--quick", action="store_true", help="the tiny model, short run")
    args = parse_with_threads(parser, argv)
    options: dict[str, Any] = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "system_tokens": args.system_tokens,
    }
    if args.quick:
        options |= {"model": "llama-tiny", "context": 256, "max_tokens": 8, "rounds": 1,
                    "system_tokens": 160}  # fmt: skip
    report = measure(**options)
    t, m, p = report["throughput"], report["throughput"]["memory"], report["prefix_cache"]
    print(
        f"{t['requests']} concurrent / one at a time: {t['concurrent_over_alone']:.2f}x "
        f"({t['concurrent_tokens_per_s']:.1f} vs {t['alone_tokens_per_s']:.1f} tok/s), "
        f"greedy equal {t['greedy_equal']}/{t['requests']}; KV held / tokens held "
        f"{m['held_over_tokens']:.3f}; repeated system prompt TTFT {p['repeat_over_first']:.3f}x"
    )
    if not args.quick or args.out:
        write_report(report, args.out, "serving-engine.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
