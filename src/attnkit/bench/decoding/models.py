"""The Llama-shaped models of the decoding benchmarks, by name.

Random weights: speed does not depend on their values. ``llama-tiny`` is for smoke runs.
"""

from __future__ import annotations

from attnkit.config import FAMILIES, PRESETS, TransformerConfig

__all__ = ["DECODE_MODELS", "QUANT_MODELS", "llama_config"]

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
