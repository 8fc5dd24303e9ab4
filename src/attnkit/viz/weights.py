"""Attention weights as heatmaps: one head, a layers x heads grid, maps side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnkit.viz._common import (
    ATTN_CMAP,
    MAX_ANNOTATED,
    annotate_cells,
    as_array,
    check_tokens,
    new_figure,
    set_token_ticks,
)

__all__ = ["attention_grid", "attention_map", "attention_maps"]


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
    w = as_array(weights, "weights")
    if w.ndim != 2:
        raise ValueError(f"attention_map expects weights of shape (L, S), got {tuple(w.shape)}")
    L, S = w.shape
    if key_tokens is None and query_tokens is not None and L == S:
        key_tokens = query_tokens
    q_labels = check_tokens(query_tokens, L, "query_tokens")
    k_labels = check_tokens(key_tokens, S, "key_tokens")

    if ax is None:
        cell = min(0.55, 7.0 / max(L, S, 1))  # inches per token, so big maps still fit
        fig = new_figure(2.6 + cell * S, 1.6 + cell * L)
        ax = fig.add_subplot()
    else:
        # The caller's axes: its figure (a SubFigure behaves the same here) gets the colorbar.
        fig = cast(Figure, ax.get_figure())
    vmax = max(float(np.nanmax(w)), 1e-12) if w.size else 1.0
    image = ax.imshow(
        w, cmap=ATTN_CMAP, vmin=0.0, vmax=vmax, aspect="equal", interpolation="nearest"
    )
    set_token_ticks(ax, "x", k_labels, S)
    set_token_ticks(ax, "y", q_labels, L)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title if title is not None else "Attention weights")
    if max(L, S) <= MAX_ANNOTATED:
        annotate_cells(ax, w, vmax)
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
    w = as_array(weights, "weights")
    if w.ndim != 4:
        raise ValueError(
            f"attention_grid expects weights of shape (layers, heads, L, S), got {tuple(w.shape)}"
        )
    n_layers, n_heads, L, S = w.shape
    if min(w.shape) == 0:
        raise ValueError(f"attention_grid got empty weights of shape {tuple(w.shape)}")
    if tokens is not None and L != S:
        raise ValueError(f"tokens label both axes, so L must equal S; got weights {tuple(w.shape)}")
    labels = check_tokens(tokens, L, "tokens")

    cell = 2.0 if max(L, S) <= 12 else 2.8
    fig = new_figure(cell * n_heads + 1.4, cell * n_layers + 0.8)
    axes = fig.subplots(n_layers, n_heads, squeeze=False, sharex=True, sharey=True)
    vmax = max(float(np.nanmax(w)), 1e-12)
    image = None
    for i in range(n_layers):
        for j in range(n_heads):
            ax = axes[i, j]
            image = ax.imshow(
                w[i, j],
                cmap=ATTN_CMAP,
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
    set_token_ticks(axes[-1, 0], "x", labels, S, max_labels=12)
    set_token_ticks(axes[-1, 0], "y", labels, L, max_labels=12)
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
    fig = new_figure(5.2 * len(weights), 5.0)
    axes = fig.subplots(1, len(weights), squeeze=False)[0]
    for ax, (name, w) in zip(axes, weights.items(), strict=True):
        attention_map(w, query_tokens=query_tokens, key_tokens=key_tokens, title=name, ax=ax)
    if title is not None:
        fig.suptitle(title)
    return fig
