"""Hugging Face decoder folders <-> :class:`attnkit.TransformerLM`.

A folder holds ``config.json``, the weights (``model.safetensors``, or shards
``model-0000N-of-0000M.safetensors`` listed in ``model.safetensors.index.json``) and optionally
``generation_config.json`` and ``tokenizer.json``. Supported architectures:

=====================  =================================================================
``LlamaForCausalLM``   RMSNorm, SwiGLU, rotary (``rope_scaling`` default/linear/llama3), GQA,
                       ``attention_bias``/``mlp_bias``, ``head_dim``, tied or untied head
``MistralForCausalLM`` Llama + ``sliding_window`` (attnkit's ``window``)
``Qwen2ForCausalLM``   Llama with biases on q/k/v only
``GPT2LMHeadModel``    LayerNorm, learned positions, fused ``c_attn`` ``Conv1D`` weights,
                       ``gelu_new`` (tanh GELU)
=====================  =================================================================

Loading builds the model on the meta device, allocates the parameters once in the target dtype
and reads the safetensors files tensor by tensor straight into them (the format is read here:
an 8-byte header length, a JSON header, raw little-endian data), so the peak memory is the
weights plus the largest single tensor. Every config option that changes the numbers is either
mapped or rejected with an error naming it; nothing is silently ignored.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnkit.config import FAMILIES, TransformerConfig, check_rope_scaling
from attnkit.positional import permute_rotary_weight

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "config_from_hf",
    "from_pretrained",
    "hf_config_from",
    "read_generation_config",
    "read_safetensors_header",
    "save_pretrained",
]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GPT2LMHeadModel",
)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# Tensors some checkpoints carry that are recomputed buffers, not weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


# --------------------------------------------------------------------------------------------
# config.json <-> TransformerConfig
# --------------------------------------------------------------------------------------------


def _architecture(data: dict[str, Any]) -> str:
    archs = data.get("architectures") or []
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if known:
        return known[0]
    if not archs and data.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[data["model_type"]]
    raise ValueError(
        f"unsupported architecture {archs or data.get('model_type')!r}; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _local_rope_base(data: dict[str, Any]) -> float | None:
    """Gemma 3's rotary base of the sliding layers (``rope_local_base_freq``, or the
    ``sliding_attention`` entry of transformers 5's per-layer-type ``rope_parameters``)."""
    params = data.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling of the sliding layers is not supported: {local}")
        return float(local.get("rope_theta", 10_000.0))
    base = data.get("rope_local_base_freq")
    return None if base is None else float(base)


