"""The lab's report: PNG figures in ``figures/`` and one self-contained ``report.html``.

This module decides what the report shows and computes it: which figures (a :class:`FigureSpec`
each, drawn by :mod:`attnkit.viz`), the best head, held-out examples and the cost of the model.
:mod:`attnkit.lab.page` turns it into HTML. The sections follow the blog: the rescale factor and
softmax, the attention weights of the trained model, the cost of the model, positions (with the
positional-encoding comparison when it was run) and the training curves.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnkit.explorer import ExplorerInput, explorer_page
from attnkit.lab import page
from attnkit.lab.checkpoint import atomic_write
from attnkit.lab.page import PE_LABELS, FigureSpec
from attnkit.lab.tasks import IGNORE
from attnkit.lab.train import (
    LabConfig,
    TrainResult,
    attention_weights,
    eval_set,
    head_alignment,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure as MplFigure

    from attnkit.complexity import CostBreakdown

__all__ = ["FigureSpec", "ReportData", "write_report"]

_SCHEME_COLORS = {"none": "tab:gray", "sinusoidal": "tab:blue", "rope": "tab:orange"}


def __getattr__(name: str) -> object:
    # ``Figure`` was this class's name until it was renamed so as not to shadow matplotlib's.
    if name == "Figure":
        warnings.warn(
            "attnkit.lab.report.Figure is now FigureSpec", DeprecationWarning, stacklevel=2
        )
        return FigureSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class ReportData:
    """What the report shows, beyond the main run.

    Attributes:
        result: The main run (its model draws the attention maps).
        metrics: The run's ``metrics.json`` content (summary numbers).
        length_table: Positions name -> {length: accuracy or None}.
        compare: Positions name -> run, when ``--compare-pe`` was used.
        figures: Filled by :func:`write_report`.
        explorers: Positions name -> (file, bytes) of the explorer pages; filled by
            :func:`write_report`.
    """

    result: TrainResult
    metrics: dict[str, Any]
    length_table: dict[str, dict[int, float | None]] = field(default_factory=dict)
    compare: dict[str, TrainResult] | None = None
    figures: list[FigureSpec] = field(default_factory=list)
    explorers: dict[str, tuple[str, int]] = field(default_factory=dict)


# --------------------------------------------------------------------------- figures


def _example(result: TrainResult, count: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    task = result.config.make_task()
    return eval_set(task, count, result.config.seed + 12345)


def _best_head(result: TrainResult) -> tuple[int, int, torch.Tensor]:
    task = result.config.make_task()
    x, _ = eval_set(task, 200, result.config.seed + 777)
    align = head_alignment(task, x, attention_weights(result.model, x))  # (layers, H)
    flat = int(align.argmax())
    return flat // align.shape[1], flat % align.shape[1], align


def _make_figures(data: ReportData, fig_dir: Path) -> list[FigureSpec]:
    from attnkit import viz
    from attnkit.complexity import crossover_seq_len
    from attnkit.positional import SinusoidalPositionalEncoding

    r = data.result
    cfg = r.config
    task = cfg.make_task()
    x, _ = _example(r)
    w = attention_weights(r.model, x[:1])[0]  # (layers, H, L, L)
    tokens = task.labels(x[0])
    layer, head, align = _best_head(r)
    data.metrics["attention"] = {
        "best_layer": layer,
        "best_head": head,
        "best_alignment": float(align.max()),
        "alignment": align.tolist(),
    }
    pred = r.model(x[:1].to(next(r.model.parameters()).device)).argmax(-1)[0].cpu()

    builders: list[tuple[FigureSpec, Callable[[], Any]]] = [
        (
            FigureSpec(
                "scaling.png",
                "Dot products of random d-dim vectors spread like sqrt(d); "
                "dividing by sqrt(d) keeps them near 1, and softmax stays soft.",
                "scaling",
            ),
            viz.scaling_demo,
        ),
        (
            FigureSpec(
                "softmax.png",
                "softmax([1, 2]) against softmax([10, 20]): the same ratio of "
                "scores, but the larger ones give an almost one-hot row.",
                "scaling",
            ),
            viz.softmax_demo,
        ),
        (
            FigureSpec(
                "attention_grid.png",
                f"Every layer and head of the trained model on one "
                f"held-out input ({' '.join(tokens)}).",
                "attention",
            ),
            lambda: viz.attention_grid(
                w, tokens=tokens, title=f"{cfg.task}: attention of every layer and head"
            ),
        ),
        (
            FigureSpec(
                "attention_head.png",
                f"Layer {layer}, head {head}: the head whose attention "
                f"best lands where the answer is ({float(align.max()):.0%} of its weight). "
                f"Rows are queries (the output positions), columns the keys they read.",
                "attention",
            ),
            lambda: viz.attention_map(
                w[layer, head],
                query_tokens=[f"{i}:{t}" for i, t in enumerate(task.labels(pred))],
                key_tokens=[f"{i}:{t}" for i, t in enumerate(tokens)],
                title=f"{cfg.task}, layer {layer} head {head} "
                f"(rows: predicted output, columns: input)",
            ),
        ),
    ]

    seq_lens = [2**k for k in range(3, 15)]
    cost: dict[str, list[int]] = {
        name: []
        for name in (
            "projections (n·d²)",
            "feed-forward (n·d·F)",
            "projections + feed-forward (all n·d² terms)",
            "scores + weighted sum (n²·d)",
            "softmax (n²)",
        )
    }
    for n in seq_lens:
        rows = {c["name"]: c["flops"] for c in _model_cost(cfg, n).rows()}
        cost["projections (n·d²)"].append(
            sum(rows[k] for k in ("q_proj", "k_proj", "v_proj", "out_proj"))
        )
        cost["feed-forward (n·d·F)"].append(rows["ffn_up"] + rows["ffn_down"])
        cost["projections + feed-forward (all n·d² terms)"].append(
            cost["projections (n·d²)"][-1] + cost["feed-forward (n·d·F)"][-1]
        )
        cost["scores + weighted sum (n²·d)"].append(rows["scores"] + rows["weighted_sum"])
        cost["softmax (n²)"].append(rows["softmax"])
    cross, _ = crossover_seq_len(cfg.dim, cfg.num_heads, ffn_dim=cfg.ffn_dim)
    builders.append(
        (
            FigureSpec(
                "cost_curves.png",
                f"FLOPs of one block of this model (D={cfg.dim}, "
                f"H={cfg.num_heads}, F={cfg.ffn_dim}) against sequence length: the n²·d matmuls "
                f"overtake all n·d² matmuls together at n = {cross}; "
                f"the model trains at n = {cfg.seq_len}.",
                "cost",
            ),
            lambda: viz.complexity_curves(
                seq_lens, cost, crossover=cross, title="FLOPs of one transformer block by component"
            ),
        )
    )

    head_dim = cfg.dim // cfg.num_heads
    builders += [
        (
            FigureSpec(
                "positions_sinusoidal.png",
                f"The sinusoidal table of the model ({cfg.table_len} positions x {cfg.dim} dims).",
                "positions",
            ),
            lambda: viz.sinusoidal_heatmap(SinusoidalPositionalEncoding(cfg.dim, cfg.table_len).pe),
        ),
        (
            FigureSpec(
                "positions_rotary.png",
                f"RoPE rotation speeds for this model's head dim ({head_dim}).",
                "positions",
            ),
            lambda: viz.rotary_frequencies(head_dim),
        ),
        (
            FigureSpec(
                "rotary_relative.png",
                "RoPE scores depend only on the offset between query and "
                "key: the curves for different absolute positions coincide.",
                "positions",
            ),
            lambda: viz.rotary_relative_scores(head_dim),
        ),
    ]
    if data.compare:
        builders += [
            (
                FigureSpec(
                    "compare_pe.png",
                    "Held-out accuracy and training loss of the same encoder "
                    "with each position scheme.",
                    "compare",
                ),
                lambda: _compare_curves(data.compare or {}),
            ),
            (
                FigureSpec(
                    "compare_pe_attention.png",
                    "The best head of each model on the same "
                    "input: without positions the weights cannot depend on where a token is.",
                    "compare",
                ),
                lambda: _compare_attention(data.compare or {}),
            ),
        ]
    builders.append(
        (
            FigureSpec(
                "training_curves.png",
                "Training loss and accuracy (every few "
                "steps) and held-out accuracy (every evaluation).",
                "training",
            ),
            lambda: viz.training_curves(_curve_history(r.history), title=f"Training {cfg.task}"),
        )
    )

    figures = []
    for fig_spec, build in builders:
        fig = build()
        fig_spec.path = viz.save_figure(fig, fig_dir / fig_spec.name)
        figures.append(fig_spec)
    return figures


def _curve_history(history: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    keep = ("step", "loss", "accuracy", "eval_loss", "eval_accuracy")
    return [{k: row[k] for k in keep if k in row} for row in history]


def _compare_curves(compare: Mapping[str, TrainResult]) -> MplFigure:
    from attnkit import viz

    return viz.run_comparison(
        {name: res.eval["accuracy"] for name, res in compare.items()},
        {name: res.history for name, res in compare.items()},
        labels=PE_LABELS,
        colors=_SCHEME_COLORS,
        title="Same encoder, three position schemes",
    )


def _compare_attention(compare: Mapping[str, TrainResult]) -> MplFigure:
    from attnkit import viz

    first = next(iter(compare.values()))
    x, _ = _example(first)
    maps = {}
    for name, res in compare.items():
        layer, head, align = _best_head(res)
        title = (
            f"{PE_LABELS.get(name, name)}: "
            f"layer {layer} head {head} ({float(align.max()):.0%} on target)"
        )
        maps[title] = attention_weights(res.model, x[:1])[0, layer, head]  # (L, L)
    return viz.attention_maps(maps, query_tokens=first.config.make_task().labels(x[0]))


def _examples(result: TrainResult) -> list[page.Example]:
    """Held-out examples with the model's answers (unscored positions blank)."""
    task = result.config.make_task()
    x, y = _example(result)
    device = next(result.model.parameters()).device
    with torch.no_grad():
        pred = result.model(x.to(device)).argmax(-1).cpu()
    examples = []
    for i in range(x.shape[0]):
        scored = y[i] != IGNORE
        shown = torch.where(scored, pred[i], torch.full_like(pred[i], -1))
        want = torch.where(scored, y[i], torch.full_like(y[i], -1))
        examples.append(
            page.Example(
                inputs=" ".join(task.labels(x[i])),
                target=" ".join(task.labels(want)),
                output=" ".join(task.labels(shown)),
                correct=bool((pred[i][scored] == y[i][scored]).all()),
            )
        )
    return examples


