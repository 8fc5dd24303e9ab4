"""Explicit float64 references that the tests compare attnkit against."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Textbook attention in float64, with fully-masked rows defined as zero output.

    ``softcap`` caps the scores with ``tanh(s / softcap) * softcap`` before the mask.

    ``allowed`` is a bool mask (True = may attend) broadcastable to the scores. k/v heads are
    repeated to the query heads (grouped-query attention) by ``repeat_interleave``.

    Returns (out, weights) in float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(g, dim=-3)
        v = v.repeat_interleave(g, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("...le,...se->...ls", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if allowed is None:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    allowed = allowed.expand(scores.shape)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max) * allowed
    denom = exp.sum(dim=-1, keepdim=True)
    weights = torch.where(denom > 0, exp / denom.clamp_min(1e-300), torch.zeros_like(exp))
    return weights @ v, weights


def bottom_right_causal(L: int, S: int) -> Tensor:
    """Bool (L, S): query i may attend key j iff j <= i + S - L (written independently)."""
    out = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        for j in range(S):
            out[i, j] = j <= i + S - L
    return out


def loop_mask(
    L: int,
    S: int,
    *,
    causal: bool = False,
    window: int | None = None,
    segment_ids: Tensor | None = None,
    key_lengths: Tensor | None = None,
) -> Tensor:
    """The constraints written out one (b, i, j) at a time, independently of attnkit."""
    B = next((len(t) for t in (segment_ids, key_lengths) if t is not None), 1)
    segment_ids = None if segment_ids is None else segment_ids.tolist()
    key_lengths = None if key_lengths is None else key_lengths.tolist()
    out = [[[False] * S for _ in range(L)] for _ in range(B)]
    for b in range(B):
        for i in range(L):
            p = i + S - L
            for j in range(S):
                ok = not causal or j <= p
                ok = ok and (window is None or abs(p - j) < window)
                ok = ok and (key_lengths is None or j < key_lengths[b])
                ok = ok and (segment_ids is None or segment_ids[b][j] == segment_ids[b][p])
                out[b][i][j] = ok
    return torch.tensor(out, dtype=torch.bool).view(B, 1, L, S)
