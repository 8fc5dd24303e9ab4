"""Hugging Face ``config.json`` <-> :class:`attnkit.TransformerConfig`, both ways.

Both directions read the family's record (:class:`~attnkit.interop.architectures.Architecture`)
and nothing else: :func:`config_from_hf` finds the record of ``architectures`` (or
``model_type``) and maps the keys it names; :func:`hf_config_from` tries the records in
registration order and writes the first one that expresses every option of the config.

Every config option that changes the numbers is either mapped or rejected with an error naming
it; nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from attnkit.config import TransformerConfig, check_rope_scaling
from attnkit.interop.architectures import (
    EXTRA_FIELDS,
    Architecture,
    ConfigKeys,
    architectures,
    find,
    rope_parameters,
    supported,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "config_from_hf", "hf_config_from"]

#: The built-in architectures (more may be registered: :func:`.architectures.register`).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a.name for a in architectures())

_DEFAULTS = {f.name: f.default for f in fields(TransformerConfig)}
# Options a record fixes; checked in this order when saving (the activation after the norm).
_LAYOUT = ("causal", "norm_first", "position", "norm", "qk_norm", "post_norms", "scale_embeddings")


# --------------------------------------------------------------------------------------------
# config.json -> TransformerConfig
# --------------------------------------------------------------------------------------------


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


def _activation(arch: Architecture, data: dict[str, Any]) -> tuple[str, Any]:
    """``(key, name)`` of the activation: the first of the family's keys that is set."""
    for key in arch.keys.activation:
        if data.get(key):
            return key, data[key]
    return arch.keys.activation[0], next(iter(arch.activations))


def _sizes(keys: ConfigKeys, data: dict[str, Any]) -> dict[str, Any]:
    """The sizes the family's keys name (``KeyError`` for a required one that is missing)."""
    out: dict[str, Any] = {}
    for name in ConfigKeys.SIZES:
        key = getattr(keys, name)
        if key is None:
            continue
        value = data.get(key)
        if value is None:
            if name not in keys.defaults:
                raise KeyError(key)
            value = keys.defaults[name]
        out[name] = value
    out["eps"] = float(out["eps"])
    return out


def _biases(arch: Architecture, data: dict[str, Any]) -> dict[str, Any]:
    """The config's bias options: one ``bias`` when the three agree, else the three."""
    qkv, out, mlp = (b if isinstance(b, bool) else bool(data.get(b, False)) for b in arch.biases)
    if qkv == out == mlp:
        return {"bias": qkv}
    return {"bias": False, "qkv_bias": qkv, "out_bias": out, "mlp_bias": mlp}


