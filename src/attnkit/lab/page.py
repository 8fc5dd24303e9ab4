"""The HTML of the lab report: stylesheet, page template and the pieces the page is made of.

Nothing here trains, evaluates or draws: :mod:`attnkit.lab.report` computes the numbers and the
figures and hands them to :func:`render`, which only formats them into the shared page shell of
:mod:`attnkit.pages`. Every figure is embedded as a base64 PNG (so the page can be mailed or
opened anywhere) and names its file in ``data-file``.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING

from attnkit.pages import figure as embed_figure
from attnkit.pages import page, table

if TYPE_CHECKING:
    from attnkit.complexity import CostBreakdown
    from attnkit.lab.train import TrainResult

__all__ = ["PE_LABELS", "TASK_NOTES", "Example", "FigureSpec", "render"]

PE_LABELS = {"none": "no positions", "sinusoidal": "sinusoidal", "rope": "rotary (RoPE)"}
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

CSS = """
.cards{display:flex;flex-wrap:wrap;gap:.8em;margin:1.2em 0}
.card{border:1px solid #d0d7de;border-radius:8px;padding:.6em 1em;min-width:9em}
.card b{display:block;font-size:1.5em}.card span{color:#59636e;font-size:.85em}
"""

# The body of the page. $-placeholders are filled by render(): values marked _html are HTML, the
# rest plain text that render() escapes.
BODY = Template("""<h1>attnkit lab: <code>$task</code></h1>
<p class="sub">$description. A $num_layers-layer, $num_heads-head
encoder (D=$dim, $positions positions)
trained on sequences of $seq_len tokens over $num_symbols symbols, generated on the
fly; evaluated on $eval_sequences held-out sequences it never saw.</p>
<div class="cards">$cards_html</div>
$examples_html

<h2>1. Scaled dot-product attention: the rescale factor and softmax</h2>
<p>Attention is <code>softmax(QKᵀ/√d_k)V</code>. The dot product of two random d-dim vectors
has a standard deviation of √d, so without the rescale the scores grow with the dimension and
softmax saturates to one-hot rows.</p>
$scaling_html

<h2>2. Attention weights of the trained model</h2>
<p>Row <i>i</i> of a map is how query <i>i</i> spreads its attention over the keys (each row
sums to 1). $task_note_html The best head here is layer
$best_layer, head $best_head, with
$best_alignment of its weight on the positions holding the
answer.</p>
$explorer_html
$attention_html

<h2>3. Computational and memory cost of this model</h2>
$cost_html
$cost_figures_html

<h2>4. Positions</h2>
<p>Attention alone treats its input as a set. This model uses
<b>$positions</b> positions. The sinusoidal
table is added once to the embeddings; RoPE rotates queries and keys in every layer so that
scores depend on the offset between tokens.</p>
$positions_html
$compare_html
$length_html

<h2>5. Training</h2>
$training_html
<p>Training time $train_time s over $steps steps
($processes); seed $seed.</p>
$config_html
<p class="sub">Written by <code>attnkit lab</code>; numbers in <code>metrics.json</code>, the
model in <code>checkpoint.safetensors</code>.</p>
""")


@dataclass(frozen=True)
class Example:
    """One held-out example as the page shows it: token labels joined by spaces.

    Attributes:
        inputs: The input sequence.
        target: The expected output (unscored positions shown as ``·``).
        output: The model's output at the scored positions.
        correct: Whether every scored position is right.
    """

    inputs: str
    target: str
    output: str
    correct: bool


@dataclass
class FigureSpec:
    """A figure of the report: file name (under ``figures/``), caption and section.

    Attributes:
        name: File name, e.g. ``"scaling.png"``.
        caption: What the figure shows (the page's caption and alt text).
        section: The page section it belongs to (``scaling``, ``attention``, ``cost``,
            ``positions``, ``compare`` or ``training``).
        path: Where it was written; set by :func:`write_report`.
    """

    name: str
    caption: str
    section: str
    path: Path | None = None


def figure(spec: FigureSpec) -> str:
    """One ``<figure>`` with the PNG of ``spec`` embedded and a link to its file."""
    if spec.path is None:
        raise ValueError(f"figure {spec.name!r} has not been drawn (no path)")
    return embed_figure(spec.path, spec.caption, file=f"figures/{spec.name}")


def _figures(figures: Sequence[FigureSpec], section: str) -> str:
    return "\n".join(figure(f) for f in figures if f.section == section)


def accuracy(value: float | None) -> str:
    """An accuracy with three decimals, green from 0.99 and red below 0.5; ``–`` for None."""
    if value is None:
        return "–"
    cls = "ok" if value >= 0.99 else ("bad" if value < 0.5 else "")
    return f'<span class="{cls}">{value:.3f}</span>'


def _label(positions: str) -> str:
    return html.escape(PE_LABELS.get(positions, positions))


def _examples(examples: Sequence[Example]) -> str:
    rows = [
        [
            f"<code>{html.escape(e.inputs)}</code>",
            f"<code>{html.escape(e.target)}</code>",
            f"<code>{html.escape(e.output)}</code>",
            '<span class="ok">yes</span>' if e.correct else '<span class="bad">no</span>',
        ]
        for e in examples
    ]
    return table(["input", "target (· = not scored)", "model output", "all right"], rows, left=3)


def _cost(cost: CostBreakdown, *, vocab_size: int, counted_params: int) -> str:
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
    embed = vocab_size * cost.dim
    head = cost.dim * vocab_size + vocab_size
    symbols = ", ".join(f"{k}={v}" for k, v in cost.symbols.items() if v is not None)
    header = ["component", "computes", "FLOPs formula", "FLOPs", "share", "params"]
    return (
        f"<p>Per block, for one training batch ({symbols}); the model has "
        f"{cost.num_layers} blocks. Formulas and numbers come from "
        f"<code>attnkit.complexity.transformer_cost</code>.</p>"
        + table([*header, "params formula"], rows, left=3)
        + f"<p>Forward FLOPs of the whole batch: <b>{cost.flops:,}</b> ({cost.num_layers} "
        f"blocks; the dominant term at n={cost.seq_len} is <b>{cost.dominant_term}</b>, and the "
        f"n² terms overtake at n = {cost.crossover_seq_len}). Parameters: blocks "
        f"{cost.params:,} (formula) + embedding {embed:,} + head {head:,} = "
        f"{cost.params + embed + head:,}; counted on the model: <b>{counted_params:,}</b>. "
        f"Attention matrices kept for backward on the textbook path: "
        f"{cost.textbook_saved_attn_bytes:,} bytes, against "
        f"{cost.fused_saved_attn_bytes:,} for a fused kernel.</p>"
    )


def _lengths(lengths_table: Mapping[str, Mapping[int, float | None]], train_len: int) -> str:
    if not lengths_table:
        return ""
    lengths = sorted({n for row in lengths_table.values() for n in row})
    header = ["positions"] + [f"n={n}" + (" (train)" if n == train_len else "") for n in lengths]
    rows = [
        [_label(name)] + [accuracy(row.get(n)) for n in lengths]
        for name, row in lengths_table.items()
    ]
    return (
        f"<h3>Length generalization</h3><p>Trained on n = {train_len}, tested on held-out "
        f"sequences of other lengths (token accuracy; – where the length does not fit). "
        f"The position tables cover longer sequences, but a model trained at one length has "
        f"only learned that length's pattern (for reversal, i → n-1-i moves with n), so "
        f"accuracy usually falls to chance: this is a measurement, not a promise.</p>"
        + table(header, rows)
    )


def _explorers(explorers: Mapping[str, tuple[str, int]]) -> str:
    if not explorers:
        return ""
    (_, (path, size)), *others = explorers.items()
    more = ""
    if others:
        links = ", ".join(
            f'<a href="{html.escape(p)}">{_label(name)}</a>' for name, (p, _) in others
        )
        more = f" The same inputs in the other encoders of the comparison: {links}."
    return (
        f'<p class="explorer"><b><a href="{html.escape(path)}">Open the interactive attention '
        f"explorer</a></b> ({html.escape(path)}, {size / 1024:.0f} KB, works offline): the "
        "trained model on held-out inputs, every layer and head; its input selector gives the "
        "model's accuracy on each, so you can find where it errs and look at its attention "
        "there. Hover a token to draw where each head looks; click a map to read its exact "
        f"weights.{more}</p>"
    )


def _compare(compare: Mapping[str, TrainResult] | None, figures: Sequence[FigureSpec]) -> str:
    if not compare:
        return ""
    rows = [
        [
            _label(name),
            accuracy(res.eval["accuracy"]),
            accuracy(res.eval["sequence_accuracy"]),
            f"{res.eval['loss']:.4f}",
            f"{res.train_time_s:.1f}",
        ]
        for name, res in compare.items()
    ]
    header = ["positions", "held-out accuracy", "sequences all right", "held-out loss"]
    cfg = next(iter(compare.values())).config
    return (
        "<h3>Does the encoder need positions? (--compare-pe)</h3>"
        "<p>The same encoder with no positions, sinusoidal positions added to the input, and "
        "rotary positions in every attention layer. Without positions attention is "
        "permutation-equivariant: the output at a position depends only on its own token and "
        "the <i>set</i> of tokens, so an order-dependent task cannot be learned.</p>"
        f"<p class=training>All three were trained the same way: {cfg.steps:,} steps of "
        f"{cfg.batch_size} sequences of {cfg.seq_len} tokens (the same batches, drawn from seed "
        f"{cfg.seed}, and the same initialisation seed), AdamW at a peak learning rate of "
        f"{cfg.lr:g} ({cfg.warmup_steps}-step warmup, cosine decay), weight decay "
        f"{cfg.weight_decay:g}, dropout {cfg.dropout:g}. Rotary base {cfg.rope_base:g}: "
        "rotary scores depend only on offsets, so a rotary encoder must infer absolute "
        "positions (which <code>reverse</code> needs) from the sequence's edges; with the "
        "10,000 of language models, 5 of the 8 frequency pairs of a 16-dim head barely turn "
        "over the lab's lengths, and it learned more slowly and less reliably across seeds "
        "(0.84 held-out accuracy after 400 steps on reverse).</p>"
        + table([*header, "train time (s)"], rows)
        + _figures(figures, "compare")
    )


def render(
    result: TrainResult,
    *,
    description: str,
    attention: Mapping[str, float],
    examples: Sequence[Example],
    cost: CostBreakdown,
    vocab_size: int,
    figures: Sequence[FigureSpec],
    lengths_table: Mapping[str, Mapping[int, float | None]],
    compare: Mapping[str, TrainResult] | None = None,
    explorers: Mapping[str, tuple[str, int]] | None = None,
) -> str:
    """The whole ``report.html``.

    Args:
        result: The main run (configuration, held-out metrics, time, size).
        description: One line about the task.
        attention: ``best_layer``, ``best_head`` and ``best_alignment`` of the trained model.
        examples: Held-out examples with the model's answers.
        cost: The cost of one training batch (:func:`attnkit.complexity.transformer_cost`).
        vocab_size: Vocabulary of the task (embedding and head parameters).
        figures: The drawn figures; each lands in the section it names (``scaling``,
            ``attention``, ``cost``, ``positions``, ``compare``, ``training``).
        lengths_table: Positions name -> {length: accuracy or None}.
        compare: Positions name -> run, when ``--compare-pe`` was used.
        explorers: Positions name -> (file relative to the report, size in bytes) of the
            interactive attention explorers (:mod:`attnkit.explorer`); the first is the main
            run's.

    Returns:
        The page.
    """
    cfg = result.config
    processes = f"{result.world_size} process{'es' if result.world_size > 1 else ''}"
    cards = [
        (accuracy(result.eval["accuracy"]), "held-out token accuracy"),
        (accuracy(result.eval["sequence_accuracy"]), "held-out sequences all right"),
        (f"{result.train_time_s:.1f} s", f"training ({processes})"),
        (f"{result.num_params:,}", "parameters"),
        (f"{result.step:,}", f"steps x {cfg.batch_size} sequences"),
    ]
    config_rows = [[html.escape(k), html.escape(str(v))] for k, v in cfg.to_dict().items()]
    body = BODY.substitute(
        task=html.escape(cfg.task),
        description=html.escape(description),
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        dim=cfg.dim,
        positions=_label(cfg.positions),
        seq_len=cfg.seq_len,
        num_symbols=cfg.num_symbols,
        eval_sequences=f"{int(result.eval['sequences']):,}",
        cards_html="".join(
            f'<div class="card"><b>{v}</b><span>{html.escape(k)}</span></div>' for v, k in cards
        ),
        examples_html=_examples(examples),
        scaling_html=_figures(figures, "scaling"),
        task_note_html=TASK_NOTES.get(cfg.task, ""),
        best_layer=attention.get("best_layer", "?"),
        best_head=attention.get("best_head", "?"),
        best_alignment=f"{attention.get('best_alignment', float('nan')):.0%}",
        explorer_html=_explorers(explorers or {}),
        attention_html=_figures(figures, "attention"),
        cost_html=_cost(cost, vocab_size=vocab_size, counted_params=result.num_params),
        cost_figures_html=_figures(figures, "cost"),
        positions_html=_figures(figures, "positions"),
        compare_html=_compare(compare, figures),
        length_html=_lengths(lengths_table, cfg.seq_len),
        training_html=_figures(figures, "training"),
        train_time=f"{result.train_time_s:.1f}",
        steps=f"{result.step:,}",
        processes=processes,
        seed=cfg.seed,
        config_html=table(["option", "value"], config_rows),
    )
    return page(f"attnkit lab: {cfg.task}", body, css=CSS)
