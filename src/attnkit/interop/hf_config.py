"""Hugging Face ``config.json`` <-> :class:`attnkit.TransformerConfig`, both ways.

=====================  =================================================================
``LlamaForCausalLM``   RMSNorm, SwiGLU, rotary (``rope_scaling`` default/linear/llama3), GQA,
                       ``attention_bias``/``mlp_bias``, ``head_dim``, tied or untied head
``MistralForCausalLM`` Llama + ``sliding_window`` (attnkit's ``window``)
``Qwen2ForCausalLM``   Llama with biases on q/k/v only
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
    "GPT2LMHeadModel",
)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


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


def _rope(data: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` / ``rope_scaling``."""
    params = dict(data.get("rope_parameters") or {})
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


def _llama_config(data: dict[str, Any], arch: str) -> TransformerConfig:
    theta, scaling = _rope(data)
    act = data.get("hidden_act", "silu")
    window = data.get("sliding_window")
    checks: dict[str, tuple[Any, Any]] = {"hidden_act": (act, act == "silu")}
    if arch == "MistralForCausalLM":
        pass  # sliding_window (null or an int) maps to window
    elif arch == "Qwen2ForCausalLM":
        types = data.get("layer_types")
        if types is None:  # older configs: sliding layers from max_window_layers on
            first = data.get("max_window_layers", 0)
            use = bool(data.get("use_sliding_window", False))
            types = [
                "sliding_attention" if use and i >= first else "full_attention"
                for i in range(data["num_hidden_layers"])
            ]
        kinds = set(types)
        checks["layer_types"] = (
            types,
            kinds <= {"full_attention"} or kinds == {"sliding_attention"},
        )
        window = window if kinds == {"sliding_attention"} else None
    else:
        window = None  # Llama has no sliding window
    checks["pretraining_tp"] = (
        data.get("pretraining_tp", 1),
        data.get("pretraining_tp", 1) in (1, None),
    )
    _require(data, arch, checks)
    heads = data["num_attention_heads"]
    if arch == "Qwen2ForCausalLM":
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif arch == "MistralForCausalLM":
        qkv_bias = out_bias = mlp_bias = False
    else:
        qkv_bias = out_bias = bool(data.get("attention_bias", False))
        mlp_bias = bool(data.get("mlp_bias", False))
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
        rope_base=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        **FAMILIES["llama"],
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
        need("num_kv_heads", c.num_kv_heads, c.num_heads, fam)
        need("head_dim", c.head_dim, c.dim // c.num_heads, fam)
        need("window", c.window, None, fam)
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
    fam = "Llama/Mistral/Qwen2 (position='rope')"
    need("position", c.position, "rope", "GPT2LMHeadModel ('learned') or Llama ('rope')")
    need("norm", c.norm, "rmsnorm", fam)
    need("activation", c.activation, "swiglu", fam)
    check()
    common: dict[str, Any] = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
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
    if (qkv_bias, out_bias, mlp_bias) == (True, False, False):
        sliding = c.window is not None
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": sliding,
            "sliding_window": c.window,
            "max_window_layers": 0 if sliding else c.num_layers,
            "layer_types": [("sliding" if sliding else "full") + "_attention"] * c.num_layers,
        } | common
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
