"""``attnkit tour``: every claim of the blog (and two on today's variants), measured on attnkit's
own modules.

* :mod:`attnkit.tour.claims`: one check per claim; each measures and returns a
  :class:`ClaimResult` (verdict, numbers, what its picture needs);
* :mod:`attnkit.tour.figures`: one drawing per claim, from its result (matplotlib);
* :mod:`attnkit.tour.report`: :func:`run_tour` runs them in the blog's order and writes
  ``report.html``, ``claims.json``, the figures and the trained model's explorer.

Needs matplotlib (the ``viz`` extra) for the figures and tqdm (``lab``) for the training.
"""

from attnkit.tour.claims import (
    BLOG_ORDER,
    CHECKS,
    CLAIMS,
    ClaimResult,
    check_causal,
    check_cost,
    check_frequencies,
    check_interpretable,
    check_permutation,
    check_qk_norm,
    check_rope_norm,
    check_rope_relative,
    check_saturation,
    check_scaled_scores,
    check_sinusoidal_shift,
    check_softcap,
    train_tour_model,
)
from attnkit.tour.figures import draw
from attnkit.tour.report import run_tour

__all__ = [
    "BLOG_ORDER",
    "CHECKS",
    "CLAIMS",
    "ClaimResult",
    "check_causal",
    "check_cost",
    "check_frequencies",
    "check_interpretable",
    "check_permutation",
    "check_qk_norm",
    "check_rope_norm",
    "check_rope_relative",
    "check_saturation",
    "check_scaled_scores",
    "check_sinusoidal_shift",
    "check_softcap",
    "draw",
    "run_tour",
    "train_tour_model",
]
