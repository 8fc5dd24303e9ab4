"""Importers from torch's MultiheadAttention / TransformerEncoderLayer, mask conversion, and the
BERT encoder (padded and packed) against transformers' BertModel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from attnkit import MultiHeadAttention
from attnkit.blog import TransformerBlock
from attnkit.interop import (
    from_torch_encoder_layer,
    from_torch_multihead_attention,
    mask_from_torch,
)
from attnkit.interop.bert import BertConfig, BertEncoder, PackedBatch, bert_state_dict
from tests.reference import reference_attention

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
    assert_close(ours(x, mask=mask)[0], _bf(ref, batch_first), atol=1e-5, rtol=1e-5)


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
    out, _ = ours(q, k, v, mask=mask_from_torch(key_padding_mask=kpm))
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


# --------------------------------------------------------------------------------------------
# BERT (interop/bert.py): padded and packed paths against transformers' BertModel.
# --------------------------------------------------------------------------------------------

# A Hugging Face BERT config.json (its layer_norm_eps and hidden_act take their defaults).
TINY_BERT_JSON = {
    "vocab_size": 50,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 24,
    "max_position_embeddings": 32,
}
TINY_BERT = BertConfig.from_hf(TINY_BERT_JSON)


def _hf_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(**TINY_BERT_JSON, attn_implementation="eager")
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # LayerNorms start as (1, 0): give them values that matter
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _ours_from(hf: nn.Module) -> BertEncoder:
    ours = BertEncoder(TINY_BERT).eval()
    ours.load_state_dict(bert_state_dict(hf.state_dict(), TINY_BERT.model.num_layers))
    return ours


def _padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ids and token types right-padded to the longest, and the real-token mask."""
    S = max(lengths)
    real = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    ids = torch.randint(1, TINY_BERT.model.vocab_size, real.shape).masked_fill(~real, 0)
    types = torch.randint(0, 2, real.shape).masked_fill(~real, 0)
    return ids, types, real


LENGTHS = {
    "sorted": [9, 9, 7, 4, 4, 3, 1],
    "unsorted": [2, 11, 5, 1, 8],
    "equal": [6, 6, 6],
    "one": [5],
}


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_bert_padded_and_packed_equal_transformers(lengths: list[int]) -> None:
    hf = _hf_bert()
    ours = _ours_from(hf)
    ids, types, real = _padded(lengths)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=real.long(), token_type_ids=types)
        want = want.last_hidden_state[real]  # (N, D): real tokens, text by text
        padded = ours(ids, real, types)[real]
        for ratio in (1.0, 2.0, float("inf")):
            batch = PackedBatch.from_lengths(lengths, group_ratio=ratio)
            packed = ours.forward_packed(ids[real], batch, types[real])  # (N, D)
            assert_close(packed, want, atol=2e-5, rtol=1e-4)
    assert_close(padded, want, atol=2e-5, rtol=1e-4)


def test_bert_attention_weights_equal_transformers() -> None:
    hf = _hf_bert()
    ours = _ours_from(hf)
    ids, types, real = _padded([7, 4])
    with torch.no_grad():
        want = hf(
            input_ids=ids, attention_mask=real.long(), token_type_ids=types, output_attentions=True
        )
        hidden, weights = ours(ids, real, types, return_weights=True)
    assert weights.shape == (2, 2, 4, 7, 7)  # (layers, B, H, L, L)
    assert_close(weights, torch.stack(want.attentions), atol=1e-5, rtol=0)
    assert_close(hidden[real], want.last_hidden_state[real], atol=2e-5, rtol=1e-4)
    assert_close(ours(ids, real, types), hidden, atol=1e-6, rtol=0)  # fused kernel: same values


@pytest.mark.parametrize("ratio", [1.0, 1.5, float("inf")])
def test_packed_attend_equals_per_text_reference(ratio: float) -> None:
    lengths, H, E = [8, 8, 5, 3, 2, 1, 6], 2, 4
    batch = PackedBatch.from_lengths(lengths, group_ratio=ratio)
    qkv = torch.randn(sum(lengths), 3 * H * E)
    got = batch.attend(qkv, num_heads=H, scale=0.3)
    start = 0
    for n in lengths:
        q, k, v = qkv[start : start + n].view(n, 3, H, E).permute(1, 2, 0, 3)  # (H, n, E) each
        want, _ = reference_attention(q, k, v, scale=0.3)  # (H, n, E)
        assert_close(got[start : start + n], want.transpose(0, 1).flatten(1).float())
        start += n


