"""Claims 11 and 12, beyond the blog: soft-capped scores (Gemma 2) and qk-norm (Qwen3, Gemma 3),
each measured against the same layer without it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import MultiHeadAttention
from attnkit.tour.verdict import ClaimResult, claim_result, seeded

__all__ = ["check_qk_norm", "check_softcap"]


def _row_stats(module: nn.Module, x: Tensor) -> dict[str, float]:
    """Read from the module's weights ``(B, H, L, S)``: ``range``, the largest log-weight range
    of a row (over its non-zero weights), ``max_weight``, the mean largest weight of a row,
    ``largest``, the largest weight, ``zero``, the share of weights that underflowed to 0, and
    ``std``, the mean within-row std of the scores (NaN when a weight underflowed).

    Within a row ``log w = s - logsumexp(s)``: log-weight differences are score differences, so
    the range and spread of a row's log-weights are those of its (capped) scores.
    """
    with torch.no_grad():
        _, w = module(x, return_weights=True)
    logw = w.log()
    seen = w > 0
    top = torch.where(seen, logw, -math.inf).amax(-1)
    bottom = torch.where(seen, logw, math.inf).amin(-1)
    centred = logw - logw.mean(-1, keepdim=True)
    return {
        "range": float((top - bottom).max()),
        "max_weight": float(w.amax(-1).mean()),
        "largest": float(w.amax()) if w.numel() else 0.0,
        "zero": float((~seen).double().mean()),
        "std": float((centred.pow(2).sum(-1) / (w.shape[-1] - 1)).mean().sqrt()),
    }


def _twin(module: nn.Module, **options: Any) -> nn.Module:
    """A ``MultiHeadAttention`` with ``module``'s projections and the given options."""
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"the module under test must be a MultiHeadAttention, got {module!r}")
    twin = MultiHeadAttention(module.embed_dim, module.num_heads, **options).double()
    twin.load_state_dict(module.state_dict(), strict=False)  # the norms' weights stay out
    return twin.eval()


def _gain_stats(
    module: nn.Module, n: int, dim: int, seed: int, gains: Sequence[float], **options: Any
) -> list[tuple[float, dict[str, float], dict[str, float]]]:
    """Per gain ``g``, ``g`` and the :func:`_row_stats` of ``module`` (in float64) and of its
    :func:`_twin` with ``options``, both on the same seeded tokens ``(4, n, dim)`` times ``g``."""
    module = module.double().eval()
    plain = _twin(module, **options)
    x = torch.randn(4, n, dim, generator=seeded(seed), dtype=torch.float64)
    return [(g, _row_stats(module, g * x), _row_stats(plain, g * x)) for g in gains]


def check_softcap(
    capped: Callable[[], nn.Module] | None = None,
    *,
    cap: float = 3.0,
    dim: int = 32,
    num_heads: int = 4,
    n: int = 32,
    gains: Sequence[float] = (0.25, 1, 4, 16, 64),
    seed: int = 0,
) -> ClaimResult:
    """Claim 11: soft-capped scores bound the weights' range; uncapped ones do not.

    Random tokens scaled by each gain ``g`` go through ``MultiHeadAttention(softcap=cap)`` and
    through the same layer without the cap, in float64; each row's log-weight range (its score
    range) and largest weight are read from the returned weights. Passes when every capped row
    stays within ``2 * cap`` (and so every weight below ``1 / (1 + (n - 1) e^(-2 cap))``, none
    zero) while the largest gain drives the capped range past ``cap`` (the cap is reached, not
    avoided) and the uncapped range past ``2 * cap`` with a mean largest weight above 0.99.

    Args:
        capped: ``() -> module`` under test, a ``MultiHeadAttention`` (its projections are
            copied into the uncapped twin); default ``MultiHeadAttention(dim, num_heads,
            softcap=cap)``.
        cap: The cap ``c``.
        dim: Model dim.
        num_heads: Heads.
        n: Tokens per example (keys per row).
        gains: Scales of the random tokens.
        seed: Seed of the weights and the tokens.

    Returns:
        The claim's result; measured: per gain, both ranges and largest weights.
    """
    torch.manual_seed(seed)
    module = MultiHeadAttention(dim, num_heads, softcap=cap) if capped is None else capped()
    rows = [
        {
            "gain": g,
            "capped_range": c["range"],
            "capped_max_weight": c["max_weight"],
            "capped_largest_weight": c["largest"],
            "capped_zero_weights": c["zero"],
            "uncapped_range": u["range"],
            "uncapped_max_weight": u["max_weight"],
            "uncapped_zero_weights": u["zero"],
        }
        for g, c, u in _gain_stats(module, n, dim, seed, gains)
    ]
    bound = 1 / (1 + (n - 1) * math.exp(-2 * cap))
    within = all(r["capped_range"] <= 2 * cap * (1 + 1e-9) for r in rows)
    below = all(r["capped_largest_weight"] <= bound for r in rows)
    last = rows[-1]
    reached = last["capped_range"] > cap and all(r["capped_zero_weights"] == 0 for r in rows)
    runaway = last["uncapped_range"] > 2 * cap and last["uncapped_max_weight"] > 0.99
    verdict = (
        f"capped log-weight range <= 2c = {2 * cap:g} at every gain: {within} (largest "
        f"{max(r['capped_range'] for r in rows):.2f}, past c at gain {last['gain']:g}: "
        f"{reached}); every capped weight <= {bound:.3f}: {below}; uncapped range "
        f"{last['uncapped_range']:.0f} and mean largest weight {last['uncapped_max_weight']:.3f} "
        f"at gain {last['gain']:g}: {runaway}"
    )
    measured = {"cap": cap, "keys": n, "max_weight_bound": bound, "per_gain": rows}
    return claim_result(11, within and below and reached and runaway, measured, verdict)


