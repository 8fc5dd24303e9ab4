"""The Llama-shaped models of the decoding benchmarks, by name.

Random weights: speed does not depend on their values. ``llama-tiny`` is for smoke runs.
A benchmark of one of them takes its command line from :func:`model_parser`, its model and
prompt from :func:`random_lm` and :func:`random_prompt` (seeded, so every run decodes the same
tokens) and the head of its report from :func:`model_report`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnkit import decoding
from attnkit.bench.results import bench_parser
from attnkit.config import FAMILIES, PRESETS, TransformerConfig
from attnkit.models import TransformerLM

__all__ = [
    "DECODE_MODELS",
    "QUANT_MODELS",
    "llama_config",
    "model_parser",
    "model_report",
    "random_lm",
    "random_prompt",
]

_LLAMA = FAMILIES["llama"]
#: name -> (config, prompt length, new tokens); "llama-tiny" is for quick smoke runs.
DECODE_MODELS: dict[str, tuple[TransformerConfig, int, int]] = {
    "llama-tiny": (
        TransformerConfig(256, 64, 2, 4, num_kv_heads=2, ffn_dim=172, max_seq_len=64, **_LLAMA),
        32,
        8,
    ),
    "llama-3m": (
        TransformerConfig(1024, 256, 4, 8, num_kv_heads=4, ffn_dim=688, max_seq_len=1024, **_LLAMA),
        512,
        128,
    ),
    "llama-100m": (PRESETS["llama-100m"].replace(max_seq_len=1024), 128, 64),
}

#: The shape of real small checkpoints (a 135M Llama: 30 layers, D576, 9/3 heads, head_dim 64,
#: SwiGLU 1536, vocab 49152, tied, rope_theta 1e5); prompt 40, 96 new tokens. Its steps are
#: short, so per-step overhead weighs more against the weights' read than on ``llama-100m``.
DECODE_MODELS["llama-135m"] = (
    TransformerConfig(
        49152, 576, 30, 9, num_kv_heads=3, ffn_dim=1536, max_seq_len=256, rope_base=1e5, **_LLAMA
    ),
    40,
    96,
)
#: The models of the quantization rows.
QUANT_MODELS: dict[str, tuple[TransformerConfig, int, int]] = {
    name: DECODE_MODELS[name] for name in ("llama-135m", "llama-tiny")
}


def llama_config(name: str) -> TransformerConfig:
    """The config of a benchmark model (see :data:`DECODE_MODELS`).

    Raises:
        ValueError: For an unknown name.
    """
    if name not in DECODE_MODELS:
        raise ValueError(f"unknown decode model {name!r}; known: {sorted(DECODE_MODELS)}")
    return DECODE_MODELS[name][0]


def random_lm(name: str) -> TransformerLM:
    """:data:`DECODE_MODELS`' ``name`` with the weights ``torch.manual_seed(0)`` draws, in eval
    mode and prepared for decoding (:func:`attnkit.decoding.prepare`)."""
    torch.manual_seed(0)
    return decoding.prepare(TransformerLM(DECODE_MODELS[name][0]).eval())


def random_prompt(lm: TransformerLM, length: int, seed: int = 0) -> Tensor:
    """A ``(1, length)`` prompt of token ids drawn uniformly from ``lm``'s vocabulary by a
    generator seeded with ``seed`` (the global seed is left alone)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, lm.config.vocab_size or 1, (1, length), generator=g)


def model_report(
    kind: str,
    name: str,
    *,
    prompt: int,
    new: int,
    repeats: int,
    rows: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """The report of a benchmark of the model ``name``: ``kind``, ``model``, its ``shape``
    (layers, dim, vocabulary), ``prompt`` (its length), ``new_tokens``, ``repeats``, then
    ``extra`` and the ``rows``, in this order (the order of the JSON written)."""
    config = DECODE_MODELS[name][0]
    return {
        "kind": kind,
        "model": name,
        "shape": {"layers": config.num_layers, "dim": config.dim, "vocab": config.vocab_size},
        "prompt": prompt,
        "new_tokens": new,
        "repeats": repeats,
        **extra,
        "rows": rows,
    }


def model_parser(module: str, doc: str | None, *, new: int) -> argparse.ArgumentParser:
    """:func:`~attnkit.bench.results.bench_parser` with the options of a benchmark of one model:
    ``--out`` (the report's path), ``--model`` (default ``llama-135m``), ``--new`` (default
    ``new``) and ``--repeats`` (default 3)."""
    parser = bench_parser(module, doc)
    parser.add_argument("--out", type=Path, default=None, help="report path")
    parser.add_argument("--model", default="llama-135m", choices=sorted(DECODE_MODELS))
    parser.add_argument("--new", type=int, default=new, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (medians)")
    return parser