def _rope(data: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` / ``rope_scaling``."""
    params = dict(data.get("rope_parameters") or {})
    if "full_attention" in params:  # per layer type (Gemma 3): the global layers' rotary
        params = dict(params["full_attention"])
    partial = params.pop("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    theta = float(params.pop("rope_theta", data.get("rope_theta", 10_000.0)))
    scaling = params or data.get("rope_scaling")
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default", "linear", "llama3"):
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    try:
        return theta, check_rope_scaling(scaling)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config.json rope_scaling: {err}") from None


def _require(data: dict[str, Any], arch: str, checks: dict[str, tuple[Any, Any]]) -> None:
    """Raise for options that change the numbers and have no attnkit counterpart."""
    bad = {k: got for k, (got, ok) in checks.items() if not ok}
    if bad:
        raise ValueError(
            f"{arch} config options not supported by attnkit (they change the outputs): {bad}"
        )


def config_from_hf(data: dict[str, Any]) -> tuple[str, TransformerConfig]:
    """Map a ``config.json`` dict to ``(architecture, TransformerConfig)``.

    Args:
        data: The parsed ``config.json``.

    Returns:
        The architecture name and the equivalent config.

    Raises:
        ValueError: For an unsupported architecture (listing the supported ones), or an option
            that changes the outputs but has no attnkit counterpart (naming it).
    """
    arch = _architecture(data)
    if data.get("quantization_config"):
        method = data["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"quantized checkpoints are not supported (quantization_config: {method}); "
            "use the unquantized weights"
        )
    try:
        if arch == "GPT2LMHeadModel":
            return arch, _gpt2_config(data)
        return arch, _llama_config(data, arch)
    except KeyError as err:
        raise ValueError(f"config.json of {arch} lacks the key {err.args[0]!r}") from None


def _gpt2_config(data: dict[str, Any]) -> TransformerConfig:
    acts = {
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_fast": "gelu_tanh",
        "gelu": "gelu",
        "relu": "relu",
        "silu": "silu",
        "swish": "silu",
    }
    act = data.get("activation_function", "gelu_new")
    _require(
        data,
        "GPT2LMHeadModel",
        {
            "activation_function": (act, act in acts),
            "scale_attn_weights": (
                data.get("scale_attn_weights", True),
                data.get("scale_attn_weights", True) is True,
            ),
            "scale_attn_by_inverse_layer_idx": (
                data.get("scale_attn_by_inverse_layer_idx", False),
                not data.get("scale_attn_by_inverse_layer_idx", False),
            ),
            "add_cross_attention": (
                data.get("add_cross_attention", False),
                not data.get("add_cross_attention", False),
            ),
        },
    )
    return TransformerConfig(
        vocab_size=data["vocab_size"],
        dim=data["n_embd"],
        num_layers=data["n_layer"],
        num_heads=data["n_head"],
        ffn_dim=data.get("n_inner") or 4 * data["n_embd"],
        max_seq_len=data["n_positions"],
        eps=float(data.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(data.get("tie_word_embeddings", True)),
        **(FAMILIES["gpt2"] | {"activation": acts[act]}),
    )


def _layer_types(data: dict[str, Any], arch: str) -> list[str] | None:
    """Each layer's attention kind, as the architecture's config defines it."""
    n = data["num_hidden_layers"]
    if data.get("layer_types") is not None:
        return list(data["layer_types"])
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Older configs: sliding layers from max_window_layers on, if use_sliding_window.
        first = data.get("max_window_layers", 0)
        use = bool(data.get("use_sliding_window", False))
        return ["sliding_attention" if use and i >= first else "full_attention" for i in range(n)]
    if arch in _GEMMA:  # every `pattern`-th layer global, the others sliding
        pattern = 2 if arch == "Gemma2ForCausalLM" else data.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return None


def _llama_config(data: dict[str, Any], arch: str) -> TransformerConfig:
    """The rotary/RMSNorm families: Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3."""
    theta, scaling = _rope(data)
    gemma = arch in _GEMMA
    act = data.get("hidden_activation" if gemma else "hidden_act") or data.get("hidden_act")
    want_act = "gelu_pytorch_tanh" if gemma else "silu"
    checks: dict[str, tuple[Any, Any]] = {"hidden_act": (act, act == want_act)}
    checks["pretraining_tp"] = (
        data.get("pretraining_tp", 1),
        data.get("pretraining_tp", 1) in (1, None),
    )
    if arch == "Phi3ForCausalLM":
        factor = data.get("partial_rotary_factor", 1.0)
        checks["partial_rotary_factor"] = (factor, factor in (1, 1.0, None))
    _require(data, arch, checks)
    window = data.get("sliding_window")
    types = _layer_types(data, arch)
    if arch == "LlamaForCausalLM":
        window = None  # Llama has no sliding window
    if types is not None:
        kinds = set(types)
        if kinds <= {"full_attention"}:
            types, window = None, None
        elif kinds == {"sliding_attention"}:
            types = None  # every layer slides: one window for all
    heads = data["num_attention_heads"]
    family: dict[str, Any] = dict(FAMILIES["llama"])
    attention_bias = bool(data.get("attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        qkv_bias = out_bias = mlp_bias = False
    else:
        qkv_bias = out_bias = attention_bias
        mlp_bias = bool(data.get("mlp_bias", False))
    if arch == "Qwen3ForCausalLM":
        family["qk_norm"] = True
    if gemma:
        family |= {
            "norm": "rmsnorm_plus_one",
            "activation": "geglu_tanh",
            "post_norms": True,
            "scale_embeddings": True,
            "attn_scale": float(data.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": data.get("attn_logit_softcapping"),
            "logit_softcap": data.get("final_logit_softcapping"),
        }
    if arch == "Gemma3ForCausalLM":
        family |= {"qk_norm": True, "rope_local_base": _local_rope_base(data)}
    return TransformerConfig(
        vocab_size=data["vocab_size"],
        dim=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim") or data["hidden_size"] // heads,
        ffn_dim=data["intermediate_size"],
        max_seq_len=data.get("max_position_embeddings", 2048),
        eps=float(data.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        window=window,
        layer_types=None if types is None else tuple(types),
        rope_base=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(data.get("tie_word_embeddings", gemma)),
        **family,
    )


def hf_config_from(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face architecture equivalent to ``config``.

    GPT-2 for learned positions with LayerNorm and biases everywhere; for rotary positions,
    RMSNorm and SwiGLU: Qwen2 (biases on q/k/v only), Mistral (a sliding window) or Llama.
    Interleaved rotary pairs are saved as Hugging Face's halves by permuting each head's
    query/key channels (same scores, same outputs).

    Raises:
        ValueError: Naming the option that has no counterpart in any supported architecture.
    """
    c = config
    qkv_bias = c.bias if c.qkv_bias is None else c.qkv_bias
    out_bias = c.bias if c.out_bias is None else c.out_bias
    mlp_bias = c.bias if c.mlp_bias is None else c.mlp_bias

    problems: list[str] = []

    def need(option: str, value: Any, wanted: Any, family: str) -> None:
        if value != wanted:
            problems.append(f"{option}={value!r} (needs {wanted!r} in {family})")

    def check() -> None:
        if problems:
            raise ValueError(
                "this model cannot be saved as a Hugging Face folder; options without a "
                f"counterpart: {'; '.join(problems)}"
            )

    need("causal", c.causal, True, "a causal LM")
    need("norm_first", c.norm_first, True, "a pre-norm decoder")
    check()
    if c.position == "learned":
        fam = "GPT2LMHeadModel (position='learned')"
        need("norm", c.norm, "layernorm", fam)
        acts = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
        if c.activation not in acts:
            problems.append(f"activation={c.activation!r} (needs one of {sorted(acts)} in {fam})")
        need("bias", (qkv_bias, out_bias, mlp_bias), (True, True, True), fam)
        need("num_kv_heads", c.kv_heads, c.num_heads, fam)
        need("head_dim", c.attn_head_dim, c.dim // c.num_heads, fam)
        need("window", c.window, None, fam)
        for option in ("attn_scale", "attn_softcap", "logit_softcap", "layer_types"):
            need(option, getattr(c, option), None, fam)
        for flag in ("qk_norm", "post_norms", "scale_embeddings"):
            need(flag, getattr(c, flag), False, fam)
        check()
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": c.vocab_size,
            "n_embd": c.dim,
            "n_layer": c.num_layers,
            "n_head": c.num_heads,
            "n_inner": c.ffn_dim,
            "n_positions": c.max_seq_len,
            "activation_function": acts[c.activation],
            "layer_norm_epsilon": c.eps,
            "tie_word_embeddings": c.tie_embeddings,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
        }
    need("position", c.position, "rope", "GPT2LMHeadModel ('learned') or Llama ('rope')")
    types = list(c.layer_types) if c.layer_types is not None else None
    if c.norm == "rmsnorm_plus_one":
        return _gemma_config_from(c, need, check)
    fam = "Llama/Mistral/Qwen2/Qwen3 (position='rope')"
    need("norm", c.norm, "rmsnorm", fam)
    need("activation", c.activation, "swiglu", fam)
    for option in ("attn_scale", "attn_softcap", "logit_softcap", "rope_local_base"):
        need(option, getattr(c, option), None, fam)
    need("post_norms", c.post_norms, False, fam)
    need("scale_embeddings", c.scale_embeddings, False, fam)
    check()
    common: dict[str, Any] = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.attn_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.eps,
        "tie_word_embeddings": c.tie_embeddings,
        "rope_theta": c.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base}
        | (c.rope_scaling or {}),
        "attention_dropout": 0.0,
    }
    if c.rope_scaling is not None:
        common["rope_scaling"] = dict(c.rope_scaling)
    kinds = types or [("sliding" if c.window is not None else "full") + "_attention"] * c.num_layers
    qwen = {
        "use_sliding_window": "sliding_attention" in kinds,
        "sliding_window": c.window,
        "max_window_layers": kinds.index("sliding_attention")
        if "sliding_attention" in kinds
        else c.num_layers,
        "layer_types": kinds,
    }
    if c.qk_norm:
        fam = "Qwen3ForCausalLM (qk_norm)"
        need("bias", (qkv_bias, mlp_bias), (out_bias, False), fam)
        check()
        return (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "attention_bias": qkv_bias,
            }
            | qwen
            | common
        )
    if (qkv_bias, out_bias, mlp_bias) == (True, False, False) or types is not None:
        need("bias", (qkv_bias, out_bias, mlp_bias), (True, False, False), "Qwen2ForCausalLM")
        check()
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"} | qwen | common
    if c.window is not None:
        fam = "MistralForCausalLM (window)"
        need("bias", (qkv_bias, out_bias, mlp_bias), (False, False, False), fam)
        check()
        return {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "sliding_window": c.window,
        } | common
    if qkv_bias != out_bias:
        raise ValueError(
            f"qkv_bias={qkv_bias} with out_bias={out_bias} has no counterpart in "
            "LlamaForCausalLM (attention_bias covers q, k, v and o together) or Qwen2"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": qkv_bias,
        "mlp_bias": mlp_bias,
    } | common


def _gemma_config_from(c: TransformerConfig, need: Any, check: Any) -> dict[str, Any]:
    """Gemma 2 (soft-capping) or Gemma 3 text (qk-norm, local rotary base) ``config.json``."""
    arch = "Gemma3ForCausalLM" if c.qk_norm else "Gemma2ForCausalLM"
    fam = f"{arch} (norm='rmsnorm_plus_one')"
    need("activation", c.activation, "geglu_tanh", fam)
    need("post_norms", c.post_norms, True, fam)
    need("scale_embeddings", c.scale_embeddings, True, fam)
    biases = [c.bias if b is None else b for b in (c.qkv_bias, c.out_bias, c.mlp_bias)]
    need("bias", biases, [False] * 3, fam)
    if arch == "Gemma2ForCausalLM":
        need("rope_local_base", c.rope_local_base, None, fam)
    scale = c.attn_scale if c.attn_scale is not None else c.head_dim**-0.5
    scalar = round(scale**-2)  # Gemma's query_pre_attn_scalar is an int: scale = scalar**-0.5
    need("attn_scale", scale, scalar**-0.5, f"{fam} (the inverse square root of an int)")
    check()
    kinds = list(c.layer_types) if c.layer_types is not None else None
    if kinds is None:
        kinds = [("sliding" if c.window is not None else "full") + "_attention"] * c.num_layers
    full = {"rope_type": "default", "rope_theta": c.rope_base} | (c.rope_scaling or {})
    local = c.rope_local_base if c.rope_local_base is not None else c.rope_base
    data: dict[str, Any] = {
        "architectures": [arch],
        "model_type": "gemma3_text" if c.qk_norm else "gemma2",
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.eps,
        "tie_word_embeddings": c.tie_embeddings,
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": c.attn_softcap,
        "final_logit_softcapping": c.logit_softcap,
        "sliding_window": c.window or c.max_seq_len,
        "layer_types": kinds,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
    if arch == "Gemma3ForCausalLM":
        data["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
        data["rope_local_base_freq"] = local
    else:
        data["rope_parameters"] = full
    data["rope_theta"] = c.rope_base
    return data


# --------------------------------------------------------------------------------------------
# Weight names
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """Where one checkpoint tensor goes: ``param[rows]`` (transposed first for ``Conv1D``).

    ``rotary_heads``: a query/key projection of that many heads, whose channels are permuted
    when the attnkit model pairs rotary channels interleaved (Hugging Face pairs halves).
    """

    param: str
    rows: tuple[int, int] | None = None
    transpose: bool = False
    rotary_heads: int | None = None


def weight_map(arch: str, config: TransformerConfig) -> dict[str, _Entry]:
    """Checkpoint tensor name -> attnkit parameter (name, row range, transpose)."""
    c = config
    q_rows, kv_rows = c.num_heads * c.attn_head_dim, c.kv_heads * c.attn_head_dim
    qkv_rows = {
        "q": (0, q_rows),
        "k": (q_rows, q_rows + kv_rows),
        "v": (q_rows + kv_rows, q_rows + 2 * kv_rows),
    }
    qkv_bias = c.bias if c.qkv_bias is None else c.qkv_bias
    out_bias = c.bias if c.out_bias is None else c.out_bias
    mlp_bias = c.bias if c.mlp_bias is None else c.mlp_bias
    out: dict[str, _Entry] = {}
    if arch == "GPT2LMHeadModel":
        out["transformer.wte.weight"] = _Entry("embedding.weight")
        out["transformer.wpe.weight"] = _Entry("position.weight")
        out["transformer.ln_f.weight"] = _Entry("norm.weight")
        out["transformer.ln_f.bias"] = _Entry("norm.bias")
        for i in range(c.num_layers):
            hf, ak = f"transformer.h.{i}.", f"blocks.{i}."
            attn = f"{ak}attention."
            for part, target in [
                ("ln_1", f"{ak}norm1"),
                ("ln_2", f"{ak}norm2"),
                ("attn.c_attn", f"{attn}{_QKV}"),
                ("attn.c_proj", f"{attn}{_OUT}"),
                ("mlp.c_fc", f"{ak}feed_forward.linear1"),
                ("mlp.c_proj", f"{ak}feed_forward.linear2"),
            ]:
                conv = not part.startswith("ln")
                out[f"{hf}{part}.weight"] = _Entry(f"{target}.weight", transpose=conv)
                out[f"{hf}{part}.bias"] = _Entry(f"{target}.bias")
    else:
        out["model.embed_tokens.weight"] = _Entry("embedding.weight")
        out["model.norm.weight"] = _Entry("norm.weight")
        F = int(c.ffn_dim or 4 * c.dim)
        fused = arch == "Phi3ForCausalLM"  # Phi-3 stores q/k/v and gate/up fused, as attnkit
        for i in range(c.num_layers):
            hf, ak = f"model.layers.{i}.", f"blocks.{i}."
            attn = f"{ak}attention."
            if fused:
                out[f"{hf}self_attn.qkv_proj.weight"] = _Entry(f"{attn}{_QKV}.weight")
            else:
                for name, rows in qkv_rows.items():
                    heads = {"q": c.num_heads, "k": c.kv_heads}.get(name)
                    for kind in ("weight", "bias") if qkv_bias else ("weight",):
                        out[f"{hf}self_attn.{name}_proj.{kind}"] = _Entry(
                            f"{attn}{_QKV}.{kind}", rows, rotary_heads=heads
                        )
            linears: list[tuple[str, str, bool, tuple[int, int] | None]] = [
                ("self_attn.o_proj", f"{attn}{_OUT}", out_bias, None),
                ("mlp.down_proj", f"{ak}feed_forward.linear2", mlp_bias, None),
            ]
            if fused:
                linears.append(("mlp.gate_up_proj", f"{ak}feed_forward.gate_up", mlp_bias, None))
            else:
                linears.append(("mlp.gate_proj", f"{ak}feed_forward.gate_up", mlp_bias, (0, F)))
                linears.append(("mlp.up_proj", f"{ak}feed_forward.gate_up", mlp_bias, (F, 2 * F)))
            for part, target, bias, span in linears:
                out[f"{hf}{part}.weight"] = _Entry(f"{target}.weight", span)
                if bias:
                    out[f"{hf}{part}.bias"] = _Entry(f"{target}.bias", span)
            norms = {"input_layernorm": "norm1"}
            if c.post_norms:  # Gemma: a norm after attention and one before and after the MLP
                norms |= {
                    "post_attention_layernorm": "post_attn_norm",
                    "pre_feedforward_layernorm": "norm2",
                    "post_feedforward_layernorm": "post_ffn_norm",
                }
            else:
                norms["post_attention_layernorm"] = "norm2"
            for theirs, ours in norms.items():
                out[f"{hf}{theirs}.weight"] = _Entry(f"{ak}{ours}.weight")
            if c.qk_norm:
                for name in ("q", "k"):
                    out[f"{hf}self_attn.{name}_norm.weight"] = _Entry(f"{attn}{name}_norm.weight")
    if not c.tie_embeddings:
        out["lm_head.weight"] = _Entry("lm_head.weight")
    return out


# Attribute names of the block attention's fused q/k/v and output projections.
_QKV, _OUT = "qkv_proj", "out_proj"


# --------------------------------------------------------------------------------------------
# safetensors, read and written here (no extra dependency, one tensor in memory at a time)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The tensors of a safetensors file: name -> (dtype, shape, offset, size), checked against
    the file's size.

    Raises:
        ValueError: If the file is truncated or its header is malformed (naming the file).
    """
    return {k: (v.dtype, v.shape, v.start, v.nbytes) for k, v in _header(Path(path)).items()}


def _header(path: Path) -> dict[str, _TensorInfo]:
    if sys.byteorder != "little":  # pragma: no cover - safetensors data is little-endian
        raise ValueError("reading safetensors needs a little-endian machine")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is truncated: {size} bytes, not a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(
                f"{path} is truncated: header of {n} bytes announced, file has {size} bytes"
            )
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: malformed safetensors header ({err})") from None
    infos: dict[str, _TensorInfo] = {}
    end = 0
    for key, entry in meta.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            lo, hi = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed safetensors entry {key!r}: {entry}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if hi - lo != nbytes:
            raise ValueError(
                f"{path}: tensor {key!r} of shape {shape} {entry['dtype']} needs {nbytes} bytes, "
                f"header gives {hi - lo}"
            )
        infos[key] = _TensorInfo(dtype, shape, 8 + n + lo, nbytes)
        end = max(end, hi)
    if 8 + n + end > size:
        raise ValueError(
            f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}"
        )
    return infos


# Bytes read at a time: a tensor larger than this is copied in blocks of rows, so loading
# needs the parameters plus one block, whatever the checkpoint's and the target's dtypes.
_CHUNK_BYTES = 4 * 2**20


def _read_into(f: Any, info: _TensorInfo, dest: Tensor) -> None:
    """Copy a checkpoint tensor into ``dest`` (same shape, any dtype), block of rows by block.

    Raises:
        ValueError: If the file ends before the tensor does.
    """
    f.seek(info.start)
    if not info.nbytes:
        return
    rows = info.shape[0] if info.shape else 1
    row_bytes = info.nbytes // rows
    step = max(1, _CHUNK_BYTES // row_bytes)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        buf = bytearray(n * row_bytes)
        if f.readinto(buf) != len(buf):
            raise ValueError(f"{f.name} is truncated while reading a tensor")
        block = torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype)  # (n * row,)
        if info.shape:
            dest[r0 : r0 + n].copy_(block.view(n, *info.shape[1:]))
        else:
            dest.copy_(block.view(()))


def _write_safetensors(path: Path, tensors: dict[str, Tensor]) -> None:
    """Write ``tensors`` (CPU, contiguous) as one safetensors file."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in tensors.items():
        header[key] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.nbytes:  # the raw bytes of the tensor's storage, without a copy
                f.write((ctypes.c_uint8 * t.nbytes).from_address(t.data_ptr()))
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{index}: malformed index ({err!r})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path} lacks the weight shards {missing} named in {INDEX_NAME}"
            )
        return [path / n for n in names]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    raise FileNotFoundError(
        f"{path} has no weights: expected {WEIGHTS_NAME} or {INDEX_NAME} with its shards "
        "(.bin/.pt weights are not read; convert them to safetensors)"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """Token ids for generation: ``eos_token_id`` (int or list), ``pad_token_id``,
    ``bos_token_id`` from ``generation_config.json``, falling back to ``config.json``.

    Returns:
        The ids that are set (missing ones are left out).
    """
    path = Path(path)
    out: dict[str, Any] = {}
    for name in ("config.json", "generation_config.json"):  # the latter wins
        if (path / name).is_file():
            data = _read_json(path / name)
            for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
                if data.get(key) is not None:
                    out[key] = data[key]
    return out


def from_pretrained(
    path: str | Path,
    *,
    cls: Callable[[TransformerConfig], nn.Module],
    dtype: torch.dtype | None = None,
) -> Any:
    """Load a Hugging Face decoder folder into ``cls(config)`` (eval mode).

    ``TransformerLM.from_pretrained`` calls this with ``cls=TransformerLM``; the loader itself
    knows only the config and the parameter names, so it sits below the models.

    Args:
        path: Folder with ``config.json`` and safetensors weights.
        cls: The model class (:class:`attnkit.TransformerLM`), called with the config.
        dtype: Parameter dtype (default: torch's default dtype, float32); ``torch.bfloat16`` or
            ``torch.float16`` load straight into that dtype.

    Returns:
        The model; ``model.generation_config`` holds the folder's eos/pad/bos ids.

    Raises:
        FileNotFoundError: Naming the missing folder, ``config.json`` or weight files.
        ValueError: Unsupported architecture or option, truncated files, tensor shapes that do
            not match the config, missing or unexpected tensors.
        TypeError: If ``dtype`` is not a floating torch dtype.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} lacks config.json")
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    arch, config = config_from_hf(_read_json(path / "config.json"))
    files = _weight_files(path)
    headers = {f: _header(f) for f in files}  # truncation errors before any allocation
    with torch.device("meta"):
        lm = cls(config)
    lm = lm.to(dtype).to_empty(device="cpu")
    params = dict(lm.named_parameters())
    entries = weight_map(arch, config)
    base_prefix = "transformer." if arch == "GPT2LMHeadModel" else "model."
    filled: dict[str, int] = dict.fromkeys(params, 0)
    unexpected: list[str] = []
    with torch.no_grad():
        for file, infos in headers.items():
            with open(file, "rb") as f:
                for key, info in infos.items():
                    # Base-model checkpoints (e.g. the original gpt2) omit the prefix.
                    entry = entries.get(key) or entries.get(base_prefix + key)
                    if entry is None:
                        if not key.endswith(_IGNORED_SUFFIXES) and not (
                            key == "lm_head.weight" and config.tie_embeddings
                        ):
                            unexpected.append(key)
                        continue
                    target: Tensor = params[entry.param]
                    if entry.rows is not None:
                        target = target[entry.rows[0] : entry.rows[1]]
                    want = tuple(target.shape[::-1] if entry.transpose else target.shape)
                    if info.shape != want:
                        raise ValueError(
                            f"{file.name}: tensor {key} has shape {list(info.shape)}, the "
                            f"config ({arch}) needs {list(want)}"
                        )
                    _read_into(f, info, target.t() if entry.transpose else target)
                    filled[entry.param] += target.numel()
    if unexpected:
        raise ValueError(
            f"{path}: tensors with no place in {arch} as configured: {unexpected[:8]}"
            + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        )
    missing = [k for k, p in params.items() if filled[k] < p.numel()]
    if missing:
        raise ValueError(f"{path}: the weights lack tensors for {missing[:8]}")
    for buf_name, buf in lm.named_buffers():
        if buf.numel():  # to_empty left them uninitialised; every buffer here is recomputable
            raise ValueError(f"unexpected non-empty buffer {buf_name} after loading")
    lm.generation_config = read_generation_config(path)  # type: ignore[assignment]
    return lm.eval()


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def _hf_tensors(
    lm: nn.Module, arch: str, config: TransformerConfig
) -> Iterator[tuple[str, Tensor]]:
    params = dict(lm.named_parameters())
    for key, entry in weight_map(arch, config).items():
        t = params[entry.param].detach()
        if entry.rows is not None:
            t = t[entry.rows[0] : entry.rows[1]]
        if entry.rotary_heads is not None and config.rope_interleaved:
            t = permute_rotary_weight(t, entry.rotary_heads, to="split")
        yield key, (t.t() if entry.transpose else t).contiguous().cpu()


def save_pretrained(lm: nn.Module, path: str | Path, *, max_shard_size: int | None = None) -> Path:
    """Write ``lm`` as a Hugging Face folder ``transformers`` loads with the same outputs.

    Writes ``config.json``, ``generation_config.json`` (when ``lm.generation_config`` has ids)
    and ``model.safetensors`` (or shards of at most ``max_shard_size`` bytes plus
    ``model.safetensors.index.json``). Everything is written into a temporary folder beside
    ``path`` first; a new ``path`` is then renamed into place in one step, an existing folder
    gets each file moved in atomically (weights before ``config.json``; other files, such as a
    ``tokenizer.json``, are kept; stale shards are removed).

    Args:
        lm: A :class:`attnkit.TransformerLM`.
        path: Destination folder.
        max_shard_size: Shard the weights into files of at most this many bytes.

    Returns:
        ``path``.

    Raises:
        ValueError: If an option of the model has no counterpart (naming it), or a bad
            ``max_shard_size``.
    """
    config: TransformerConfig = lm.config  # type: ignore[assignment]
    hf = hf_config_from(config)
    arch = hf["architectures"][0]
    if max_shard_size is not None and max_shard_size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    dtype = next(lm.parameters()).dtype
    gen: dict[str, Any] = dict(getattr(lm, "generation_config", {}))
    hf |= {k: v for k, v in gen.items() if k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    hf["dtype"] = hf["torch_dtype"] = _HF_DTYPE_NAMES.get(dtype, "float32")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        shards: list[dict[str, Tensor]] = [{}]
        size = 0
        for key, t in _hf_tensors(lm, arch, config):
            if max_shard_size is not None and shards[-1] and size + t.nbytes > max_shard_size:
                shards.append({})
                size = 0
            shards[-1][key] = t
            size += t.nbytes
        names = (
            [WEIGHTS_NAME]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        for name, shard in zip(names, shards, strict=True):
            _write_safetensors(tmp / name, shard)
        if len(shards) > 1:
            total = sum(t.nbytes for s in shards for t in s.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: n for n, s in zip(names, shards, strict=True) for k in s},
            }
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
            names.append(INDEX_NAME)
        if gen:
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
            names.append("generation_config.json")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        names.append("config.json")
        if not path.exists():
            os.replace(tmp, path)
            return path
        stale = [p for p in path.glob("model*.safetensors*") if p.name not in names]
        for name in names:
            os.replace(tmp / name, path / name)
        for p in stale:
            p.unlink()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path
