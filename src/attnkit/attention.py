"""Multi-head attention, and the blog's attention classes as presets of it.

:class:`MultiHeadAttention` is the one general module: self- or cross-attention, separate or fused
q/k/v projections, grouped-query attention (``num_kv_heads``), causal / sliding-window masking,
rotary positions and a KV cache for decoding. It never computes attention itself: it projects,
splits heads and calls :func:`attnkit.functional.scaled_dot_product_attention`.

The blog's classes (``ScaleDotProductAttention``, ``Attention``, ``SelfAttention``,
``MultiheadCrossAttention``, ``MultiHeadSelfAttention``) keep the blog's constructor signatures
and parameter names (``w_q``, ``w_qkv``, ``output_map``...), so a state_dict saved from the blog's
code loads with ``strict=True`` and gives the same outputs.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import functional as F_attn
from attnkit.cache import KVCache

__all__ = [
    "Attention",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
    "MultiheadCrossAttention",
    "ScaleDotProductAttention",
    "SelfAttention",
    "merge_heads",
    "split_heads",
]


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """``(..., L, H*E) -> (..., H, L, E)``."""
    return x.unflatten(-1, (num_heads, -1)).transpose(-2, -3)


def merge_heads(x: Tensor) -> Tensor:
    """``(..., H, L, E) -> (..., L, H*E)``."""
    return x.transpose(-2, -3).flatten(-2)


def _check_positive(**sizes: int | None) -> None:
    bad = {n: s for n, s in sizes.items() if s is not None and (not isinstance(s, int) or s < 1)}
    if bad:
        raise ValueError(f"sizes must be positive ints, got {bad}")


class MultiHeadAttention(nn.Module):
    """General multi-head attention.

    Args:
        embed_dim: Query input dim ``D``.
        num_heads: Query heads ``H``.
        kdim: Key input dim (cross-attention); defaults to ``embed_dim``.
        vdim: Value input dim; defaults to ``kdim``.
        hidden_dim: Total projected dim ``H * E``; defaults to ``embed_dim``.
        out_dim: Output dim; defaults to ``embed_dim``.
        num_kv_heads: Key/value heads ``K`` (grouped-query attention); defaults to ``num_heads``.
        bias: Whether the query/key/value projections have biases.
        out_bias: Whether the output projection has a bias (default ``bias``).
        fused_qkv: One ``Linear`` producing ``[q | k | v]`` (self-attention only).
        dropout: Dropout on the attention weights, active only in training mode.
        causal: Causal masking (bottom-right aligned, see the functional core).
        window: Sliding-window size (see :func:`attnkit.functional.scaled_dot_product_attention`).
        scale: Score multiplier; defaults to ``1 / sqrt(E)``.
        rotary: Optional rotary module applied to queries and keys after the head split; it is
            called as ``rotary(x, positions)`` with ``x`` of shape ``(..., heads, L, E)``.

    Raises:
        ValueError: If sizes are not positive or do not divide.
    """

    # Attribute names of the projections. The blog's presets rename them so that the blog's
    # state_dicts load strictly; everything else refers to them through these names.
    q_name: ClassVar[str] = "q_proj"
    k_name: ClassVar[str] = "k_proj"
    v_name: ClassVar[str] = "v_proj"
    qkv_name: ClassVar[str] = "qkv_proj"
    out_name: ClassVar[str] = "out_proj"

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        hidden_dim: int | None = None,
        out_dim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        fused_qkv: bool = False,
        dropout: float = 0.0,
        causal: bool = False,
        window: int | None = None,
        scale: float | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__()
        hidden_dim = embed_dim if hidden_dim is None else hidden_dim
        out_dim = embed_dim if out_dim is None else out_dim
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kdim = embed_dim if kdim is None else kdim
        vdim = kdim if vdim is None else vdim
        _check_positive(
            embed_dim=embed_dim,
            num_heads=num_heads,
            kdim=kdim,
            vdim=vdim,
            hidden_dim=hidden_dim,
            out_dim=out_dim,
            num_kv_heads=num_kv_heads,
            window=window,
        )
        if hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim ({hidden_dim}) must be divisible by num_heads ({num_heads})"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if fused_qkv and (kdim != embed_dim or vdim != embed_dim):
            raise ValueError(
                f"fused_qkv needs kdim == vdim == embed_dim, got kdim={kdim}, vdim={vdim}, "
                f"embed_dim={embed_dim}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if scale is not None and not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        self.embed_dim, self.kdim, self.vdim = embed_dim, kdim, vdim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_dim // num_heads
        self.hidden_dim, self.out_dim = hidden_dim, out_dim
        self.fused_qkv = fused_qkv
        self.dropout, self.causal, self.window, self.scale = dropout, causal, window, scale
        kv_hidden = num_kv_heads * self.head_dim
        if fused_qkv:
            setattr(
                self, self.qkv_name, nn.Linear(embed_dim, hidden_dim + 2 * kv_hidden, bias=bias)
            )
        else:
            setattr(self, self.q_name, nn.Linear(embed_dim, hidden_dim, bias=bias))
            setattr(self, self.k_name, nn.Linear(kdim, kv_hidden, bias=bias))
            setattr(self, self.v_name, nn.Linear(vdim, kv_hidden, bias=bias))
        out_bias = bias if out_bias is None else out_bias
        setattr(self, self.out_name, nn.Linear(hidden_dim, out_dim, bias=out_bias))
        self.rotary = rotary

    def project_qkv(
        self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Project inputs and split heads.

        Shape:
            query ``(..., L, D)``, key ``(..., S, kdim)``, value ``(..., S, vdim)`` ->
            q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, E)``.
        """
        if query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query has last dim {query.shape[-1]}, expected embed_dim={self.embed_dim} "
                f"(query shape {tuple(query.shape)})"
            )
        is_self = key is None or (key is query and (value is None or value is query))
        if self.fused_qkv:
            if not is_self:
                raise ValueError("fused_qkv attention is self-attention: pass only the query")
            kv_hidden = self.num_kv_heads * self.head_dim
            qkv = getattr(self, self.qkv_name)(query)  # (..., L, H*E + 2*K*E)
            q, k, v = qkv.split([self.hidden_dim, kv_hidden, kv_hidden], dim=-1)
        else:
            key = query if key is None else key
            value = key if value is None else value
            if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
                raise ValueError(
                    f"key/value last dims ({key.shape[-1]}, {value.shape[-1]}) must equal "
                    f"kdim={self.kdim}, vdim={self.vdim}"
                )
            if key.shape[:-1] != value.shape[:-1]:
                raise ValueError(
                    f"key {tuple(key.shape)} and value {tuple(value.shape)} differ "
                    "in batch or length"
                )
            q = getattr(self, self.q_name)(query)  # (..., L, H*E)
            k = getattr(self, self.k_name)(key)  # (..., S, K*E)
            v = getattr(self, self.v_name)(value)  # (..., S, K*E)
        q = split_heads(q, self.num_heads)  # (..., H, L, E)
        k = split_heads(k, self.num_kv_heads)  # (..., K, S, E)
        v = split_heads(v, self.num_kv_heads)  # (..., K, S, E)
        return q, k, v

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Args:
            query: Query tokens.
            key: Key tokens (defaults to ``query``).
            value: Value tokens (defaults to ``key``).
            mask: Bool (``True`` = may attend) or additive float mask, broadcastable to
                ``(B, H, L, S)``.
            positions: Integer positions of the query tokens for the rotary module, shape
                ``(L,)`` or ``(B, L)``; defaults to ``cache length + arange(L)``.
            kv_cache: Cache of this layer's keys/values for incremental decoding; the new
                keys/values are appended and attention runs over all cached positions.
            return_weights: Also return the attention weights ``(B, H, L, S)``.

        Returns:
            ``out`` of shape ``(B, L, out_dim)``, or ``(out, weights)``.

        Shape:
            query ``(B, L, D)``, key ``(B, S, kdim)``, value ``(B, S, vdim)`` ->
            ``(B, L, out_dim)``. Leading dims other than ``B`` also work (``(L, D)`` too).
        """
        q, k, v = self.project_qkv(query, key, value)
        if self.rotary is not None:
            if k.shape[-2] != q.shape[-2] and kv_cache is None:
                raise ValueError("rotary positions need self-attention (same query/key tokens)")
            if positions is None:
                start = 0 if kv_cache is None else kv_cache.length
                positions = torch.arange(start, start + q.shape[-2], device=q.device)
            q = self.rotary(q, positions)
            k = self.rotary(k, positions)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, K, cached + L, E)
        dropout_p = self.dropout if self.training else 0.0
        out_proj = getattr(self, self.out_name)
        if return_weights:
            out, weights = F_attn.scaled_dot_product_attention(
                q,
                k,
                v,
                mask,
                causal=self.causal,
                window=self.window,
                scale=self.scale,
                dropout_p=dropout_p,
                return_weights=True,
            )
            return out_proj(merge_heads(out)), weights  # (B, L, out_dim), (B, H, L, S)
        out = F_attn.scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            causal=self.causal,
            window=self.window,
            scale=self.scale,
            dropout_p=dropout_p,
        )  # (B, H, L, E)
        return out_proj(merge_heads(out))  # (B, L, out_dim)

    def extra_repr(self) -> str:
        parts = [f"heads={self.num_heads}", f"head_dim={self.head_dim}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"kv_heads={self.num_kv_heads}")
        if self.causal:
            parts.append("causal=True")
        if self.window is not None:
            parts.append(f"window={self.window}")
        return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# The blog's classes, same names, constructors and parameter names.
# --------------------------------------------------------------------------------------------


class ScaleDotProductAttention(nn.Module):
    """The blog's parameter-free ``softmax(q k^T / sqrt(d_k)) v``.

    Args:
        d_k: The dim whose square root divides the scores.
    """

    def __init__(self, d_k: int) -> None:
        super().__init__()
        _check_positive(d_k=d_k)
        self.d_k = d_k

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Shape: q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)`` -> ``(..., L, Ev)``."""
        scale = 1.0 / math.sqrt(self.d_k)
        if return_weights:
            return F_attn.scaled_dot_product_attention(
                q, k, v, mask, scale=scale, return_weights=True
            )
        return F_attn.scaled_dot_product_attention(q, k, v, mask, scale=scale)


