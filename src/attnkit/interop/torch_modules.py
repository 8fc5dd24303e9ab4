"""Importers from PyTorch's own modules into attnkit modules with the same outputs.

* :func:`from_torch_multihead_attention`: ``nn.MultiheadAttention`` -> :class:`MultiHeadAttention`
* :func:`from_torch_encoder_layer`: ``nn.TransformerEncoderLayer`` -> ``TransformerBlock``
* :func:`mask_from_torch`: torch's ``attn_mask`` / ``key_padding_mask`` (bool ``True`` = may NOT
  attend) -> one attnkit mask (bool ``True`` = may attend, or additive float).

attnkit modules are batch-first: a module imported from ``batch_first=False`` torch takes
``(B, L, D)``, so transpose torch's ``(L, B, D)`` inputs with ``x.transpose(0, 1)``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.attention import MultiHeadAttention
from attnkit.blog import TransformerBlock

__all__ = ["from_torch_encoder_layer", "from_torch_multihead_attention", "mask_from_torch"]


def _copy_linear(dst: nn.Linear, weight: Tensor, bias: Tensor | None) -> None:
    dst.weight.copy_(weight)
    if bias is not None:
        dst.bias.copy_(bias)


def _check_plain_mha(m: nn.MultiheadAttention) -> None:
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"expected an nn.MultiheadAttention, got {type(m).__name__}")
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError(
            "nn.MultiheadAttention with add_bias_kv=True or add_zero_attn=True has no attnkit "
            f"equivalent (add_bias_kv={m.bias_k is not None}, add_zero_attn={m.add_zero_attn})"
        )


@torch.no_grad()
def from_torch_multihead_attention(
    m: nn.MultiheadAttention, *, fused_qkv: bool = False
) -> MultiHeadAttention:
    """Build an attnkit :class:`MultiHeadAttention` with the weights of ``m``.

    torch stores the q/k/v projections as one ``in_proj_weight`` with rows ``[q; k; v]`` (or as
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when ``kdim``/``vdim`` differ from
    ``embed_dim``); both layouts are handled, as are ``bias=False`` and dropout.

    Args:
        m: The torch module.
        fused_qkv: Copy ``in_proj_weight`` into one fused projection (faster self-attention,
            but the result then only does self-attention). Needs ``kdim == vdim == embed_dim``.

    Returns:
        A batch-first module, in the training mode of ``m``, that returns ``(out, weights)``:
        in ``out, weights = new(q, k, v, mask)``, ``out`` equals ``m(q, k, v, ...)[0]`` (with
        ``(L, B, D)`` inputs transposed when ``m.batch_first`` is false, and the masks converted
        by :func:`mask_from_torch`); ``weights`` is ``None`` unless ``return_weights=True``,
        then ``(B, H, L, S)``, which ``m`` returns averaged over the heads unless
        ``average_attn_weights=False``.

    Raises:
        TypeError: If ``m`` is not an ``nn.MultiheadAttention``.
        ValueError: For ``add_bias_kv``/``add_zero_attn``, which attnkit does not implement, or
            ``fused_qkv`` with different key/value dims.
    """
    _check_plain_mha(m)
    D = m.embed_dim
    bias = m.in_proj_bias is not None
    same = m._qkv_same_embed_dim
    if fused_qkv and not same:
        raise ValueError(
            f"fused_qkv needs kdim == vdim == embed_dim, got kdim={m.kdim}, "
            f"vdim={m.vdim}, embed_dim={D}"
        )
    new = MultiHeadAttention(
        D, m.num_heads, kdim=m.kdim, vdim=m.vdim, bias=bias, fused_qkv=fused_qkv, dropout=m.dropout
    )
    new = new.to(device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
    b_q = b_k = b_v = None
    if bias:
        b_q, b_k, b_v = m.in_proj_bias.split(D)  # torch keeps one [q; k; v] bias even with kdim
    if fused_qkv:
        _copy_linear(new.qkv_proj, m.in_proj_weight, m.in_proj_bias)
    else:
        if same:
            w_q, w_k, w_v = m.in_proj_weight.split(D)  # rows [q; k; v], each (D, D)
        else:
            w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        _copy_linear(new.q_proj, w_q, b_q)
        _copy_linear(new.k_proj, w_k, b_k)
        _copy_linear(new.v_proj, w_v, b_v)
    _copy_linear(new.out_proj, m.out_proj.weight, m.out_proj.bias)
    return new.train(m.training)


def _activation_name(layer: nn.TransformerEncoderLayer) -> Literal["relu", "gelu"]:
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        return "gelu"
    raise ValueError(f"only relu and (exact) gelu activations can be imported, got {act!r}")


@torch.no_grad()
def from_torch_encoder_layer(layer: nn.TransformerEncoderLayer) -> TransformerBlock:
    """Build an attnkit ``TransformerBlock`` with the weights and settings of ``layer``.

    Copies ``norm_first`` (pre-/post-norm), the activation (relu or exact gelu), the LayerNorm
    ``eps``, the feed-forward width and dropout.

    Args:
        layer: The torch encoder layer.

    Returns:
        A batch-first block in the training mode of ``layer``: ``block(x, mask)`` equals
        ``layer(x, src_mask, src_key_padding_mask)`` with the masks converted by
        :func:`mask_from_torch`.

    Raises:
        TypeError: If ``layer`` is not an ``nn.TransformerEncoderLayer``.
        ValueError: For activations other than relu/gelu, or attention options attnkit lacks.
    """
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise TypeError(f"expected an nn.TransformerEncoderLayer, got {type(layer).__name__}")
    attn = layer.self_attn
    _check_plain_mha(attn)
    activation = _activation_name(layer)
    D, hidden = attn.embed_dim, layer.linear1.out_features
    ff_bias = layer.linear1.bias is not None
    if (attn.in_proj_bias is not None) != ff_bias:
        raise ValueError("attention and feed-forward biases must be both on or both off")
    block = TransformerBlock(
        D,
        hidden,
        attn.num_heads,
        norm_first=layer.norm_first,
        norm="layernorm",
        activation=activation,
        eps=layer.norm1.eps,
        dropout=layer.dropout.p,
        bias=ff_bias,
    )
    block = block.to(device=layer.linear1.weight.device, dtype=layer.linear1.weight.dtype)
    mha = block.attention
    assert isinstance(mha, MultiHeadAttention)  # the block built its own (attention=None)
    _copy_linear(mha.qkv_proj, attn.in_proj_weight, attn.in_proj_bias)
    _copy_linear(mha.out_proj, attn.out_proj.weight, attn.out_proj.bias)
    _copy_linear(block.feed_forward.linear1, layer.linear1.weight, layer.linear1.bias)
    _copy_linear(block.feed_forward.linear2, layer.linear2.weight, layer.linear2.bias)
    for ours, theirs in ((block.norm1, layer.norm1), (block.norm2, layer.norm2)):
        if not isinstance(theirs, nn.LayerNorm):
            raise ValueError(f"only LayerNorm norms can be imported, got {type(theirs).__name__}")
        assert isinstance(ours, nn.LayerNorm)  # built with norm="layernorm"
        ours.weight.copy_(theirs.weight)
        ours.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(ours.bias))
    return block.train(layer.training)


def mask_from_torch(
    *,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    num_heads: int | None = None,
) -> Tensor | None:
    """Convert torch's masks (bool ``True`` = may NOT attend) into one attnkit mask.

    Args:
        attn_mask: ``(L, S)`` or ``(B * H, L, S)``; bool (``True`` = masked out) or additive.
        key_padding_mask: ``(B, S)``; bool (``True`` = padding, ignored) or additive.
        num_heads: ``H``, needed to unflatten a 3-D ``attn_mask``.

    Returns:
        Bool (``True`` = may attend) when every given mask is bool, else additive float;
        broadcastable to ``(B, H, L, S)``. ``None`` when both masks are ``None``.

    Raises:
        ValueError: If a mask has the wrong number of dims, or ``num_heads`` is missing.
    """
    parts: list[Tensor] = []
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            if num_heads is None:
                raise ValueError("a 3-D attn_mask (B * H, L, S) needs num_heads")
            attn_mask = attn_mask.unflatten(0, (-1, num_heads))  # (B, H, L, S)
        elif attn_mask.dim() != 2:
            raise ValueError(
                f"attn_mask must be (L, S) or (B * H, L, S), got {tuple(attn_mask.shape)}"
            )
        parts.append(~attn_mask if attn_mask.dtype == torch.bool else attn_mask)
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2:
            raise ValueError(
                f"key_padding_mask must be (B, S), got {tuple(key_padding_mask.shape)}"
            )
        kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        parts.append(~kpm if kpm.dtype == torch.bool else kpm)
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        out = parts[0]
        for p in parts[1:]:
            out = out & p
        return out
    dtype = next(p.dtype for p in parts if p.dtype != torch.bool)
    additive = [
        torch.where(p, 0.0, float("-inf")).to(dtype) if p.dtype == torch.bool else p for p in parts
    ]
    out = additive[0]
    for p in additive[1:]:
        out = out + p
    return out
