"""Blocks: the blog's classes, torch's TransformerEncoderLayer, and every option."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from attnkit.blocks import FeedForward
from attnkit.blog import MultiHeadSelfAttention, PositionalTransformerBlock, TransformerBlock
from attnkit.cache import KVCache
from attnkit.positional import RotaryEmbedding
from tests.blog_reference import (
    BlogFeedForward,
    BlogPositionalTransformerBlock,
    BlogTransformerBlock,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _randomize_norms(module: nn.Module) -> None:
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.5, 0.5)


def _torch_layer_state(block: TransformerBlock) -> dict[str, torch.Tensor]:
    """Map a TransformerBlock's parameters to nn.TransformerEncoderLayer names."""
    sd = block.state_dict()
    return {
        "self_attn.in_proj_weight": sd["attention.w_qkv.weight"],
        "self_attn.in_proj_bias": sd["attention.w_qkv.bias"],
        "self_attn.out_proj.weight": sd["attention.output_map.weight"],
        "self_attn.out_proj.bias": sd["attention.output_map.bias"],
        "linear1.weight": sd["feed_forward.linear1.weight"],
        "linear1.bias": sd["feed_forward.linear1.bias"],
        "linear2.weight": sd["feed_forward.linear2.weight"],
        "linear2.bias": sd["feed_forward.linear2.bias"],
        "norm1.weight": sd["norm1.weight"],
        "norm1.bias": sd["norm1.bias"],
        "norm2.weight": sd["norm2.weight"],
        "norm2.bias": sd["norm2.bias"],
    }


def test_feed_forward_loads_blog_state_dict() -> None:
    blog, ours = BlogFeedForward(8, 24, 6), FeedForward(8, 24, 6)
    ours.load_state_dict(blog.state_dict(), strict=True)
    x = torch.randn(3, 5, 8)
    assert_close(ours(x), blog(x))


def test_swiglu_adds_a_gate_and_computes_silu_gate_times_up() -> None:
    ff = FeedForward(8, 16, 8, activation="swiglu")
    assert set(ff.state_dict()) == {
        f"{n}.{p}" for n in ("gate_up", "linear2") for p in ("weight", "bias")
    }
    x = torch.randn(2, 8)
    w, b = ff.gate_up.weight, ff.gate_up.bias
    gate = nn.functional.linear(x, w[:16], b[:16])
    up = nn.functional.linear(x, w[16:], b[16:])
    expected = ff.linear2(nn.functional.silu(gate) * up)
    assert_close(ff(x), expected)
    # attnkit 0.2's unfused names still load, into the fused rows [gate | up]
    old = {"gate.weight": w[:16], "gate.bias": b[:16], "linear1.weight": w[16:]}
    old |= {
        "linear1.bias": b[16:],
        "linear2.weight": ff.linear2.weight,
        "linear2.bias": ff.linear2.bias,
    }
    again = FeedForward(8, 16, 8, activation="swiglu")
    again.load_state_dict({k: v.detach().clone() for k, v in old.items()}, strict=True)
    assert_close(again(x), expected)
    assert not FeedForward(8, 16, 8, activation="gelu").gated
    with pytest.raises(ValueError, match="tanhh"):
        FeedForward(8, 16, 8, activation="tanhh")  # type: ignore[arg-type]


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_block_loads_blog_state_dict(causal: bool) -> None:
    blog = BlogTransformerBlock(16, 40, 4, causal=causal)
    _randomize_norms(blog)
    ours = TransformerBlock(16, 40, 4, causal=causal)
    ours.load_state_dict(blog.state_dict(), strict=True)
    assert isinstance(ours.attention, MultiHeadSelfAttention)
    x = torch.randn(2, 7, 16)
    assert_close(ours(x), blog(x), **TOL)


@pytest.mark.parametrize(
    ("options", "torch_options"),
    [
        ({}, {}),
        ({"norm_first": True, "activation": "gelu"}, {"norm_first": True, "activation": "gelu"}),
        ({"activation": "gelu", "eps": 1e-12}, {"activation": "gelu", "layer_norm_eps": 1e-12}),
    ],
)
def test_transformer_block_equals_torch_encoder_layer(options: dict, torch_options: dict) -> None:
    ours = TransformerBlock(16, 40, 4, **options)
    _randomize_norms(ours)
    ref = nn.TransformerEncoderLayer(16, 4, 40, dropout=0.0, batch_first=True, **torch_options)
    ref.load_state_dict(_torch_layer_state(ours), strict=True)
    ref.eval()  # torch's fast path and the slow path agree; eval is how inference runs
    x = torch.randn(3, 6, 16)
    lengths = torch.tensor([6, 4, 1])
    real = torch.arange(6)[None, :] < lengths[:, None]  # (B, L) True = real token
    assert_close(ours(x), ref(x), **TOL)
    # key padding: attnkit True = may attend; torch True = ignore
    out, exp = ours(x, real[:, None, None, :]), ref(x, src_key_padding_mask=~real)
    assert_close(out[real], exp[real], **TOL)


