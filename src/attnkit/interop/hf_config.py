"""Hugging Face ``config.json`` <-> :class:`attnkit.TransformerConfig`, both ways.

=====================  =================================================================
``LlamaForCausalLM``   RMSNorm, SwiGLU, rotary (``rope_scaling`` default/linear/llama3), GQA,
                       ``attention_bias``/``mlp_bias``, ``head_dim``, tied or untied head
``MistralForCausalLM`` Llama + ``sliding_window`` (attnkit's ``window``)
``Qwen2ForCausalLM``   Llama with biases on q/k/v only; sliding, full or mixed layers
``Qwen3ForCausalLM``   Qwen2's layers with qk-norm and an explicit ``head_dim``
``Phi3ForCausalLM``    Llama with fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint
``Gemma2ForCausalLM``  ``(1 + w)`` RMSNorm, GeGLU, norms after attention and MLP, scaled
                       embeddings, soft-capping, ``query_pre_attn_scalar``, alternating layers
``Gemma3ForCausalLM``  Gemma 2 without soft-capping, with qk-norm and a local rotary base
``GPT2LMHeadModel``    LayerNorm, learned positions, fused ``c_attn`` ``Conv1D`` weights,
                       ``gelu_new`` (tanh GELU)
=====================  =================================================================

Every config option that changes the numbers is either mapped or rejected with an error naming
it; nothing is silently ignored.
"""

from __future__ import annotations

from typing import Any

from attnkit.config import FAMILIES, TransformerConfig, check_rope_scaling

__all__ = ["SUPPORTED_ARCHITECTURES", "config_from_hf", "hf_config_from"]

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
    want_act = "gelu_pytorch_tanh" if gemma else "silu"  # the only one, and the default
    act = data.get("hidden_activation") or data.get("hidden_act") or want_act
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
