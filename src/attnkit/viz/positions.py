"""Positions: the sinusoidal table, rotary frequencies, rotary scores by offset, rotary tables.

The rotary pictures rotate with :func:`attnkit.positional.apply_rope`, so they show the library's
own rotation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from attnkit.positional import apply_rope
from attnkit.viz._common import (
    as_array,
    new_figure,
)

__all__ = ["rotary_frequencies", "rotary_relative_scores", "rotary_table", "sinusoidal_heatmap"]


def sinusoidal_heatmap(pe: Any, *, title: str | None = None) -> Figure:
    """The sinusoidal position table as a heatmap, like the blog's picture.

    Left columns (small dimension index) oscillate quickly with position and tell neighbours
    apart; right columns change slowly and carry long-range position.

    Args:
        pe: Positional-encoding table, e.g. ``SinusoidalPositionalEncoding(dim, n).pe``.
        title: Figure title.

    Returns:
        The figure.

    Raises:
        ValueError: If ``pe`` is not 2-D or is empty.

    Shape:
        pe: (positions, dim).
    """
    table = as_array(pe, "pe")
    if table.ndim != 2 or min(table.shape) == 0:
        raise ValueError(
            f"sinusoidal_heatmap expects pe of shape (positions, dim), got {tuple(table.shape)}"
        )
    positions, dim = table.shape
    fig = new_figure(10, 5.5)
    ax = fig.add_subplot()
    limit = max(1.0, float(np.nanmax(np.abs(table))))
    image = ax.imshow(
        table, aspect="auto", cmap="coolwarm", vmin=-limit, vmax=limit, interpolation="nearest"
    )
    ax.set_xlabel("embedding dimension  (sin on even, cos on odd)")
    ax.set_ylabel("position")
    ax.set_title(
        title
        if title is not None
        else f"Sinusoidal positional encoding: {positions} positions x {dim} dims"
    )
    fig.colorbar(image, ax=ax, label="value")
    box = {"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.7"}
    for x, align, note in (
        (0.02, "left", "fast: tells\nneighbours apart"),
        (0.98, "right", "slow: long-range\nposition"),
    ):
        ax.text(x, 0.97, note, transform=ax.transAxes, va="top", ha=align, fontsize=9, bbox=box)
    return fig


def _rope_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary head_dim must be a positive even number, got {head_dim}")
    if base <= 1.0:
        raise ValueError(f"rotary base must be > 1, got {base}")
    pair = torch.arange(0, head_dim, 2, dtype=torch.float64)
    return base ** (-pair / head_dim)  # (E/2,) radians per position


def rotary_frequencies(head_dim: int, base: float = 10_000.0) -> Figure:
    """Rotation speed of every RoPE pair: pair i turns ``base**(-2i/head_dim)`` radians per token.

    The right axis gives the same speed as a wavelength: how many positions one full turn takes.

    Args:
        head_dim: Head dimension E (even).
        base: Frequency base of the rotary tables.

    Returns:
        The figure.

    Raises:
        ValueError: If ``head_dim`` is not a positive even number or ``base <= 1``.
    """
    inv_freq = _rope_inv_freq(head_dim, base).numpy()
    pairs = np.arange(inv_freq.size)
    fig = new_figure(8, 4.8)
    ax = fig.add_subplot()
    ax.semilogy(pairs, inv_freq, "o-", color="tab:blue", markersize=4)
    ax.set_xlabel(f"pair index i  (features 2i, 2i+1 of a {head_dim}-dim head)")
    ax.set_ylabel("rotation speed (radians per position)")
    ax.set_title(f"RoPE rotation speeds (head_dim={head_dim}, base={base:g})")
    ax.grid(True, which="both", alpha=0.3)
    wavelength = ax.secondary_yaxis(
        "right",
        functions=(
            lambda w: 2 * np.pi / np.maximum(w, 1e-300),
            lambda lam: 2 * np.pi / np.maximum(lam, 1e-300),
        ),
    )
    wavelength.set_ylabel("wavelength (positions per full turn)")
    ax.annotate(
        "fast pairs: short-range",
        xy=(pairs[0], inv_freq[0]),
        xytext=(0.12, 0.9),
        textcoords="axes fraction",
        arrowprops={"arrowstyle": "->", "color": "0.4"},
        fontsize=9,
    )
    ax.annotate(
        "slow pairs: long-range",
        xy=(pairs[-1], inv_freq[-1]),
        xytext=(0.55, 0.12),
        textcoords="axes fraction",
        arrowprops={"arrowstyle": "->", "color": "0.4"},
        fontsize=9,
    )
    return fig


def _rotate(x: torch.Tensor, position: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent feature pairs (2i, 2i+1) of ``x`` by ``position * inv_freq[i]``."""
    angles = position * inv_freq  # (E/2,)
    return apply_rope(x, angles.cos(), angles.sin())


