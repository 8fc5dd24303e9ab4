"""The tour's drawings: one function per claim, from the numbers its check measured.

Each ``draw_*`` takes the :class:`~attnkit.tour.claims.ClaimResult` of its claim and reads
``result.measured`` (the numbers of ``claims.json``) and ``result.drawing`` (the arrays a picture
needs beyond them); nothing here measures. :func:`draw` picks the function by the claim's id.

Needs matplotlib (the ``viz`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from matplotlib.figure import Figure

from attnkit import viz
from attnkit.flex import presets
from attnkit.tour.claims import ClaimResult

__all__ = ["DRAW", "draw"]


def _figure(width: float, height: float, cols: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(width, height), layout="constrained", facecolor="white")
    axes = fig.subplots(1, cols, squeeze=False)[0]
    return fig, list(axes)


def _title(ax: Any, title: str) -> None:
    """Title a panel and give it the tour's small legend."""
    ax.set_title(title)
    ax.legend(fontsize=8)


def _log_log(ax: Any, xs: list[Any], labels: list[str], xlabel: str, ylabel: str) -> None:
    """Log-log axes ticked at the measured ``xs`` alone (no minor ticks between them)."""
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
    ax.set_xticks(xs, labels)
    ax.minorticks_off()


def _table(result: ClaimResult, name: str, x: str) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """``result.measured``, its table ``name`` (a list of rows) and the rows' column ``x`` (the
    horizontal axis of the plots drawn from the table)."""
    m = result.measured
    rows = m[name]
    return m, rows, [r[x] for r in rows]


def draw_scaled_scores(result: ClaimResult) -> Figure:
    """Claim 1: the std of the scores against d, with and without the scale."""
    rows = result.measured["per_dim"]
    fig, (ax,) = _figure(6.4, 4.0)
    ds = [r["d"] for r in rows]
    ax.plot(ds, [r["unscaled_std"] for r in rows], "o-", color="#d62728", label="q·k (unscaled)")
    ax.plot(ds, [math.sqrt(d) for d in ds], ":", color="#d62728", alpha=0.6, label="√d")
    ax.plot(ds, [r["scaled_std"] for r in rows], "o-", color="#1f77b4", label="q·k / √d")
    ax.axhline(1.0, color="#1f77b4", ls=":", alpha=0.6)
    ax.set(xscale="log", yscale="log", xlabel="head dim d", ylabel="std of the scores")
    ax.set_xticks(ds, [str(d) for d in ds])
    ax.set_title("Std of random scores, read from the module's weights")
    ax.legend()
    return fig


def draw_saturation(result: ClaimResult) -> Figure:
    """Claim 2: the mean largest weight of a row against d, with and without the scale."""
    rows = result.measured["per_dim"]
    n = result.drawing["keys"]
    fig, (ax,) = _figure(6.4, 4.0)
    ds = [r["d"] for r in rows]
    ax.plot(
        ds,
        [r["unscaled_max_weight"] for r in rows],
        "o-",
        color="#d62728",
        label="softmax(q·k): no scale",
    )
    ax.plot(
        ds, [r["scaled_max_weight"] for r in rows], "o-", color="#1f77b4", label="softmax(q·k / √d)"
    )
    ax.axhline(1.0, color="gray", ls=":")
    ax.axhline(1 / n, color="gray", ls="--", lw=0.8)
    ax.text(ds[0], 1 / n * 1.15, f"uniform 1/{n}", fontsize=8, color="gray")
    ax.set(xscale="log", ylim=(0, 1.05), xlabel="head dim d", ylabel="mean largest weight of a row")
    ax.set_xticks(ds, [str(d) for d in ds])
    ax.set_title(f"Softmax over {n} keys: one-hot without the scale")
    ax.legend(loc="center right")
    return fig


