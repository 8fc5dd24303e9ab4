"""One record per model architecture: what a family's checkpoints say, in attnkit's terms.

An :class:`Architecture` names a family three ways (the Hugging Face architecture, its
``model_type`` and llama.cpp's ``general.architecture``) and holds everything the loaders and
savers need to know about it: the ``config.json`` keys of its sizes, the attnkit options every
checkpoint of the family has, its activation names, where its biases are configured, how it says
which layers slide, the options only it carries (soft-capping, a local rotary base, ...) and its
tensor names in both formats. :mod:`~attnkit.interop.hf_config`,
:mod:`~attnkit.interop.hf_weights` and :mod:`~attnkit.interop.gguf` read nothing else, so a family
that combines options attnkit already has is one more record (:func:`register`).

=====================  =================================================================
``LlamaForCausalLM``   RMSNorm, SwiGLU, rotary (``rope_scaling`` default/linear/llama3), GQA,
                       ``attention_bias``/``mlp_bias``, ``head_dim``, tied or untied head
``MistralForCausalLM`` Llama + ``sliding_window`` (attnkit's ``window``)
``Qwen2ForCausalLM``   Llama with biases on q/k/v only; sliding, full or mixed layers
``Qwen3ForCausalLM``   Qwen2's layers with qk-norm and an explicit ``head_dim``
``Phi3ForCausalLM``    Llama with fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint
``Gemma2ForCausalLM``  ``(1 + w)`` RMSNorm, GeGLU, norms after attention and MLP, scaled
                       embeddings, soft-capping, ``query_pre_attn_scalar``, alternating layers
``Gemma3ForCausalLM``  Gemma 2 with qk-norm and a local rotary base
``GPT2LMHeadModel``    LayerNorm, learned positions, fused ``c_attn`` ``Conv1D`` weights,
                       ``gelu_new`` (tanh GELU)
=====================  =================================================================

GGUF files: ``llama`` (which llama.cpp also writes for Mistral-style models), ``qwen2`` and
``qwen3``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal

from attnkit.config import ACTIVATIONS, FAMILIES, TransformerConfig

__all__ = [
    "GEMMA2",
    "GEMMA3",
    "GEMMA_TENSORS",
    "GPT2",
    "GPT2_KEYS",
    "GPT2_TENSORS",
    "LLAMA",
    "LLAMA_GGUF_TENSORS",
    "LLAMA_KEYS",
    "LLAMA_TENSORS",
    "LOCAL_ROPE_BASE",
    "MISTRAL",
    "PHI3",
    "PHI3_TENSORS",
    "QUERY_PRE_ATTN_SCALAR",
    "QWEN2",
    "QWEN3",
    "SOFTCAPPING",
    "Architecture",
    "ConfigKeys",
    "ConfigOption",
    "GGUFFormat",
    "SlidingLayers",
    "TensorNames",
    "architecture",
    "architectures",
    "find",
    "find_gguf",
    "register",
    "supported",
    "unregister",
]

#: The kinds of attention a layer can have (Hugging Face's ``layer_types`` values).
FULL, SLIDING = "full_attention", "sliding_attention"


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


# --------------------------------------------------------------------------------------------
# The parts of a record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigKeys:
    """The ``config.json`` keys of a family's sizes, as fields named like
    :class:`~attnkit.TransformerConfig`'s.

    ``None`` for ``num_kv_heads`` or ``head_dim``: the family has no such key, so the size is
    attnkit's derived default (``num_heads``, ``dim // num_heads``). ``activation`` lists the
    keys that may name the activation, the first found wins (all are written). ``defaults``
    holds the value of a key ``config.json`` may omit (``None``: attnkit derives the size); a
    key without a default is required.
    """

    vocab_size: str = "vocab_size"
    dim: str = "hidden_size"
    num_layers: str = "num_hidden_layers"
    num_heads: str = "num_attention_heads"
    num_kv_heads: str | None = "num_key_value_heads"
    head_dim: str | None = "head_dim"
    ffn_dim: str = "intermediate_size"
    max_seq_len: str = "max_position_embeddings"
    eps: str = "rms_norm_eps"
    activation: tuple[str, ...] = ("hidden_act",)
    defaults: Mapping[str, Any] = field(
        default_factory=lambda: _frozen(
            {"num_kv_heads": None, "head_dim": None, "max_seq_len": 2048, "eps": 1e-6}
        )
    )

    #: The size fields, in the order they are read and written.
    SIZES = (
        "vocab_size",
        "dim",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "ffn_dim",
        "max_seq_len",
        "eps",
    )


LLAMA_KEYS = ConfigKeys()
GPT2_KEYS = ConfigKeys(
    dim="n_embd",
    num_layers="n_layer",
    num_heads="n_head",
    num_kv_heads=None,
    head_dim=None,
    ffn_dim="n_inner",
    max_seq_len="n_positions",
    eps="layer_norm_epsilon",
    activation=("activation_function",),
    defaults=_frozen({"ffn_dim": None, "eps": 1e-5}),
)


@dataclass(frozen=True)
class SlidingLayers:
    """How a family's ``config.json`` says which layers attend through a sliding window.

    Every kind reads ``layer_types`` when the config has it; without it:

    * ``"none"``: no sliding window (a ``sliding_window`` key is not read).
    * ``"all"``: every layer slides by ``sliding_window`` (``None``: none does).
    * ``"max_window_layers"``: with ``use_sliding_window``, the layers from
      ``max_window_layers`` on slide (Qwen2's older configs).
    * ``"pattern"``: every ``every``-th layer is global, the others slide; ``every_key`` names
      the config key that may set ``every`` (Gemma).
    """

    kind: Literal["none", "all", "max_window_layers", "pattern"]
    every: int = 0
    every_key: str | None = None

    def __post_init__(self) -> None:
        kinds = ("none", "all", "max_window_layers", "pattern")
        if self.kind not in kinds:
            raise ValueError(f"SlidingLayers kind must be one of {kinds}, got {self.kind!r}")
        if self.kind == "pattern" and self.every < 1:
            raise ValueError(f"a 'pattern' of sliding layers needs every >= 1, got {self.every}")

    def read(self, data: dict[str, Any], n: int) -> tuple[int | None, tuple[str, ...] | None]:
        """``(window, layer_types)`` of the ``config.json`` of ``n`` layers, as
        :class:`TransformerConfig` takes them (``layer_types`` ``None`` when every layer has the
        same kind)."""
        window = None if self.kind == "none" else data.get("sliding_window")
        types: list[str] | None = None
        if data.get("layer_types") is not None:
            types = list(data["layer_types"])
        elif self.kind == "max_window_layers":
            first = data.get("max_window_layers", 0)
            use = bool(data.get("use_sliding_window", False))
            types = [SLIDING if use and i >= first else FULL for i in range(n)]
        elif self.kind == "pattern":
            every = data.get(self.every_key, self.every) if self.every_key else self.every
            types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
        if types is not None:
            kinds = set(types)
            if kinds <= {FULL}:
                return None, None
            if kinds == {SLIDING}:
                return window, None  # every layer slides: one window for all
        return window, None if types is None else tuple(types)

    def problems(self, c: TransformerConfig) -> list[str]:
        """What of ``c``'s windows this kind cannot write."""
        if self.kind == "none" and (c.window, c.layer_types) != (None, None):
            return [f"window={c.window!r}, layer_types={c.layer_types!r} (needs no window)"]
        if self.kind == "all" and c.layer_types is not None:
            return [f"layer_types={c.layer_types!r} (needs one window for every layer)"]
        return []

    def write(self, c: TransformerConfig) -> dict[str, Any]:
        """The ``config.json`` keys of ``c``'s windows."""
        if self.kind == "none":
            return {}
        if self.kind == "all":
            return {"sliding_window": c.window}
        kinds = list(c.layer_types or [SLIDING if c.window is not None else FULL] * c.num_layers)
        if self.kind == "pattern":  # the config needs a window even with no sliding layer
            return {"sliding_window": c.window or c.max_seq_len, "layer_types": kinds}
        return {
            "use_sliding_window": SLIDING in kinds,
            "sliding_window": c.window,
            "max_window_layers": kinds.index(SLIDING) if SLIDING in kinds else c.num_layers,
            "layer_types": kinds,
        }


def _no_problem(config: TransformerConfig) -> str | None:
    return None


@dataclass(frozen=True)
class ConfigOption:
    """An attnkit option that some families' ``config.json`` carries under names of its own.

    Attributes:
        fields: The :class:`TransformerConfig` fields it covers; a family without the option
            saves only configs that leave them ``None``.
        read: ``config.json`` -> those fields.
        write: Config -> the ``config.json`` keys.
        problem: Why a config cannot be written (``None``: it can).
    """

    fields: tuple[str, ...]
    read: Callable[[dict[str, Any]], dict[str, Any]]
    write: Callable[[TransformerConfig], dict[str, Any]]
    problem: Callable[[TransformerConfig], str | None] = _no_problem


#: The fields of the options below: ``None`` unless a family carries them.
EXTRA_FIELDS = ("attn_scale", "attn_softcap", "logit_softcap", "rope_local_base")

SOFTCAPPING = ConfigOption(
    ("attn_softcap", "logit_softcap"),
    read=lambda d: {
        "attn_softcap": d.get("attn_logit_softcapping"),
        "logit_softcap": d.get("final_logit_softcapping"),
    },
    write=lambda c: {
        "attn_logit_softcapping": c.attn_softcap,
        "final_logit_softcapping": c.logit_softcap,
    },
)


def _query_scalar(c: TransformerConfig) -> int:
    """Gemma's ``query_pre_attn_scalar``: an int whose inverse square root is the scale."""
    scale = c.attn_scale if c.attn_scale is not None else c.head_dim**-0.5
    return round(scale**-2)


def _query_scalar_problem(c: TransformerConfig) -> str | None:
    scale = c.attn_scale if c.attn_scale is not None else c.head_dim**-0.5
    wanted = _query_scalar(c) ** -0.5
    if scale != wanted:
        return f"attn_scale={scale!r} (needs {wanted!r}, the inverse square root of an int)"
    return None


QUERY_PRE_ATTN_SCALAR = ConfigOption(
    ("attn_scale",),
    read=lambda d: {"attn_scale": float(d.get("query_pre_attn_scalar", 256)) ** -0.5},
    write=lambda c: {"query_pre_attn_scalar": _query_scalar(c)},
    problem=_query_scalar_problem,
)


def rope_parameters(c: TransformerConfig) -> dict[str, Any]:
    """The ``rope_parameters`` of ``c``'s rotary positions (transformers 5's form)."""
    return {"rope_type": "default", "rope_theta": c.rope_base} | (c.rope_scaling or {})


def _read_local_rope_base(data: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's rotary base of the sliding layers (``rope_local_base_freq``, or the
    ``sliding_attention`` entry of transformers 5's per-layer-type ``rope_parameters``);
    ``None`` when it is the global layers' base."""
    params = data.get("rope_parameters") or {}
    local = params.get(SLIDING) if isinstance(params, dict) else None
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling of the sliding layers is not supported: {local}")
        base = local.get("rope_theta", 10_000.0)
    else:
        base = data.get("rope_local_base_freq")
    full = params.get(FULL, params) if isinstance(params, dict) else {}
    same = base is not None and float(base) == full.get("rope_theta", data.get("rope_theta"))
    return {"rope_local_base": None if base is None or same else float(base)}


def _write_local_rope_base(c: TransformerConfig) -> dict[str, Any]:
    local = c.rope_local_base if c.rope_local_base is not None else c.rope_base
    return {
        "rope_parameters": {
            FULL: rope_parameters(c),
            SLIDING: {"rope_type": "default", "rope_theta": local},
        },
        "rope_local_base_freq": local,
    }


LOCAL_ROPE_BASE = ConfigOption(
    ("rope_local_base",), read=_read_local_rope_base, write=_write_local_rope_base
)


@dataclass(frozen=True)
class TensorNames:
    """A checkpoint's tensor names, keyed by the attnkit module whose parameters they hold.

    A tensor is ``<name>.weight`` or ``<name>.bias``. A tuple of names splits the module's rows
    among them, in order: q, k, v of the fused ``attention.qkv_proj``; gate, up of
    ``feed_forward.gate_up``.

    Attributes:
        model: Top-level attnkit module (``embedding``, ``position``, ``norm``, ``lm_head``) ->
            name.
        layer: The prefix of layer ``i``'s names (``"model.layers.{i}."``).
        block: Attnkit module under ``blocks.{i}.`` -> name(s) under ``layer``.
        base_prefix: Omitted by checkpoints of the base model (the original gpt2 on the Hub).
        transposed: 2-D layer weights are stored ``(in, out)`` (GPT-2's ``Conv1D``).
    """

    model: Mapping[str, str]
    layer: str
    block: Mapping[str, str | tuple[str, ...]]
    base_prefix: str = ""
    transposed: bool = False


_LLAMA_BLOCK = {
    "attention.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.out_proj": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "feed_forward.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "feed_forward.linear2": "mlp.down_proj",
}
_LLAMA_MODEL = {"embedding": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}

LLAMA_TENSORS = TensorNames(
    _frozen(_LLAMA_MODEL), "model.layers.{i}.", _frozen(_LLAMA_BLOCK), base_prefix="model."
)
#: Phi-3 stores q/k/v and gate/up fused, as attnkit does.
PHI3_TENSORS = TensorNames(
    _frozen(_LLAMA_MODEL),
    "model.layers.{i}.",
    _frozen(
        _LLAMA_BLOCK
        | {"attention.qkv_proj": "self_attn.qkv_proj", "feed_forward.gate_up": "mlp.gate_up_proj"}
    ),
    base_prefix="model.",
)
#: Gemma: a norm after attention and one before and after the MLP.
GEMMA_TENSORS = TensorNames(
    _frozen(_LLAMA_MODEL),
    "model.layers.{i}.",
    _frozen(
        _LLAMA_BLOCK
        | {
            "post_attn_norm": "post_attention_layernorm",
            "norm2": "pre_feedforward_layernorm",
            "post_ffn_norm": "post_feedforward_layernorm",
        }
    ),
    base_prefix="model.",
)
GPT2_TENSORS = TensorNames(
    _frozen(
        {
            "embedding": "transformer.wte",
            "position": "transformer.wpe",
            "norm": "transformer.ln_f",
            "lm_head": "lm_head",
        }
    ),
    "transformer.h.{i}.",
    _frozen(
        {
            "norm1": "ln_1",
            "norm2": "ln_2",
            "attention.qkv_proj": "attn.c_attn",
            "attention.out_proj": "attn.c_proj",
            "feed_forward.linear1": "mlp.c_fc",
            "feed_forward.linear2": "mlp.c_proj",
        }
    ),
    base_prefix="transformer.",
    transposed=True,
)
#: llama.cpp's names (its llama, qwen2 and qwen3 graphs share them).
LLAMA_GGUF_TENSORS = TensorNames(
    _frozen({"embedding": "token_embd", "norm": "output_norm", "lm_head": "output"}),
    "blk.{i}.",
    _frozen(
        {
            "attention.qkv_proj": ("attn_q", "attn_k", "attn_v"),
            "attention.out_proj": "attn_output",
            "attention.q_norm": "attn_q_norm",
            "attention.k_norm": "attn_k_norm",
            "norm1": "attn_norm",
            "norm2": "ffn_norm",
            "feed_forward.gate_up": ("ffn_gate", "ffn_up"),
            "feed_forward.linear2": "ffn_down",
        }
    ),
)


@dataclass(frozen=True)
class GGUFFormat:
    """How llama.cpp stores a family.

    Attributes:
        name: Its ``general.architecture``.
        tensors: Its tensor names (llama.cpp's llama, qwen2 and qwen3 graphs share them).
        interleaved_rotary: llama.cpp's converter interleaved each head's rotary pairs in the
            query/key rows (its llama graph rotates adjacent pairs); loading undoes it.
    """

    name: str
    tensors: TensorNames = LLAMA_GGUF_TENSORS
    interleaved_rotary: bool = False


# A projection's bias: fixed for the family, or the config.json key that switches it.
Bias = bool | str


# --------------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """Everything attnkit knows about one checkpoint family.

    Attributes:
        name: The Hugging Face architecture (``config.json``'s ``architectures``).
        model_type: ``config.json``'s ``model_type`` (read when ``architectures`` is absent).
        options: :class:`TransformerConfig` options every checkpoint of the family has
            (positions, norm, qk-norm, post-norms, scaled embeddings, rotary pairing).
        activations: The family's ``config.json`` activation names -> attnkit's ``activation``;
            the first is the default and the name saved for its attnkit activation.
        keys: The ``config.json`` keys of the sizes.
        biases: ``(qkv, out, mlp)``: each fixed, or the ``config.json`` key that sets it (a key
            shared by two says they are equal).
        sliding: How the config says which layers slide.
        extras: Options only some families carry.
        tensors: The tensor names of its Hugging Face checkpoints.
        tie_default: Whether the head is tied when ``config.json`` does not say.
        fixed: ``config.json`` options attnkit has no counterpart for -> the values that leave
            the outputs as attnkit computes them (the first: the default and the value saved).
        constants: Keys written into a saved ``config.json`` as they are.
        saves: Whether :func:`~attnkit.interop.hf_config.hf_config_from` may choose it (Phi-3's
            checkpoints are saved as Llama's).
        gguf: How its GGUF files are written (``None``: attnkit reads none).
    """

    name: str
    model_type: str
    options: Mapping[str, Any]
    activations: Mapping[str, str]
    keys: ConfigKeys = LLAMA_KEYS
    biases: tuple[Bias, Bias, Bias] = (False, False, False)
    sliding: SlidingLayers = SlidingLayers("none")
    extras: tuple[ConfigOption, ...] = ()
    tensors: TensorNames = LLAMA_TENSORS
    tie_default: bool = False
    fixed: Mapping[str, tuple[Any, ...]] = field(default_factory=lambda: _frozen({}))
    constants: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))
    saves: bool = True
    gguf: GGUFFormat | None = None

    def __post_init__(self) -> None:
        if not self.activations:
            raise ValueError(f"{self.name}: activations must name at least one activation")
        bad = {k: v for k, v in self.activations.items() if v not in ACTIVATIONS}
        if bad:
            raise ValueError(f"{self.name}: activations {bad} map to none of {ACTIVATIONS}")
        if len(self.biases) != 3 or not all(isinstance(b, bool | str) for b in self.biases):
            raise ValueError(
                f"{self.name}: biases must be (qkv, out, mlp), each a bool or a config.json "
                f"key, got {self.biases!r}"
            )
        unknown = set(self.options) - {f.name for f in fields(TransformerConfig)}
        if unknown:
            raise ValueError(f"{self.name}: options {sorted(unknown)} are not config fields")
        for attr in ("options", "activations", "fixed", "constants"):
            object.__setattr__(self, attr, _frozen(getattr(self, attr)))

    @property
    def position(self) -> str:
        """The family's positions (``"rope"`` unless its options say otherwise)."""
        return str(self.options.get("position", "rope"))


# The Llama graph's options (FAMILIES["llama"] less what the records map: activation, biases).
_LLAMA = {k: v for k, v in FAMILIES["llama"].items() if k not in ("activation", "bias")}

LLAMA = Architecture(
    "LlamaForCausalLM",
    "llama",
    options=_LLAMA,
    activations={"silu": "swiglu"},  # silu on the gate of the gated MLP
    biases=("attention_bias", "attention_bias", "mlp_bias"),
    fixed={"pretraining_tp": (1, None)},
    constants={"attention_dropout": 0.0},
    gguf=GGUFFormat("llama", interleaved_rotary=True),
)
# Llama with a sliding window (its GGUF files are written as llama's).
MISTRAL = replace(
    LLAMA,
    name="MistralForCausalLM",
    model_type="mistral",
    sliding=SlidingLayers("all"),
    biases=(False, False, False),
    gguf=None,
)
# Llama with biases on q/k/v only, and sliding, full or mixed layers.
QWEN2 = replace(
    LLAMA,
    name="Qwen2ForCausalLM",
    model_type="qwen2",
    biases=(True, False, False),
    sliding=SlidingLayers("max_window_layers"),
    gguf=GGUFFormat("qwen2"),
)
# Qwen2's layers with qk-norm (and optional biases on q/k/v/o).
QWEN3 = replace(
    QWEN2,
    name="Qwen3ForCausalLM",
    model_type="qwen3",
    options=_LLAMA | {"qk_norm": True},
    biases=("attention_bias", "attention_bias", False),
    gguf=GGUFFormat("qwen3"),
)
# Mistral with fused q/k/v and gate/up tensors; saved as Llama.
PHI3 = replace(
    MISTRAL, name="Phi3ForCausalLM", model_type="phi3", tensors=PHI3_TENSORS, saves=False
)
# (1 + w) RMSNorm, GeGLU, norms after attention and MLP, scaled embeddings, soft-capping,
# query_pre_attn_scalar, alternating sliding and global layers.
GEMMA2 = replace(
    LLAMA,
    name="Gemma2ForCausalLM",
    model_type="gemma2",
    options=_LLAMA | {"norm": "rmsnorm_plus_one", "post_norms": True, "scale_embeddings": True},
    activations={"gelu_pytorch_tanh": "geglu_tanh"},
    keys=ConfigKeys(activation=("hidden_activation", "hidden_act")),
    biases=("attention_bias", "attention_bias", False),
    sliding=SlidingLayers("pattern", every=2),
    extras=(SOFTCAPPING, QUERY_PRE_ATTN_SCALAR),
    tensors=GEMMA_TENSORS,
    tie_default=True,
    gguf=None,
)
# Gemma 2 with qk-norm, a local rotary base and a configurable sliding pattern.
GEMMA3 = replace(
    GEMMA2,
    name="Gemma3ForCausalLM",
    model_type="gemma3_text",
    options={**GEMMA2.options, "qk_norm": True},
    sliding=SlidingLayers("pattern", every=6, every_key="sliding_window_pattern"),
    extras=(*GEMMA2.extras, LOCAL_ROPE_BASE),
)
# LayerNorm, learned positions, fused c_attn Conv1D weights, biases everywhere.
GPT2 = Architecture(
    "GPT2LMHeadModel",
    "gpt2",
    options={"position": "learned"},
    activations={
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_fast": "gelu_tanh",
        "gelu": "gelu",
        "relu": "relu",
        "silu": "silu",
        "swish": "silu",
    },
    keys=GPT2_KEYS,
    biases=(True, True, True),
    tensors=GPT2_TENSORS,
    tie_default=True,
    fixed={
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "add_cross_attention": (False,),
    },
    constants={"reorder_and_upcast_attn": False}
    | dict.fromkeys(("attn_pdrop", "embd_pdrop", "resid_pdrop"), 0.0),
)

# name -> record, in the order hf_config_from tries them when saving.
_REGISTRY: dict[str, Architecture] = {
    a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3, GPT2)
}


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------


def register(arch: Architecture) -> Architecture:
    """Add ``arch`` to the families attnkit reads (and saves, after the built-in ones).

    Returns:
        ``arch``.

    Raises:
        TypeError: If ``arch`` is not an :class:`Architecture`.
        ValueError: If its name, ``model_type`` or GGUF name is already registered.
    """
    if not isinstance(arch, Architecture):
        raise TypeError(f"register needs an Architecture, got {type(arch).__name__}")
    for other in _REGISTRY.values():
        clash = [
            f"{what} {mine!r}"
            for what, mine, theirs in (
                ("name", arch.name, other.name),
                ("model_type", arch.model_type, other.model_type),
                ("gguf", _gguf_name(arch), _gguf_name(other)),
            )
            if mine is not None and mine == theirs
        ]
        if clash:
            raise ValueError(f"{arch.name}: {', '.join(clash)} already registered by {other.name}")
    _REGISTRY[arch.name] = arch
    return arch


def unregister(name: str) -> Architecture:
    """Remove the record of Hugging Face architecture ``name`` (the inverse of
    :func:`register`).

    Returns:
        The removed record.

    Raises:
        ValueError: For a name not registered.
    """
    found = architecture(name)
    del _REGISTRY[name]
    return found


def architectures() -> tuple[Architecture, ...]:
    """Every registered record, built-in ones first."""
    return tuple(_REGISTRY.values())


def architecture(name: str) -> Architecture:
    """The record of Hugging Face architecture ``name``.

    Raises:
        ValueError: For a name not registered (listing the registered ones).
    """
    found = _REGISTRY.get(name)
    if found is None:
        raise ValueError(f"unsupported architecture {name!r}; supported: {supported()}")
    return found


def find(names: list[str], model_type: str | None = None) -> Architecture | None:
    """The record of the first registered name in ``names`` (``config.json``'s
    ``architectures``); with no names, of ``model_type``. ``None`` when none is registered."""
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    if not names and model_type is not None:
        for arch in _REGISTRY.values():
            if arch.model_type == model_type:
                return arch
    return None


def _gguf_name(arch: Architecture) -> str | None:
    return None if arch.gguf is None else arch.gguf.name


def find_gguf(name: str | None) -> Architecture | None:
    """The record of llama.cpp architecture ``name`` (``general.architecture``), or ``None``."""
    for arch in _REGISTRY.values():
        if arch.gguf is not None and arch.gguf.name == name:
            return arch
    return None


def supported(*, gguf: bool = False) -> str:
    """The registered Hugging Face architectures (or GGUF architectures), comma-separated."""
    if gguf:
        return ", ".join(a.gguf.name for a in _REGISTRY.values() if a.gguf is not None)
    return ", ".join(_REGISTRY)
