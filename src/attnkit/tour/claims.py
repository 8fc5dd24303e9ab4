"""The tour's measurements: one check per claim of the blog, run on attnkit's own modules.

Each check runs attnkit's modules (the blog's classes, the positional modules, the models, the
lab's training), measures what the claim says, and returns a :class:`ClaimResult` with a verdict,
the numbers behind it and what its picture needs; :mod:`attnkit.tour.figures` draws it. The
modules under test can be swapped for others (a broken attention, a non-causal model, ...): the
checks fail on them, which is how the tests show that each check can fail.

Needs only torch (and tqdm, the ``lab`` extra, for claim 10's training).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import (
    MultiHeadAttention,
    PositionalTransformerBlock,
    RotaryEmbedding,
    ScaleDotProductAttention,
    SinusoidalPositionalEncoding,
    TransformerBlock,
    TransformerEncoder,
    TransformerLM,
    complexity,
    profiling,
)

Attend = Callable[[int], nn.Module]  # d -> a module called as m(q, k, v, return_weights=True)
Rotate = Callable[[Tensor, Tensor], Tensor]  # (x (..., L, E), positions (L,)) -> rotated x


@dataclass
class ClaimResult:
    """The verdict on one claim.

    Attributes:
        id: The claim's number (1..10 the blog's, 11 and 12 today's variants).
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
}
#: The order of the blog's sections, then today's variants.
BLOG_ORDER = (1, 2, 10, 9, 3, 4, 5, 6, 7, 8, 11, 12)


def _result(
    cid: int,
    passed: bool,
    measured: dict[str, Any],
    verdict: str,
    drawing: dict[str, Any] | None = None,
) -> ClaimResult:
    section, claim = CLAIMS[cid]
    return ClaimResult(cid, claim, section, bool(passed), measured, verdict, drawing or {})


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- 1, 2: the scale


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
    gen = _gen(seed + d)
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
    return _result(1, ok_scaled and ok_unscaled, {"per_dim": rows, "tolerance": tolerance}, verdict)


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
    return _result(2, rising and saturated and calm, measured, verdict, {"keys": n})


# --------------------------------------------------------------------------- 3: cost


