"""What a claim says and what its check returns: the texts of the claims, their order in the blog
and :class:`ClaimResult`, shared by the checks of :mod:`attnkit.tour.claims`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["BLOG_ORDER", "CLAIMS", "ClaimResult", "claim_result", "seeded"]


@dataclass
class ClaimResult:
    """The verdict on one claim.

    Attributes:
        id: The claim's number (1..10 the blog's, 11 to 15 today's variants).
        claim: The claim, in one sentence.
        section: The blog section it comes from.
        passed: Whether the measurement supports it.
        measured: The numbers behind the verdict (JSON-serialisable).
        verdict: One sentence saying what was measured against what threshold.
        drawing: What the claim's picture needs beyond ``measured`` (arrays, labels); read by
            :mod:`attnkit.tour.figures`, not written to ``claims.json``.
        explorer: Tokens and per-layer weights ``(H, L, L)`` to show in the explorer, if any.
    """

    id: int
    claim: str
    section: str
    passed: bool
    measured: dict[str, Any]
    verdict: str
    drawing: dict[str, Any] = field(default_factory=dict, repr=False)
    explorer: tuple[list[str], list[Tensor]] | None = field(default=None, repr=False)

    def to_dict(self, figure_path: str) -> dict[str, Any]:
        """The ``claims.json`` entry: id, claim, passed, measured, figure (and section, verdict)."""
        return {
            "id": self.id,
            "claim": self.claim,
            "passed": self.passed,
            "measured": self.measured,
            "figure": figure_path,
            "section": self.section,
            "verdict": self.verdict,
        }


CLAIMS: dict[int, tuple[str, str]] = {
    1: (
        "Rescale factor",
        "The scaled dot product q·k/√d of random unit-variance vectors has standard deviation "
        "about 1 for every d; unscaled it grows as √d.",
    ),
    2: (
        "Rescale factor",
        "Without the scale, softmax saturates toward one-hot as d grows.",
    ),
    3: (
        "Computational and memory complexity",
        "The FLOPs split into n·d² terms (projections) and n²·d terms (scores and weighted sum); "
        "the n² terms overtake at the predicted crossover n* = 2d, and measured time follows "
        "the predicted shape.",
    ),
    4: (
        "Transformer block and position embeddings",
        "Attention without positions is permutation-equivariant: permuting the input tokens "
        "permutes the output the same way.",
    ),
    5: (
        "Sinusoidal positional embeddings",
        "PE(p + k) is a fixed linear map of PE(p), a rotation per frequency pair, the same for "
        "every p.",
    ),
    6: (
        "Sinusoidal positional embeddings",
        "Low dimensions vary fast (short range), high dimensions slowly (long range).",
    ),
    7: ("Rotary positional embeddings (RoPE)", "RoPE preserves vector norms."),
    8: (
        "Rotary positional embeddings (RoPE)",
        "With RoPE, the score of a query at position p and a key at position s depends only on "
        "s - p.",
    ),
    9: (
        "Attention weight, attention mask and causal attention",
        "Causal masking: the weights are lower-triangular, and changing future tokens never "
        "changes earlier outputs.",
    ),
    10: (
        "Attention weight, attention mask and causal attention",
        "Attention weights are interpretable: a trained model's best head puts most of its "
        "weight where the task says the answer is.",
    ),
    11: (
        "Beyond the blog: attention in today's models",
        "Soft-capping the scores with c·tanh(s/c) (Gemma 2) keeps every row's log-weights within "
        "a range of 2c, so no weight can exceed 1/(1 + (n-1)·e^(-2c)) however large the scores "
        "grow; uncapped, the range grows with the scores and the softmax goes one-hot.",
    ),
    12: (
        "Beyond the blog: attention in today's models",
        "RMS-normalising each head's queries and keys (qk-norm: Qwen3, Gemma 3) fixes the "
        "scores' scale: when the activations grow by g, the scores stay put (|s| <= sqrt(E)); "
        "without it they grow as g².",
    ),
    13: (
        "Beyond the blog: attention variants through attnkit.flex",
        "ALiBi (a per-head linear penalty on the distance, added by a score_mod) extrapolates: "
        "trained at length L, a model keeps its accuracy at 2L, where a model without positions "
        "cannot even find the most recent signal token.",
    ),
    14: (
        "Beyond the blog: attention variants through attnkit.flex",
        "With a prefix-LM mask_mod, the prefix tokens see the whole prefix, later ones included, "
        "while the tokens after it stay causal.",
    ),
    15: (
        "Beyond the blog: attention variants through attnkit.flex",
        "A sliding window's cost grows linearly with the length: the blocks of the score matrix "
        "a block mask computes grow as N, the causal mask's as N².",
    ),
}
#: The order of the blog's sections, then today's variants.
BLOG_ORDER = (1, 2, 10, 9, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15)


def claim_result(
    cid: int,
    passed: bool,
    measured: dict[str, Any],
    verdict: str,
    drawing: dict[str, Any] | None = None,
) -> ClaimResult:
    """The :class:`ClaimResult` of claim ``cid``, its text and section taken from :data:`CLAIMS`."""
    section, claim = CLAIMS[cid]
    return ClaimResult(cid, claim, section, bool(passed), measured, verdict, drawing or {})


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (each check draws its inputs from its own)."""
    return torch.Generator().manual_seed(seed)