def draw_cost(result: ClaimResult) -> Figure:
    """Claim 3: counted against predicted FLOPs, and measured time against the FLOPs' shape."""
    rows = result.measured["flops"]
    predicted_n = result.measured["predicted_crossover"]
    median = {int(n): t for n, t in result.measured["median_time_s"].items()}
    flops = result.drawing["predicted_flops"]  # {n: FLOPs} at the timed lengths
    dim, num_heads = result.drawing["dim"], result.drawing["num_heads"]
    tl = sorted(median)
    a, b = tl[-2], tl[-1]
    fig, (ax1, ax2) = _figure(11.0, 4.4, cols=2)
    ns = [r["n"] for r in rows]
    ax1.plot(ns, [r["counted_linear"] for r in rows], "o-", label="n·d² terms: projections")
    ax1.plot(ns, [r["counted_quadratic"] for r in rows], "o-", label="n²·d terms: QKᵀ, weights·V")
    ax1.plot(ns, [r["predicted_linear"] for r in rows], "k:", lw=1, label="predicted (complexity)")
    ax1.plot(ns, [r["predicted_quadratic"] for r in rows], "k:", lw=1)
    ax1.axvline(predicted_n, color="gray", ls="--")
    ax1.text(
        predicted_n * 1.08, 0.04, f"n* = 2d = {predicted_n}", transform=ax1.get_xaxis_transform()
    )
    ax1.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="matmul FLOPs")
    ticks = [n for n in ns if n in (16, 32, 64, 128, 256, 512)]
    ax1.set_xticks(ticks, [str(n) for n in ticks])
    ax1.minorticks_off()
    _title(ax1, f"FLOPs counted by torch, MultiHeadAttention(D={dim}, H={num_heads})")
    ax2.plot(tl, [median[n] * 1e3 for n in tl], "o-", label="measured (median)")
    ax2.plot(
        tl, [flops[n] / flops[b] * median[b] * 1e3 for n in tl], "k:", label="∝ predicted FLOPs"
    )
    ax2.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="forward time (ms)")
    ax2.set_xticks(tl, [str(n) for n in tl])
    ax2.minorticks_off()
    slope_time, slope_flops = result.measured["time_slope"], result.measured["flops_slope"]
    _title(ax2, f"Time: slope {slope_time:.2f} vs FLOPs slope {slope_flops:.2f} ({a}→{b})")
    return fig


def draw_permutation(result: ClaimResult) -> Figure:
    """Claim 4: the permutation error without positions and with each kind of positions."""
    m = result.measured
    tolerance = m["tolerance"]
    fig, (ax,) = _figure(6.4, 3.8)
    labels = [result.drawing["label"], "sinusoidal", "rotary"]
    values = [m["max_error"], m["with_positions"]["sinusoidal"], m["with_positions"]["rope"]]
    ax.bar(labels, [max(v, 1e-10) for v in values], color=["#1f77b4", "#ff7f0e", "#2ca02c"])
    ax.axhline(tolerance, color="gray", ls="--")
    ax.text(2.4, tolerance * 1.5, "tolerance", ha="right", fontsize=8, color="gray")
    ax.set(yscale="log", ylabel="max |f(P x) − P f(x)|", ylim=(1e-10, 10))
    ax.set_title("Permute the tokens: does the output permute the same way?")
    for i, v in enumerate(values):
        ax.text(i, max(v, 1e-10) * 1.6, f"{v:.1e}", ha="center", fontsize=9)
    return fig


