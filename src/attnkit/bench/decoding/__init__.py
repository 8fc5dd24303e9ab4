"""Decoding benchmarks: attnkit's cached decoding against transformers, and what it rests on.

* :mod:`~attnkit.bench.decoding.models`: the Llama-shaped models, by name;
* :mod:`~attnkit.bench.decoding.rows`: greedy decoding against ``LlamaForCausalLM``, eager and
  compiled, fp32 and bf16, with the share of the read-bandwidth bound;
* :mod:`~attnkit.bench.decoding.batched`: left-padded prompts decoded together;
* :mod:`~attnkit.bench.decoding.prefill`: time to first token;
* :mod:`~attnkit.bench.decoding.layouts`: single-row products per kernel and weight layout.

``python -m attnkit.bench.decoding --help`` runs any of them and writes JSON.
"""

from __future__ import annotations

from attnkit.bench.decoding.batched import batched_rows, left_padded_prompts, vs_batched_rows
from attnkit.bench.decoding.layouts import layout_kernels, layout_table
from attnkit.bench.decoding.models import DECODE_MODELS, QUANT_MODELS, llama_config
from attnkit.bench.decoding.prefill import bf16_gemm_speedup, prefill_rows, vs_prefill_rows
from attnkit.bench.decoding.rows import TARGETS, decode_rows, read_bandwidth, vs_rows

__all__ = [
    "DECODE_MODELS",
    "QUANT_MODELS",
    "TARGETS",
    "batched_rows",
    "bf16_gemm_speedup",
    "decode_rows",
    "layout_kernels",
    "layout_table",
    "left_padded_prompts",
    "llama_config",
    "prefill_rows",
    "read_bandwidth",
    "vs_batched_rows",
    "vs_prefill_rows",
    "vs_rows",
]
