"""Tests for attnkit.viz and the ``attnkit plot`` command (Agg backend, no display)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
np = pytest.importorskip("numpy")

from matplotlib.image import imread  # noqa: E402

from attnkit import viz  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def render(fig, path: Path) -> np.ndarray:
    """Save ``fig`` as PNG, check the file, and return its pixels."""
    written = viz.save_figure(fig, path)
    data = written.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    return imread(written)


def sinusoidal_table(positions: int, dim: int) -> torch.Tensor:
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * 10_000.0 ** (
        -torch.arange(0, dim, 2, dtype=torch.float64) / dim
    )
    pe = torch.zeros(positions, dim, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = angles.sin(), angles.cos()
    return pe


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def weights(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).softmax(-1)


# ----------------------------------------------------------------------------- every plot

HISTORY = [
    {"step": 0, "loss": 2.0, "eval_accuracy": 0.1},
    {"step": 5, "loss": 1.0},
    {"step": 10, "loss": 0.25, "eval_accuracy": 0.8},
]


BUILDERS = {
    "attention_map": lambda g: viz.attention_map(weights(g, 5, 6), title="one head"),
    "attention_map_tokens": lambda g: viz.attention_map(weights(g, 4, 4), query_tokens="abcd"),
    "attention_map_big": lambda g: viz.attention_map(weights(g, 70, 90)),
    "attention_grid": lambda g: viz.attention_grid(weights(g, 2, 3, 4, 4), tokens="wxyz"),
    "sinusoidal_heatmap": lambda g: viz.sinusoidal_heatmap(sinusoidal_table(50, 32)),
    "rotary_frequencies": lambda g: viz.rotary_frequencies(16),
    "rotary_relative_scores": lambda g: viz.rotary_relative_scores(16, max_offset=8),
    "rotary_table": lambda g: viz.rotary_table(torch.rand(20, 8), torch.rand(20, 8)),
    "scaling_demo": lambda g: viz.scaling_demo(dims=(4, 64), n=32),
    "softmax_demo": lambda g: viz.softmax_demo(),
    "complexity_curves": lambda g: viz.complexity_curves(
        [16, 64, 256], {"linear": [1, 4, 16], "quadratic": [0.1, 1.6, 25.6]}, crossover=100
    ),
    "training_curves": lambda g: viz.training_curves({"loss": [2.0, 1.0, 0.5], "acc": [0, 0.5, 1]}),
    "attention_maps": lambda g: viz.attention_maps({"a": weights(g, 3, 3), "b": weights(g, 3, 3)}),
    "run_comparison": lambda g: viz.run_comparison(
        {"x": 0.5, "y": 0.9}, {"x": HISTORY, "y": HISTORY}, title="two runs"
    ),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_plot_writes_a_png(name: str, gen: torch.Generator, tmp_path: Path) -> None:
    fig = BUILDERS[name](gen)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert fig.axes and all(ax.get_title() or fig.get_suptitle() for ax in fig.axes[:1])
    pixels = render(fig, tmp_path / "nested" / f"{name}.png")
    assert pixels.std() > 0.01  # not a blank canvas


def test_save_figure_adds_suffix_and_parents(tmp_path: Path) -> None:
    path = viz.save_figure(viz.softmax_demo(), tmp_path / "a" / "b" / "softmax")
    assert path == tmp_path / "a" / "b" / "softmax.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.slow
def test_import_attnkit_does_not_import_matplotlib() -> None:
    code = "import sys, attnkit; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ----------------------------------------------------------------------------- content


def test_picture_depends_on_weights(gen: torch.Generator, tmp_path: Path) -> None:
    a, b = weights(gen, 6, 6), weights(gen, 6, 6)
    img_a = render(viz.attention_map(a), tmp_path / "a.png")
    img_a2 = render(viz.attention_map(a.clone()), tmp_path / "a2.png")
    img_b = render(viz.attention_map(b), tmp_path / "b.png")
    assert np.array_equal(img_a, img_a2)  # deterministic ...
    assert not np.array_equal(img_a, img_b)  # ... and driven by the input


def test_grid_depends_on_weights_and_tokens(gen: torch.Generator, tmp_path: Path) -> None:
    w = weights(gen, 1, 2, 3, 3)
    base = render(viz.attention_grid(w), tmp_path / "base.png")
    other = render(viz.attention_grid(w.flip(-1)), tmp_path / "other.png")
    labelled = render(viz.attention_grid(w, tokens=["x", "y", "z"]), tmp_path / "tok.png")
    assert not np.array_equal(base, other)
    assert not np.array_equal(base, labelled)


def test_attention_map_shows_the_numbers_and_labels(gen: torch.Generator) -> None:
    w = weights(gen, 2, 3)
    fig = viz.attention_map(w, query_tokens=["q0", "q1"], key_tokens=["k0", "k1", "k2"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["k0", "k1", "k2"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["q0", "q1"]
    cells = sorted(t.get_text() for t in ax.texts)
    assert cells == sorted(f"{v:.2f}" for v in w.flatten().tolist())


def test_grid_labels_layers_and_heads(gen: torch.Generator) -> None:
    fig = viz.attention_grid(weights(gen, 2, 3, 4, 5))
    panels = [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]
    assert len(panels) == 6
    assert [panels[j].get_title() for j in range(3)] == ["head 0", "head 1", "head 2"]
    assert panels[0].get_ylabel().startswith("layer 0") and panels[3].get_ylabel().startswith(
        "layer 1"
    )


def test_rotary_curves_coincide_for_every_absolute_position() -> None:
    fig = viz.rotary_relative_scores(32, max_offset=12, positions=(0, 12, 1000), seed=3)
    curves = [line.get_ydata() for line in fig.axes[0].lines[:3]]
    offsets = fig.axes[0].lines[0].get_xdata()
    assert list(offsets) == list(range(-12, 13))
    both = ~np.isnan(curves[0]) & ~np.isnan(curves[2])
    assert both.sum() == 13  # p = 0 has no keys before it
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[2]))
    torch.testing.assert_close(torch.tensor(curves[0][both]), torch.tensor(curves[2][both]))
    # the scores do vary with the offset: a flat line would pass the checks above trivially
    assert np.nanstd(curves[2]) > 0.5


def test_rotary_frequencies_follow_the_formula() -> None:
    fig = viz.rotary_frequencies(8, base=100.0)
    speeds = fig.axes[0].lines[0].get_ydata()
    expected = [100.0 ** (-2 * i / 8) for i in range(4)]
    torch.testing.assert_close(torch.tensor(speeds), torch.tensor(expected, dtype=torch.float64))


def test_scaling_demo_shows_sqrt_d_growth() -> None:
    dims = (4, 256)
    fig = viz.scaling_demo(dims=dims, n=64, seed=1)
    raw, scaled = fig.axes[0].lines[0].get_ydata(), fig.axes[0].lines[1].get_ydata()
    for d, r, s in zip(dims, raw, scaled, strict=True):
        assert abs(s - 1) < 0.15  # the blog's ~1.04
        assert r == pytest.approx(s * math.sqrt(d))
    peak_raw, peak_scaled = fig.axes[1].lines[0].get_ydata(), fig.axes[1].lines[1].get_ydata()
    assert peak_raw[-1] > 0.8 and peak_scaled[-1] < 0.3


def test_softmax_demo_bars_match_softmax() -> None:
    fig = viz.softmax_demo()
    heights = [p.get_height() for p in fig.axes[0].patches]
    expected = (
        torch.tensor([1.0, 2.0]).softmax(-1).tolist()
        + torch.tensor([10.0, 20.0]).softmax(-1).tolist()
    )
    assert heights == pytest.approx(expected, rel=1e-6)


def test_complexity_curves_lines_and_crossover() -> None:
    fig = viz.complexity_curves(
        [8, 16], {"a": [1.0, 2.0], "b": [0.0, 4.0]}, crossover=12, ylabel="bytes"
    )
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_ylabel() == "bytes"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    assert any("12" in t.get_text() for t in ax.texts)
    assert np.isnan(ax.lines[1].get_ydata()[0])  # zero cost cannot sit on a log axis


def test_training_curves_accepts_rows_and_columns(tmp_path: Path) -> None:
    rows = [{"step": 10 * i, "loss": 1.0 / (i + 1)} for i in range(6)]
    for i in (0, 5):
        rows[i]["val_accuracy"] = i / 5
    fig_rows = viz.training_curves(rows)
    loss_ax, acc_ax = fig_rows.axes
    assert list(loss_ax.lines[0].get_xdata()) == [0, 10, 20, 30, 40, 50]
    assert list(acc_ax.lines[0].get_xdata()) == [0, 50]  # missing evals are skipped
    assert list(acc_ax.lines[0].get_ydata()) == [0.0, 1.0]

    columns = {"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows]}
    fig_cols = viz.training_curves(columns)
    assert len(fig_cols.axes) == 1  # no accuracy column, one panel
    assert list(fig_cols.axes[0].lines[0].get_ydata()) == [r["loss"] for r in rows]


def test_attention_maps_draws_each_map_with_its_title(gen: torch.Generator) -> None:
    maps = {"first": weights(gen, 3, 4), "second": weights(gen, 3, 4)}
    fig = viz.attention_maps(maps, query_tokens="abc", key_tokens="wxyz", title="both")
    panels = [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]
    assert [ax.get_title() for ax in panels] == ["first", "second"]
    for ax, w in zip(panels, maps.values(), strict=True):
        np.testing.assert_array_equal(ax.images[0].get_array(), w.double().numpy())
        assert [t.get_text() for t in ax.get_xticklabels()] == list("wxyz")
    assert fig.get_suptitle() == "both"


def test_run_comparison_plots_the_runs() -> None:
    other = [{"step": 0, "loss": 3.0}, {"step": 10, "loss": 2.0, "eval_accuracy": 0.3}]
    fig = viz.run_comparison(
        {"rope": 0.75, "none": 0.25},
        {"rope": HISTORY, "none": other},
        labels={"rope": "rotary"},
        colors={"rope": "tab:orange"},
    )
    bars, evals, losses = fig.axes
    assert [p.get_height() for p in bars.patches] == [0.75, 0.25]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["rotary", "none"]
    assert [t.get_text() for t in bars.texts] == ["0.750", "0.250"]
    assert list(evals.lines[0].get_xdata()) == [0, 10]
    assert list(evals.lines[0].get_ydata()) == [0.1, 0.8]
    assert list(evals.lines[1].get_ydata()) == [0.3]
    assert list(losses.lines[0].get_ydata()) == [2.0, 1.0, 0.25]
    assert list(losses.lines[1].get_xdata()) == [0, 10]
    assert [t.get_text() for t in losses.get_legend().get_texts()] == ["rotary", "none"]
    assert matplotlib.colors.same_color(losses.lines[0].get_color(), "tab:orange")
    assert losses.get_yscale() == "log"
    assert fig.get_suptitle() == "Runs compared"


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: viz.attention_map(torch.rand(2, 3, 4)), r"\(L, S\), got \(2, 3, 4\)"),
        (lambda: viz.attention_map(torch.rand(2, 3), query_tokens="abc"), "query_tokens has 3"),
        (lambda: viz.attention_map(torch.rand(2, 3), key_tokens="ab"), "key_tokens has 2"),
        (lambda: viz.attention_grid(torch.rand(2, 3, 3)), r"\(layers, heads, L, S\), got"),
        (lambda: viz.attention_grid(torch.rand(1, 1, 2, 3), tokens="ab"), "L must equal S"),
        (lambda: viz.attention_grid(torch.rand(0, 1, 2, 2)), "empty"),
        (lambda: viz.sinusoidal_heatmap(torch.rand(10)), r"\(positions, dim\), got \(10,\)"),
        (lambda: viz.rotary_table(torch.rand(4, 2), torch.rand(4, 3)), r"\(4, 2\) and \(4, 3\)"),
        (lambda: viz.rotary_frequencies(7), "even number, got 7"),
        (lambda: viz.rotary_relative_scores(8, positions=(-1,)), "positions"),
        (lambda: viz.scaling_demo(dims=()), "dims"),
        (lambda: viz.complexity_curves([1, 2], {"a": [1, 2, 3]}), r"series\['a'\] has shape"),
        (lambda: viz.complexity_curves([1, 2], {"a": [1, -2]}), ">= 0"),
        (lambda: viz.complexity_curves([1, 2], {}), "empty"),
        (lambda: viz.training_curves({"step": [1, 2]}), "'loss' or 'accuracy'"),
        (lambda: viz.training_curves({"loss": [1, 2], "acc": [1]}), "equally long"),
        (lambda: viz.attention_maps({}), "weights is empty"),
        (lambda: viz.attention_maps({"a": torch.rand(2)}), r"\(L, S\), got \(2,\)"),
        (lambda: viz.run_comparison({}, {}), "same runs"),
        (lambda: viz.run_comparison({"a": 1.0}, {"b": []}), r"\['a'\] and \['b'\]"),
    ],
)
def test_bad_input_raises_value_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_training_curves_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="history"):
        viz.training_curves(3.0)


# ----------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_plot_all_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.cli import main

    out = tmp_path / "pictures"
    assert main(["plot", "all", "--out", str(out), "--max-seq-len", "40", "--dim", "32"]) == 0
    printed = capsys.readouterr().out.split()
    expected = {
        "scaling.png",
        "softmax.png",
        "sinusoidal.png",
        "rotary_frequencies.png",
        "rotary_table.png",
        "rotary_relative.png",
        "bias_alibi.png",
        *(f"mask_{n}.png" for n in ("causal", "sliding_window", "prefix_lm", "dilated")),
        *(f"mask_{n}.png" for n in ("document", "padding")),
    }
    assert {Path(p).name for p in printed} == expected
    for name in expected:
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE)


def test_plot_command_options_change_the_picture(tmp_path: Path) -> None:
    from attnkit.cli import main

    for dim in (16, 64):
        assert (
            main(["plot", "sinusoidal", "--out", str(tmp_path / str(dim)), "--dim", str(dim)]) == 0
        )
    assert not np.array_equal(
        imread(tmp_path / "16" / "sinusoidal.png"), imread(tmp_path / "64" / "sinusoidal.png")
    )


def test_plot_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "everything", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["plot", "rotary", "--out", str(tmp_path), "--head-dim", "7"]) == 2
    assert "--head-dim must be even" in capsys.readouterr().err


def test_attention_map_draws_into_a_given_axes(gen: torch.Generator) -> None:
    fig = matplotlib.figure.Figure()
    left, right = fig.subplots(1, 2)
    assert viz.attention_map(weights(gen, 3, 3), ax=right) is fig
    assert right.images and not left.images
