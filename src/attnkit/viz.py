"""Pictures of attention for learners: every function returns a matplotlib ``Figure``.

Nothing here calls ``plt.show()`` or touches pyplot's global state: figures are built with
``matplotlib.figure.Figure`` directly, which renders with the Agg canvas and works on headless
machines. Save them with :func:`save_figure`. Inputs are torch tensors, numpy arrays or nested
lists; the rotary pictures rotate with :func:`attnkit.positional.apply_rope`, so they show the
library's own rotation.

matplotlib is the optional ``viz`` extra; ``import attnkit`` never imports this module.

Shape legend: L query length, S key length, E head dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from attnkit.positional import apply_rope

__all__ = [
    "attention_grid",
    "attention_map",
    "attention_maps",
    "complexity_curves",
    "rotary_frequencies",
    "rotary_relative_scores",
    "rotary_table",
    "run_comparison",
    "save_figure",
    "scaling_demo",
    "sinusoidal_heatmap",
    "softmax_demo",
    "training_curves",
]

_ATTN_CMAP = "viridis"
_MAX_ANNOTATED = 10  # write the weight in each cell when both sides have at most this many tokens
_MAX_LABELLED = 40  # beyond this many tokens, label every k-th one so labels stay readable


# --------------------------------------------------------------------------- helpers


def _as_array(x: Any, name: str) -> np.ndarray:
    """Convert a tensor, array or nested list to a float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{name} must be a tensor or array of numbers, got {type(x).__name__}"
        ) from err


def _new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained", facecolor="white")


def _check_tokens(tokens: Sequence[str] | None, length: int, name: str) -> list[str] | None:
    if tokens is None:
        return None
    labels = [str(t) for t in tokens]
    if len(labels) != length:
        raise ValueError(f"{name} has {len(labels)} labels but the weights have {length} positions")
    return labels


def _set_token_ticks(
    ax: Axes, axis: str, labels: list[str] | None, length: int, max_labels: int = _MAX_LABELLED
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


def _annotate_cells(ax: Axes, w: np.ndarray, vmax: float) -> None:
    fontsize = 9 if max(w.shape) <= 6 else 7
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            value = w[i, j]
            # dark text on the bright (yellow) end of viridis, light text elsewhere
            color = "black" if value > 0.6 * vmax else "white"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color=color, fontsize=fontsize)


# --------------------------------------------------------------------------- attention weights