def check_qk_norm(
    normed: Callable[[], nn.Module] | None = None,
    *,
    dim: int = 64,
    num_heads: int = 4,
    n: int = 32,
    gains: Sequence[float] = (1, 2, 4, 8, 16),
    tolerance: float = 0.05,
    seed: int = 0,
) -> ClaimResult:
    """Claim 12: with qk-norm the scores' spread does not follow the activations' scale.

    Random tokens scaled by each gain ``g`` go through ``MultiHeadAttention`` with RMSNorm on
    each head's queries and keys (bias-free projections, as in Qwen3) and through the same layer
    without the norms, in float64; the within-row std of the scores is read from the returned
    weights (as in claim 1). Passes when the normed std varies by at most ``tolerance``
    (relative) over the gains and every normed row's score range stays within ``2 sqrt(E)``
    (unit RMSNorm weights: ``|q|, |k| = sqrt(E)``), while the plain std grows with log-log slope
    2 (within 0.1).

    Args:
        normed: ``() -> module`` under test, a ``MultiHeadAttention`` (its projections are
            copied into the plain twin); default one with ``nn.RMSNorm`` as ``q_norm`` and
            ``k_norm``.
        dim: Model dim.
        num_heads: Heads.
        n: Tokens per example.
        gains: Scales of the random tokens.
        tolerance: Allowed relative change of the normed scores' std.
        seed: Seed of the weights and the tokens.

    Returns:
        The claim's result; measured: per gain, both stds.
    """
    torch.manual_seed(seed)
    E = dim // num_heads
    module: nn.Module
    if normed is None:
        module = MultiHeadAttention(
            dim, num_heads, bias=False, q_norm=nn.RMSNorm(E), k_norm=nn.RMSNorm(E)
        )
    else:
        module = normed()
    rows = [
        {
            "gain": g,
            "normed_std": normed_row["std"],
            "normed_range": normed_row["range"],
            "plain_std": plain_row["std"],
        }
        for g, normed_row, plain_row in _gain_stats(module, n, dim, seed, gains, bias=False)
    ]
    stds = [r["normed_std"] for r in rows]
    flat = max(stds) / min(stds) - 1
    bounded = all(r["normed_range"] <= 2 * math.sqrt(E) * (1 + 1e-9) for r in rows)
    a, b = rows[0], rows[-1]
    slope = math.log(b["plain_std"] / a["plain_std"]) / math.log(b["gain"] / a["gain"])
    grows = abs(slope - 2) <= 0.1
    verdict = (
        f"normed score std changes by {flat:.1%} over gains {a['gain']:g}..{b['gain']:g} "
        f"(tolerance {tolerance:.0%}); normed score range within 2·sqrt(E) = "
        f"{2 * math.sqrt(E):.0f}: {bounded}; plain std grows with slope {slope:.2f} (2 ± 0.1)"
    )
    measured = {
        "per_gain": rows,
        "normed_relative_change": flat,
        "tolerance": tolerance,
        "plain_slope": slope,
        "head_dim": E,
    }
    return claim_result(12, flat <= tolerance and bounded and grows, measured, verdict)
