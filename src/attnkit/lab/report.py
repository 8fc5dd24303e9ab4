"""The lab's report: PNG figures in ``figures/`` and one self-contained ``report.html``.

The HTML embeds every figure as a base64 PNG (so the file can be mailed or opened anywhere) and
names the PNG beside it in ``data-file``. Its sections follow the blog: the rescale factor and
softmax, the attention weights of the trained model, the cost of the model, positions (with the
positional-encoding comparison when it was run) and the training curves.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnkit.lab.checkpoint import atomic_write
from attnkit.lab.tasks import IGNORE
from attnkit.lab.train import (
    TrainResult,
    attention_weights,
    eval_set,
    head_alignment,
)

__all__ = ["Figure", "ReportData", "write_report"]

TASK_NOTES = {
    "reverse": "For <code>reverse</code>, output <i>i</i> needs input <i>n-1-i</i>: a head that "
    "has learned the task draws the anti-diagonal.",
    "copy": "For <code>copy</code>, the blank at position <i>i</i> needs the symbol at "
    "<i>i - n/2</i>: a head that has learned the task draws a diagonal shifted by n/2.",
    "sort": "For <code>sort</code>, output <i>i</i> needs the <i>i</i>-th smallest symbol: "
    "a head that has learned the task looks, from each row, at the inputs holding that symbol.",
    "recall": "For <code>recall</code>, only the last position is scored: it must find the "
    "earlier copy of the query key and read the value stored after it.",
}
PE_LABELS = {"none": "no positions", "sinusoidal": "sinusoidal", "rope": "rotary (RoPE)"}


@dataclass
class Figure:
    """A figure of the report: file name (under ``figures/``), caption and section."""

    name: str
    caption: str
    section: str
    path: Path | None = None


@dataclass
class ReportData:
    """What the report shows, beyond the main run.

    Attributes:
        result: The main run (its model draws the attention maps).
        metrics: The run's ``metrics.json`` content (summary numbers).
        length_table: Positions name -> {length: accuracy or None}.
        compare: Positions name -> run, when ``--compare-pe`` was used.
        figures: Filled by :func:`write_report`.
    """

    result: TrainResult
    metrics: dict[str, Any]
    length_table: dict[str, dict[int, float | None]] = field(default_factory=dict)
    compare: dict[str, TrainResult] | None = None
    figures: list[Figure] = field(default_factory=list)


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


def _make_figures(data: ReportData, fig_dir: Path) -> list[Figure]:
    from attnkit import viz
    from attnkit.complexity import crossover_seq_len, transformer_cost
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

    builders: list[tuple[Figure, Callable[[], Any]]] = [
        (
            Figure(
                "scaling.png",
                "Dot products of random d-dim vectors spread like sqrt(d); "
                "dividing by sqrt(d) keeps them near 1, and softmax stays soft.",
                "scaling",
            ),
            viz.scaling_demo,
        ),
        (
            Figure(
                "softmax.png",
                "softmax([1, 2]) against softmax([10, 20]): the same ratio of "
                "scores, but the larger ones give an almost one-hot row.",
                "scaling",
            ),
            viz.softmax_demo,
        ),
        (
            Figure(
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
            Figure(
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
        rows = {
            c["name"]: c["flops"]
            for c in transformer_cost(n, cfg.dim, cfg.num_heads, ffn_dim=cfg.ffn_dim).rows()
        }
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
            Figure(
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
            Figure(
                "positions_sinusoidal.png",
                f"The sinusoidal table of the model ({cfg.table_len} positions x {cfg.dim} dims).",
                "positions",
            ),
            lambda: viz.sinusoidal_heatmap(SinusoidalPositionalEncoding(cfg.dim, cfg.table_len).pe),
        ),
        (
            Figure(
                "positions_rotary.png",
                f"RoPE rotation speeds for this model's head dim ({head_dim}).",
                "positions",
            ),
            lambda: viz.rotary_frequencies(head_dim),
        ),
        (
            Figure(
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
                Figure(
                    "compare_pe.png",
                    "Held-out accuracy and training loss of the same encoder "
                    "with each position scheme.",
                    "compare",
                ),
                lambda: _compare_curves(data.compare or {}),
            ),
            (
                Figure(
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
            Figure(
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


def _compare_curves(compare: Mapping[str, TrainResult]) -> Any:
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(12, 4.5), layout="constrained", facecolor="white")
    left, mid, right = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1.4, 1.4]})
    names = list(compare)
    accs = [compare[n].eval["accuracy"] for n in names]
    colors = {"none": "tab:gray", "sinusoidal": "tab:blue", "rope": "tab:orange"}
    bars = left.bar(
        [PE_LABELS.get(n, n) for n in names],
        accs,
        color=[colors.get(n, "tab:green") for n in names],
    )
    left.bar_label(bars, labels=[f"{a:.3f}" for a in accs], padding=2)
    left.set_ylim(0, 1.1)
    left.set_ylabel("held-out token accuracy")
    left.set_title("final accuracy")
    for name in names:
        hist = compare[name].history
        ev = [(h["step"], h["eval_accuracy"]) for h in hist if "eval_accuracy" in h]
        tr = [(h["step"], h["loss"]) for h in hist if "loss" in h]
        color = colors.get(name, "tab:green")
        if ev:
            mid.plot(
                *zip(*ev, strict=True),
                "o-",
                markersize=3,
                color=color,
                label=PE_LABELS.get(name, name),
            )
        if tr:
            right.plot(*zip(*tr, strict=True), color=color, label=PE_LABELS.get(name, name))
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
    fig.suptitle("Same encoder, three position schemes")
    return fig


def _compare_attention(compare: Mapping[str, TrainResult]) -> Any:
    from matplotlib.figure import Figure as MplFigure

    from attnkit import viz

    names = list(compare)
    first = compare[names[0]]
    task = first.config.make_task()
    x, _ = _example(first)
    tokens = task.labels(x[0])
    fig = MplFigure(figsize=(5.2 * len(names), 5.0), layout="constrained", facecolor="white")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        layer, head, align = _best_head(compare[name])
        w = attention_weights(compare[name].model, x[:1])[0, layer, head]
        viz.attention_map(
            w,
            query_tokens=tokens,
            title=f"{PE_LABELS.get(name, name)}: "
            f"layer {layer} head {head} ({float(align.max()):.0%} on target)",
            ax=ax,
        )
    return fig


# --------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;
margin:2em auto;padding:0 1.2em;color:#1f2328;line-height:1.5}
h1{margin-bottom:.1em}h2{border-bottom:1px solid #d0d7de;padding-bottom:.25em;margin-top:2em}
.sub{color:#59636e;margin-top:0}
.cards{display:flex;flex-wrap:wrap;gap:.8em;margin:1.2em 0}
.card{border:1px solid #d0d7de;border-radius:8px;padding:.6em 1em;min-width:9em}
.card b{display:block;font-size:1.5em}.card span{color:#59636e;font-size:.85em}
.ok{color:#1a7f37}.bad{color:#cf222e}
figure{margin:1.2em 0}figure img{max-width:100%;border:1px solid #eaeef2;border-radius:6px}
figcaption{color:#59636e;font-size:.9em}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:right}
th{background:#f6f8fa}td.l,th.l{text-align:left}
code,pre{background:#f6f8fa;border-radius:4px;padding:.1em .3em;font-size:.9em}
pre{padding:.8em;overflow-x:auto}
"""


