"""Importers from torch's MultiheadAttention / TransformerEncoderLayer, and mask conversion."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from attnkit import MultiHeadAttention
from attnkit.blocks import TransformerBlock
from attnkit.interop import (
    from_torch_encoder_layer,
    from_torch_multihead_attention,
    mask_from_torch,
)

B, L, S, D, H = 2, 5, 7, 16, 4


def _padding(B: int, S: int, lengths: list[int]) -> torch.Tensor:
    """torch convention: True = padding (ignored)."""
    return torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]  # (B, S)


def _bf(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """(B, N, D) -> torch's layout."""
    return x if batch_first else x.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool_attn", "float_attn", "both"])
def test_multihead_attention_self(batch_first: bool, bias: bool, mask_kind: str) -> None:
    m = nn.MultiheadAttention(D, H, bias=bias, batch_first=batch_first, dropout=0.1).eval()
    ours = from_torch_multihead_attention(m)
    assert isinstance(ours, MultiHeadAttention) and not ours.training
    x = torch.randn(B, L, D)
    kpm = _padding(B, L, [L, 3]) if mask_kind in ("padding", "both") else None
    attn_mask = None
    if mask_kind in ("bool_attn", "both"):
        attn_mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)  # True = masked out
    elif mask_kind == "float_attn":
        attn_mask = torch.randn(L, L)
    ref, _ = m(
        _bf(x, batch_first),
        _bf(x, batch_first),
        _bf(x, batch_first),
        key_padding_mask=kpm,
        attn_mask=attn_mask,
        need_weights=False,
    )
    mask = mask_from_torch(attn_mask=attn_mask, key_padding_mask=kpm)
    assert_close(ours(x, mask=mask), _bf(ref, batch_first), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kdim", "vdim"), [(None, None), (12, 12), (12, 20)])
def test_multihead_attention_cross_and_kvdims(kdim: int | None, vdim: int | None) -> None:
    m = nn.MultiheadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=True).eval()
    assert m._qkv_same_embed_dim == (kdim is None)
    ours = from_torch_multihead_attention(m)
    q = torch.randn(B, L, D)
    k = torch.randn(B, S, kdim or D)
    v = torch.randn(B, S, vdim or D)
    kpm = _padding(B, S, [S, 4])
    ref, _ = m(q, k, v, key_padding_mask=kpm, need_weights=False)
    out = ours(q, k, v, mask=mask_from_torch(key_padding_mask=kpm))
    assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_multihead_attention_fused_qkv_and_weights() -> None:
    m = nn.MultiheadAttention(D, H, batch_first=True).eval()
    ours = from_torch_multihead_attention(m, fused_qkv=True)
    assert ours.fused_qkv
    x = torch.randn(B, L, D)
    kpm = _padding(B, L, [2, L])
    ref, ref_w = m(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    out, w = ours(x, mask=mask_from_torch(key_padding_mask=kpm), return_weights=True)
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


def test_multihead_attention_keeps_training_mode_and_dtype() -> None:
    m = nn.MultiheadAttention(D, H, batch_first=True).double()
    ours = from_torch_multihead_attention(m)
    assert ours.training and ours.out_proj.weight.dtype == torch.float64


def test_multihead_attention_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch_multihead_attention(nn.MultiheadAttention(D, H, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        from_torch_multihead_attention(nn.MultiheadAttention(D, H, add_zero_attn=True))
    with pytest.raises(TypeError, match="Linear"):
        from_torch_multihead_attention(nn.Linear(D, D))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fused_qkv"):
        from_torch_multihead_attention(nn.MultiheadAttention(D, H, kdim=8), fused_qkv=True)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", F.gelu, nn.ReLU()])
@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_layer(norm_first: bool, activation: object, batch_first: bool) -> None:
    layer = nn.TransformerEncoderLayer(
        D,
        H,
        dim_feedforward=24,
        dropout=0.1,
        activation=activation,  # type: ignore[arg-type]
        layer_norm_eps=1e-6,
        batch_first=batch_first,
        norm_first=norm_first,
    ).eval()
    with torch.no_grad():  # non-trivial norms, so that a missed copy shows
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    block = from_torch_encoder_layer(layer)
    assert isinstance(block, TransformerBlock) and not block.training
    assert block.norm1.eps == 1e-6 and block.norm_first == norm_first
    x = torch.randn(B, L, D)
    kpm = _padding(B, L, [L, 3])
    src_mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    # with and without autograd: torch may take a fused inference path only without it
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            ref = layer(_bf(x, batch_first), src_mask=src_mask, src_key_padding_mask=kpm)
            out = block(x, mask_from_torch(attn_mask=src_mask, key_padding_mask=kpm))
        assert_close(out, _bf(ref, batch_first), atol=1e-5, rtol=1e-5)


def test_encoder_layer_without_bias() -> None:
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=24, batch_first=True, bias=False)
    layer.eval()
    block = from_torch_encoder_layer(layer)
    assert block.feed_forward.linear1.bias is None
    x = torch.randn(B, L, D)
    assert_close(block(x), layer(x), atol=1e-5, rtol=1e-5)


def test_encoder_layer_rejects_other_activations() -> None:
    layer = nn.TransformerEncoderLayer(D, H, activation=nn.GELU(approximate="tanh"))
    with pytest.raises(ValueError, match="activation"):
        from_torch_encoder_layer(layer)
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        from_torch_encoder_layer(nn.Linear(D, D))  # type: ignore[arg-type]


def test_mask_from_torch() -> None:
    kpm = _padding(2, 4, [4, 2])
    attn = torch.tensor([[False, True, False, False]] * 3)  # (L=3, S=4), True = masked out
    assert mask_from_torch() is None
    m = mask_from_torch(attn_mask=attn, key_padding_mask=kpm)
    assert m.dtype == torch.bool and m.shape == (2, 1, 3, 4)
    assert m[1, 0, 0].tolist() == [True, False, False, False]
    assert m[0, 0, 0].tolist() == [True, False, True, True]
    # a float mask makes the result additive, with -inf where the bool one masked
    f = mask_from_torch(attn_mask=torch.zeros(3, 4), key_padding_mask=kpm)
    assert f.dtype == torch.float32 and torch.isinf(f[1, 0, 0, 2:]).all() and f[0].eq(0).all()
    # a per-batch-and-head mask (B * H, L, S) needs num_heads
    per_head = torch.zeros(2 * 3, 3, 4, dtype=torch.bool)
    per_head[4, 1, 0] = True  # batch 1, head 1, query 1, key 0
    m3 = mask_from_torch(attn_mask=per_head, num_heads=3)
    assert m3.shape == (2, 3, 3, 4) and not m3[1, 1, 1, 0] and m3.sum() == 2 * 3 * 3 * 4 - 1
    with pytest.raises(ValueError, match="num_heads"):
        mask_from_torch(attn_mask=per_head)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mask_from_torch(key_padding_mask=torch.zeros(4, dtype=torch.bool))
