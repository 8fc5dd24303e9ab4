"""The tour's measurements: one check per claim of the blog, run on attnkit's own modules.

Each check runs attnkit's modules (the blog's classes, the positional modules, the models, the
lab's training), measures what the claim says, and returns a :class:`ClaimResult` with a verdict,
the numbers behind it and what its picture needs; :mod:`attnkit.tour.figures` draws it. The
modules under test can be swapped for others (a broken attention, a non-causal model, ...): the
checks fail on them, which is how the tests show that each check can fail.

The checks live by topic, following the blog's sections:

* :mod:`attnkit.tour.scale`: claims 1 and 2, the scale of the scores;
* :mod:`attnkit.tour.cost`: claim 3, FLOPs and time;
* :mod:`attnkit.tour.positions`: claims 4 to 8, permutations, the sinusoidal table and RoPE;
* :mod:`attnkit.tour.weights`: claims 9 and 10, causal masking and interpretable weights;
* :mod:`attnkit.tour.variants`: claims 11 and 12, soft-capping and qk-norm;
* :mod:`attnkit.tour.flexvariants`: claims 13 to 15, ALiBi, prefix-LM and sliding windows through
  :mod:`attnkit.flex`;
* :mod:`attnkit.tour.verdict`: the claims' texts, their order and :class:`ClaimResult`.

This module gathers them into :data:`CHECKS`, the registry the report runs.

Needs only torch (and tqdm, the ``lab`` extra, for claim 10's training).
"""

from __future__ import annotations

from collections.abc import Callable

from attnkit.tour.cost import check_cost
from attnkit.tour.flexvariants import (
    check_alibi_extrapolation,
    check_prefix_lm,
    check_window_cost,
    recency_batch,
)
from attnkit.tour.positions import (
    Rotate,
    check_frequencies,
    check_permutation,
    check_rope_norm,
    check_rope_relative,
    check_sinusoidal_shift,
)
from attnkit.tour.scale import Attend, check_saturation, check_scaled_scores
from attnkit.tour.variants import check_qk_norm, check_softcap
from attnkit.tour.verdict import BLOG_ORDER, CLAIMS, ClaimResult
from attnkit.tour.weights import check_causal, check_interpretable, train_tour_model

__all__ = [
    "BLOG_ORDER",
    "CHECKS",
    "CLAIMS",
    "Attend",
    "ClaimResult",
    "Rotate",
    "check_alibi_extrapolation",
    "check_causal",
    "check_cost",
    "check_frequencies",
    "check_interpretable",
    "check_permutation",
    "check_prefix_lm",
    "check_qk_norm",
    "check_rope_norm",
    "check_rope_relative",
    "check_saturation",
    "check_scaled_scores",
    "check_sinusoidal_shift",
    "check_softcap",
    "check_window_cost",
    "recency_batch",
    "train_tour_model",
]

CHECKS: dict[int, Callable[[], ClaimResult]] = {
    1: check_scaled_scores,
    2: check_saturation,
    3: check_cost,
    4: check_permutation,
    5: check_sinusoidal_shift,
    6: check_frequencies,
    7: check_rope_norm,
    8: check_rope_relative,
    9: check_causal,
    10: check_interpretable,
    11: check_softcap,
    12: check_qk_norm,
    13: check_alibi_extrapolation,
    14: check_prefix_lm,
    15: check_window_cost,
}
"""Claim id -> its check, run with its defaults (attnkit's own modules)."""
