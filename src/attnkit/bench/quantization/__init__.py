"""Weight-only quantization, measured once: speed, quality, loading memory and kernels.

* :mod:`~attnkit.bench.quantization.speed`: decode steps of fp32, bf16, int8 and int4 weights
  (and torchao's int8) against transformers, with their share of the read-bandwidth bound;
* :mod:`~attnkit.bench.quantization.quality`: top-1 agreement and perplexity change on English
  text, and the loading peak memory;
* :mod:`~attnkit.bench.quantization.kernels`: every one-row product kernel per weight matrix;
* :mod:`~attnkit.bench.quantization.layouts`: quality per layout (int8 per channel or in blocks,
  int4 groups) and GGUF block files loaded natively against their dequantized models
  (``python -m attnkit.bench.quantization.layouts``).

``python -m attnkit.bench.quantization --help`` runs the sections and writes JSON.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from attnkit.bench.quantization.kernels import kernel_rows, model_matrices
from attnkit.bench.quantization.quality import (
    QUALITY_LM,
    english_text,
    load_peak,
    quality_rows,
    text_ids,
    train_text_lm,
)
from attnkit.bench.quantization.speed import (
    minilm_cosines,
    quantization_quality,
    quantize_rows,
    quantized_variants,
    stored_bytes,
    torchao_int8,
    torchao_variants,
)

__all__ = [
    "QUALITY_LM",
    "english_text",
    "kernel_rows",
    "load_peak",
    "minilm_cosines",
    "model_matrices",
    "parse_sections",
    "quality_rows",
    "quantization_quality",
    "quantize_rows",
    "quantized_variants",
    "stored_bytes",
    "text_ids",
    "torchao_int8",
    "torchao_variants",
    "train_text_lm",
]


def parse_sections(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, sections: Sequence[str], out: Path
) -> argparse.Namespace:
    """Add the options that end both quantization benchmarks' command lines, parse ``argv`` and
    apply ``--threads``.

    The options: ``--threads`` (torch intra-op threads, 1 unless given; 0 keeps torch's choice),
    ``--skip SECTION`` (repeatable, one of ``sections``) and ``--out`` (the JSON file, ``out``
    unless given).
    """
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument("--skip", action="append", default=[], choices=sections)
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args