def _counted_flops(module: nn.Module, x: Tensor) -> tuple[int, int]:
    """(linear, quadratic) matmul FLOPs that torch's FlopCounterMode counts for one forward."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        module(x, return_weights=True)  # the explicit path: its matmuls are what is counted
    counts = counter.get_flop_counts()["Global"]
    linear = quadratic = 0
    for op, flops in counts.items():
        name = str(op)
        if "addmm" in name or name.endswith(".mm") or name == "aten.mm":
            linear += int(flops)
        else:  # bmm / baddbmm: Q K^T and weights V
            quadratic += int(flops)
    return linear, quadratic


def check_cost(
    module: nn.Module | None = None,
    *,
    dim: int = 64,
    num_heads: int = 4,
    lengths: Sequence[int] = (16, 32, 64, 96, 127, 128, 129, 192, 256, 512),
    timed_lengths: Sequence[int] = (1024, 2048, 4096),
    repeats: int = 5,
) -> ClaimResult:
    """Claim 3: per-component FLOPs, the n² terms overtaking at n* = 2d, time following the shape.

    The FLOPs of ``attnkit.MultiHeadAttention`` are counted by ``FlopCounterMode`` while it runs
    and compared with :func:`attnkit.complexity.attention_cost`'s components; the crossover is
    where the counted n² FLOPs first reach the counted n·d² FLOPs. The forward is timed
    (interleaved, medians) and the log-log slope of time over the two largest lengths is compared
    with the slope of the predicted FLOPs there.

    Args:
        module: The attention under test, called as ``module(x, return_weights=True)`` on
            ``(1, n, dim)``; default ``MultiHeadAttention(dim, num_heads)``. The prediction is
            always that of ``MultiHeadAttention(dim, num_heads)``.
        dim: Model dim D.
        num_heads: Heads H.
        lengths: Sequence lengths whose FLOPs are counted (include ``2*dim`` and its neighbours).
        timed_lengths: Sequence lengths that are timed (at least 2).
        repeats: Timings per length.

    Returns:
        The claim's result.
    """
    torch.manual_seed(0)
    mha = (module if module is not None else MultiHeadAttention(dim, num_heads)).eval()
    predicted_n, _ = complexity.crossover_seq_len(dim, num_heads)
    rows = []
    for n in lengths:
        linear, quadratic = _counted_flops(mha, torch.randn(1, n, dim))
        cost = complexity.attention_cost(n, dim, num_heads)
        want_lin = sum(c.flops for c in cost.components if c.matmul and not c.quadratic)
        want_quad = sum(c.flops for c in cost.components if c.matmul and c.quadratic)
        rows.append(
            {
                "n": n,
                "counted_linear": linear,
                "counted_quadratic": quadratic,
                "predicted_linear": want_lin,
                "predicted_quadratic": want_quad,
            }
        )
    counts_match = all(
        r["counted_linear"] == r["predicted_linear"]
        and r["counted_quadratic"] == r["predicted_quadratic"]
        for r in rows
    )
    over = [r["n"] for r in rows if r["counted_quadratic"] >= r["counted_linear"]]
    measured_n = min(over) if over else None
    crossover_ok = measured_n == predicted_n
    # time: interleaved rounds, so that load changes of a shared machine hit every length alike
    xs = {n: torch.randn(1, n, dim) for n in timed_lengths}
    with torch.inference_mode():
        for n in timed_lengths:
            mha(xs[n])  # warm-up
        samples = profiling.time_interleaved(
            {str(n): functools.partial(mha, xs[n]) for n in timed_lengths}, repeats=repeats
        )
    times = {n: samples[str(n)] for n in timed_lengths}
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    flops = {n: complexity.attention_cost(n, dim, num_heads).flops for n in timed_lengths}
    a, b = timed_lengths[-2], timed_lengths[-1]
    slope_time = math.log(median[b] / median[a]) / math.log(b / a)
    slope_flops = math.log(flops[b] / flops[a]) / math.log(b / a)
    shape_ok = abs(slope_time - slope_flops) <= 0.6
    verdict = (
        f"counted FLOPs equal the predicted components at every n: {counts_match}; n² terms "
        f"first reach the n·d² terms at n = {measured_n} (predicted {predicted_n}); time slope "
        f"{slope_time:.2f} within 0.6 of the FLOPs slope {slope_flops:.2f}: {shape_ok}"
    )
    measured = {
        "flops": rows,
        "predicted_crossover": predicted_n,
        "measured_crossover": measured_n,
        "median_time_s": {str(n): median[n] for n in timed_lengths},
        "time_slope": slope_time,
        "flops_slope": slope_flops,
    }
    drawing = {"predicted_flops": flops, "dim": dim, "num_heads": num_heads}
    return _result(3, counts_match and crossover_ok and shape_ok, measured, verdict, drawing)


# --------------------------------------------------------------------------- 4: permutation


def _permutation_error(module: nn.Module, *, dim: int, seed: int) -> float:
    gen = _gen(seed)
    x = torch.randn(2, 12, dim, generator=gen)
    perm = torch.randperm(12, generator=gen)
    with torch.no_grad():
        return float((module(x[:, perm]) - module(x)[:, perm]).abs().max())


def check_permutation(
    module: nn.Module | None = None, *, dim: int = 32, tolerance: float = 1e-5, seed: int = 0
) -> ClaimResult:
    """Claim 4: without positions, ``f(x[perm]) == f(x)[perm]``.

    Args:
        module: Maps ``(B, L, dim)`` to ``(B, L, dim)``; default the blog's ``TransformerBlock``.
        dim: Model dim.
        tolerance: Largest allowed ``|f(P x) - P f(x)|``.
        seed: Seed of the input and the permutation.

    Returns:
        The claim's result; measured also holds the same error with sinusoidal and rotary
        positions, for contrast.
    """
    torch.manual_seed(seed)
    under_test = module if module is not None else TransformerBlock(dim, 2 * dim, 4)
    err = _permutation_error(under_test.eval(), dim=dim, seed=seed)
    contrast = {
        kind: _permutation_error(
            PositionalTransformerBlock(dim, 2 * dim, 4, position_type=kind).eval(),
            dim=dim,
            seed=seed,
        )
        for kind in ("sinusoidal", "rope")
    }
    passed = err <= tolerance
    verdict = f"max |f(Px) - P f(x)| = {err:.2e} (tolerance {tolerance:.0e})"
    measured = {"max_error": err, "tolerance": tolerance, "with_positions": contrast}
    label = "module under test" if module is not None else "no positions"
    return _result(4, passed, measured, verdict, {"label": label})


# --------------------------------------------------------------------------- 5, 6: sinusoidal


def _sinusoidal_table(dim: int = 64, length: int = 512) -> Tensor:
    return SinusoidalPositionalEncoding(dim=dim, max_seq_len=length).pe.double()  # (length, dim)


def _pair_angles(table: Tensor) -> Tensor:
    """Angle of each (even, odd) channel pair seen as a point (cos-part, sin-part): (N, dim/2)."""
    pairs = table.reshape(table.shape[0], -1, 2)  # (N, dim/2, 2): (sin, cos) per the blog
    return torch.atan2(pairs[..., 0], pairs[..., 1])


def check_sinusoidal_shift(
    table: Tensor | None = None,
    *,
    shifts: Sequence[int] = (1, 7, 50, 300),
    tolerance: float = 1e-4,
) -> ClaimResult:
    """Claim 5: ``PE(p + k) = M_k PE(p)`` for every p, with ``M_k`` a rotation per channel pair.

    For each shift ``k`` and pair, ``M_k`` is the rotation taking ``PE(0)`` to ``PE(k)`` (read off
    the table); the check is that the same rotation takes ``PE(p)`` to ``PE(p + k)`` for every p.

    Args:
        table: ``(positions, dim)`` table under test; default ``SinusoidalPositionalEncoding``'s.
        shifts: Shifts ``k``.
        tolerance: Largest allowed ``|PE(p + k) - M_k PE(p)|``.

    Returns:
        The claim's result.
    """
    pe = (table if table is not None else _sinusoidal_table()).double()
    N, dim = pe.shape
    pairs = pe.reshape(N, dim // 2, 2)  # (N, P, 2)
    errors: dict[str, float] = {}
    per_pair: dict[int, Tensor] = {}
    for k in shifts:
        a, b = pairs[0], pairs[k]  # (P, 2)
        # rotation angle from PE(0) to PE(k) in each pair's plane, and the ratio of lengths
        theta = torch.atan2(a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0], (a * b).sum(-1))  # (P,)
        c, s = theta.cos(), theta.sin()
        x, y = pairs[: N - k, :, 0], pairs[: N - k, :, 1]
        rotated = torch.stack((c * x - s * y, s * x + c * y), dim=-1)  # (N-k, P, 2)
        err = (rotated - pairs[k:]).abs().amax(-1)  # (N-k, P)
        errors[str(k)] = float(err.max())
        per_pair[k] = err.amax(0)
    worst = max(errors.values())
    passed = worst <= tolerance
    verdict = (
        f"largest error over all p, pairs and k in {list(shifts)}: {worst:.2e} "
        f"(tolerance {tolerance:.0e})"
    )
    return _result(
        5,
        passed,
        {"max_error_per_shift": errors, "tolerance": tolerance, "positions": N, "dim": dim},
        verdict,
        {"table": pe, "per_pair": per_pair},
    )


def check_frequencies(table: Tensor | None = None) -> ClaimResult:
    """Claim 6: each channel pair turns at its own speed; low pairs fast, high pairs slowly.

    Every pair's angular speed is measured from the table (the unwrapped angle's mean step); its
    wavelength is ``2π / speed``. Passes when the wavelengths increase strictly with the pair
    index, the first is under 10 positions and the last over 1000 times the first.

    Args:
        table: ``(positions, dim)`` table under test; default ``SinusoidalPositionalEncoding``'s.

    Returns:
        The claim's result.
    """
    pe = (table if table is not None else _sinusoidal_table()).double()
    angles = _pair_angles(pe)  # (N, P)
    step = torch.remainder(angles.diff(dim=0) + math.pi, 2 * math.pi) - math.pi  # wrapped steps
    speed = step.mean(0).abs()  # (P,) radians per position
    wavelength = (2 * math.pi / speed.clamp_min(1e-12)).tolist()
    increasing = all(b > a for a, b in itertools.pairwise(wavelength))
    short = wavelength[0] < 10
    long = wavelength[-1] > 1000 * wavelength[0]
    verdict = (
        f"wavelengths rise with the pair index: {increasing}; shortest {wavelength[0]:.2f} "
        f"positions (< 10: {short}); longest {wavelength[-1]:.0f} (> 1000x the shortest: {long})"
    )
    measured = {"wavelengths": wavelength, "radians_per_position": speed.tolist()}
    return _result(6, increasing and short and long, measured, verdict, {"table": pe})


# --------------------------------------------------------------------------- 7, 8: RoPE


def _default_rotate(head_dim: int = 64) -> Rotate:
    rope = RotaryEmbedding(head_dim)
    return lambda x, positions: rope(x, positions)


def check_rope_norm(
    rotate: Rotate | None = None, *, head_dim: int = 64, tolerance: float = 1e-5, seed: int = 0
) -> ClaimResult:
    """Claim 7: ``|rope(x, p)| == |x|``, for every vector and every channel pair.

    Args:
        rotate: ``(x, positions) -> rotated x`` under test; default ``RotaryEmbedding``
            (both pair conventions are measured when it is the default).
        head_dim: E.
        tolerance: Largest allowed relative change of a norm.
        seed: Seed of the vectors.

    Returns:
        The claim's result.
    """
    gen = _gen(seed)
    x = torch.randn(2, 4, 256, head_dim, generator=gen)  # (B, H, L, E)
    positions = torch.cat([torch.arange(128), torch.arange(100_000, 100_128)])  # near and far
    rotations = (
        {"under test": rotate}
        if rotate is not None
        else {
            "interleaved (blog)": _default_rotate(head_dim),
            "split halves (NeoX)": (lambda r: lambda t, p: r(t, p))(
                RotaryEmbedding(head_dim, interleaved=False)
            ),
        }
    )
    measured: dict[str, Any] = {"tolerance": tolerance}
    worst = 0.0
    before = x.norm(dim=-1).flatten()
    after = {}
    for name, fn in rotations.items():
        with torch.no_grad():
            y = fn(x, positions)
        ratio = y.norm(dim=-1) / x.norm(dim=-1)
        rel = float((ratio - 1).abs().max())
        measured[name] = {"max_relative_norm_change": rel}
        worst = max(worst, rel)
        after[name] = y.norm(dim=-1).flatten()
    verdict = f"largest relative change of a norm: {worst:.2e} (tolerance {tolerance:.0e})"
    drawing = {"before": before, "after": after}
    return _result(7, worst <= tolerance, measured, verdict, drawing)


def check_rope_relative(
    rotate: Rotate | None = None,
    *,
    head_dim: int = 64,
    length: int = 48,
    far: int = 5000,
    tolerance: float = 1e-4,
    seed: int = 0,
) -> ClaimResult:
    """Claim 8: ``rope(q, p) · rope(k, s)`` depends only on ``s - p``.

    Scores of one query and one key placed at every pair of positions form a matrix whose
    diagonals (constant ``s - p``) must be constant, also when both positions move ``far`` ahead;
    the scores must still vary across offsets (otherwise positions would carry nothing).

    Args:
        rotate: ``(x, positions) -> rotated x`` under test; default ``RotaryEmbedding``.
        head_dim: E.
        length: Positions ``0 .. length-1`` on each side.
        far: Shift applied to both positions for the second matrix.
        tolerance: Largest allowed spread along a diagonal, relative to the scores' scale.
        seed: Seed of the query and key.

    Returns:
        The claim's result.
    """
    fn = rotate if rotate is not None else _default_rotate(head_dim)
    gen = _gen(seed)
    q = torch.randn(head_dim, generator=gen).expand(length, head_dim)
    k = torch.randn(head_dim, generator=gen).expand(length, head_dim)
    pos = torch.arange(length)
    with torch.no_grad():
        scores = fn(q, pos) @ fn(k, pos).T  # (p, s)
        shifted = fn(q, pos + far) @ fn(k, pos + far).T
    scale = float(scores.abs().max())
    spread = 0.0
    by_offset = []
    for off in range(-(length - 1), length):
        diag = torch.diagonal(scores, offset=off)
        spread = max(spread, float(diag.max() - diag.min()))
        by_offset.append(float(diag.mean()))
    move = float((shifted - scores).abs().max())
    varies = float(torch.tensor(by_offset).std()) > 0.05 * scale
    ok = spread <= tolerance * scale and move <= tolerance * scale and varies
    verdict = (
        f"largest spread along a diagonal {spread:.2e}, change when both positions move by "
        f"{far}: {move:.2e} (tolerance {tolerance:.0e} x scale {scale:.2f}); varies with the "
        f"offset: {varies}"
    )
    measured = {
        "diagonal_spread": spread,
        "shift_change": move,
        "scale": scale,
        "varies_with_offset": varies,
        "tolerance": tolerance,
    }
    return _result(8, ok, measured, verdict, {"scores": scores, "by_offset": by_offset})


# --------------------------------------------------------------------------- 9: causal


def check_causal(
    model: nn.Module | None = None, *, vocab: int = 32, length: int = 16, seed: int = 0
) -> ClaimResult:
    """Claim 9: causal weights are lower-triangular and the future never changes the past.

    Args:
        model: Maps ids ``(B, L)`` to ``(logits, per-layer weights)`` with
            ``return_weights=True``; default a small ``TransformerLM``.
        vocab: Vocabulary of the random ids.
        length: Sequence length.
        seed: Seed of the model and the ids.

    Returns:
        The claim's result.
    """
    torch.manual_seed(seed)
    lm = model if model is not None else TransformerLM(vocab, 32, 2, 4, max_seq_len=64)
    lm.eval().double()  # float64: "never changes" is then checked to 1e-10, not float32 noise
    gen = _gen(seed)
    ids = torch.randint(0, vocab, (2, length), generator=gen)
    with torch.no_grad():
        logits, weights = lm(ids, return_weights=True)
        upper = max(float(w.triu(diagonal=1).abs().max()) for w in weights)
        past_change, future_change = [], []
        for t in range(length - 1):
            other = ids.clone()
            other[:, t + 1 :] = (
                ids[:, t + 1 :] + torch.randint(1, vocab, (2, length - t - 1), generator=gen)
            ) % vocab
            changed = (lm(other) - logits).abs().amax(dim=(0, 2))  # (L,) per position
            past_change.append(float(changed[: t + 1].max()))
            future_change.append(float(changed[t + 1 :].max()))
    past = max(past_change)
    uses_context = min(future_change) > 1e-4
    ok = upper == 0.0 and past <= 1e-10 and uses_context
    verdict = (
        f"largest weight above the diagonal {upper:.1e} (must be 0); largest change of an "
        f"earlier output {past:.1e} (<= 1e-10); later outputs do change: {uses_context}"
    )
    measured = {
        "max_weight_above_diagonal": upper,
        "max_past_change": past,
        "min_future_change": min(future_change),
    }
    drawing = {
        "map": weights[-1][0, 0],  # last layer, first example, head 0: (L, L)
        "past_change": past_change,
        "future_change": future_change,
    }
    return _result(9, ok, measured, verdict, drawing)


# --------------------------------------------------------------------------- 10: interpretable


def train_tour_model(*, steps: int = 300, seed: int = 0) -> Any:
    """A small encoder trained on the lab's ``reverse`` task (a few seconds on a CPU).

    Returns:
        The lab's :class:`attnkit.lab.train.TrainResult`.
    """
    from attnkit.lab.train import LabConfig, train

    config = LabConfig(
        task="reverse",
        seq_len=10,
        dim=32,
        ffn_dim=64,
        num_layers=2,
        num_heads=4,
        steps=steps,
        eval_size=256,
        eval_every=0,
        seed=seed,
    )
    return train(config, progress=False)


def check_interpretable(
    model: TransformerEncoder | None = None, config: Any = None, *, threshold: float = 0.5
) -> ClaimResult:
    """Claim 10: the trained model's best head puts most of its weight on the answer's source.

    On held-out inputs of the lab's task, each head's share of attention on the positions that
    hold the answer (:func:`attnkit.lab.train.head_alignment`) is measured; the best head must
    reach ``threshold`` (chance is 1/n).

    Args:
        model: A lab model; default one trained by :func:`train_tour_model`.
        config: Its :class:`attnkit.lab.train.LabConfig` (needed with ``model``).
        threshold: Share the best head must reach.

    Returns:
        The claim's result; ``measured`` holds the alignment of every head and the accuracy.
    """
    from attnkit.lab.train import attention_weights, eval_set, evaluate, head_alignment

    if model is None:
        result = train_tour_model()
        model, config = result.model, result.config
    if config is None:
        raise ValueError("pass the model's LabConfig with the model")
    task = config.make_task()
    x, y = eval_set(task, 256, config.seed + 1)
    weights = attention_weights(model, x)  # (B, layers, H, L, L)
    align = head_alignment(task, x, weights)  # (layers, H)
    best = int(align.argmax())
    layer, head = divmod(best, align.shape[1])
    share = float(align[layer, head])
    accuracy = evaluate(model, x, y)["accuracy"]
    verdict = (
        f"best head (layer {layer}, head {head}) puts {share:.3f} of its weight on the answer's "
        f"position (threshold {threshold}; chance {1 / task.seq_len:.2f}); held-out accuracy "
        f"{accuracy:.3f}"
    )
    measured = {
        "best_layer": layer,
        "best_head": head,
        "best_share": share,
        "threshold": threshold,
        "chance": 1 / task.seq_len,
        "alignment": align.tolist(),
        "heldout_accuracy": accuracy,
        "task": task.name,
        "train_steps": config.steps,
    }
    drawing = {"map": weights[0, layer, head], "tokens": task.labels(x[0])}
    res = _result(10, share >= threshold, measured, verdict, drawing)
    res.explorer = (task.labels(x[0]), list(weights[0].unbind(0)))  # layers x (H, L, L)
    return res


# --------------------------------------------------------------------------- 11, 12: variants


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
    module = module.double().eval()
    plain = _twin(module)
    x = torch.randn(4, n, dim, generator=_gen(seed), dtype=torch.float64)
    rows = []
    for g in gains:
        c, u = _row_stats(module, g * x), _row_stats(plain, g * x)
        rows.append(
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
        )
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
    return _result(11, within and below and reached and runaway, measured, verdict)


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
    module = module.double().eval()
    plain = _twin(module, bias=False)
    x = torch.randn(4, n, dim, generator=_gen(seed), dtype=torch.float64)
    rows = []
    for g in gains:
        normed_row, plain_row = _row_stats(module, g * x), _row_stats(plain, g * x)
        rows.append(
            {
                "gain": g,
                "normed_std": normed_row["std"],
                "normed_range": normed_row["range"],
                "plain_std": plain_row["std"],
            }
        )
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
    return _result(12, flat <= tolerance and bounded and grows, measured, verdict)


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
}
"""Claim id -> its check, run with its defaults (attnkit's own modules)."""