EXPLORER_INPUTS = 8
"""Held-out inputs in each explorer page, chosen with the input selector."""


def explorer_inputs(result: TrainResult, x: torch.Tensor, y: torch.Tensor) -> list[ExplorerInput]:
    """One explorer input per held-out sequence: its weights, its accuracy in the label.

    Shape:
        x, y ``(B, L)``: held-out inputs and targets.
    """
    task = result.config.make_task()
    weights = attention_weights(result.model, x)  # (B, layers, H, L, L)
    device = next(result.model.parameters()).device
    with torch.no_grad():
        pred = result.model(x.to(device)).argmax(-1).cpu()  # (B, L)
    inputs = []
    for b in range(x.shape[0]):
        scored = y[b] != IGNORE
        right, total = int(((pred[b] == y[b]) & scored).sum()), int(scored.sum())
        shown = torch.where(scored, pred[b], torch.full_like(pred[b], -1))
        want = torch.where(scored, y[b], torch.full_like(y[b], -1))
        mark = "all right" if right == total else f"{total - right} wrong"
        inputs.append(
            ExplorerInput(
                [f"{i}:{t}" for i, t in enumerate(task.labels(x[b]))],  # positions matter here
                weights[b],
                label=f"input {b}: {right / max(total, 1):.0%} of {total} right ({mark})",
                note=f"target: {' '.join(task.labels(want))}; "
                f"model output: {' '.join(task.labels(shown))}",
            )
        )
    return inputs


