"""The architecture records: every registered family maps its config both ways and names every
parameter of the model its config builds; a new family that combines existing options is one
record (here StarCoder2, registered only in this test) and loads its checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from attnkit import TransformerConfig, TransformerLM
from attnkit.interop import architectures as arch_mod
from attnkit.interop.architectures import (
    LLAMA,
    LLAMA_KEYS,
    LLAMA_TENSORS,
    MISTRAL,
    Architecture,
    SlidingLayers,
    architectures,
    register,
    rope_parameters,
    unregister,
)
from attnkit.interop.hf_config import config_from_hf, hf_config_from
from attnkit.interop.hf_weights import weight_map
from attnkit.interop.loading import IGNORED_SUFFIXES
from tests.helpers import padded_batch, randomize

SIZES = {
    "vocab_size": 61,
    "dim": 32,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "ffn_dim": 40,
    "max_seq_len": 64,
    "eps": 1e-5,
}
# Values for the options only some families carry (written through the family's own keys).
EXTRAS = TransformerConfig(
    vocab_size=61,
    dim=32,
    num_layers=3,
    num_heads=4,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    rope_base=500.0,
    attn_scale=12**-0.5,
    attn_softcap=30.0,
    logit_softcap=20.0,
    rope_local_base=50.0,
)


def config_json(arch: Architecture, *, options: bool) -> dict[str, Any]:
    """A ``config.json`` of ``arch`` built from its record alone: the sizes under its keys and,
    with ``options``, every option it has switched away from its default."""
    data: dict[str, Any] = {"architectures": [arch.name], "model_type": arch.model_type}
    data |= {getattr(arch.keys, k): v for k, v in SIZES.items() if getattr(arch.keys, k)}
    if not options:
        if arch.sliding.kind in ("all", "pattern"):  # Mistral's one option; Gemma's layers
            data["sliding_window"] = 4
        return data
    data |= {key: True for key in arch.biases if isinstance(key, str)}
    data["tie_word_embeddings"] = not arch.tie_default
    if arch.position == "rope":
        data["rope_parameters"] = rope_parameters(EXTRAS)
    if arch.sliding.kind != "none":
        data["sliding_window"] = 4
    if arch.sliding.kind == "max_window_layers":
        data |= {"use_sliding_window": True, "max_window_layers": 1}
    for extra in arch.extras:
        data |= extra.write(EXTRAS)
    return data


def meta_model(config: TransformerConfig) -> TransformerLM:
    with torch.device("meta"):
        return TransformerLM(config)


def check_covers(entries: dict[str, Any], lm: TransformerLM) -> None:
    """Every parameter of ``lm`` is filled exactly once, row range by row range."""
    params = dict(lm.named_parameters())
    rows: dict[str, list[tuple[int, int]]] = {}
    for name, entry in entries.items():
        assert entry.param in params, name
        p = params[entry.param]
        rows.setdefault(entry.param, []).append(entry.rows or (0, p.shape[0]))
    assert sorted(rows) == sorted(params)
    for name, spans in rows.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == params[name].shape[0], name
        assert all(a[1] == b[0] for a, b in pairwise(spans)), name


@pytest.mark.parametrize("options", [False, True], ids=["plain", "options"])
@pytest.mark.parametrize("arch", architectures(), ids=lambda a: a.name)
def test_every_record_maps_config_and_tensor_names(arch: Architecture, options: bool) -> None:
    data = config_json(arch, options=options)
    name, config = config_from_hf(data)
    assert name == arch.name
    for option, value in arch.options.items():
        assert getattr(config, option) == value, option
    if options:  # the options switched on arrived
        assert config.tie_embeddings == (not arch.tie_default)
        assert all(getattr(config, f) is not None for e in arch.extras for f in e.fields)
        if arch.sliding.kind != "none":
            assert config.window == 4
    lm = meta_model(config)
    check_covers(weight_map(arch, lm), lm)
    if arch.gguf is not None:
        gguf_names = weight_map(arch, lm, names=arch.gguf.tensors)
        check_covers(gguf_names, lm)
        assert all(n.startswith(("blk.", "token_embd.", "output")) for n in gguf_names)
    saved = hf_config_from(config)
    if arch.saves:
        assert saved["architectures"] == [arch.name]
    assert config_from_hf(saved)[1] == config


@pytest.mark.parametrize("options", [False, True], ids=["plain", "options"])
@pytest.mark.parametrize(
    "arch", [a for a in architectures() if a.name != "Phi3ForCausalLM"], ids=lambda a: a.name
)
def test_tensor_names_are_the_transformers_state_dict(arch: Architecture, options: bool) -> None:
    """The record's names are exactly the tensors transformers' model of the config holds
    (Phi-3's fused checkpoint layout is not transformers' module layout: test_hf loads it)."""
    transformers = pytest.importorskip("transformers")
    data = config_json(arch, options=options)
    _, config = config_from_hf(data)
    hf_config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        model = getattr(transformers, arch.name)(hf_config)
    theirs = {
        k
        for k in model.state_dict()
        if not k.endswith(IGNORED_SUFFIXES)
        and not (k == "lm_head.weight" and config.tie_embeddings)
    }
    assert set(weight_map(arch, meta_model(config))) == theirs


def test_unsaveable_config_names_the_closest_family() -> None:
    gemma3 = next(a for a in architectures() if a.name == "Gemma3ForCausalLM")
    config = TransformerConfig(61, 32, 2, 4, **gemma3.options, activation="geglu_tanh", bias=False)
    assert hf_config_from(config)["architectures"] == ["Gemma3ForCausalLM"]
    with pytest.raises(ValueError, match=r"in Gemma3ForCausalLM, .*: mlp_bias=True \(needs Fal"):
        hf_config_from(config.replace(mlp_bias=True))


def test_register_rejects_clashes_and_bad_records() -> None:
    with pytest.raises(ValueError, match="model_type 'llama' already registered by Llama"):
        register(replace(LLAMA, name="MyLlama", gguf=None))
    with pytest.raises(ValueError, match="gguf 'llama' already registered"):
        register(replace(LLAMA, name="MyLlama", model_type="my-llama"))
    with pytest.raises(TypeError, match="Architecture"):
        register("LlamaForCausalLM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"options \['flash'\] are not config fields"):
        replace(LLAMA, options={"flash": True})
    with pytest.raises(ValueError, match=r"activations \{'gelu': 'geglu'\} map to none"):
        replace(LLAMA, activations={"gelu": "geglu"})
    with pytest.raises(ValueError, match="biases must be"):
        replace(LLAMA, biases=(True, False))
    with pytest.raises(ValueError, match="kind must be one of"):
        SlidingLayers("some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every >= 1"):
        SlidingLayers("pattern")
    with pytest.raises(ValueError, match=r"unsupported architecture 'Nope'.*LlamaForCausalLM"):
        unregister("Nope")


# --------------------------------------------------------------------------------------------
# A family that only combines existing options: one record
# --------------------------------------------------------------------------------------------

#: StarCoder2: Mistral's sliding window with LayerNorm, a plain tanh-GELU MLP (``c_fc``,
#: ``c_proj``) and every bias switched by one key.
STARCODER2 = replace(
    MISTRAL,
    name="Starcoder2ForCausalLM",
    model_type="starcoder2",
    options=MISTRAL.options | {"norm": "layernorm"},
    activations={"gelu_pytorch_tanh": "gelu_tanh"},
    keys=replace(LLAMA_KEYS, eps="norm_epsilon"),
    biases=("use_bias", "use_bias", "use_bias"),
    tensors=replace(
        LLAMA_TENSORS,
        block=LLAMA_TENSORS.block
        | {"feed_forward.linear1": "mlp.c_fc", "feed_forward.linear2": "mlp.c_proj"},
    ),
    tie_default=True,
)


@pytest.fixture
def starcoder2() -> Iterator[Architecture]:
    register(STARCODER2)
    yield STARCODER2
    unregister(STARCODER2.name)
    assert STARCODER2 not in arch_mod.architectures()


def test_a_registered_record_loads_and_saves_its_family(
    starcoder2: Architecture, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    data = config_json(starcoder2, options=False) | {"sliding_window": 3}
    hf_config = transformers.Starcoder2Config(
        **{k: v for k, v in data.items() if k != "model_type"}, tie_word_embeddings=False
    )
    ref = transformers.Starcoder2ForCausalLM(hf_config).eval()
    randomize(ref, 0)
    ref.save_pretrained(tmp_path / "hf")
    lm = TransformerLM.from_pretrained(tmp_path / "hf")
    assert (lm.config.norm, lm.config.activation, lm.config.window) == ("layernorm", "gelu_tanh", 3)
    ids, mask = padded_batch()
    real = mask.bool()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = lm(ids, real, positions=pos)
    assert want[real].abs().max() > 0.5  # the weights are not trivially small
    assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
    # Saving chooses the new record (no built-in one has LayerNorm with rotary positions).
    out = lm.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == "Starcoder2ForCausalLM"
    with torch.no_grad():
        again = back(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert_close(again[real], want[real], atol=1e-5, rtol=1e-5)