def _read(arch: Architecture, data: dict[str, Any]) -> TransformerConfig:
    key, act = _activation(arch, data)
    bad = {k: data.get(k, ok[0]) for k, ok in arch.fixed.items() if data.get(k, ok[0]) not in ok}
    if act not in arch.activations:
        bad = {key: act} | bad
    if bad:
        raise ValueError(
            f"{arch.name} config options not supported by attnkit (they change the outputs): {bad}"
        )
    options: dict[str, Any] = dict(arch.options) | {"activation": arch.activations[act]}
    if arch.position == "rope":
        options["rope_base"], options["rope_scaling"] = _rope(data)
    for extra in arch.extras:
        options |= extra.read(data)
    sizes = _sizes(arch.keys, data)
    window, types = arch.sliding.read(data, sizes["num_layers"])
    return TransformerConfig(
        **sizes,
        **options,
        **_biases(arch, data),
        window=window,
        layer_types=types,
        tie_embeddings=bool(data.get("tie_word_embeddings", arch.tie_default)),
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
    names = list(data.get("architectures") or [])
    arch = find(names, data.get("model_type"))
    if arch is None:
        raise ValueError(
            f"unsupported architecture {names or data.get('model_type')!r}; supported: "
            f"{supported()}"
        )
    if data.get("quantization_config"):
        method = data["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"quantized checkpoints are not supported (quantization_config: {method}); "
            "use the unquantized weights"
        )
    try:
        return arch.name, _read(arch, data)
    except KeyError as err:
        raise ValueError(f"config.json of {arch.name} lacks the key {err.args[0]!r}") from None


# --------------------------------------------------------------------------------------------
# TransformerConfig -> config.json
# --------------------------------------------------------------------------------------------


def _resolved_biases(c: TransformerConfig) -> tuple[bool, bool, bool]:
    return (
        c.bias if c.qkv_bias is None else c.qkv_bias,
        c.bias if c.out_bias is None else c.out_bias,
        c.bias if c.mlp_bias is None else c.mlp_bias,
    )


def _problems(arch: Architecture, c: TransformerConfig) -> list[str]:
    """The options of ``c`` that ``arch``'s ``config.json`` cannot express (empty: none)."""
    out: list[str] = []

    def need(option: str, value: Any, wanted: Any) -> None:
        if value != wanted:
            out.append(f"{option}={value!r} (needs {wanted!r})")

    # The layout options, then any other the family fixes (rotary pairs are permuted instead).
    fixed = [*_LAYOUT, *(k for k in arch.options if k not in _LAYOUT and k != "rope_interleaved")]
    for option in fixed:
        need(option, getattr(c, option), arch.options.get(option, _DEFAULTS[option]))
        if option == "norm" and c.activation not in arch.activations.values():
            acts = sorted(set(arch.activations.values()))
            out.append(f"activation={c.activation!r} (needs one of {acts})")
    if arch.keys.num_kv_heads is None:
        need("num_kv_heads", c.num_kv_heads, c.num_heads)
    if arch.keys.head_dim is None:
        need("head_dim", c.head_dim, c.dim // c.num_heads)
    shared: dict[str, tuple[str, bool]] = {}
    for option, want, got in zip(
        ("qkv_bias", "out_bias", "mlp_bias"), arch.biases, _resolved_biases(c), strict=True
    ):
        if isinstance(want, bool):
            need(option, got, want)
        elif shared.setdefault(want, (option, got))[1] != got:
            first, value = shared[want]
            out.append(f"{first}={value} with {option}={got} ({want} sets both)")
    out += arch.sliding.problems(c)
    covered = {name for extra in arch.extras for name in extra.fields}
    for option in EXTRA_FIELDS:
        if option not in covered:
            need(option, getattr(c, option), None)
    out += [p for extra in arch.extras if (p := extra.problem(c)) is not None]
    return out


def _write(arch: Architecture, c: TransformerConfig) -> dict[str, Any]:
    data: dict[str, Any] = {"architectures": [arch.name], "model_type": arch.model_type}
    for name in ConfigKeys.SIZES:
        key = getattr(arch.keys, name)
        if key is not None:
            data[key] = getattr(c, name)
    act = next(k for k, v in arch.activations.items() if v == c.activation)
    data |= dict.fromkeys(arch.keys.activation, act)
    data["tie_word_embeddings"] = c.tie_embeddings
    for want, got in zip(arch.biases, _resolved_biases(c), strict=True):
        if isinstance(want, str):
            data[want] = got
    if arch.position == "rope":
        data |= {"rope_theta": c.rope_base, "rope_parameters": rope_parameters(c)}
        if c.rope_scaling is not None:
            data["rope_scaling"] = dict(c.rope_scaling)
    data |= arch.sliding.write(c)
    for extra in arch.extras:
        data |= extra.write(c)
    return data | {k: ok[0] for k, ok in arch.fixed.items()} | dict(arch.constants)


def hf_config_from(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face architecture equivalent to ``config``.

    The first registered architecture (that saves) whose record expresses every option of
    ``config`` (GPT-2 for learned positions with LayerNorm and biases everywhere; for rotary
    positions, RMSNorm and SwiGLU: Llama, Mistral for a sliding window, Qwen2 for biases on
    q/k/v only, Qwen3 for qk-norm; Gemma 2/3 for ``rmsnorm_plus_one``). Interleaved rotary
    pairs are saved as Hugging Face's halves by permuting each head's query/key channels (same
    scores, same outputs).

    Raises:
        ValueError: Naming the options that have no counterpart in the closest architecture
            (the one with the same positions and the fewest such options), or the config's
            ``score_mod`` / ``mask_mod`` (no Hugging Face architecture has them).
    """
    variants = {n: getattr(config, n) for n in ("score_mod", "mask_mod") if getattr(config, n)}
    if variants:
        raise ValueError(
            "this model cannot be saved as a Hugging Face folder: no architecture there has the "
            f"attention variants {variants}"
        )
    found: dict[str, list[str]] = {}
    for arch in architectures():
        if arch.saves:
            found[arch.name] = problems = _problems(arch, config)
            if not problems:
                return _write(arch, config)
    by_name = {a.name: a for a in architectures()}
    closest = min(found, key=lambda n: (by_name[n].position != config.position, len(found[n])))
    raise ValueError(
        "this model cannot be saved as a Hugging Face folder; options without a counterpart "
        f"in {closest}, the closest architecture: {'; '.join(found[closest])}"
    )