def _write_explorers(out: Path, data: ReportData) -> dict[str, tuple[str, int]]:
    """The interactive explorer of the main run (``explorer.html``) and, with ``--compare-pe``,
    of each compared encoder (``explorer-<positions>.html``), all on the same
    :data:`EXPLORER_INPUTS` held-out inputs."""
    runs: dict[str, TrainResult] = {data.result.config.positions: data.result}
    for name, res in (data.compare or {}).items():
        runs.setdefault(name, res)
    x, y = _example(data.result, EXPLORER_INPUTS)
    written: dict[str, tuple[str, int]] = {}
    for index, (name, res) in enumerate(runs.items()):
        cfg = res.config
        task = cfg.make_task()
        file = "explorer.html" if index == 0 else f"explorer-{name}.html"
        layer, _, _ = _best_head(res)
        what = task.description[:1].upper() + task.description[1:]
        text = explorer_page(
            explorer_inputs(res, x, y),
            title=f"attnkit lab: {cfg.task}, {PE_LABELS.get(name, name)} positions",
            description=f"{what}. Held-out inputs the model never saw in training, with its "
            f"accuracy on each; it opens on layer {layer}, which holds the head that learned "
            "the task best.",
            layer=layer,
        )
        path = atomic_write(out / file, functools.partial(_write_text, text=text))
        written[name] = (file, path.stat().st_size)
    return written


