"""Attention variants as model options: ``TransformerConfig(score_mod=..., mask_mod=...)`` runs the
layers through :mod:`attnkit.flex`, against explicit float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnkit import MultiHeadAttention, TransformerConfig, TransformerLM
from attnkit.config import FLEX_VARIANTS
from attnkit.interop.hf_config import hf_config_from
from tests.reference import reference_attention

D, H, V = 32, 4, 48


def _alibi_bias(heads: int, L: int, S: int) -> torch.Tensor:
    """ALiBi written out (power-of-two heads): slope ``2^(-8 (h+1) / H)`` times ``j - i`` for
    query ``i`` at position ``S - L + i``."""
    slopes = torch.tensor(
        [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64
    )
    i = torch.arange(S - L, S, dtype=torch.float64).view(L, 1)
    j = torch.arange(S, dtype=torch.float64).view(1, S)
    return slopes.view(heads, 1, 1) * (j - i)  # (H, L, S)


def _lm(**options: object) -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(V, D, 2, H, ffn_dim=64, max_seq_len=64, **options)  # type: ignore[arg-type]
    return TransformerLM(config).eval()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "options",
    [
        {"score_mod": {"name": "alibi"}},
        {"score_mod": {"name": "relative_bias", "max_distance": 8}},
        {"score_mod": {"name": "softcap", "cap": 20.0}},
        {"mask_mod": {"name": "prefix_lm", "prefix": 16}},
        {"mask_mod": {"name": "sliding_window", "window": 256}},
        {"mask_mod": {"name": "dilated", "dilation": 2}, "score_mod": {"name": "alibi"}},
    ],
)
def test_named_variants_round_trip(options: dict) -> None:
    config = TransformerConfig(V, D, 2, H, position="none", **options)
    data = config.to_dict()
    for key, spec in options.items():
        assert data[key] == spec
    assert TransformerConfig.from_dict(data) == config
    import json

    assert TransformerConfig.from_dict(json.loads(json.dumps(data))) == config


def test_a_name_alone_is_a_spec_and_a_callable_does_not_serialise() -> None:
    assert TransformerConfig(V, D, 2, H, score_mod="alibi").score_mod == {"name": "alibi"}

    def halve(score, b, h, q, kv):
        return score / 2

    config = TransformerConfig(V, D, 2, H, score_mod=halve)
    assert config.score_mod is halve  # allowed in memory
    with pytest.raises(ValueError, match=r"score_mod is the callable 'halve'.*named variant"):
        config.to_dict()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"score_mod": "rope2d"}, ValueError, r"unknown score_mod variant 'rope2d'.*alibi"),
        ({"score_mod": "prefix_lm"}, ValueError, "'prefix_lm' is a mask_mod, not a score_mod"),
        ({"mask_mod": {"name": "prefix_lm"}}, ValueError, r"missing \['prefix'\]"),
        (
            {"mask_mod": {"name": "sliding_window", "window": 4, "size": 2}},
            ValueError,
            r"unknown \['size'\]",
        ),
        (
            {"mask_mod": {"name": "sliding_window", "window": 0}},
            ValueError,
            "window must be positive",
        ),
        ({"mask_mod": {"name": "dilated", "dilation": 2.5}}, TypeError, "dilation must be int"),
        ({"score_mod": {"name": "softcap", "cap": math.inf}}, ValueError, "cap must be positive"),
        ({"mask_mod": {"name": "document"}}, ValueError, "depends on the batch"),
        ({"mask_mod": 3}, TypeError, "mask_mod must be a variant name"),
        ({"mask_mod": "prefix_lm", "window": 4}, ValueError, "not both"),
        ({"score_mod": "alibi", "attn_softcap": 30.0}, ValueError, "not both"),
    ],
)
def test_bad_specs_are_named(options: dict, error: type, match: str) -> None:
    if options.get("mask_mod") == "prefix_lm":
        options = {**options, "mask_mod": {"name": "prefix_lm", "prefix": 2}}
    with pytest.raises(error, match=match):
        TransformerConfig(V, D, 2, H, **options)


def test_hf_export_refuses_variants() -> None:
    config = TransformerConfig(V, D, 2, H, score_mod="alibi", position="learned")
    with pytest.raises(ValueError, match=r"Hugging Face.*attention variants.*alibi"):
        hf_config_from(config)
    hf_config_from(config.replace(score_mod=None))  # the same model without it saves


# --------------------------------------------------------------------------- layers


def _layer_and_reference(
    L: int, **variant: object
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], MultiHeadAttention]:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, causal=True, **variant).eval()  # type: ignore[arg-type]
    x = torch.randn(2, L, D)
    with torch.no_grad():
        return layer(x)[0], layer.project_qkv(x), layer


@pytest.mark.parametrize("L", [5, 40, 150])
def test_alibi_layer_equals_the_float64_reference(L: int) -> None:
    out, (q, k, v), layer = _layer_and_reference(L, score_mod="alibi")
    allowed = torch.ones(L, L).tril().bool()
    ref, _ = reference_attention(q, k, v, allowed, bias=_alibi_bias(H, L, L))
    with torch.no_grad():
        want = layer.out_proj(ref.float().transpose(1, 2).flatten(-2))
    assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("L", [6, 40, 150])
def test_prefix_lm_layer_equals_the_float64_reference(L: int) -> None:
    prefix = L // 3
    out, (q, k, v), layer = _layer_and_reference(
        L, mask_mod={"name": "prefix_lm", "prefix": prefix}
    )
    i, j = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    allowed = (j <= i) | (j < prefix)  # the prefix sees all of itself, then causal
    ref, _ = reference_attention(q, k, v, allowed)
    with torch.no_grad():
        want = layer.out_proj(ref.float().transpose(1, 2).flatten(-2))
    assert_close(out, want, atol=2e-5, rtol=1e-4)
    # a prefix token sees the future prefix: changing the last prefix token changes the first
    x = torch.randn(1, L, D)
    y = x.clone()
    y[0, prefix - 1] += 1.0
    with torch.no_grad():
        assert (layer(x)[0][0, 0] - layer(y)[0][0, 0]).abs().max() > 1e-4


def test_weights_path_equals_the_flex_path_and_shows_the_mask() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, causal=True, mask_mod={"name": "sliding_window", "window": 3},
                               score_mod="alibi").eval()  # fmt: skip
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        out, none = layer(x)
        out_w, weights = layer(x, return_weights=True)
    assert none is None
    assert_close(out_w, out, atol=1e-5, rtol=1e-5)
    i, j = torch.arange(9).view(9, 1), torch.arange(9).view(1, 9)
    assert torch.equal(weights[0, 0] > 0, (j <= i) & (j > i - 3))


def test_a_custom_mask_mod_is_combined_with_causal() -> None:
    def even_keys(b, h, q, kv):
        return kv % 2 == 0

    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, causal=True, mask_mod=even_keys).eval()
    x = torch.randn(1, 7, D)
    with torch.no_grad():
        out = layer(x)[0]
        q, k, v = layer.project_qkv(x)
        i, j = torch.arange(7).view(7, 1), torch.arange(7).view(1, 7)
        ref, _ = reference_attention(q, k, v, (j <= i) & (j % 2 == 0))
        want = layer.out_proj(ref.float().transpose(1, 2).flatten(-2))
    assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_relative_bias_table_gets_the_float64_gradient() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, causal=True,
                               score_mod={"name": "relative_bias", "max_distance": 3})  # fmt: skip
    table = layer.variant.bias_table
    with torch.no_grad():
        table.normal_()
    x = torch.randn(2, 10, D)
    layer(x)[0].square().sum().backward()
    # float64 autograd through the explicit math, with the table indexed by clamped offsets
    t64 = table.detach().double().requires_grad_()
    q, k, v = (t.detach().double() for t in layer.project_qkv(x))
    i, j = torch.arange(10).view(10, 1), torch.arange(10).view(1, 10)
    bias = t64[:, (i - j).clamp(-3, 3) + 3]  # (H, L, S)
    ref, _ = reference_attention(q, k, v, j <= i, bias=bias)
    w = layer.out_proj.weight.double()
    (ref.transpose(1, 2).flatten(-2) @ w.T + layer.out_proj.bias.double()).square().sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    assert_close(table.grad.double(), t64.grad, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- decoding, compile


@pytest.mark.parametrize(
    "variant",
    [
        {"score_mod": "alibi"},
        {"mask_mod": {"name": "prefix_lm", "prefix": 5}},
        {"score_mod": {"name": "relative_bias", "max_distance": 4}},
    ],
)
def test_cached_decoding_equals_uncached(variant: dict) -> None:
    lm = _lm(position="none", **variant)
    if lm.blocks[0].attention.variant.bias_table is not None:
        with torch.no_grad():
            for block in lm.blocks:
                block.attention.variant.bias_table.normal_()
    prompt = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        caches = lm.make_kv_caches(2, 16)
        logits = [lm(prompt, kv_caches=caches)]
        ids = torch.cat([prompt, torch.randint(0, V, (2, 4))], 1)
        full = lm(ids)
        for t in range(7, 11):  # the steps see their own absolute positions
            logits.append(lm(ids[:, t : t + 1], kv_caches=caches))
    assert_close(torch.cat(logits, 1), full, atol=2e-5, rtol=1e-4)
    cached = lm.generate(prompt, 6, use_cache=True)
    assert torch.equal(cached, lm.generate(prompt, 6, use_cache=False))


@pytest.mark.slow
def test_fullgraph_compile_of_the_model_equals_eager_forward_and_backward() -> None:
    lm = _lm(position="rope", score_mod={"name": "relative_bias", "max_distance": 4},
             mask_mod={"name": "sliding_window", "window": 5})  # fmt: skip
    with torch.no_grad():
        for block in lm.blocks:
            block.attention.variant.bias_table.normal_()
    torch._dynamo.reset()
    compiled = torch.compile(lm, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, V, (2, 12))
    assert_close(compiled(ids), lm(ids), atol=1e-5, rtol=1e-5)
    lm.zero_grad()
    lm(ids).square().mean().backward()
    eager = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad()
    compiled(ids).square().mean().backward()
    got = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    assert "blocks.0.attention.variant.bias_table" in got
    assert eager.keys() == got.keys()
    for name in eager:
        assert_close(got[name], eager[name], atol=1e-5, rtol=1e-4, msg=name)


def test_every_named_variant_builds_a_model_that_runs() -> None:
    specs = {
        "alibi": {},
        "relative_bias": {"max_distance": 4},
        "softcap": {"cap": 5.0},
        "prefix_lm": {"prefix": 3},
        "sliding_window": {"window": 3},
        "dilated": {"dilation": 2},
    }
    assert set(specs) == set(FLEX_VARIANTS)
    ids = torch.randint(0, V, (1, 6))
    for name, params in specs.items():
        field = FLEX_VARIANTS[name][0]
        lm = _lm(position="none", **{field: {"name": name, **params}})
        with torch.no_grad():
            out = lm(ids)
        assert out.shape == (1, 6, V) and torch.isfinite(out).all(), name


def test_left_padded_batch_decodes_each_row_as_alone() -> None:
    lm = _lm(position="none", score_mod="alibi")
    short, long = torch.randint(0, V, (1, 4)), torch.randint(0, V, (1, 7))
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    batch = lm.generate(ids, 5, attention_mask=mask, pad_token_id=0, eos_token_id=[])
    assert torch.equal(batch[0, 3:], lm.generate(short, 5, eos_token_id=[])[0])
    assert torch.equal(batch[1], lm.generate(long, 5, eos_token_id=[])[0])


def test_a_copied_layer_keeps_working_through_the_op_after_the_original_is_gone() -> None:
    import copy
    import gc

    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, causal=True, score_mod="alibi").eval()
    twin = copy.deepcopy(layer)
    assert twin.variant.key != layer.variant.key
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        q, k, v = twin.project_qkv(x)
        want = layer(x)[0]
    del layer
    gc.collect()
    out = torch.ops.attnkit.flex_layer(q, k, v, None, None, [], twin.variant.key, (D // H) ** -0.5)
    with torch.no_grad():
        assert_close(twin.out_proj(out.transpose(1, 2).flatten(-2)), want, atol=1e-6, rtol=1e-6)