def draw_sinusoidal_shift(result: ClaimResult) -> Figure:
    """Claim 5: three channel pairs turning, and the error of one rotation per pair and shift."""
    pe = result.drawing["table"]  # (positions, dim)
    pairs = pe.reshape(pe.shape[0], -1, 2)  # (N, P, 2)
    tolerance = result.measured["tolerance"]
    fig, (ax1, ax2) = _figure(11.0, 4.3, cols=2)
    # three pairs, positions 0..7; drawn at radii 1, 3/4, 1/2 so that they do not overlap
    for pair, radius, colour in ((0, 1.0, "#1f77b4"), (2, 0.75, "#ff7f0e"), (5, 0.5, "#2ca02c")):
        pts = (pairs[:8, pair] * radius).numpy()  # (8, 2)
        ax1.plot(
            pts[:, 0],
            pts[:, 1],
            "o-",
            color=colour,
            ms=4,
            lw=0.8,
            label=f"pair {pair} (dims {2 * pair}, {2 * pair + 1})",
        )
        for p_ in (0, 1, 2):
            ax1.annotate(
                f"p={p_}",
                pts[p_],
                fontsize=7,
                color=colour,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax1.set_aspect("equal")
    ax1.set(
        xlabel="even channel (sin)", ylabel="odd channel (cos)", xlim=(-1.2, 1.2), ylim=(-1.2, 1.2)
    )
    ax1.set_title("Each pair turns by a fixed angle per position")
    ax1.legend(fontsize=8, loc="lower left")
    for k, err in result.drawing["per_pair"].items():
        ax2.plot(range(len(err)), err.clamp_min(1e-12).numpy(), "o-", ms=3, label=f"k = {k}")
    ax2.axhline(tolerance, color="gray", ls="--")
    ax2.set(yscale="log", xlabel="channel pair", ylabel="max over p of |PE(p+k) − R_k PE(p)|")
    _title(ax2, "One rotation per pair maps every PE(p) to PE(p + k)")
    return fig


def draw_frequencies(result: ClaimResult) -> Figure:
    """Claim 6: the table, and the measured wavelength of each channel pair."""
    wavelength = result.measured["wavelengths"]
    fig, (ax1, ax2) = _figure(11.0, 4.2, cols=2)
    ax1.imshow(
        result.drawing["table"].T.numpy(), aspect="auto", cmap="coolwarm", interpolation="nearest"
    )
    ax1.set(xlabel="position p", ylabel="embedding dimension")
    ax1.set_title("Sinusoidal table: low dimensions change fast")
    ax2.plot(range(len(wavelength)), wavelength, "o-", ms=3)
    ax2.set(yscale="log", xlabel="channel pair i", ylabel="wavelength (positions)")
    ax2.set_title("Measured wavelength of each pair")
    return fig


def draw_rope_norm(result: ClaimResult) -> Figure:
    """Claim 7: every vector's norm after the rotation against before."""
    fig, (ax,) = _figure(6.4, 4.0)
    before = result.drawing["before"]
    for name, after in result.drawing["after"].items():
        rel = result.measured[name]["max_relative_norm_change"]
        ax.scatter(
            before.numpy(), after.numpy(), s=3, alpha=0.4, label=f"{name}: max |Δ|/|x| = {rel:.1e}"
        )
    lo, hi = float(before.min()), float(before.max())
    ax.plot([lo, hi], [lo, hi], "k:", lw=1)
    ax.set(xlabel="|x|", ylabel="|rope(x, p)|")
    _title(ax, "RoPE at positions 0..127 and 100000..100127")
    return fig


def draw_rope_relative(result: ClaimResult) -> Figure:
    """Claim 8: the score matrix (constant along diagonals) and the score by offset."""
    scores, by_offset = result.drawing["scores"], result.drawing["by_offset"]
    length = scores.shape[0]
    spread = result.measured["diagonal_spread"]
    fig, (ax1, ax2) = _figure(11.0, 4.3, cols=2)
    image = ax1.imshow(scores.numpy(), cmap="coolwarm", interpolation="nearest")
    fig.colorbar(image, ax=ax1, shrink=0.85, label="score")
    ax1.set(xlabel="key position s", ylabel="query position p")
    ax1.set_title("rope(q, p) · rope(k, s): constant along diagonals")
    ax2.plot(range(-(length - 1), length), by_offset, "-", lw=1.2)
    ax2.set(xlabel="offset s − p", ylabel="score")
    ax2.set_title(f"Score by offset (diagonal spread {spread:.0e})")
    return fig


def draw_causal(result: ClaimResult) -> Figure:
    """Claim 9: a causal map, and how far changing the future moves the past and the future."""
    past_change, future_change = result.drawing["past_change"], result.drawing["future_change"]
    steps = range(len(past_change))
    fig, (ax1, ax2) = _figure(11.0, 4.3, cols=2)
    image = ax1.imshow(result.drawing["map"].numpy(), cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax1, shrink=0.85, label="weight")
    ax1.set(xlabel="key position", ylabel="query position")
    ax1.set_title("Last layer, head 0: nothing above the diagonal")
    ax2.plot(
        steps, [max(v, 1e-18) for v in past_change], "o-", label="largest change at positions ≤ t"
    )
    ax2.plot(steps, future_change, "s-", label="largest change at positions > t")
    ax2.set(yscale="log", xlabel="t: tokens after t replaced", ylabel="max |Δ logits|")
    _title(ax2, "Changing the future")
    return fig


def draw_interpretable(result: ClaimResult) -> Figure:
    """Claim 10: the best head's map on a held-out input."""
    m = result.measured
    tokens = result.drawing["tokens"]
    return viz.attention_map(
        result.drawing["map"],
        query_tokens=tokens,
        key_tokens=tokens,
        title=f"layer {m['best_layer']}, head {m['best_head']} on a held-out input: "
        f"{m['best_share']:.0%} on the answer",
    )


def draw_softcap(result: ClaimResult) -> Figure:
    """Claim 11: each row's log-weight range and the largest weight against the tokens' gain."""
    m, rows, gains = _table(result, "per_gain", "gain")
    cap, bound = m["cap"], m["max_weight_bound"]
    fig, (ax1, ax2) = _figure(11.0, 4.3, cols=2)
    ax1.plot(gains, [r["uncapped_range"] for r in rows], "o-", color="#d62728", label="uncapped")
    ax1.plot(gains, [r["capped_range"] for r in rows], "o-", color="#1f77b4", label=f"c = {cap:g}")
    ax1.axhline(2 * cap, color="#1f77b4", ls=":", label="2c")
    ax1.set(
        xscale="log", yscale="log", xlabel="gain g of the tokens", ylabel="max log-weight range"
    )
    _title(ax1, "A row's log-weights (its scores) span at most 2c")
    ax2.plot(
        gains, [r["uncapped_max_weight"] for r in rows], "o-", color="#d62728", label="uncapped"
    )
    ax2.plot(gains, [r["capped_max_weight"] for r in rows], "o-", color="#1f77b4", label="capped")
    ax2.axhline(bound, color="#1f77b4", ls=":", label=f"bound {bound:.3f}")
    ax2.set(xscale="log", ylim=(0, 1.05), xlabel="gain g of the tokens")
    ax2.set(ylabel="mean largest weight of a row")
    _title(ax2, f"Softmax over {m['keys']} keys: capped rows never go one-hot")
    return fig


def draw_qk_norm(result: ClaimResult) -> Figure:
    """Claim 12: the scores' within-row std against the tokens' gain, with and without qk-norm."""
    m, rows, gains = _table(result, "per_gain", "gain")
    fig, (ax,) = _figure(6.4, 4.0)
    plain = [r["plain_std"] for r in rows]
    ax.plot(gains, plain, "o-", color="#d62728", label=f"no qk-norm (slope {m['plain_slope']:.2f})")
    ax.plot(gains, [plain[0] * (g / gains[0]) ** 2 for g in gains], "k:", lw=1, label="∝ g²")
    ax.plot(gains, [r["normed_std"] for r in rows], "o-", color="#1f77b4", label="RMSNorm on q, k")
    _log_log(ax, gains, [f"{g:g}" for g in gains], "gain g of the tokens", "std of the scores")
    _title(ax, "Scores read from the weights as the activations grow")
    return fig


def draw_alibi_extrapolation(result: ClaimResult) -> Figure:
    """Claim 13: accuracy at the training length and at twice it, with ALiBi and without."""
    m = result.measured
    lengths = list(m["accuracy"])
    fig, (ax,) = _figure(6.4, 4.0)
    xs = range(len(lengths))
    ax.bar([x - 0.2 for x in xs], [m["accuracy"][n] for n in lengths], 0.4, color="#1f77b4",
           label="ALiBi")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [m["accuracy_without_positions"][n] for n in lengths], 0.4,
           color="#d62728", label="no positions")  # fmt: skip
    ax.set_xticks(list(xs), [f"length {n}" + (" (trained)" if i == 0 else "") for i, n in
                             enumerate(lengths)])  # fmt: skip
    ax.set(ylim=(0, 1.05), ylabel="accuracy: the most recent signal token")
    _title(ax, "Trained at one length, evaluated at twice it")
    return fig


