"""MultiHeadAttention and the blog's presets: blog compatibility, torch parity, cache, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import attnkit
from attnkit import masks as M
from tests import blog_attention_reference as blog
from tests.reference import reference_attention

B, N, S, D = 2, 5, 7, 12


def _load_from(blog_module: nn.Module, ours: nn.Module) -> None:
    ours.load_state_dict(blog_module.state_dict(), strict=True)


def test_scale_dot_product_attention_matches_blog():
    q, k, v = torch.randn(B, 3, N, 8), torch.randn(B, 3, S, 8), torch.randn(B, 3, S, 6)
    ours = attnkit.ScaleDotProductAttention(8)
    assert_close(ours(q, k, v), blog.BlogScaleDotProductAttention(8)(q, k, v))
    _, w = ours(q, k, v, return_weights=True)
    assert w.shape == (B, 3, N, S)
    assert_close(w.sum(-1), torch.ones(B, 3, N))


def test_attention_blog_state_dict_loads_strictly_and_matches():
    ref = blog.BlogAttention(D, 16, 10)
    ours = attnkit.Attention(D, 16, 10)
    _load_from(ref, ours)
    q, k, v = torch.randn(B, N, D), torch.randn(B, S, D), torch.randn(B, S, D)
    assert_close(ours(q, k, v), ref(q, k, v), atol=1e-5, rtol=1e-5)
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_self_attention_blog_state_dict_loads_strictly_and_matches():
    ref = blog.BlogSelfAttention(D, 16, 10)
    ours = attnkit.SelfAttention(D, 16, 10)
    _load_from(ref, ours)
    x = torch.randn(B, N, D)
    assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_multihead_cross_attention_blog_state_dict_loads_strictly_and_matches():
    ref = blog.BlogMultiheadCrossAttention(D, 16, 10, 4)
    ours = attnkit.MultiheadCrossAttention(D, 16, 10, 4)
    _load_from(ref, ours)
    q, kv = torch.randn(B, N, D), torch.randn(B, S, D)
    assert_close(ours(q, kv, kv), ref(q, kv, kv), atol=1e-5, rtol=1e-5)
    assert ours.dim_per_head == 4
    assert ours.get_heads(q, ours.w_q).shape == (B, 4, N, 4)


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_self_attention_blog_state_dict_loads_strictly_and_matches(causal):
    ref = blog.BlogMultiHeadSelfAttention(D, 16, 10, 4, causal=causal)
    ours = attnkit.MultiHeadSelfAttention(D, 16, 10, 4, causal=causal)
    _load_from(ref, ours)
    x = torch.randn(B, N, D)
    mask = torch.rand(B, 1, N, N) > 0.3
    mask[..., 0] = True  # keep every row alive so the blog gives no NaN
    assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    assert_close(ours(x, mask), ref(x, mask), atol=1e-5, rtol=1e-5)
    out, w = ours(x, mask, return_weights=True)
    assert_close(out, ref(x, mask), atol=1e-5, rtol=1e-5)
    assert w.shape == (B, 4, N, N)


def test_blog_nan_rows_are_zero_in_attnkit():
    ref = blog.BlogMultiHeadSelfAttention(D, 16, 10, 4)
    ours = attnkit.MultiHeadSelfAttention(D, 16, 10, 4)
    _load_from(ref, ours)
    x = torch.randn(B, N, D)
    mask = torch.ones(N, N, dtype=torch.bool)
    mask[2] = False
    assert torch.isnan(ref(x, mask)[:, 2]).all()
    out = ours(x, mask)
    # A dead row contributes nothing but the output projection's bias.
    assert_close(out[:, 2], ours.output_map.bias.expand(B, 10))
    live = [0, 1, 3, 4]
    assert_close(out[:, live], ref(x, mask)[:, live], atol=1e-5, rtol=1e-5)


def _copy_to_torch_mha(ours: attnkit.MultiHeadAttention, heads: int) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(
        ours.embed_dim, heads, batch_first=True, kdim=ours.kdim, vdim=ours.vdim
    )
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            ref.in_proj_weight.copy_(
                torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight])
            )
        else:
            ref.q_proj_weight.copy_(ours.q_proj.weight)
            ref.k_proj_weight.copy_(ours.k_proj.weight)
            ref.v_proj_weight.copy_(ours.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("masking", ["none", "causal", "padding", "both"])
def test_matches_torch_multihead_attention(cross, masking):
    kdim = 9 if cross else None
    ours = attnkit.MultiHeadAttention(D, 3, kdim=kdim, vdim=kdim).eval()
    ref = _copy_to_torch_mha(ours, 3)
    x = torch.randn(B, N, D)
    mem = torch.randn(B, S, 9) if cross else x
    s = mem.shape[1]
    lengths = torch.tensor([s, s - 2])
    ours_mask, attn_mask, kpm = None, None, None
    if masking in ("causal", "both"):
        allowed = M.causal_mask(N, s)
        ours_mask = allowed
        attn_mask = ~allowed  # torch: True = NOT allowed
    if masking in ("padding", "both"):
        pad = M.padding_mask(lengths, s)  # (B, 1, 1, S)
        ours_mask = pad if ours_mask is None else ours_mask & pad
        kpm = ~pad[:, 0, 0]
    expected, w_ref = ref(
        x, mem, mem, attn_mask=attn_mask, key_padding_mask=kpm, average_attn_weights=False
    )
    out, w = ours(x, mem, mem, ours_mask, return_weights=True)
    assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    plain, none = ours(x, mem, mem, ours_mask)
    assert none is None  # like torch's module with need_weights=False
    assert_close(plain, expected, atol=1e-5, rtol=1e-5)


def test_grouped_query_attention_equals_repeated_kv_weights():
    H, K, E = 6, 2, 4
    gqa = attnkit.MultiHeadAttention(D, H, head_dim=E, num_kv_heads=K, causal=True)
    full = attnkit.MultiHeadAttention(D, H, head_dim=E, causal=True)
    with torch.no_grad():
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(full, name)
            dst.weight.copy_(src.weight.view(K, E, D).repeat_interleave(H // K, 0).reshape(-1, D))
            dst.bias.copy_(src.bias.view(K, E).repeat_interleave(H // K, 0).reshape(-1))
    x = torch.randn(B, N, D)
    assert_close(gqa(x)[0], full(x)[0], atol=1e-5, rtol=1e-5)
    assert gqa.k_proj.weight.shape == (K * E, D)


def test_fused_and_separate_projections_agree():
    fused = attnkit.MultiHeadAttention(D, 4, fused_qkv=True, num_kv_heads=2)
    sep = attnkit.MultiHeadAttention(D, 4, num_kv_heads=2)
    wq, wk, wv = fused.qkv_proj.weight.split([12, 6, 6])
    bq, bk, bv = fused.qkv_proj.bias.split([12, 6, 6])
    with torch.no_grad():
        for lin, w, b in ((sep.q_proj, wq, bq), (sep.k_proj, wk, bk), (sep.v_proj, wv, bv)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        sep.out_proj.load_state_dict(fused.out_proj.state_dict())
    x = torch.randn(B, N, D)
    assert_close(fused(x)[0], sep(x)[0])


def test_module_output_equals_float64_reference():
    m = attnkit.MultiHeadAttention(D, 3, causal=True, bias=False)
    x = torch.randn(B, N, D)
    q = (x @ m.q_proj.weight.T).view(B, N, 3, 4).transpose(1, 2)
    k = (x @ m.k_proj.weight.T).view(B, N, 3, 4).transpose(1, 2)
    v = (x @ m.v_proj.weight.T).view(B, N, 3, 4).transpose(1, 2)
    ref, _ = reference_attention(q, k, v, M.causal_mask(N))
    expected = ref.transpose(1, 2).reshape(B, N, D) @ m.out_proj.weight.double().T
    assert_close(m(x)[0], expected.float(), atol=1e-5, rtol=1e-5)


def test_dropout_only_in_training():
    m = attnkit.MultiHeadAttention(D, 4, dropout=0.5)
    x = torch.randn(B, N, D)
    m.eval()
    assert_close(m(x)[0], m(x)[0])
    m.train()
    assert not torch.allclose(m(x)[0], m(x)[0])


@pytest.mark.slow
def test_compile_fullgraph():
    m = attnkit.MultiHeadAttention(D, 4, num_kv_heads=2, causal=True).eval()
    x = torch.randn(B, N, D)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    assert_close(compiled(x), m(x))
    mask = torch.rand(B, 1, N, N) > 0.5
    assert_close(compiled(x, mask=mask), m(x, mask=mask))


def test_deprecated_hidden_dim_warns_at_the_callers_line_and_means_num_heads_times_head_dim():
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match=r"MultiHeadAttention\(hidden_dim=\.\.\.\)") as w:
        old = attnkit.MultiHeadAttention(12, 4, hidden_dim=20)
    assert [r.filename for r in w] == [__file__]
    torch.manual_seed(0)
    new = attnkit.MultiHeadAttention(12, 4, head_dim=5)
    assert old.state_dict().keys() == new.state_dict().keys()
    for name, tensor in new.state_dict().items():
        assert torch.equal(old.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match=r"give head_dim \(5\) or its deprecated form hidden_dim"):
        attnkit.MultiHeadAttention(12, 4, head_dim=5, hidden_dim=20)


def test_constructor_and_input_errors():
    with pytest.raises(ValueError, match=r"hidden_dim \(10\) must be divisible by num_heads \(4\)"):
        attnkit.MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads"):
        attnkit.MultiHeadAttention(12, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"sizes must be positive ints, got \{'embed_dim': 0, "):
        attnkit.MultiHeadAttention(0, 1)
    with pytest.raises(ValueError, match="fused_qkv needs kdim == vdim == embed_dim"):
        attnkit.MultiHeadAttention(12, 4, kdim=6, fused_qkv=True)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        attnkit.MultiHeadAttention(12, 4, dropout=1.5)
    for bad in (0.0, -1.0, math.inf, "50"):
        with pytest.raises(ValueError, match=rf"softcap must be a positive finite number .*{bad}"):
            attnkit.MultiHeadAttention(12, 4, softcap=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"hidden_dim \(16\) must be divisible by num_heads \(3\)"):
        attnkit.MultiHeadSelfAttention(8, 16, 8, 3)
    m = attnkit.MultiHeadAttention(12, 4)
    with pytest.raises(ValueError, match=r"query has last dim 5, expected embed_dim=12"):
        m(torch.randn(2, 3, 5))
    cross = attnkit.MultiHeadAttention(12, 4, kdim=6, vdim=8)
    with pytest.raises(ValueError, match=r"key has last dim 5, expected kdim=6 .*; value has "):
        cross(torch.randn(2, 3, 12), torch.randn(2, 4, 5), torch.randn(2, 4, 9))
    with pytest.raises(ValueError, match=r"key \(2, 4, 6\) and value \(2, 5, 8\) differ"):
        cross(torch.randn(2, 3, 12), torch.randn(2, 4, 6), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="fused_qkv attention is self-attention"):
        attnkit.MultiHeadAttention.forward(
            attnkit.MultiHeadSelfAttention(12, 12, 12, 4),
            torch.randn(1, 2, 12),
            torch.randn(1, 3, 12),
        )
    with pytest.raises(ValueError, match=r"does not broadcast"):
        m(torch.randn(2, 3, 12), mask=torch.ones(4, 4, dtype=torch.bool))


# ----------------------------------------------- checkpoint names, aliases, one call per layer

BLOG_PAIRS = [
    (lambda: blog.BlogAttention(D, 16, 10), lambda: attnkit.Attention(D, 16, 10)),
    (lambda: blog.BlogSelfAttention(D, 16, 10), lambda: attnkit.SelfAttention(D, 16, 10)),
    (
        lambda: blog.BlogMultiheadCrossAttention(D, 16, 10, 4),
        lambda: attnkit.MultiheadCrossAttention(D, 16, 10, 4),
    ),
    (
        lambda: blog.BlogMultiHeadSelfAttention(D, 16, 10, 4),
        lambda: attnkit.MultiHeadSelfAttention(D, 16, 10, 4),
    ),
]


def _inputs(module: nn.Module) -> tuple[torch.Tensor, ...]:
    x, kv = torch.randn(B, N, D), torch.randn(B, S, D)
    fused = isinstance(module, attnkit.MultiHeadSelfAttention)
    return (x,) if fused else (x, kv, kv)


@pytest.mark.parametrize(("make_blog", "make_ours"), BLOG_PAIRS)
def test_state_dict_keeps_the_blog_names_and_round_trips(make_blog, make_ours):
    ref, ours = make_blog(), make_ours()
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(ref.state_dict())  # same names, same order
    for name, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value)
    again = make_ours()
    again.load_state_dict(ours.state_dict(), strict=True)  # save -> load round trip
    args = _inputs(ours)
    assert torch.equal(again(*args), ours(*args))
    assert_close(ours(*args), ref(*args), atol=1e-5, rtol=1e-5)
    # The blog's code loads our state_dict too.
    ref2 = make_blog()
    ref2.load_state_dict(ours.state_dict(), strict=True)
    assert_close(ref2(*args), ref(*args))


@pytest.mark.parametrize(("make_blog", "make_ours"), BLOG_PAIRS)
def test_attribute_names_also_load_and_parameters_are_named_by_attribute(make_blog, make_ours):
    ours = make_ours()
    by_attribute = {n: p.detach() + 1 for n, p in ours.named_parameters()}
    prefixes = {n.split(".")[0] for n in by_attribute}
    assert prefixes <= {"q_proj", "k_proj", "v_proj", "qkv_proj", "out_proj"}
    assert "out_proj" in prefixes
    ours.load_state_dict(by_attribute, strict=True)
    for n, p in ours.named_parameters():
        assert torch.equal(p, by_attribute[n])
    # named_parameters and state_dict list the same tensors, under attribute vs. blog names.
    blog_names = list(make_blog().state_dict())
    assert [p.data_ptr() for p in ours.parameters()] == [
        ours.state_dict()[n].data_ptr() for n in blog_names
    ]


def test_strict_loading_still_reports_bad_keys():
    ours = attnkit.MultiHeadSelfAttention(D, 16, 10, 4)
    sd = ours.state_dict()
    sd["w_qkv.extra"] = torch.zeros(1)
    del sd["output_map.bias"]
    with pytest.raises(RuntimeError) as err:
        ours.load_state_dict(sd, strict=True)
    # Named as in the checkpoint, not by the attributes the keys were mapped to.
    assert 'Missing key(s) in state_dict: "output_map.bias"' in str(err.value)
    assert 'Unexpected key(s) in state_dict: "w_qkv.extra"' in str(err.value)
    result = ours.load_state_dict(sd, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["output_map.bias"], ["w_qkv.extra"])
    block = attnkit.TransformerBlock(16, 24, 4)
    sd = block.state_dict()
    sd["attention.output_map.extra"] = sd.pop("attention.output_map.weight")
    result = block.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["attention.output_map.weight"]
    assert result.unexpected_keys == ["attention.output_map.extra"]


def test_blog_attribute_names_are_read_only_aliases():
    cross = attnkit.MultiheadCrossAttention(D, 16, 10, 4)
    assert cross.w_q is cross.q_proj and cross.w_k is cross.k_proj and cross.w_v is cross.v_proj
    assert cross.output_map.weight is cross.out_proj.weight
    fused = attnkit.MultiHeadSelfAttention(D, 16, 10, 4)
    assert fused.w_qkv is fused.qkv_proj and fused.output_map is fused.out_proj
    pos = attnkit.PositionalMultiHeadSelfAttention(16, 4)
    assert pos.qkv is pos.qkv_proj and pos.output is pos.out_proj
    assert set(pos.state_dict()) == {"qkv.weight", "qkv.bias", "output.weight", "output.bias"}
    with pytest.raises(AttributeError, match=r"'w_qkv' is a read-only alias of 'qkv_proj'"):
        fused.w_qkv = nn.Linear(D, 48)
    with pytest.raises(AttributeError, match=r"'output_map' is a read-only alias of 'out_proj'"):
        cross.output_map = nn.Linear(16, 10)
    replacement = nn.Linear(16, 10)
    cross.out_proj = replacement  # the attribute itself may be replaced
    assert cross.output_map is replacement and "output_map.weight" in cross.state_dict()


def test_every_checkpoint_name_is_a_read_only_alias():
    core = attnkit.MultiHeadAttention(8, 2, fused_qkv=True)
    assert list(core.state_dict()) == [n for n, _ in core.named_parameters()]  # core names
    for cls in (attnkit.Attention, attnkit.SelfAttention, attnkit.PositionalMultiHeadSelfAttention):
        for alias in cls.checkpoint_names.values():
            assert isinstance(getattr(cls, alias), property), (cls, alias)


def test_blog_presets_share_one_forward():
    assert isinstance(attnkit.Attention(D, 16, 10), attnkit.MultiheadCrossAttention)
    assert isinstance(attnkit.SelfAttention(D, 16, 10), attnkit.MultiHeadSelfAttention)
    assert attnkit.Attention.forward is attnkit.MultiheadCrossAttention.forward
    assert attnkit.SelfAttention.forward is attnkit.MultiHeadSelfAttention.forward


def test_nested_blog_names_and_copies():
    import copy
    import pickle

    block = attnkit.TransformerBlock(D, 24, 4)
    sd = block.state_dict()
    assert "attention.w_qkv.weight" in sd and "attention.output_map.bias" in sd
    assert not any("qkv_proj" in k or "out_proj" in k for k in sd)
    clone = copy.deepcopy(block)
    unpickled = pickle.loads(pickle.dumps(block))
    x = torch.randn(B, N, D)
    for other in (clone, unpickled):
        assert list(other.state_dict()) == list(sd)
        other.load_state_dict(sd, strict=True)
        assert torch.equal(other(x), block(x))


@pytest.mark.parametrize("return_weights", [False, True])
def test_weights_pass_through_every_layer(return_weights):
    """One call per layer: weights reach the model's output exactly when they are asked for."""
    lm = attnkit.TransformerLM(20, 16, 2, 4, max_seq_len=16).eval()
    ids = torch.randint(0, 20, (2, 5))
    out = lm(ids, return_weights=return_weights)
    block, h = lm.blocks[0], lm.embedding(ids)
    block_out = block(h, return_weights=return_weights)  # (x, weights or None), as below
    attn_out = block.attention(block.norm1(h), return_weights=return_weights)  # pre-norm
    if return_weights:
        logits, weights = out
        assert len(weights) == 2 and weights[0].shape == (2, 4, 5, 5)
        assert_close(logits, lm(ids))
        assert_close(block_out[1], attn_out[1])
        assert_close(weights[0], attn_out[1])
        assert torch.equal(torch.tril(weights[0]), weights[0])  # causal
    else:
        assert isinstance(out, torch.Tensor)
        assert block_out[1] is None and attn_out[1] is None