def rotary_relative_scores(
    head_dim: int = 64,
    *,
    max_offset: int = 48,
    positions: Sequence[int] = (0, 37, 500),
    base: float = 10_000.0,
    seed: int = 0,
) -> Figure:
    """RoPE's score ``<R_p q, R_s k>`` against the offset ``s - p``, for several absolute ``p``.

    One fixed random q and k are rotated to absolute positions p and s = p + offset. The curves
    for different p lie on top of each other: the score depends only on the offset (the blog's
    ``R_p^T R_s = R_{s-p}``). The largest gap between curves is printed in the legend.

    Args:
        head_dim: Head dimension E (even).
        max_offset: Offsets run over ``-max_offset..max_offset``.
        positions: Absolute query positions p to overlay (offsets with s < 0 are skipped).
        base: Frequency base of the rotary tables.
        seed: Seed for q and k.

    Returns:
        The figure.

    Raises:
        ValueError: If ``head_dim`` is not a positive even number, ``max_offset < 1``,
            ``positions`` is empty or holds a negative position.
    """
    inv_freq = _rope_inv_freq(head_dim, base)
    if max_offset < 1:
        raise ValueError(f"max_offset must be >= 1, got {max_offset}")
    positions = [int(p) for p in positions]
    if not positions or min(positions) < 0:
        raise ValueError(f"positions must be non-empty and >= 0, got {positions}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(head_dim, generator=gen, dtype=torch.float64)
    offsets = np.arange(-max_offset, max_offset + 1)

    curves = []
    for p in positions:
        rq = _rotate(q, p, inv_freq)
        scores = [
            float(rq @ _rotate(k, p + int(d), inv_freq)) if p + d >= 0 else np.nan for d in offsets
        ]
        curves.append(np.array(scores))
    stacked = np.vstack(curves)
    gap = float(np.nanmax(np.nanmax(stacked, axis=0) - np.nanmin(stacked, axis=0)))

    fig = new_figure(9, 5)
    ax = fig.add_subplot()
    styles = ["-", "--", ":", "-."]
    markers = [None, "o", "x", "s"]
    for n, (p, curve) in enumerate(zip(positions, curves, strict=True)):
        ax.plot(
            offsets,
            curve,
            linestyle=styles[n % 4],
            marker=markers[n % 4],
            markersize=4,
            markevery=3,
            linewidth=3.0 if n == 0 else 1.5,
            alpha=0.55 if n == 0 else 0.95,
            label=f"query at p = {p}",
        )
    ax.axhline(
        float(q @ k), color="0.5", linewidth=0.8, linestyle=":", label="q . k without rotation"
    )
    ax.axvline(0, color="0.5", linewidth=0.8, linestyle=":")
    ax.set_xlabel("relative offset s - p  (key position minus query position)")
    ax.set_ylabel(r"score $\langle R_p\,q,\ R_s\,k \rangle$")
    ax.set_title("RoPE: the score depends only on the offset s - p, not on p")
    ax.grid(True, alpha=0.3)
    ax.legend(
        title=f"largest gap between\ncurves: {gap:.1e}",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=9,
    )
    return fig


def rotary_table(cos: Any, sin: Any, *, title: str | None = None) -> Figure:
    """The rotary cos and sin tables side by side: position (y) x pair index (x).

    Args:
        cos: Cosine of the rotation angles, e.g. the first output of ``rope_cos_sin``.
        sin: Sine of the rotation angles.
        title: Figure title.

    Returns:
        The figure.

    Raises:
        ValueError: If the tables are not 2-D, empty, or differ in shape.

    Shape:
        cos, sin: (positions, E/2).
    """
    c, s = as_array(cos, "cos"), as_array(sin, "sin")
    if c.ndim != 2 or c.shape != s.shape or min(c.shape) == 0:
        raise ValueError(
            f"rotary_table expects cos and sin of one shape (positions, E/2), "
            f"got {tuple(c.shape)} and {tuple(s.shape)}"
        )
    fig = new_figure(11, 5)
    axes = fig.subplots(1, 2, sharey=True)
    image = None
    for ax, table, name in zip(axes, (c, s), ("cos", "sin"), strict=True):
        image = ax.imshow(
            table, aspect="auto", cmap="coolwarm", vmin=-1, vmax=1, interpolation="nearest"
        )
        ax.set_title(f"{name}(position x speed of pair i)")
        ax.set_xlabel("pair index i")
    axes[0].set_ylabel("position")
    assert image is not None  # two tables were drawn
    fig.colorbar(image, ax=axes, label="value")
    fig.suptitle(
        title
        if title is not None
        else f"Rotary tables: {c.shape[0]} positions x {c.shape[1]} pairs"
    )
    return fig