def draw_prefix_lm(result: ClaimResult) -> Figure:
    """Claim 14: the prefix-LM mask and each position's output change for two changed tokens."""
    m = result.measured
    fig, (ax1, ax2) = _figure(11.0, 4.3, cols=2)
    viz.mask_picture(presets.prefix_lm(m["prefix"]), m["length"], ax=ax1,
                     title=f"prefix_lm({m['prefix']})")  # fmt: skip
    positions = range(m["length"])
    floor = 1e-17  # zero changes drawn at the bottom of the log axis
    for key, at, colour in (
        ("change_in_prefix", m["changed_in_prefix"], "#1f77b4"),
        ("change_after_prefix", m["changed_after_prefix"], "#d62728"),
    ):
        values = [max(v, floor) for v in result.drawing[key]]
        ax2.plot(positions, values, "o-", color=colour, label=f"token {at} changed")
        ax2.axvline(at, color=colour, ls=":", lw=1)
    ax2.axvspan(-0.5, m["prefix"] - 0.5, color="#cccccc", alpha=0.4, label="prefix")
    ax2.set(yscale="log", xlabel="position", ylabel="largest change of the output")
    _title(ax2, "Which outputs a changed token reaches")
    return fig


def draw_window_cost(result: ClaimResult) -> Figure:
    """Claim 15: computed blocks against the length, window and causal, on log-log axes."""
    m, rows, ns = _table(result, "per_length", "n")
    fig, (ax,) = _figure(6.4, 4.0)
    ax.plot(ns, [r["causal_blocks"] for r in rows], "o-", color="#d62728",
            label=f"causal (slope {m['causal_slope']:.2f})")  # fmt: skip
    ax.plot(ns, [r["window_blocks"] for r in rows], "o-", color="#1f77b4",
            label=f"window {m['window']} (slope {m['window_slope']:.2f})")  # fmt: skip
    _log_log(ax, ns, [str(n) for n in ns], "sequence length N",
             f"computed blocks of {m['block_size']}²")  # fmt: skip
    _title(ax, "Blocks a block mask computes")
    return fig


DRAW: dict[int, Callable[[ClaimResult], Figure]] = {
    1: draw_scaled_scores,
    2: draw_saturation,
    3: draw_cost,
    4: draw_permutation,
    5: draw_sinusoidal_shift,
    6: draw_frequencies,
    7: draw_rope_norm,
    8: draw_rope_relative,
    9: draw_causal,
    10: draw_interpretable,
    11: draw_softcap,
    12: draw_qk_norm,
    13: draw_alibi_extrapolation,
    14: draw_prefix_lm,
    15: draw_window_cost,
}
"""Claim id -> the function that draws it."""


def draw(result: ClaimResult) -> Figure:
    """The figure of one claim's result.

    Raises:
        ValueError: If the claim's id has no drawing.
    """
    if result.id not in DRAW:
        raise ValueError(f"no drawing for claim {result.id}; known: {sorted(DRAW)}")
    return DRAW[result.id](result)
