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
