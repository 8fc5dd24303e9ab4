"""What every picture of :mod:`attnkit.viz` shares: input conversion, the figure, token ticks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

ATTN_CMAP = "viridis"
MAX_ANNOTATED = 10  # write the weight in each cell when both sides have at most this many tokens
MAX_LABELLED = 40  # beyond this many tokens, label every k-th one so labels stay readable


def as_array(x: Any, name: str) -> np.ndarray:
    """Convert a tensor, array or nested list to a float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{name} must be a tensor or array of numbers, got {type(x).__name__}"
        ) from err


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained", facecolor="white")


def check_tokens(tokens: Sequence[str] | None, length: int, name: str) -> list[str] | None:
    if tokens is None:
        return None
    labels = [str(t) for t in tokens]
    if len(labels) != length:
        raise ValueError(f"{name} has {len(labels)} labels but the weights have {length} positions")
    return labels


def set_token_ticks(
    ax: Axes, axis: str, labels: list[str] | None, length: int, max_labels: int = MAX_LABELLED
) -> None:
    """Put token labels (or position numbers) on one axis, thinning them when there are many."""
    if labels is None:
        # positions: let matplotlib pick a few round integers
        locator = MaxNLocator(nbins=min(length, 10), integer=True)
        (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(locator)
        return
    step = max(1, math.ceil(length / max_labels))
    ticks = list(range(0, length, step))
    names = [labels[i] for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks)
        # token strings read better rotated; bare numbers do not need it
        rotate = max((len(n) for n in names), default=0) > 2
        ax.set_xticklabels(
            names,
            rotation=60 if rotate else 0,
            ha="right" if rotate else "center",
            rotation_mode="anchor",
        )
    else:
        ax.set_yticks(ticks)
        ax.set_yticklabels(names)


def annotate_cells(ax: Axes, w: np.ndarray, vmax: float) -> None:
    fontsize = 9 if max(w.shape) <= 6 else 7
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            value = w[i, j]
            # dark text on the bright (yellow) end of viridis, light text elsewhere
            color = "black" if value > 0.6 * vmax else "white"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color=color, fontsize=fontsize)