def test_attend_returns_weights_only_when_asked():
    q = torch.randn(1, 2, 4, 8)
    o1, none = attnkit.functional.attend(q, q, q, causal=True)
    o2, weights = attnkit.functional.attend(q, q, q, causal=True, return_weights=True)
    assert none is None and weights is not None
    assert_close(o1, o2)
    ref_out, ref_w = reference_attention(q, q, q, M.causal_mask(4, 4))
    assert_close(o2, ref_out.float(), atol=1e-5, rtol=1e-5)
    assert_close(weights, ref_w.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: attnkit.MultiHeadAttention(8, 2),
        lambda: attnkit.MultiHeadSelfAttention(8, 8, 8, 2),
        lambda: attnkit.TransformerBlock(8, 16, 2),
        lambda: attnkit.PositionalTransformerBlock(8, 16, 2, "sinusoidal"),
    ],
)
def test_layer_keywords_are_checked(make):
    layer, x = make(), torch.randn(1, 3, 8)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['postions'\]"):
        layer(x, positions=None, postions=torch.arange(3))


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: attnkit.MultiHeadAttention(8, 2, **kw),
        lambda **kw: attnkit.TransformerLayer(8, 16, 2, **kw),
        lambda **kw: attnkit.TransformerBlock(8, 16, 2, **kw),
    ],
)
def test_constructor_keywords_are_checked(make):
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['windw'\]"):
        make(windw=4)
    layer = make(window=4, num_kv_heads=1, scale=0.5)  # the attention options pass through
    attention = getattr(layer, "attention", layer)
    assert (attention.window, attention.num_kv_heads, attention.scale) == (4, 1, 0.5)


def test_blog_cross_attention_takes_the_layer_keywords():
    # Decoding one token at a time through a KV cache equals attending with a causal mask.
    torch.manual_seed(0)
    attn = attnkit.MultiheadCrossAttention(D, 16, 10, 4).eval()
    x = torch.randn(B, N, D)
    full = attn(x, x, x, torch.ones(N, N, dtype=torch.bool).tril())
    cache = attnkit.KVCache(B, 4, N, 4)
    steps = [attn(t, t, t, kv_cache=cache) for t in x.split(1, dim=1)]  # each (B, 1, 10)
    assert_close(torch.cat(steps, dim=1), full)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['cache'\]"):
        attn(x, x, x, cache=cache)