def _write_text(path: str, *, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")


def write_report(out_dir: str | Path, data: ReportData) -> Path:
    """Draw the figures into ``out_dir/figures``, write the explorer and ``out_dir/report.html``.

    ``data.metrics`` gains ``"attention"`` (the best head and its alignment), ``"figures"``
    (the PNG paths, relative to ``out_dir``) and ``"explorers"`` (positions name -> explorer
    page, relative to ``out_dir``).

    Returns:
        The path of ``report.html``.
    """
    out = Path(out_dir)
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    data.figures = _make_figures(data, fig_dir)
    data.metrics["figures"] = [f"figures/{f.name}" for f in data.figures]
    data.explorers = _write_explorers(out, data)
    data.metrics["explorers"] = {name: file for name, (file, _) in data.explorers.items()}
    text = _render(data)
    return atomic_write(out / "report.html", functools.partial(_write_text, text=text))


def _model_cost(cfg: LabConfig, seq_len: int, *, batch: int = 1, layers: int = 1) -> CostBreakdown:
    """The cost of ``layers`` blocks of the lab's model on ``batch`` sequences of ``seq_len``."""
    from attnkit.complexity import transformer_cost

    dim, heads, ffn = cfg.dim, cfg.num_heads, cfg.ffn_dim
    return transformer_cost(seq_len, dim, heads, ffn_dim=ffn, num_layers=layers, batch=batch)


def _render(data: ReportData) -> str:
    cfg = data.result.config
    task = cfg.make_task()
    return page.render(
        data.result,
        description=task.description,
        attention=data.metrics.get("attention", {}),
        examples=_examples(data.result),
        cost=_model_cost(cfg, cfg.seq_len, batch=cfg.batch_size, layers=cfg.num_layers),
        vocab_size=task.vocab_size,
        figures=data.figures,
        lengths_table=data.length_table,
        compare=data.compare,
        explorers=data.explorers,
    )
