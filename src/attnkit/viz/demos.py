"""The blog's numbers drawn: why the scores are scaled, and what softmax does to them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from attnkit.viz._common import (
    new_figure,
)

__all__ = ["scaling_demo", "softmax_demo"]


def scaling_demo(
    dims: Sequence[int] = (4, 16, 64, 256, 1024, 4096),
    n: int = 256,
    seed: int = 0,
) -> Figure:
    """Why divide by sqrt(d): the spread of q.k grows like sqrt(d), and softmax saturates.

    Left: the standard deviation of ``q . k`` for ``n`` random Gaussian queries and keys, raw and
    divided by sqrt(d). Right: the average largest softmax weight of a row of ``n`` such scores;
    without the rescale, rows become one-hot as d grows.

    Args:
        dims: Vector dimensions d to try.
        n: Number of queries and keys (the score matrix is n x n).
        seed: Seed for q and k.

    Returns:
        The figure.

    Raises:
        ValueError: If ``dims`` is empty or holds a value < 1, or ``n < 2``.
    """
    dims = sorted({int(d) for d in dims})
    if not dims or dims[0] < 1:
        raise ValueError(f"dims must be non-empty positive integers, got {dims}")
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    gen = torch.Generator().manual_seed(seed)
    raw_std, scaled_std, raw_peak, scaled_peak = [], [], [], []
    for d in dims:
        q = torch.randn(n, d, generator=gen, dtype=torch.float64)
        k = torch.randn(n, d, generator=gen, dtype=torch.float64)
        scores = q @ k.T  # (n, n)
        scaled = scores / math.sqrt(d)
        raw_std.append(float(scores.std()))
        scaled_std.append(float(scaled.std()))
        raw_peak.append(float(scores.softmax(-1).amax(-1).mean()))
        scaled_peak.append(float(scaled.softmax(-1).amax(-1).mean()))

    fig = new_figure(12, 4.8)
    left, right = fig.subplots(1, 2)
    d_arr = np.array(dims, dtype=float)
    left.loglog(d_arr, raw_std, "o-", color="tab:red", label=r"raw $q\cdot k$")
    left.loglog(d_arr, scaled_std, "s-", color="tab:blue", label=r"$q\cdot k/\sqrt{d}$")
    left.loglog(d_arr, np.sqrt(d_arr), ":", color="0.4", label=r"$\sqrt{d}$ (theory)")
    left.set_xlabel("dimension d")
    left.set_ylabel("standard deviation of the scores")
    left.set_title(r"Dot products spread like $\sqrt{d}$; rescaled they stay near 1")
    left.grid(True, which="both", alpha=0.3)
    left.legend()

    right.semilogx(d_arr, raw_peak, "o-", color="tab:red", label="without rescale")
    right.semilogx(d_arr, scaled_peak, "s-", color="tab:blue", label=r"with $1/\sqrt{d}$")
    right.axhline(1.0 / n, color="0.4", linestyle=":", label=f"uniform (1/{n})")
    right.set_ylim(0, 1.05)
    right.set_xlabel("dimension d")
    right.set_ylabel("mean largest softmax weight per row")
    right.set_title(f"Without rescaling, softmax over {n} keys turns one-hot")
    right.grid(True, which="both", alpha=0.3)
    right.legend()
    fig.suptitle(f"The rescale factor, measured on {n} random Gaussian queries and keys")
    return fig


def softmax_demo() -> Figure:
    """The blog's softmax example and what scaling the scores does to it.

    Left: ``softmax([1, 2])`` against ``softmax([10, 20])``. Right: the weights of
    ``softmax(t * [1, 2])`` as the scale t grows; they saturate to one-hot.

    Returns:
        The figure.
    """
    base = torch.tensor([1.0, 2.0], dtype=torch.float64)
    fig = new_figure(12, 4.8)
    left, right = fig.subplots(1, 2)

    small, large = base.softmax(-1).numpy(), (10 * base).softmax(-1).numpy()
    x = np.arange(2)
    width = 0.38
    for offset, values, label, color in (
        (-width / 2, small, "softmax([1, 2])", "tab:blue"),
        (width / 2, large, "softmax([10, 20])", "tab:red"),
    ):
        bars = left.bar(x + offset, values, width, label=label, color=color)
        left.bar_label(bars, labels=[f"{v:.5g}" for v in values], fontsize=9, padding=2)
    left.set_xticks(x, ["score of token 0", "score of token 1"])
    left.set_ylim(0, 1.12)
    left.set_ylabel("softmax weight")
    left.set_title("Same ratio of scores, very different weights")
    left.legend(loc="upper left")

    scales = np.logspace(-1, 1.5, 200)
    weights = (torch.from_numpy(scales)[:, None] * base).softmax(-1).numpy()  # (200, 2)
    right.semilogx(scales, weights[:, 1], color="tab:orange", label="weight of token 1 (score 2t)")
    right.semilogx(scales, weights[:, 0], color="tab:purple", label="weight of token 0 (score t)")
    for t, color in ((1.0, "tab:blue"), (10.0, "tab:red")):
        w = (t * base).softmax(-1).numpy()
        right.plot([t, t], w[::-1], "o", color=color, markersize=7)
        right.axvline(t, color=color, linestyle=":", linewidth=1)
        right.annotate(
            f"t = {t:g}\n[{t:g}, {2 * t:g}]",
            xy=(t, 0.5),
            xytext=(4, 0),
            textcoords="offset points",
            color=color,
            fontsize=9,
            va="center",
        )
    right.set_ylim(-0.02, 1.02)
    right.set_xlabel("scale t applied to the scores [1, 2]")
    right.set_ylabel("softmax weight")
    right.set_title("Larger scores saturate softmax to one-hot")
    right.grid(True, which="both", alpha=0.3)
    right.legend(loc="upper left")
    fig.suptitle("Softmax is not scale-invariant: big scores give (almost) one-hot weights")
    return fig