def attention_map(
    weights: Any,
    *,
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Heatmap of one head's attention weights: row i shows how query i spreads over the keys.

    Args:
        weights: Attention weights of one head (rows usually sum to 1).
        query_tokens: Labels for the rows (queries); defaults to positions 0..L-1.
        key_tokens: Labels for the columns (keys); defaults to ``query_tokens`` when L == S.
        title: Figure title; defaults to ``"Attention weights"``.
        ax: Draw into this axes instead of a new figure.

    Returns:
        The figure holding the map (``ax.figure`` when ``ax`` is given).

    Raises:
        ValueError: If ``weights`` is not 2-D or a label list has the wrong length.

    Shape:
        weights: (L, S).
    """
    w = _as_array(weights, "weights")
    if w.ndim != 2:
        raise ValueError(f"attention_map expects weights of shape (L, S), got {tuple(w.shape)}")
    L, S = w.shape
    if key_tokens is None and query_tokens is not None and L == S:
        key_tokens = query_tokens
    q_labels = _check_tokens(query_tokens, L, "query_tokens")
    k_labels = _check_tokens(key_tokens, S, "key_tokens")

    if ax is None:
        cell = min(0.55, 7.0 / max(L, S, 1))  # inches per token, so big maps still fit
        fig = _new_figure(2.6 + cell * S, 1.6 + cell * L)
        ax = fig.add_subplot()
    else:
        # The caller's axes: its figure (a SubFigure behaves the same here) gets the colorbar.
        fig = cast(Figure, ax.get_figure())
    vmax = max(float(np.nanmax(w)), 1e-12) if w.size else 1.0
    image = ax.imshow(
        w, cmap=_ATTN_CMAP, vmin=0.0, vmax=vmax, aspect="equal", interpolation="nearest"
    )
    _set_token_ticks(ax, "x", k_labels, S)
    _set_token_ticks(ax, "y", q_labels, L)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title if title is not None else "Attention weights")
    if max(L, S) <= _MAX_ANNOTATED:
        _annotate_cells(ax, w, vmax)
    fig.colorbar(image, ax=ax, label="attention weight", shrink=0.85)
    return fig


def attention_grid(
    weights: Any,
    *,
    tokens: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """A layers x heads grid of attention maps, sharing one colour scale.

    Rows are labelled ``layer i`` and columns ``head j`` (0-based, as in ``weights[i, j]``).

    Args:
        weights: Attention weights of every layer and head.
        tokens: Token labels, used for both axes (needs L == S); positions when omitted.
        title: Figure title; defaults to ``"Attention weights per layer and head"``.

    Returns:
        The figure.

    Raises:
        ValueError: If ``weights`` is not 4-D, is empty, or ``tokens`` has the wrong length.

    Shape:
        weights: (layers, heads, L, S).
    """
    w = _as_array(weights, "weights")
    if w.ndim != 4:
        raise ValueError(
            f"attention_grid expects weights of shape (layers, heads, L, S), got {tuple(w.shape)}"
        )
    n_layers, n_heads, L, S = w.shape
    if min(w.shape) == 0:
        raise ValueError(f"attention_grid got empty weights of shape {tuple(w.shape)}")
    if tokens is not None and L != S:
        raise ValueError(f"tokens label both axes, so L must equal S; got weights {tuple(w.shape)}")
    labels = _check_tokens(tokens, L, "tokens")

    cell = 2.0 if max(L, S) <= 12 else 2.8
    fig = _new_figure(cell * n_heads + 1.4, cell * n_layers + 0.8)
    axes = fig.subplots(n_layers, n_heads, squeeze=False, sharex=True, sharey=True)
    vmax = max(float(np.nanmax(w)), 1e-12)
    image = None
    for i in range(n_layers):
        for j in range(n_heads):
            ax = axes[i, j]
            image = ax.imshow(
                w[i, j],
                cmap=_ATTN_CMAP,
                vmin=0.0,
                vmax=vmax,
                aspect="equal",
                interpolation="nearest",
            )
            if i == 0:
                ax.set_title(f"head {j}", fontsize=10)
            if j == 0:
                ax.set_ylabel(f"layer {i}\nquery", fontsize=10)
            if i == n_layers - 1:
                ax.set_xlabel("key", fontsize=9)
    # The axes share x and y, so one call sets the ticks of all; only the outer axes show labels.
    _set_token_ticks(axes[-1, 0], "x", labels, S, max_labels=12)
    _set_token_ticks(axes[-1, 0], "y", labels, L, max_labels=12)
    for ax in axes.flat:
        ax.tick_params(labelsize=7)
    assert image is not None  # the weights are not empty
    fig.colorbar(image, ax=axes, label="attention weight", shrink=0.8)
    fig.suptitle(title if title is not None else "Attention weights per layer and head")
    return fig


def attention_maps(
    weights: Mapping[str, Any],
    *,
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """Several attention maps side by side, e.g. the same input seen by different models.

    Each panel is an :func:`attention_map` with its own colour scale and colorbar.

    Args:
        weights: Panel title -> that head's attention weights, drawn left to right.
        query_tokens: Labels for the rows of every panel; positions when omitted.
        key_tokens: Labels for the columns; defaults to ``query_tokens`` when L == S.
        title: Figure title; none when omitted.

    Returns:
        The figure.

    Raises:
        ValueError: If ``weights`` is empty, a map is not 2-D or a label list has the wrong
            length.

    Shape:
        each weights value: (L, S).
    """
    if not weights:
        raise ValueError("weights is empty: give at least one attention map")
    fig = _new_figure(5.2 * len(weights), 5.0)
    axes = fig.subplots(1, len(weights), squeeze=False)[0]
    for ax, (name, w) in zip(axes, weights.items(), strict=True):
        attention_map(w, query_tokens=query_tokens, key_tokens=key_tokens, title=name, ax=ax)
    if title is not None:
        fig.suptitle(title)
    return fig


# --------------------------------------------------------------------------- positions


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
    table = _as_array(pe, "pe")
    if table.ndim != 2 or min(table.shape) == 0:
        raise ValueError(
            f"sinusoidal_heatmap expects pe of shape (positions, dim), got {tuple(table.shape)}"
        )
    positions, dim = table.shape
    fig = _new_figure(10, 5.5)
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
    fig = _new_figure(8, 4.8)
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

    fig = _new_figure(9, 5)
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
    c, s = _as_array(cos, "cos"), _as_array(sin, "sin")
    if c.ndim != 2 or c.shape != s.shape or min(c.shape) == 0:
        raise ValueError(
            f"rotary_table expects cos and sin of one shape (positions, E/2), "
            f"got {tuple(c.shape)} and {tuple(s.shape)}"
        )
    fig = _new_figure(11, 5)
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


# --------------------------------------------------------------------------- the blog's numbers


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

    fig = _new_figure(12, 4.8)
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
    fig = _new_figure(12, 4.8)
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


# --------------------------------------------------------------------------- costs and training


def complexity_curves(
    seq_lens: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    crossover: float | None = None,
    ylabel: str = "FLOPs",
    title: str | None = None,
) -> Figure:
    """Cost of each attention component against sequence length, on log-log axes.

    Args:
        seq_lens: Sequence lengths n (x values), all > 0.
        series: Component name -> cost at each length (>= 0; zeros are left out of the plot).
        crossover: Length where the quadratic term overtakes the linear ones; drawn as a
            labelled vertical line.
        ylabel: Label of the y axis (``"FLOPs"``, ``"bytes"``, ...).
        title: Figure title.

    Returns:
        The figure.

    Raises:
        ValueError: If ``series`` is empty, a series has a different length than ``seq_lens``,
            or a value is negative or not finite.
    """
    x = _as_array(seq_lens, "seq_lens")
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ValueError(f"seq_lens must be a non-empty 1-D list of positive lengths, got {x}")
    if not series:
        raise ValueError("series is empty: give at least one component to plot")
    fig = _new_figure(9, 5.5)
    ax = fig.add_subplot()
    markers = "os^vD<>p*h"
    for n, (name, values) in enumerate(series.items()):
        y = _as_array(values, f"series[{name!r}]")
        if y.shape != x.shape:
            raise ValueError(
                f"series[{name!r}] has shape {tuple(y.shape)} but seq_lens has "
                f"shape {tuple(x.shape)}"
            )
        if not np.all(np.isfinite(y)) or np.any(y < 0):
            raise ValueError(f"series[{name!r}] must be finite and >= 0, got {y}")
        ax.loglog(
            x,
            np.where(y > 0, y, np.nan),
            marker=markers[n % len(markers)],
            markersize=4,
            label=name,
        )
    if crossover is not None:
        if not math.isfinite(crossover) or crossover <= 0:
            raise ValueError(f"crossover must be a positive length, got {crossover}")
        ax.axvline(crossover, color="0.3", linestyle="--", linewidth=1)
        ax.annotate(
            f"crossover n = {crossover:,.0f}",
            xy=(crossover, 0.5),
            xycoords=("data", "axes fraction"),
            xytext=(5, 0),
            textcoords="offset points",
            rotation=90,
            va="center",
            fontsize=9,
        )
    ax.set_xlabel("sequence length n (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title if title is not None else f"{ylabel} of attention by component")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _history_columns(history: Any) -> dict[str, np.ndarray]:
    """Turn ``{name: values}`` or ``[{name: value, ...}, ...]`` into equal-length columns."""
    if isinstance(history, Mapping):
        columns = {str(k): _as_array(v, f"history[{k!r}]") for k, v in history.items()}
        lengths = {k: v.shape for k, v in columns.items()}
        if any(len(s) != 1 for s in lengths.values()) or len(set(lengths.values())) > 1:
            raise ValueError(f"history columns must be 1-D and equally long, got shapes {lengths}")
        return columns
    if isinstance(history, Sequence) and not isinstance(history, str):
        rows = list(history)
        if not all(isinstance(r, Mapping) for r in rows):
            raise TypeError("history as a list must hold dicts like {'step': 0, 'loss': 2.3}")
        names: list[str] = []
        for row in rows:
            names += [str(k) for k in row if str(k) not in names]
        return {
            name: np.array([_scalar(row.get(name, np.nan)) for row in rows], dtype=np.float64)
            for name in names
        }
    raise TypeError(f"history must be a mapping or a list of dicts, got {type(history).__name__}")


def _scalar(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")  # non-numeric entries (e.g. a phase name) are not plotted


def training_curves(history: Any, *, title: str | None = None) -> Figure:
    """Loss and accuracy against training step, in two panels.

    Every column whose name contains ``loss`` goes to the left panel (``loss``, ``val_loss``, ...)
    and every column containing ``acc`` to the right one. Missing entries (NaN, or keys absent
    from some rows, e.g. evaluation every k steps) are skipped, not drawn as zero.

    Args:
        history: Either ``{"step": [...], "loss": [...], "accuracy": [...]}`` or a list of dicts
            such as ``[{"step": 0, "loss": 2.3, "accuracy": 0.1}, ...]``. ``step`` is optional.
        title: Figure title.

    Returns:
        The figure (one panel when only losses or only accuracies are present).

    Raises:
        ValueError: If there is no loss or accuracy column, or columns differ in length.
        TypeError: If ``history`` has another type.
    """
    columns = _history_columns(history)
    length = len(next(iter(columns.values()))) if columns else 0
    steps = columns.pop("step", np.arange(length, dtype=np.float64))
    losses = {k: v for k, v in columns.items() if "loss" in k.lower()}
    accs = {k: v for k, v in columns.items() if "acc" in k.lower()}
    if length == 0 or not (losses or accs):
        raise ValueError(
            f"history needs a non-empty 'loss' or 'accuracy' column, got columns "
            f"{sorted(columns)} with {length} entries"
        )

    panels = [(name, group) for name, group in (("loss", losses), ("accuracy", accs)) if group]
    fig = _new_figure(6 * len(panels), 4.5)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (kind, group) in zip(axes, panels, strict=True):
        finite_all = []
        for name, values in group.items():
            keep = np.isfinite(values) & np.isfinite(steps)
            if not keep.any():
                continue
            finite_all.append(values[keep])
            sparse = keep.sum() <= 30
            ax.plot(
                steps[keep], values[keep], marker="o" if sparse else None, markersize=3, label=name
            )
        ax.set_xlabel("step")
        ax.set_ylabel(kind)
        ax.grid(True, alpha=0.3)
        if finite_all:
            every = np.concatenate(finite_all)
            if kind == "loss" and every.min() > 0 and every.max() / every.min() > 20:
                ax.set_yscale("log")  # losses spanning decades read better on a log axis
            if kind == "accuracy" and every.min() >= 0:
                ax.set_ylim(0, 1.02 if every.max() <= 1 else 102)
        ax.set_title("training loss" if kind == "loss" else "accuracy")
        if len(group) > 1 or kind == "accuracy":
            ax.legend()
    fig.suptitle(title if title is not None else "Training curves")
    return fig


def run_comparison(
    accuracy: Mapping[str, float],
    history: Mapping[str, Sequence[Mapping[str, float]]],
    *,
    labels: Mapping[str, str] | None = None,
    colors: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Figure:
    """Runs of one model trained different ways: final accuracy, held-out accuracy and loss.

    Three panels: a bar per run with its final held-out accuracy, the held-out accuracy at every
    evaluation, and the training loss (log scale), each against the step.

    Args:
        accuracy: Run name -> final held-out accuracy, in drawing order.
        history: Run name -> logged rows such as ``{"step": 10, "loss": 0.4}``; rows with
            ``eval_accuracy`` make the middle panel and rows with ``loss`` the right one.
        labels: Run name -> legend label; the name when missing.
        colors: Run name -> matplotlib colour; the default colour cycle when missing.
        title: Figure title; defaults to ``"Runs compared"``.

    Returns:
        The figure.

    Raises:
        ValueError: If ``accuracy`` is empty or the two mappings name different runs.
    """
    names = list(accuracy)
    if not names or set(names) != set(history):
        raise ValueError(
            f"accuracy and history must name the same runs (at least one), got {names} and "
            f"{list(history)}"
        )
    labels = labels or {}
    color = {n: (colors or {}).get(n, f"C{i}") for i, n in enumerate(names)}
    fig = _new_figure(12, 4.5)
    left, mid, right = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1.4, 1.4]})
    accs = [accuracy[n] for n in names]
    bars = left.bar([labels.get(n, n) for n in names], accs, color=[color[n] for n in names])
    left.bar_label(bars, labels=[f"{a:.3f}" for a in accs], padding=2)
    left.set_ylim(0, 1.1)
    left.set_ylabel("held-out token accuracy")
    left.set_title("final accuracy")
    for name in names:
        rows = history[name]
        ev = [(h["step"], h["eval_accuracy"]) for h in rows if "eval_accuracy" in h]
        tr = [(h["step"], h["loss"]) for h in rows if "loss" in h]
        label = labels.get(name, name)
        if ev:
            mid.plot(*zip(*ev, strict=True), "o-", markersize=3, color=color[name], label=label)
        if tr:
            right.plot(*zip(*tr, strict=True), color=color[name], label=label)
    mid.set_ylim(0, 1.02)
    mid.set_xlabel("step")
    mid.set_ylabel("held-out accuracy")
    mid.set_title("held-out accuracy during training")
    right.set_yscale("log")
    right.set_xlabel("step")
    right.set_ylabel("training loss")
    right.set_title("training loss")
    for ax in (mid, right):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title if title is not None else "Runs compared")
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (PNG at 120 dpi unless the suffix names another format).

    Parent directories are created. A path without a suffix gets ``.png``.

    Args:
        fig: The figure to write.
        path: Destination file.

    Returns:
        The path written.
    """
    out = Path(path)
    if not out.suffix:
        out = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, facecolor="white")
    return out