def _img(fig: Figure) -> str:
    assert fig.path is not None
    data = base64.b64encode(fig.path.read_bytes()).decode("ascii")
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(fig.caption)}" '
        f'data-file="figures/{html.escape(fig.name)}"><figcaption>'
        f'{html.escape(fig.caption)} <a href="figures/{html.escape(fig.name)}">'
        f"{html.escape(fig.name)}</a></figcaption></figure>"
    )


def _figs(figures: Sequence[Figure], section: str) -> str:
    return "\n".join(_img(f) for f in figures if f.section == section)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{v}</{tag}>"

    head = "".join(cell("th", i, html.escape(str(h))) for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _acc(v: float | None) -> str:
    if v is None:
        return "–"
    cls = "ok" if v >= 0.99 else ("bad" if v < 0.5 else "")
    return f'<span class="{cls}">{v:.3f}</span>'


def _examples_html(result: TrainResult) -> str:
    task = result.config.make_task()
    x, y = _example(result)
    device = next(result.model.parameters()).device
    with torch.no_grad():
        pred = result.model(x.to(device)).argmax(-1).cpu()
    rows = []
    for i in range(x.shape[0]):
        scored = y[i] != IGNORE
        shown = torch.where(scored, pred[i], torch.full_like(pred[i], -1))
        want = torch.where(scored, y[i], torch.full_like(y[i], -1))
        ok = bool((pred[i][scored] == y[i][scored]).all())
        rows.append(
            [
                f"<code>{html.escape(' '.join(task.labels(x[i])))}</code>",
                f"<code>{html.escape(' '.join(task.labels(want)))}</code>",
                f"<code>{html.escape(' '.join(task.labels(shown)))}</code>",
                '<span class="ok">yes</span>' if ok else '<span class="bad">no</span>',
            ]
        )
    return _table(["input", "target (· = not scored)", "model output", "all right"], rows, left=3)


def _cost_html(result: TrainResult) -> str:
    from attnkit.complexity import transformer_cost

    cfg = result.config
    cost = transformer_cost(
        cfg.seq_len,
        cfg.dim,
        cfg.num_heads,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        batch=cfg.batch_size,
    )
    rows = [
        [
            html.escape(c["name"]),
            html.escape(c["description"]),
            f"<code>{html.escape(c['flops_formula'])}</code>",
            f"{c['flops']:,}",
            f"{c['flops_share']:.1%}",
            f"{c['params']:,}",
            f"<code>{html.escape(c['params_formula'])}</code>",
        ]
        for c in cost.rows()
    ]
    vocab = cfg.make_task().vocab_size
    embed = vocab * cfg.dim
    head = cfg.dim * vocab + vocab
    counted = result.num_params
    symbols = ", ".join(f"{k}={v}" for k, v in cost.symbols.items() if v is not None)
    mem = cost.to_dict()["memory"]
    return (
        f"<p>Per block, for one training batch ({symbols}); the model has "
        f"{cfg.num_layers} blocks. Formulas and numbers come from "
        f"<code>attnkit.complexity.transformer_cost</code>.</p>"
        + _table(
            [
                "component",
                "computes",
                "FLOPs formula",
                "FLOPs",
                "share",
                "params",
                "params formula",
            ],
            rows,
            left=3,
        )
        + f"<p>Forward FLOPs of the whole batch: <b>{cost.flops:,}</b> ({cfg.num_layers} "
        f"blocks; the dominant term at n={cfg.seq_len} is <b>{cost.dominant_term}</b>, and the "
        f"n² terms overtake at n = {cost.crossover_seq_len}). Parameters: blocks "
        f"{cost.params:,} (formula) + embedding {embed:,} + head {head:,} = "
        f"{cost.params + embed + head:,}; counted on the model: <b>{counted:,}</b>. "
        f"Attention matrices kept for backward on the textbook path: "
        f"{mem['textbook_saved_attn_bytes']:,} bytes, against "
        f"{mem['fused_saved_attn_bytes']:,} for a fused kernel.</p>"
    )


def _length_html(table: Mapping[str, Mapping[int, float | None]], train_len: int) -> str:
    if not table:
        return ""
    lengths = sorted({n for row in table.values() for n in row})
    header = ["positions"] + [f"n={n}" + (" (train)" if n == train_len else "") for n in lengths]
    rows = [
        [html.escape(PE_LABELS.get(name, name))] + [_acc(row.get(n)) for n in lengths]
        for name, row in table.items()
    ]
    return (
        f"<h3>Length generalization</h3><p>Trained on n = {train_len}, tested on held-out "
        f"sequences of other lengths (token accuracy; – where the length does not fit). "
        f"The position tables cover longer sequences, but a model trained at one length has "
        f"only learned that length's pattern (for reversal, i → n-1-i moves with n), so "
        f"accuracy usually falls to chance: this is a measurement, not a promise.</p>"
        + _table(header, rows)
    )


def _compare_html(data: ReportData) -> str:
    if not data.compare:
        return ""
    rows = []
    for name, res in data.compare.items():
        rows.append(
            [
                html.escape(PE_LABELS.get(name, name)),
                _acc(res.eval["accuracy"]),
                _acc(res.eval["sequence_accuracy"]),
                f"{res.eval['loss']:.4f}",
                f"{res.train_time_s:.1f}",
            ]
        )
    return (
        "<h3>Does the encoder need positions? (--compare-pe)</h3>"
        "<p>The same encoder, trained the same way, with no positions, sinusoidal positions "
        "added to the input, and rotary positions in every attention layer. Without "
        "positions attention is permutation-equivariant: the output at a position depends "
        "only on its own token and the <i>set</i> of tokens, so an order-dependent task "
        "cannot be learned.</p>"
        + _table(
            [
                "positions",
                "held-out accuracy",
                "sequences all right",
                "held-out loss",
                "train time (s)",
            ],
            rows,
        )
        + _figs(data.figures, "compare")
    )


def _render(data: ReportData) -> str:
    r, m, cfg = data.result, data.metrics, data.result.config
    task = cfg.make_task()
    acc = r.eval["accuracy"]
    cards = [
        (_acc(acc), "held-out token accuracy"),
        (_acc(r.eval["sequence_accuracy"]), "held-out sequences all right"),
        (
            f"{r.train_time_s:.1f} s",
            f"training ({r.world_size} process{'es' if r.world_size > 1 else ''})",
        ),
        (f"{r.num_params:,}", "parameters"),
        (f"{r.step:,}", f"steps x {cfg.batch_size} sequences"),
    ]
    card_html = "".join(
        f'<div class="card"><b>{v}</b><span>{html.escape(k)}</span></div>' for v, k in cards
    )
    att = m.get("attention", {})
    config_rows = [[html.escape(k), html.escape(str(v))] for k, v in cfg.to_dict().items()]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>attnkit lab: {html.escape(cfg.task)}</title><style>{_CSS}</style></head>
<body>
<h1>attnkit lab: <code>{html.escape(cfg.task)}</code></h1>
<p class="sub">{html.escape(task.description)}. A {cfg.num_layers}-layer, {cfg.num_heads}-head
encoder (D={cfg.dim}, {html.escape(PE_LABELS.get(cfg.positions, cfg.positions))} positions)
trained on sequences of {cfg.seq_len} tokens over {cfg.num_symbols} symbols, generated on the
fly; evaluated on {int(r.eval["sequences"]):,} held-out sequences it never saw.</p>
<div class="cards">{card_html}</div>
{_examples_html(r)}

<h2>1. Scaled dot-product attention: the rescale factor and softmax</h2>
<p>Attention is <code>softmax(QKᵀ/√d_k)V</code>. The dot product of two random d-dim vectors
has a standard deviation of √d, so without the rescale the scores grow with the dimension and
softmax saturates to one-hot rows.</p>
{_figs(data.figures, "scaling")}

<h2>2. Attention weights of the trained model</h2>
<p>Row <i>i</i> of a map is how query <i>i</i> spreads its attention over the keys (each row
sums to 1). {TASK_NOTES.get(cfg.task, "")} The best head here is layer
{att.get("best_layer", "?")}, head {att.get("best_head", "?")}, with
{att.get("best_alignment", float("nan")):.0%} of its weight on the positions holding the
answer.</p>
{_figs(data.figures, "attention")}

<h2>3. Computational and memory cost of this model</h2>
{_cost_html(r)}
{_figs(data.figures, "cost")}

<h2>4. Positions</h2>
<p>Attention alone treats its input as a set. This model uses
<b>{html.escape(PE_LABELS.get(cfg.positions, cfg.positions))}</b> positions. The sinusoidal
table is added once to the embeddings; RoPE rotates queries and keys in every layer so that
scores depend on the offset between tokens.</p>
{_figs(data.figures, "positions")}
{_compare_html(data)}
{_length_html(data.length_table, cfg.seq_len)}

<h2>5. Training</h2>
{_figs(data.figures, "training")}
<p>Training time {r.train_time_s:.1f} s over {r.step:,} steps
({r.world_size} process{"es" if r.world_size > 1 else ""}); seed {cfg.seed}.</p>
{_table(["option", "value"], config_rows)}
<p class="sub">Written by <code>attnkit lab</code>; numbers in <code>metrics.json</code>, the
model in <code>checkpoint.safetensors</code>.</p>
</body></html>
"""


def write_report(out_dir: str | Path, data: ReportData) -> Path:
    """Draw the figures into ``out_dir/figures`` and write ``out_dir/report.html``.

    ``data.metrics`` gains ``"attention"`` (the best head and its alignment) and ``"figures"``
    (the PNG paths, relative to ``out_dir``).

    Returns:
        The path of ``report.html``.
    """
    out = Path(out_dir)
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    data.figures = _make_figures(data, fig_dir)
    data.metrics["figures"] = [f"figures/{f.name}" for f in data.figures]
    text = _render(data)
    return atomic_write(out / "report.html", lambda tmp: Path(tmp).write_text(text, "utf-8"))
