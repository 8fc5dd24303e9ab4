"""The blog's transformer classes, re-typed in plain torch (no einops), as live references.

They follow the blog's behaviour exactly: parameter names, fused ``[q | k | v]`` layouts, float32
rotary tables, ``masked_fill(-inf)`` masking. Tests load their state_dicts into attnkit's classes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tests.blog_attention_reference import BlogMultiHeadSelfAttention


class BlogFeedForward(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, hidden_dim)
        self.linear2 = nn.Linear(hidden_dim, out_dim)
        self.activation = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class BlogTransformerBlock(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_heads: int, causal: bool = False) -> None:
        super().__init__()
        self.attention = BlogMultiHeadSelfAttention(dim, dim, dim, num_heads, causal)
        self.feed_forward = BlogFeedForward(dim, hidden_dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.feed_forward(x))


class BlogSinusoidalPositionalEncoding(nn.Module):
    def __init__(self, dim: int, max_seq_len: int = 4096, base: float = 10_000.0) -> None:
        super().__init__()
        position = torch.arange(max_seq_len, dtype=torch.float32)[:, None]
        inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        angles = position * inv_freq[None, :]
        pe = torch.zeros(max_seq_len, dim)
        pe[:, 0::2] = angles.sin()
        pe[:, 1::2] = angles[:, : pe[:, 1::2].shape[1]].cos()
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pe[: x.size(1)].to(dtype=x.dtype)


def blog_rope_cos_sin(seq_len: int, head_dim: int, base: float = 10_000.0) -> tuple[Tensor, Tensor]:
    inv_freq = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(seq_len).float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def blog_apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, None], sin[None, None]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class BlogPositionalMultiHeadSelfAttention(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, causal: bool = False, use_rope: bool = False
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.causal, self.use_rope = causal, use_rope
        self.qkv = nn.Linear(dim, 3 * dim)
        self.output = nn.Linear(dim, dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        if self.use_rope:
            cos, sin = blog_rope_cos_sin(n, self.head_dim)
            q, k = blog_apply_rope(q, cos, sin), blog_apply_rope(k, cos, sin)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if self.causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask.bool(), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        return self.output(out)


class BlogPositionalTransformerBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_heads: int,
        position_type: str = "rope",
        max_seq_len: int = 4096,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.position = (
            BlogSinusoidalPositionalEncoding(dim, max_seq_len)
            if position_type == "sinusoidal"
            else nn.Identity()
        )
        self.attention = BlogPositionalMultiHeadSelfAttention(
            dim, num_heads, causal=causal, use_rope=position_type == "rope"
        )
        self.feed_forward = BlogFeedForward(dim, hidden_dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.position(x)
        x = self.norm1(x + self.attention(x, mask))
        return self.norm2(x + self.feed_forward(x))


def rope_reference(
    x: Tensor, positions: Tensor, *, base: float = 10_000.0, interleaved: bool = True
) -> Tensor:
    """Rotary embedding in float64 from the definition (a 2x2 rotation per channel pair)."""
    x = x.double()
    E = x.shape[-1]
    idx = torch.arange(E // 2, dtype=torch.float64)
    theta = positions.double()[..., None] * base ** (-2 * idx / E)  # (..., L, E/2)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : E // 2], x[..., E // 2 :]
    ra = a * theta.cos() - b * theta.sin()
    rb = a * theta.sin() + b * theta.cos()
    if interleaved:
        return torch.stack((ra, rb), dim=-1).flatten(-2)
    return torch.cat((ra, rb), dim=-1)
