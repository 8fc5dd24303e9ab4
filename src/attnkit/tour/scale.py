"""Claims 1 and 2, the blog's "Rescale factor": why the scores are divided by sqrt(d)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from attnkit import ScaleDotProductAttention
from attnkit.tour.verdict import ClaimResult, claim_result, seeded

__all__ = ["Attend", "check_saturation", "check_scaled_scores"]

Attend = Callable[[int], nn.Module]  # d -> a module called as m(q, k, v, return_weights=True)


def _blog_attention(d: int) -> nn.Module:
    return ScaleDotProductAttention(d_k=d)


def _unscaled_attention(d: int) -> nn.Module:
    return ScaleDotProductAttention(d_k=1)  # divides by sqrt(1): the raw dot product


def _scores_std(attend: nn.Module, d: int, *, n: int, batch: int, seed: int) -> tuple[float, float]:
    """Within-row std of the scores and the mean largest weight, read from the module's weights.

    ``log w_ij = s_ij - logsumexp_j s_ij``: within a row, the log-weights are the scores up to a
    constant, so their spread is the scores' spread. float64 keeps ``log w`` finite even when the
    unscaled scores saturate the softmax.
    """
    gen = seeded(seed + d)
    q = torch.randn(batch, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, n, 4, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        _, w = attend(q, k, v, return_weights=True)  # (batch, n, n)
    logw = w.log()
    centred = logw - logw.mean(-1, keepdim=True)
    # unbiased within-row variance: n/(n-1) undoes the row mean's share
    std = float((centred.pow(2).sum(-1) / (n - 1)).mean().sqrt())
    return std, float(w.amax(-1).mean())


def check_scaled_scores(
    attention: Attend = _blog_attention,
    unscaled: Attend = _unscaled_attention,
    *,
    dims: Sequence[int] = (4, 16, 64, 256, 1024),
    n: int = 64,
    tolerance: float = 0.1,
    seed: int = 0,
) -> ClaimResult:
    """Claim 1: the std of the scaled scores is ~1 for every d; the unscaled std is ~√d.

    Args:
        attention: ``d -> module`` under test (default the blog's ``ScaleDotProductAttention``).
        unscaled: ``d -> module`` without the scale (default ``ScaleDotProductAttention(d_k=1)``).
        dims: Head dims to measure.
        n: Queries and keys per example.
        tolerance: Allowed relative deviation of each std from 1 (scaled) or √d (unscaled).
        seed: Seed of the random vectors.

    Returns:
        The claim's result; measured: per d, the two stds.
    """
    rows = []
    for d in dims:
        s, _ = _scores_std(attention(d), d, n=n, batch=16, seed=seed)
        u, _ = _scores_std(unscaled(d), d, n=n, batch=16, seed=seed)
        rows.append(
            {
                "d": d,
                "scaled_std": s,
                "unscaled_std": u,
                "unscaled_std_over_sqrt_d": u / math.sqrt(d),
            }
        )
    ok_scaled = all(abs(r["scaled_std"] - 1) <= tolerance for r in rows)
    ok_unscaled = all(abs(r["unscaled_std_over_sqrt_d"] - 1) <= tolerance for r in rows)
    verdict = (
        f"scaled std within {tolerance:.0%} of 1 for every d: {ok_scaled}; unscaled std within "
        f"{tolerance:.0%} of √d: {ok_unscaled}"
    )
    return claim_result(
        1, ok_scaled and ok_unscaled, {"per_dim": rows, "tolerance": tolerance}, verdict
    )


def check_saturation(
    unscaled: Attend = _unscaled_attention,
    attention: Attend = _blog_attention,
    *,
    dims: Sequence[int] = (1, 4, 16, 64, 256, 1024),
    n: int = 64,
    seed: int = 0,
) -> ClaimResult:
    """Claim 2: without the scale the largest softmax weight of a row tends to 1 as d grows.

    Passes when the unscaled mean largest weight rises with d (non-decreasing up to 0.02) and
    exceeds 0.9 at the largest d, while the scaled one stays below 0.35 for every d.

    Args:
        unscaled: ``d -> module`` without the scale (the one under test).
        attention: ``d -> module`` with the scale, for comparison.
        dims: Head dims.
        n: Keys per row.
        seed: Seed of the random vectors.

    Returns:
        The claim's result; measured: per d, both mean largest weights, and the blog's example.
    """
    rows = []
    for d in dims:
        _, top_u = _scores_std(unscaled(d), d, n=n, batch=16, seed=seed)
        _, top_s = _scores_std(attention(d), d, n=n, batch=16, seed=seed)
        rows.append({"d": d, "unscaled_max_weight": top_u, "scaled_max_weight": top_s})
    tops = [r["unscaled_max_weight"] for r in rows]
    rising = all(b >= a - 0.02 for a, b in itertools.pairwise(tops))
    saturated = tops[-1] > 0.9
    calm = all(r["scaled_max_weight"] < 0.35 for r in rows)
    # the blog's example: softmax of scores [1, 2] and [10, 20], through attnkit's unscaled module
    blog = {}
    for scores in ((1.0, 2.0), (10.0, 20.0)):
        q = torch.tensor([[1.0]], dtype=torch.float64)
        k = torch.tensor([[scores[0]], [scores[1]]], dtype=torch.float64)
        _, w = unscaled(1)(q, k, k, return_weights=True)
        blog[str(list(scores))] = [float(x) for x in w[0]]
    verdict = (
        f"unscaled largest weight rises with d: {rising}, reaches {tops[-1]:.3f} (> 0.9): "
        f"{saturated}; scaled stays below 0.35: {calm}"
    )
    measured = {"per_dim": rows, "blog_example_softmax": blog}
    return claim_result(2, rising and saturated and calm, measured, verdict, {"keys": n})
