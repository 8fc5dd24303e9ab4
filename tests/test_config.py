"""TransformerConfig: validation, JSON round trips, presets, and both model constructors."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from attnkit import PRESETS, TransformerConfig, TransformerEncoder, TransformerLM
from attnkit.lab.train import LabConfig, build_model

SMALL = TransformerConfig(vocab_size=40, dim=32, num_layers=2, num_heads=4, max_seq_len=32)


def test_json_round_trip_keeps_every_field() -> None:
    cfg = SMALL.replace(
        num_kv_heads=2,
        head_dim=12,
        rope_scaling={"type": "linear", "factor": 2.0},
        tie_embeddings=False,
        qkv_bias=True,
        bias=False,
    )
    data = json.loads(json.dumps(cfg.to_dict()))
    assert TransformerConfig.from_dict(data) == cfg
    assert data["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}  # normalised HF keys


def test_from_dict_names_unknown_keys() -> None:
    data = SMALL.to_dict() | {"n_embd": 3, "flash": True}
    with pytest.raises(ValueError, match=r"\['flash', 'n_embd'\]"):
        TransformerConfig.from_dict(data)


def test_deprecated_hidden_dim_warns_at_the_callers_line_and_sets_ffn_dim() -> None:
    with pytest.warns(DeprecationWarning, match=r"TransformerConfig\(hidden_dim=\.\.\.\)") as w:
        cfg = TransformerConfig(40, 32, 2, 4, hidden_dim=96)
    assert cfg == TransformerConfig(40, 32, 2, 4, ffn_dim=96)
    assert [r.filename for r in w] == [__file__]
    with pytest.warns(DeprecationWarning, match=r"key 'hidden_dim'") as w:
        loaded = TransformerConfig.from_dict(SMALL.to_dict() | {"ffn_dim": None, "hidden_dim": 96})
    assert loaded == SMALL.replace(ffn_dim=96)
    assert [r.filename for r in w] == [__file__]
    for cls in (TransformerLM, TransformerEncoder):
        with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\(hidden_dim=") as w:
            model = cls(40, 32, 2, 4, hidden_dim=96)
        assert model.config.ffn_dim == 96
        assert [r.filename for r in w] == [__file__]


def test_deprecated_hidden_dim_must_agree_with_ffn_dim() -> None:
    with pytest.raises(ValueError, match=r"ffn_dim=64 and its deprecated alias hidden_dim=96"):
        TransformerConfig(40, 32, 2, 4, ffn_dim=64, hidden_dim=96)
    with pytest.raises(ValueError, match=r"ffn_dim=64 and its deprecated alias hidden_dim=96"):
        TransformerLM(40, 32, 2, 4, ffn_dim=64, hidden_dim=96)
    with pytest.raises(ValueError, match=r"ffn_dim=64 and its deprecated alias hidden_dim=96"):
        TransformerConfig.from_dict(SMALL.to_dict() | {"ffn_dim": 64, "hidden_dim": 96})


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"dim": 0}, ValueError, r"'dim': 0"),
        ({"num_layers": -1, "max_seq_len": 0}, ValueError, r"'num_layers': -1.*'max_seq_len': 0"),
        ({"num_heads": 2.0}, TypeError, r"'num_heads': 2.0"),
        ({"head_dim": True}, TypeError, r"'head_dim': True"),
        ({"num_heads": 5}, ValueError, r"dim \(32\) must be divisible by num_heads \(5\)"),
        ({"num_kv_heads": 3}, ValueError, r"num_heads \(4\) must be a multiple.*\(3\)"),
        ({"head_dim": 7}, ValueError, r"even head dim, got 7"),
        ({"position": "alibi"}, ValueError, r"position must be one of .*'alibi'"),
        ({"norm": "batchnorm"}, ValueError, r"norm must be one of .*'batchnorm'"),
        ({"activation": "tanh"}, ValueError, r"activation must be one of .*'tanh'"),
        ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        ({"eps": 0.0}, ValueError, r"eps must be a positive number, got 0.0"),
        ({"rope_base": 1.0}, ValueError, r"rope_base must be > 1, got 1.0"),
        ({"qkv_bias": 1}, TypeError, r"'qkv_bias': 1"),
        ({"rope_scaling": "llama3"}, TypeError, r"rope_scaling must be a dict"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ValueError, r"'yarn'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            ValueError,
            r"missing \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}},
            ValueError,
            r"unsupported \['beta'\]",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 0}}, ValueError, r"factor must be > 0"),
        ({"rope_scaling": {"type": "linear", "factor": "2"}}, TypeError, r"'factor': '2'"),
    ],
)
def test_bad_values_are_named(changes: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SMALL.replace(**changes)


def test_default_rope_scaling_means_none_and_head_dim_may_skip_divisibility() -> None:
    assert SMALL.replace(rope_scaling={"rope_type": "default"}).rope_scaling is None
    cfg = SMALL.replace(num_heads=5, head_dim=8)  # 32 % 5 != 0 is fine with an explicit E
    assert (cfg.attn_head_dim, cfg.kv_heads, cfg.ffn_dim) == (8, 5, 128)


def test_config_and_keyword_forms_build_the_same_lm() -> None:
    options: dict[str, Any] = {"num_kv_heads": 2, "max_seq_len": 32, "activation": "swiglu"}
    torch.manual_seed(3)
    by_keywords = TransformerLM(40, 32, 2, 4, **options)
    torch.manual_seed(3)
    by_config = TransformerLM(TransformerConfig(40, 32, 2, 4, **options))
    assert by_keywords.config == by_config.config
    sd1, sd2 = by_keywords.state_dict(), by_config.state_dict()
    assert list(sd1) == list(sd2)
    for name in sd1:
        assert torch.equal(sd1[name], sd2[name]), name
    ids = torch.randint(0, 40, (2, 6))
    assert torch.equal(by_keywords(ids), by_config(ids))
    torch.manual_seed(3)
    assert torch.equal(
        TransformerLM(vocab_size=40, dim=32, num_layers=2, num_heads=4, **options)(ids),
        by_config(ids),
    )


def test_encoder_keyword_form_keeps_its_own_defaults() -> None:
    enc = TransformerEncoder(30, 16, 2, 4)
    cfg = enc.config
    assert (cfg.position, cfg.causal, cfg.norm_first, cfg.activation, cfg.max_seq_len) == (
        "sinusoidal",
        False,
        False,
        "relu",
        512,
    )
    assert isinstance(enc.norm, torch.nn.Identity)
    assert not enc.blocks[0].attention.causal


def test_constructor_errors() -> None:
    with pytest.raises(TypeError, match=r"takes no other options; got \['dropout', 'num_heads'\]"):
        TransformerLM(SMALL, num_heads=2, dropout=0.1)
    with pytest.raises(TypeError, match=r"unknown options \['n_head'\]"):
        TransformerLM(40, 32, 2, 4, n_head=4)
    with pytest.raises(TypeError, match=r"needs a TransformerConfig or the sizes \['num_heads'\]"):
        TransformerLM(40, 32, 2)
    with pytest.raises(ValueError, match=r"vocab_size=None, causal=True"):
        TransformerLM(SMALL.replace(vocab_size=None))
    with pytest.raises(ValueError, match=r"causal=False"):
        TransformerLM(SMALL.replace(causal=False))
    with pytest.raises(ValueError, match=r"pool must be"):
        TransformerEncoder(SMALL, pool="max")


def test_lab_model_is_built_from_its_config() -> None:
    lab = LabConfig()
    assert lab.model_config() == PRESETS["lab-default"]
    torch.manual_seed(0)
    model = build_model(lab)
    torch.manual_seed(0)
    explicit = TransformerEncoder(
        12, 64, 2, 4, ffn_dim=128, max_seq_len=64, position="sinusoidal", num_outputs=12
    )
    ids = torch.randint(0, 12, (3, 16))
    assert torch.equal(model(ids), explicit(ids))


def _llama_param_count(cfg: TransformerConfig) -> int:
    assert cfg.vocab_size is not None
    D, E, F = cfg.dim, cfg.attn_head_dim, cfg.ffn_dim
    attn = D * cfg.num_heads * E + 2 * D * cfg.kv_heads * E + cfg.num_heads * E * D
    per_layer = attn + 3 * D * F + 2 * D  # q,k,v,o + gate/up/down + two RMSNorm weights
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return cfg.vocab_size * D + cfg.num_layers * per_layer + D + head


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build(name: str) -> None:
    cfg = PRESETS[name]
    with torch.device("meta"):  # shapes only: the 100M preset is not materialised
        model = TransformerLM(cfg) if cfg.causal else TransformerEncoder(cfg)
    n = sum(p.numel() for p in model.parameters())
    if name.startswith("llama"):
        assert n == _llama_param_count(cfg)
    if name == "llama-100m":
        assert 95e6 < n < 105e6


def test_llama_tiny_preset_runs_and_uses_its_options() -> None:
    lm = TransformerLM(PRESETS["llama-tiny"].replace(vocab_size=100)).eval()
    attn = lm.blocks[0].attention
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (8, 4, 32)
    assert isinstance(lm.norm, torch.nn.RMSNorm) and lm.blocks[0].feed_forward.gated
    assert lm.rotary is not None and not lm.rotary.interleaved
    ids = torch.randint(0, 100, (1, 5))
    assert_close(lm.generate(ids, 3, use_cache=True), lm.generate(ids, 3, use_cache=False))


def test_check_sizes_names_the_offending_values() -> None:
    from attnkit.config import check_sizes

    check_sizes({"dim": 4, "window": None})  # None: not given
    with pytest.raises(TypeError, match=r"sizes must be ints, got \{'dim': True, 'heads': 2.0\}"):
        check_sizes({"dim": True, "heads": 2.0, "layers": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"KVCache sizes must be positive, got \{'capacity': 0\}"):
        check_sizes({"capacity": 0, "head_dim": 1}, what="KVCache sizes")


def test_layer_types_and_the_newer_families_options() -> None:
    base = TransformerConfig(10, 16, 3, 2, window=4)
    mixed = base.replace(layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert mixed.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [mixed.layer_window(i) for i in range(3)] == [4, None, 4]
    assert [base.layer_window(i) for i in range(3)] == [4, 4, 4]
    assert TransformerConfig.from_dict(mixed.to_dict()) == mixed
    with pytest.raises(ValueError, match=r"layer_types must name 3 layers.*unknown \['local'\]"):
        base.replace(layer_types=("local", "full_attention", "full_attention"))
    with pytest.raises(ValueError, match="sliding_attention layers but window is None"):
        base.replace(window=None, layer_types=("sliding_attention",) * 3)
    with pytest.raises(ValueError, match=r"'attn_softcap': 0.0"):
        base.replace(attn_softcap=0.0)
    with pytest.raises(ValueError, match=r"post_norms .* need norm_first"):
        base.replace(post_norms=True, norm_first=False)
    with pytest.raises(ValueError, match="rope_local_base must be > 1"):
        base.replace(rope_local_base=1.0)
