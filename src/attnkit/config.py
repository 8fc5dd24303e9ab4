"""One frozen description of a transformer stack: :class:`TransformerConfig` and named presets.

:class:`attnkit.TransformerLM` and :class:`attnkit.TransformerEncoder` are built from a
:class:`TransformerConfig` (their keyword form builds one); the lab, checkpoints' ``config.json``
and checkpoint loaders read and write it with :meth:`TransformerConfig.to_dict` /
:meth:`TransformerConfig.from_dict`. The defaults are those of :class:`attnkit.TransformerLM`
(GPT-2-like: pre-norm LayerNorm, GELU, rotary positions, a tied output head).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "FLEX_VARIANTS",
    "PRESETS",
    "ROPE_SCALING_KEYS",
    "TransformerConfig",
    "check_flex_spec",
    "check_sizes",
]

PositionType = Literal["none", "sinusoidal", "learned", "rope"]
POSITIONS: tuple[str, ...] = ("none", "sinusoidal", "learned", "rope")
NORMS: tuple[str, ...] = ("layernorm", "rmsnorm", "rmsnorm_plus_one")
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh")
#: Per-layer attention kinds (``layer_types``), named as Hugging Face's configs name them.
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")

# Required keys of each rotary scaling type (Hugging Face's ``rope_scaling`` semantics).
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


FLEX_VARIANTS: dict[str, tuple[str, dict[str, type]]] = {
    "alibi": ("score_mod", {}),
    "relative_bias": ("score_mod", {"max_distance": int}),
    "softcap": ("score_mod", {"cap": float}),
    "prefix_lm": ("mask_mod", {"prefix": int}),
    "sliding_window": ("mask_mod", {"window": int}),
    "dilated": ("mask_mod", {"dilation": int}),
}
"""The named attention variants a config can hold (:mod:`attnkit.flex.presets`): name -> (the
field that takes it, its parameters and their types). Built by
:class:`attnkit.variants.FlexVariant`; the presets that depend on the batch (``document``,
``padding``) are inputs of ``forward`` (segment ids, a padding mask), not options."""
_BATCH_VARIANTS = ("document", "padding")

#: A config's ``score_mod`` / ``mask_mod``: a named variant (``"alibi"``,
#: ``{"name": "sliding_window", "window": 256}``) or, in memory only, a plain callable.
FlexSpec = dict[str, Any] | Callable[..., Any]


def check_flex_spec(spec: Any, field: str) -> FlexSpec | None:
    """Validate a ``score_mod`` / ``mask_mod`` option and return its normal form.

    Args:
        spec: ``None``, a variant name, a ``{"name": ..., **parameters}`` dict naming one of
            :data:`FLEX_VARIANTS`, or a callable (``score_mod(score, b, h, q_idx, kv_idx)`` /
            ``mask_mod(b, h, q_idx, kv_idx)``).
        field: ``"score_mod"`` or ``"mask_mod"``: which kind of variant is expected.

    Returns:
        ``None``, the callable, or a new dict ``{"name": name, **parameters}``.

    Raises:
        TypeError: If ``spec`` is none of these, or a parameter has the wrong type.
        ValueError: Naming an unknown variant, one of the other field's kind, missing or
            unknown parameters, or a parameter that is not positive.
    """
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"{field} must be a variant name, a {{'name': ...}} dict or a callable, got {spec!r}"
        )
    data = dict(spec)
    name = data.pop("name", None)
    if name in _BATCH_VARIANTS:
        raise ValueError(
            f"{field} {name!r} depends on the batch: pass segment ids or a padding mask to the "
            "model's forward instead"
        )
    ours = sorted(n for n, (kind, _) in FLEX_VARIANTS.items() if kind == field)
    if name not in FLEX_VARIANTS:
        raise ValueError(f"unknown {field} variant {name!r}; named variants: {ours}")
    kind, params = FLEX_VARIANTS[name]
    if kind != field:
        raise ValueError(f"{name!r} is a {kind}, not a {field}; {field} variants: {ours}")
    missing = sorted(set(params) - set(data))
    unknown = sorted(set(data) - set(params))
    if missing or unknown:
        raise ValueError(
            f"{field} {name!r} takes the parameters {sorted(params)}; missing {missing}, "
            f"unknown {unknown}"
        )
    for key, want in params.items():
        value = data[key]
        ok_type = int if want is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type):
            raise TypeError(f"{field} {name!r}: {key} must be {want.__name__}, got {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{field} {name!r}: {key} must be positive, got {value!r}")
    return {"name": name, **data}


def check_sizes(sizes: Mapping[str, int | None], *, what: str = "sizes") -> None:
    """Check that every given size is a positive int (``None`` means not given).

    Args:
        sizes: Name -> value.
        what: How the messages name the sizes (e.g. ``"KVCache sizes"``).

    Raises:
        TypeError: Naming the values that are not ints (a bool is not a size).
        ValueError: Naming the values below 1.
    """
    given = {k: v for k, v in sizes.items() if v is not None}
    not_int = {k: v for k, v in given.items() if isinstance(v, bool) or not isinstance(v, int)}
    if not_int:
        raise TypeError(f"{what} must be ints, got {not_int}")
    bad = {k: v for k, v in given.items() if v < 1}
    if bad:
        raise ValueError(f"{what} must be positive, got {bad}")


def check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validate a ``rope_scaling`` dict and return a normalised copy (``rope_type`` key).

    Accepts Hugging Face's forms: ``{"rope_type": "llama3", "factor": 8.0, ...}`` or the legacy
    ``{"type": "linear", "factor": 2.0}``. ``None`` and type ``"default"`` mean no scaling.

    Raises:
        TypeError: If ``scaling`` is not a dict or a value is not a number.
        ValueError: For an unknown type, missing or unknown keys, or out-of-range values.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {scaling!r}")
    data = dict(scaling)
    kind = data.pop("rope_type", None)
    legacy = data.pop("type", None)
    if kind is not None and legacy is not None and kind != legacy:
        raise ValueError(f"rope_scaling has rope_type {kind!r} and type {legacy!r}")
    kind = kind if kind is not None else legacy
    if kind == "default" and not data:
        return None
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"rope_scaling type must be one of {sorted(ROPE_SCALING_KEYS)} (or 'default'), "
            f"got {kind!r}"
        )
    need = ROPE_SCALING_KEYS[kind]
    missing = [k for k in need if k not in data]
    unknown = sorted(set(data) - set(need))
    if missing or unknown:
        raise ValueError(
            f"rope_scaling type {kind!r} needs keys {list(need)}; missing {missing}, "
            f"unsupported {unknown}"
        )
    bad = {
        k: v
        for k, v in data.items()
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
    }
    if bad:
        raise TypeError(f"rope_scaling values must be finite numbers, got {bad}")
    if data["factor"] <= 0:
        raise ValueError(f"rope_scaling factor must be > 0, got {data['factor']}")
    if kind == "llama3":
        lo, hi = data["low_freq_factor"], data["high_freq_factor"]
        if not 0 < lo < hi or data["original_max_position_embeddings"] <= 0:
            raise ValueError(
                "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor and "
                f"original_max_position_embeddings > 0, got {data}"
            )
    return {"rope_type": kind, **data}


@dataclass(frozen=True)
class TransformerConfig:
    """The shape and options of a transformer stack (encoder or decoder LM).

    Attributes:
        vocab_size: Token vocabulary ``V``; ``None`` only for an encoder fed vectors.
        dim: Model dim ``D``.
        num_layers: Number of blocks.
        num_heads: Query heads ``H``.
        num_kv_heads: Key/value heads ``K`` (grouped-query attention); ``None`` = ``num_heads``
            (stored resolved: the field always holds an int after construction).
        head_dim: Head dim ``E``; ``None`` = ``dim // num_heads`` (which must then divide;
            stored resolved).
        ffn_dim: Feed-forward hidden dim; ``None`` = ``4 * dim`` (stored resolved). The keyword
            ``hidden_dim`` is a deprecated alias.
        max_seq_len: Rows of the sinusoidal/learned tables; longest sequence an LM generates.
        position: ``"rope"``, ``"sinusoidal"``, ``"learned"`` or ``"none"``.
        causal: Causal attention (a :class:`attnkit.TransformerLM` needs ``True``).
        norm_first: Pre-norm blocks plus a final norm, or post-norm blocks.
        norm: ``"layernorm"``, ``"rmsnorm"`` or ``"rmsnorm_plus_one"`` (Gemma's RMSNorm, which
            scales by ``1 + weight`` in float32).
        activation: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"swiglu"`` or
            ``"geglu_tanh"`` (gated tanh-GELU, Gemma).
        eps: Norm epsilon.
        dropout: Dropout after the embeddings and inside the blocks.
        bias: Default for every projection bias below.
        qkv_bias: Biases of the query/key/value projections (``None`` = ``bias``).
        out_bias: Bias of the attention output projection (``None`` = ``bias``).
        mlp_bias: Biases of the feed-forward projections (``None`` = ``bias``).
        window: Sliding-window attention size (``None``: full attention).
        rope_base: Rotary wavelength base (Hugging Face's ``rope_theta``).
        rope_interleaved: Rotary pairs are adjacent channels (the blog) instead of halves
            (Hugging Face: ``False``).
        rope_scaling: ``None`` or a Hugging Face ``rope_scaling`` dict of type ``"linear"``
            (``factor``) or ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``).
        tie_embeddings: The LM's output head is the token embedding (``False``: a separate
            ``lm_head`` ``Linear`` without bias).
        qk_norm: Normalise each head's queries and keys (the config's ``norm`` over the head
            dim, one weight shared by the heads) before rotary positions (Qwen3, Gemma 3).
        attn_scale: Score multiplier; ``None`` = ``1 / sqrt(head_dim)`` (Gemma's
            ``query_pre_attn_scalar ** -0.5``).
        attn_softcap: Attention-logit soft-capping ``tanh(s / c) * c`` (Gemma 2).
        logit_softcap: Final-logit soft-capping ``tanh(z / c) * c`` (Gemma 2).
        layer_types: Per-layer ``"full_attention"`` / ``"sliding_attention"`` (Hugging Face's
            ``layer_types``); sliding layers use ``window``. ``None``: every layer uses
            ``window``.
        rope_local_base: Rotary base of the sliding layers (Gemma 3's
            ``rope_local_base_freq``); ``None``: ``rope_base`` everywhere.
        scale_embeddings: Multiply the token embeddings by ``sqrt(dim)`` (Gemma).
        post_norms: Also normalise the attention and feed-forward outputs before their
            residual adds (Gemma 2/3; needs ``norm_first``).
        score_mod: An attention variant that rewrites the scores (ALiBi, a learnable relative
            bias, soft-capping), run through :mod:`attnkit.flex`: a name or
            ``{"name": ..., **parameters}`` dict of :data:`FLEX_VARIANTS` (serialisable), or a
            callable ``score_mod(score, b, h, q_idx, kv_idx)`` (in memory only). Positions are
            absolute (a cached decoding step sees its query's own position).
        mask_mod: An attention variant that says which keys a query may see (prefix-LM,
            sliding window, dilated), as ``score_mod``; a callable is
            ``mask_mod(b, h, q_idx, kv_idx) -> bool``. The named masks are causal by themselves
            (a prefix-LM after its prefix); a callable is combined with the causal mask when
            ``causal``.

    Raises:
        TypeError: If a size is not an int or ``rope_scaling`` not a dict.
        ValueError: Naming the offending values, for bad sizes or option values.
    """

    vocab_size: int | None
    dim: int
    num_layers: int
    num_heads: int
    # Given as None for "the default", stored resolved (__post_init__): always ints after it.
    num_kv_heads: int = None  # type: ignore[assignment]
    head_dim: int = None  # type: ignore[assignment]
    ffn_dim: int = None  # type: ignore[assignment]
    max_seq_len: int = 1024
    position: PositionType = "rope"
    causal: bool = True
    norm_first: bool = True
    norm: Literal["layernorm", "rmsnorm", "rmsnorm_plus_one"] = "layernorm"
    activation: Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh"] = "gelu"
    eps: float = 1e-5
    dropout: float = 0.0
    bias: bool = True
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    window: int | None = None
    rope_base: float = 10_000.0
    rope_interleaved: bool = True
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = True
    qk_norm: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_base: float | None = None
    scale_embeddings: bool = False
    post_norms: bool = False
    score_mod: FlexSpec | None = None
    mask_mod: FlexSpec | None = None

    def __post_init__(self) -> None:
        sizes: dict[str, int | None] = {  # None: not given
            "vocab_size": self.vocab_size,
            "dim": self.dim,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "ffn_dim": self.ffn_dim,
            "max_seq_len": self.max_seq_len,
            "window": self.window,
        }
        check_sizes(sizes)
        flags = (
            "causal",
            "norm_first",
            "bias",
            "rope_interleaved",
            "tie_embeddings",
            "qk_norm",
            "scale_embeddings",
            "post_norms",
        )
        opt_flags = ("qkv_bias", "out_bias", "mlp_bias")
        not_bool = {k: getattr(self, k) for k in flags if not isinstance(getattr(self, k), bool)}
        not_bool |= {
            k: getattr(self, k)
            for k in opt_flags
            if getattr(self, k) is not None and not isinstance(getattr(self, k), bool)
        }
        if not_bool:
            raise TypeError(f"these options must be bools, got {not_bool}")
        choices = {"position": POSITIONS, "norm": NORMS, "activation": ACTIVATIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.head_dim is None and self.dim % self.num_heads:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads}) "
                "unless head_dim is given"
            )
        # Frozen: resolve the defaults through object.__setattr__, so that each size has one
        # name and one value (``config.num_kv_heads`` is always an int).
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.num_heads)
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.dim)
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.position == "rope" and self.attn_head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a positive number, got {self.eps}")
        if not (math.isfinite(self.rope_base) and self.rope_base > 1.0):
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        positive = {"attn_scale": self.attn_scale, "attn_softcap": self.attn_softcap}
        positive["logit_softcap"] = self.logit_softcap
        bad = {
            k: v
            for k, v in positive.items()
            if v is not None
            and (isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf)
        }
        if bad:
            raise ValueError(f"these options must be positive finite numbers or None, got {bad}")
        if self.rope_local_base is not None and not (
            math.isfinite(self.rope_local_base) and self.rope_local_base > 1.0
        ):
            raise ValueError(f"rope_local_base must be > 1, got {self.rope_local_base}")
        if self.post_norms and not self.norm_first:
            raise ValueError("post_norms (norms after attention and MLP) need norm_first=True")
        # Frozen: normalise through object.__setattr__ (a private copy, HF keys).
        object.__setattr__(self, "rope_scaling", check_rope_scaling(self.rope_scaling))
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            unknown = sorted({t for t in types if t not in LAYER_TYPES})
            if unknown or len(types) != self.num_layers:
                raise ValueError(
                    f"layer_types must name {self.num_layers} layers, each one of "
                    f"{LAYER_TYPES}; got {len(types)} with unknown {unknown}"
                )
            if "sliding_attention" in types and self.window is None:
                raise ValueError("layer_types has sliding_attention layers but window is None")
            object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "score_mod", check_flex_spec(self.score_mod, "score_mod"))
        object.__setattr__(self, "mask_mod", check_flex_spec(self.mask_mod, "mask_mod"))
        if self.mask_mod is not None and (self.window is not None or self.layer_types):
            raise ValueError(
                f"give window ({self.window}) / layer_types or mask_mod ({self.mask_mod!r}), not "
                "both (a window is the mask_mod {'name': 'sliding_window', 'window': w})"
            )
        if self.score_mod is not None and self.attn_softcap is not None:
            raise ValueError(
                f"give attn_softcap ({self.attn_softcap}) or score_mod ({self.score_mod!r}), not "
                "both (a cap is the score_mod {'name': 'softcap', 'cap': c})"
            )

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (``None``: full attention).

        Without ``layer_types`` every layer has ``window``; with them, only the
        ``"sliding_attention"`` layers.
        """
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.window
        return None

    # Deprecated aliases, kept so that code written against 0.2 still runs.

    @property
    def kv_heads(self) -> int:
        """Deprecated alias of :attr:`num_kv_heads`."""
        return int(self.num_kv_heads or self.num_heads)

    @property
    def attn_head_dim(self) -> int:
        """Deprecated alias of :attr:`head_dim`."""
        return int(self.head_dim or self.dim // self.num_heads)

    @property
    def hidden_dim(self) -> int:
        """Deprecated alias of :attr:`ffn_dim`."""
        return int(self.ffn_dim or 4 * self.dim)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict of every field (inverse: :meth:`from_dict`).

        Raises:
            ValueError: If ``score_mod`` or ``mask_mod`` is a callable (only named variants
                serialise).
        """
        for name in ("score_mod", "mask_mod"):
            spec = getattr(self, name)
            if callable(spec):
                raise ValueError(
                    f"{name} is the callable {getattr(spec, '__name__', spec)!r}, which cannot "
                    f"be serialised; use a named variant ({sorted(FLEX_VARIANTS)}) to save it"
                )
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Build a config from :meth:`to_dict`'s output (missing fields take their defaults).

        Raises:
            ValueError: If ``data`` has keys that are not fields (naming them).
        """
        names = {f.name for f in fields(cls)} | {"hidden_dim"}  # 0.2's name of ffn_dim
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields {unknown}")
        if "hidden_dim" in data:  # the warning points at the caller's line, not this one
            data = dict(data)
            hidden_dim = data.pop("hidden_dim")
            if data.get("ffn_dim") not in (None, hidden_dim):
                raise ValueError(
                    f"got ffn_dim={data['ffn_dim']} and its deprecated alias "
                    f"hidden_dim={hidden_dim}"
                )
            warnings.warn(
                "TransformerConfig.from_dict: the key 'hidden_dim' is deprecated; use 'ffn_dim'",
                DeprecationWarning,
                stacklevel=2,
            )
            data["ffn_dim"] = hidden_dim
        return cls(**data)

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed (validated again).

        A size left at its default follows the sizes it derives from: replacing ``num_heads``
        of a config whose ``head_dim`` was ``dim // num_heads`` derives ``head_dim`` again.
        """
        derived = {
            "num_kv_heads": self.num_heads,
            "head_dim": self.dim // self.num_heads,
            "ffn_dim": 4 * self.dim,
        }
        for name, default in derived.items():
            if name not in changes and getattr(self, name) == default:
                changes[name] = None
        return replace(self, **changes)


#: What each model family sets beyond its sizes. The presets below, the models' keyword forms and
#: the checkpoint loaders (:mod:`attnkit.interop`) all start from these.
FAMILIES: dict[str, dict[str, Any]] = {
    # The blog's encoder block: post-norm LayerNorm, ReLU, sinusoidal positions added once.
    "blog": {"position": "sinusoidal", "causal": False, "norm_first": False, "activation": "relu"},
    # BERT: the blog's layout with learned positions, exact GELU and LayerNorm eps 1e-12.
    "bert": {
        "position": "learned",
        "causal": False,
        "norm_first": False,
        "activation": "gelu",
        "eps": 1e-12,
    },
    # GPT-2: pre-norm LayerNorm, learned positions, tanh-approximated GELU, biases.
    "gpt2": {"position": "learned", "activation": "gelu_tanh"},
    # Llama (and Mistral, Qwen2): RMSNorm, SwiGLU, no biases, rotary pairs in halves (Hugging
    # Face's layout).
    "llama": {
        "position": "rope",
        "norm": "rmsnorm",
        "activation": "swiglu",
        "bias": False,
        "rope_interleaved": False,
    },
}

_BLOG, _GPT2 = FAMILIES["blog"], FAMILIES["gpt2"]
# The Llama presets: GQA with 4 key/value heads, 2048 positions.
_LLAMA = {**FAMILIES["llama"], "num_kv_heads": 4, "max_seq_len": 2048}

PRESETS: dict[str, TransformerConfig] = {
    # The lab's tagger at its defaults (LabConfig().model_config(), reversal task vocabulary).
    "lab-default": TransformerConfig(
        vocab_size=12, dim=64, num_layers=2, num_heads=4, ffn_dim=128, max_seq_len=64, **_BLOG
    ),
    # A GPT-2-small-shaped LM at attnkit's defaults.
    "gpt2-small": TransformerConfig(
        vocab_size=50257, dim=768, num_layers=12, num_heads=12, **_GPT2
    ),
    "llama-tiny": TransformerConfig(
        vocab_size=32000, dim=256, num_layers=4, num_heads=8, ffn_dim=688, **_LLAMA
    ),
    # Llama-shaped, about 100M parameters with tied embeddings.
    "llama-100m": TransformerConfig(
        vocab_size=32000, dim=768, num_layers=12, num_heads=12, ffn_dim=2048, **_LLAMA
    ),
}


def _accept_hidden_dim(generated: Any) -> Any:
    """Wrap the generated ``__init__`` so the deprecated keyword ``hidden_dim`` sets ``ffn_dim``."""

    def init(self: TransformerConfig, *args: Any, hidden_dim: int | None = None, **kw: Any) -> None:
        if hidden_dim is not None:
            if kw.get("ffn_dim") not in (None, hidden_dim):
                raise ValueError(
                    f"got ffn_dim={kw['ffn_dim']} and its deprecated alias hidden_dim={hidden_dim}"
                )
            warnings.warn(
                "TransformerConfig(hidden_dim=...) is deprecated; use ffn_dim",
                DeprecationWarning,
                stacklevel=2,
            )
            kw["ffn_dim"] = hidden_dim
        generated(self, *args, **kw)

    init.__doc__ = generated.__doc__
    return init


TransformerConfig.__init__ = _accept_hidden_dim(TransformerConfig.__init__)  # type: ignore[method-assign]