def test_bert_config_maps_the_hf_names(tmp_path: Path) -> None:
    m = TINY_BERT.model
    sizes = (m.vocab_size, m.dim, m.num_layers, m.num_heads, m.ffn_dim, m.max_seq_len)
    assert sizes == (50, 16, 2, 4, 24, 32)
    assert (m.position, m.causal, m.norm_first, m.activation, m.eps) == (
        "learned",
        False,
        False,
        "gelu",
        1e-12,
    )
    assert (TINY_BERT.type_vocab_size, TINY_BERT.pad_token_id) == (2, 0)
    relu = BertConfig.from_hf(TINY_BERT_JSON | {"hidden_act": "relu", "type_vocab_size": 3})
    assert (relu.model.activation, relu.type_vocab_size) == ("relu", 3)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_BERT_JSON | {"model_type": "bert"}))
    assert BertConfig.from_json(path) == TINY_BERT


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "roberta"}, "model_type 'bert', got 'roberta'"),
        ({"position_embedding_type": "relative_key"}, "absolute position.*'relative_key'"),
        (
            {"hidden_act": "gelu_new"},
            r"hidden_act must be one of \['gelu', 'relu'\], got 'gelu_new'",
        ),
        ({"hidden_size": None}, r"lacks the sizes \['hidden_size'\]"),
        ({"pad_token_id": 50}, r"pad_token_id must be in \[0, vocab_size=50\), got 50"),
        ({"hidden_size": 18}, r"dim \(18\) must be divisible by num_heads \(4\)"),
    ],
)
def test_bert_config_errors_name_the_values(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_BERT_JSON | change))
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        BertConfig.from_json(path)


def test_bert_config_needs_the_bert_layout() -> None:
    with pytest.raises(ValueError, match=r"a BERT stack needs .*'norm_first': False.*got"):
        BertConfig(TINY_BERT.model.replace(norm_first=True))
    with pytest.raises(ValueError, match="type_vocab_size"):
        BertConfig(TINY_BERT.model, type_vocab_size=0)


def test_packed_layout_groups_and_mean() -> None:
    batch = PackedBatch.from_lengths([9, 8, 4, 4, 2, 1])
    assert batch.num_tokens == 28 and batch.max_length == 9
    # ratio 2: [9, 8] | [4, 4, 2] | [1]; a group without padding needs no gather and no mask
    assert [(g.count, g.width) for g in batch.groups] == [(2, 9), (3, 4), (1, 1)]
    assert batch.groups[2].rows is None and batch.groups[2].real is None
    assert batch.positions.tolist()[:11] == [*range(9), 0, 1]
    assert batch.segments.tolist()[-4:] == [3, 4, 4, 5]
    x = torch.randn(28, 3, dtype=torch.float64)
    means = torch.stack([t.mean(dim=0) for t in x.split([9, 8, 4, 4, 2, 1])])
    assert_close(batch.mean(x), means)
    assert len(PackedBatch.from_lengths([9, 8, 4, 1], group_ratio=float("inf")).groups) == 1
    assert len(PackedBatch.from_lengths([3, 3, 2], group_ratio=1.0).groups) == 2


def test_packed_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="at least one text"):
        PackedBatch.from_lengths([])
    with pytest.raises(ValueError, match=r"lengths \[0, -1\]"):
        PackedBatch.from_lengths([3, 0, -1])
    with pytest.raises(ValueError, match=r"group_ratio must be >= 1, got 0\.5"):
        PackedBatch.from_lengths([3], group_ratio=0.5)
    batch = PackedBatch.from_lengths([3, 2])
    with pytest.raises(ValueError, match=r"\(N=5, 3 \* num_heads \* E\).*\(5, 16\)"):
        batch.attend(torch.randn(5, 16), num_heads=2)
    ours = BertEncoder(TINY_BERT)
    with pytest.raises(ValueError, match=r"shape \(5,\).*got \(2, 3\)"):
        ours.forward_packed(torch.zeros(2, 3, dtype=torch.long), batch)
    too_long = PackedBatch.from_lengths([33])
    with pytest.raises(ValueError, match="33 tokens exceeds the 32 learned positions"):
        ours.forward_packed(torch.zeros(33, dtype=torch.long), too_long)
