"""Curves: predicted costs over sequence length, training histories, runs compared."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from attnkit.viz._common import (
    as_array,
    new_figure,
)

__all__ = ["complexity_curves", "run_comparison", "training_curves"]


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
    x = as_array(seq_lens, "seq_lens")
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ValueError(f"seq_lens must be a non-empty 1-D list of positive lengths, got {x}")
    if not series:
        raise ValueError("series is empty: give at least one component to plot")
    fig = new_figure(9, 5.5)
    ax = fig.add_subplot()
    markers = "os^vD<>p*h"
    for n, (name, values) in enumerate(series.items()):
        y = as_array(values, f"series[{name!r}]")
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
        columns = {str(k): as_array(v, f"history[{k!r}]") for k, v in history.items()}
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
    fig = new_figure(6 * len(panels), 4.5)
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
    fig = new_figure(12, 4.5)
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