def test_rmsnorm_block_uses_torch_rmsnorm() -> None:
    block = TransformerBlock(16, 32, 4, norm="rmsnorm", norm_first=True, eps=1e-6)
    assert isinstance(block.norm1, nn.RMSNorm) and block.norm1.eps == 1e-6
    x = torch.randn(2, 5, 16)
    h = x + block.attention(block.norm1(x))
    expected = h + block.feed_forward(block.norm2(h))
    assert_close(block(x), expected)


def test_block_options_are_validated() -> None:
    with pytest.raises(ValueError, match="batchnorm"):
        TransformerBlock(16, 32, 4, norm="batchnorm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisible"):
        TransformerBlock(15, 32, 4)
    with pytest.raises(ValueError, match=r"1\.5"):
        TransformerBlock(16, 32, 4, dropout=1.5)


def test_dropout_only_in_training() -> None:
    block = TransformerBlock(16, 32, 4, dropout=0.5)
    x = torch.randn(2, 5, 16)
    block.eval()
    assert_close(block(x), block(x))
    block.train()
    assert not torch.allclose(block(x), block(x))


def test_grouped_query_block_and_weights() -> None:
    block = TransformerBlock(16, 32, 4, causal=True, num_kv_heads=2)
    assert block.attention.w_qkv.out_features == 16 + 2 * 8
    x = torch.randn(2, 5, 16)
    out, weights = block(x, return_weights=True)
    assert_close(out, block(x))
    assert weights.shape == (2, 4, 5, 5)
    assert_close(weights.sum(-1), torch.ones(2, 4, 5))
    assert torch.all(weights.triu(1) == 0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_block_cached_decoding_equals_full(norm_first: bool) -> None:
    rot = RotaryEmbedding(4)
    block = TransformerBlock(
        16,
        32,
        4,
        causal=True,
        num_kv_heads=2,
        rotary=rot,
        norm_first=norm_first,
        activation="swiglu",
    ).eval()
    x = torch.randn(2, 7, 16)
    full = block(x)
    cache = KVCache(2, 2, 7, 4)
    steps = [block(x[:, :4], kv_cache=cache)]
    steps += [block(x[:, t : t + 1], kv_cache=cache) for t in range(4, 7)]
    assert_close(torch.cat(steps, dim=1), full, **TOL)


@pytest.mark.parametrize("position_type", ["rope", "sinusoidal"])
@pytest.mark.parametrize("causal", [False, True])
def test_positional_block_loads_blog_state_dict(position_type: str, causal: bool) -> None:
    blog = BlogPositionalTransformerBlock(32, 64, 4, position_type, max_seq_len=64, causal=causal)
    _randomize_norms(blog)
    ours = PositionalTransformerBlock(32, 64, 4, position_type, max_seq_len=64, causal=causal)
    ours.load_state_dict(blog.state_dict(), strict=True)
    x = torch.randn(2, 9, 32)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    assert_close(ours(x), blog(x), **TOL)
    assert_close(ours(x, mask), blog(x, mask), **TOL)


def test_positional_block_sinusoidal_cached_decoding() -> None:
    block = PositionalTransformerBlock(16, 32, 2, "sinusoidal", max_seq_len=16, causal=True)
    x = torch.randn(1, 6, 16)
    cache = KVCache(1, 2, 6, 8)
    steps = [block(x[:, :3], kv_cache=cache)] + [
        block(x[:, t : t + 1], kv_cache=cache) for t in range(3, 6)
    ]
    assert_close(torch.cat(steps, 1), block(x), **TOL)
    with pytest.raises(ValueError, match="position_type"):
        PositionalTransformerBlock(16, 32, 2, "alibi")


def test_offset_rmsnorm_and_geglu_follow_their_formulas() -> None:
    from attnkit.blocks import OffsetRMSNorm, make_norm

    norm = make_norm("rmsnorm_plus_one", 8, eps=1e-6)
    assert isinstance(norm, OffsetRMSNorm) and torch.equal(norm.weight, torch.zeros(8))
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    xf = x.double()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.double())
    assert norm(x).dtype == torch.bfloat16
    assert_close(norm(x).double(), want, atol=2e-2, rtol=2e-2)
    ff = FeedForward(8, 16, 8, activation="geglu_tanh", bias=False)
    x = torch.randn(2, 8)
    gate, up = nn.functional.linear(x, ff.gate_up.weight).chunk(2, dim=-1)
    assert_close(ff(x), ff.linear2(nn.functional.gelu(gate, approximate="tanh") * up))
