"""The blog's attention classes, re-typed from its description in plain torch (no einops).

These are the "before" side of the state_dict compatibility tests: same attribute names, same
math (including the blog's NaN for fully-masked rows), nothing from attnkit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class BlogScaleDotProductAttention(nn.Module):
    def __init__(self, d_k: int) -> None:
        super().__init__()
        self.d_k = d_k

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        return torch.softmax(scores, dim=-1) @ v


class BlogAttention(nn.Module):
    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int) -> None:
        super().__init__()
        self.w_q = nn.Linear(dim_in, dim_hidden)
        self.w_k = nn.Linear(dim_in, dim_hidden)
        self.w_v = nn.Linear(dim_in, dim_hidden)
        self.attention = BlogScaleDotProductAttention(dim_hidden)
        self.output_map = nn.Linear(dim_hidden, dim_out)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.output_map(self.attention(self.w_q(q), self.w_k(k), self.w_v(v)))


class BlogSelfAttention(nn.Module):
    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int) -> None:
        super().__init__()
        self.w_qkv = nn.Linear(dim_in, 3 * dim_hidden)
        self.attention = BlogScaleDotProductAttention(dim_hidden)
        self.output_map = nn.Linear(dim_hidden, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.w_qkv(x).chunk(3, dim=-1)
        return self.output_map(self.attention(q, k, v))


class BlogMultiheadCrossAttention(nn.Module):
    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dim_per_head = dim_hidden // num_heads
        self.w_q = nn.Linear(dim_in, dim_hidden)
        self.w_k = nn.Linear(dim_in, dim_hidden)
        self.w_v = nn.Linear(dim_in, dim_hidden)
        self.attention = BlogScaleDotProductAttention(self.dim_per_head)
        self.output_map = nn.Linear(dim_hidden, dim_out)

    def _heads(self, x: Tensor, proj: nn.Linear) -> Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, self.num_heads, self.dim_per_head).transpose(1, 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        qh, kh, vh = self._heads(q, self.w_q), self._heads(k, self.w_k), self._heads(v, self.w_v)
        out = self.attention(qh, kh, vh).transpose(1, 2).contiguous()
        return self.output_map(out.view(q.shape[0], -1, self.num_heads * self.dim_per_head))


class BlogMultiHeadSelfAttention(nn.Module):
    def __init__(
        self, in_dim: int, hidden_dim: int, out_dim: int, num_heads: int, causal: bool = False
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dim_per_head = hidden_dim // num_heads
        self.w_qkv = nn.Linear(in_dim, 3 * hidden_dim)
        self.output_map = nn.Linear(hidden_dim, out_dim)
        self.causal = causal

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, _ = x.shape
        # "(3 h d)": the fused projection is [q | k | v], each split into heads.
        qkv = self.w_qkv(x).view(b, n, 3, self.num_heads, self.dim_per_head)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        score = q @ k.transpose(-2, -1) / math.sqrt(self.dim_per_head)
        if self.causal:
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            score = score.masked_fill(future, float("-inf"))
        if mask is not None:
            score = score.masked_fill(~mask.bool(), float("-inf"))
        out = torch.softmax(score, dim=-1) @ v
        return self.output_map(out.transpose(1, 2).reshape(b, n, -1))