class Attention(MultiHeadAttention):
    """The blog's single-head attention with separate ``w_q``, ``w_k``, ``w_v`` and ``output_map``.

    Args:
        dim_in: Input dim of queries, keys and values.
        dim_hidden: Projected dim (the scores are divided by ``sqrt(dim_hidden)``).
        dim_out: Output dim.
    """

    q_name, k_name, v_name, out_name = "w_q", "w_k", "w_v", "output_map"

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int) -> None:
        super().__init__(dim_in, 1, hidden_dim=dim_hidden, out_dim=dim_out)

    def forward(  # type: ignore[override]
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Shape: q ``(B, L, dim_in)``, k/v ``(B, S, dim_in)`` -> ``(B, L, dim_out)``."""
        return super().forward(q, k, v, mask, return_weights=return_weights)


class SelfAttention(MultiHeadAttention):
    """The blog's single-head self-attention with one fused ``w_qkv`` projection.

    Args:
        dim_in: Input dim.
        dim_hidden: Projected dim of each of q, k, v.
        dim_out: Output dim.
    """

    qkv_name, out_name = "w_qkv", "output_map"

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int) -> None:
        super().__init__(dim_in, 1, hidden_dim=dim_hidden, out_dim=dim_out, fused_qkv=True)

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Shape: x ``(B, L, dim_in)`` -> ``(B, L, dim_out)``."""
        return super().forward(x, mask=mask, return_weights=return_weights)


class MultiheadCrossAttention(MultiHeadAttention):
    """The blog's multi-head attention with separate ``w_q``, ``w_k``, ``w_v`` projections.

    Args:
        dim_in: Input dim of queries, keys and values.
        dim_hidden: Total projected dim, split over ``num_heads``.
        dim_out: Output dim.
        num_heads: Number of heads.
    """

    q_name, k_name, v_name, out_name = "w_q", "w_k", "w_v", "output_map"

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int, num_heads: int) -> None:
        super().__init__(dim_in, num_heads, hidden_dim=dim_hidden, out_dim=dim_out)

    @property
    def dim_per_head(self) -> int:
        """The blog's name for the head dim."""
        return self.head_dim

    def get_heads(self, tokens: Tensor, linear_layer: nn.Module) -> Tensor:
        """Project ``tokens`` and split heads: ``(B, N, dim_in) -> (B, H, N, E)``."""
        return split_heads(linear_layer(tokens), self.num_heads)

    def forward(  # type: ignore[override]
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Shape: q ``(B, L, dim_in)``, k/v ``(B, S, dim_in)`` -> ``(B, L, dim_out)``."""
        return super().forward(q, k, v, mask, return_weights=return_weights)


class MultiHeadSelfAttention(MultiHeadAttention):
    """The blog's multi-head self-attention with a fused ``w_qkv`` and optional causal mask.

    The keyword-only options are those of :class:`MultiHeadAttention`; at their defaults this is
    exactly the blog's class.

    Args:
        in_dim: Input dim.
        hidden_dim: Total projected dim, split over ``num_heads``.
        out_dim: Output dim.
        num_heads: Number of heads.
        causal: Forbid attending to later tokens.
        num_kv_heads: Key/value heads (grouped-query attention).
        bias: Whether the projections have biases.
        out_bias: Whether the output projection has a bias (default ``bias``).
        dropout: Dropout on the attention weights (training mode only).
        window: Sliding-window size.
        scale: Score multiplier (default ``1 / sqrt(E)``).
        rotary: Rotary module applied to queries and keys.
    """

    qkv_name, out_name = "w_qkv", "output_map"

    def __init__(
        self,
        in_dim: int,
        hidden_dim: int,
        out_dim: int,
        num_heads: int,
        causal: bool = False,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        window: int | None = None,
        scale: float | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__(
            in_dim,
            num_heads,
            hidden_dim=hidden_dim,
            out_dim=out_dim,
            fused_qkv=True,
            causal=causal,
            num_kv_heads=num_kv_heads,
            bias=bias,
            out_bias=out_bias,
            dropout=dropout,
            window=window,
            scale=scale,
            rotary=rotary,
        )

    @property
    def dim_per_head(self) -> int:
        """The blog's name for the head dim."""
        return self.head_dim

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Self-attention over ``x`` (see :meth:`MultiHeadAttention.forward` for the keywords).

        Shape:
            x ``(B, N, in_dim)``, mask broadcastable to ``(B, H, N, N)`` -> ``(B, N, out_dim)``.
        """
        return super().forward(
            x, mask=mask, positions=positions, kv_cache=kv_cache, return_weights=return_weights
        )
