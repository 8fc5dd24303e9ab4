"""Claim 3, the blog's "Computational and memory complexity": FLOPs counted while attnkit's
attention runs against :mod:`attnkit.complexity`'s prediction, and time against its shape."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnkit import MultiHeadAttention, complexity, profiling
from attnkit.tour.verdict import ClaimResult, claim_result

__all__ = ["check_cost"]


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
    return claim_result(3, counts_match and crossover_ok and shape_ok, measured, verdict, drawing)
