"""An interactive attention explorer: one self-contained HTML file per model run.

In a notebook, :func:`attnkit.show` embeds the same page in a cell (:mod:`attnkit.notebook`).

The page has two views of the attention weights of every layer and head:

- **head view**: the tokens in two columns (queries left, keys right). Hovering a token draws its
  attention as lines, one colour per head, line opacity and width growing with the weight; a
  query (left) shows where it looks, a key (right) shows who looks at it. Click pins a token. A
  layer selector and one toggle per head choose what is drawn.
- **model view**: a grid of every layer x head as small heatmaps; clicking one opens it large with
  the token labels, and hovering a cell shows its exact weight.

A page may hold several inputs of one model (:func:`explorer_page`, e.g. the lab's held-out
inputs with the model's accuracy on each); a selector above the views switches between them.

The page needs no network: its template, script and style are the files ``explorer.html``,
``explorer.js`` and ``explorer.css`` of ``attnkit/assets``, inlined into the shared page shell of
:mod:`attnkit.pages` (vanilla JS, SVG for the lines, canvas for the heatmaps, so 512 tokens stay
responsive). The weights are embedded compactly as base64: IEEE float16 (absolute error <= 2.5e-4
for weights in [0, 1]), or, for large inputs, uint8 quantized per map (``round(255 * w / max)``,
absolute error <= max/510).
The page states which encoding it uses and its own size.

What the page draws is readable from the DOM (``data-weight`` on every line and heatmap, a
``window.attnExplorer`` object that decodes the embedded weights), so tests can check the drawing
against the data in a real browser.

Only torch and the standard library are needed.
"""

from __future__ import annotations

import base64
import ctypes
import html
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Literal, TypedDict

import torch
from torch import Tensor

from attnkit.pages import asset, page

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "MAX_TOKENS",
    "ExplorerInput",
    "ExplorerOptions",
    "Precision",
    "explorer_html",
    "explorer_page",
    "stack_weights",
    "write_explorer",
]

Precision = Literal["auto", "float16", "uint8"]

MAX_TOKENS = 512
"""Most tokens per side the explorer accepts (the model view draws one pixel per cell at least)."""

_FLOAT16_MAX_VALUES = 4_000_000  # beyond this many weights, "auto" quantizes to uint8 (~1/2 size)
_TOLERANCE = 1e-3  # weights may exceed [0, 1] by rounding only
_SIZE = "\x00size\x00"  # placeholder: JSON escapes NUL, so no token can contain it


class ExplorerOptions(TypedDict, total=False):
    """The keyword options of :func:`explorer_html`, which :func:`write_explorer` hands on.

    Attributes:
        key_tokens: Labels of the keys; defaults to the query tokens.
        title: Page title and heading.
        description: A sentence under the heading (plain text).
        layer_names: One label per layer.
        layer: The layer the head view opens on.
        precision: ``"auto"``, ``"float16"`` or ``"uint8"``.
    """

    key_tokens: Sequence[str] | None
    title: str
    description: str
    layer_names: Sequence[str] | None
    layer: int
    precision: Precision


def stack_weights(weights: Tensor | Sequence[Tensor]) -> Tensor:
    """Bring attention weights to one float32 CPU tensor of shape ``(layers, H, L, S)``.

    Accepts what attnkit models return with ``return_weights=True`` for one example: a list of
    per-layer tensors ``(H, L, S)`` or ``(1, H, L, S)``, or one tensor ``(layers, H, L, S)`` or
    ``(layers, 1, H, L, S)``.

    Args:
        weights: The weights, as described above.

    Returns:
        A float32 CPU tensor ``(layers, H, L, S)``.

    Raises:
        TypeError: If ``weights`` is neither a tensor nor a sequence of tensors.
        ValueError: If the shapes do not fit (including a batch of more than one example), or the
            list is empty.

    Shape:
        weights: ``layers x (H, L, S)`` or ``(layers, H, L, S)`` -> ``(layers, H, L, S)``.
    """
    if isinstance(weights, Tensor):
        if weights.dim() not in (4, 5):
            raise ValueError(
                "weights must be (layers, H, L, S) or (layers, 1, H, L, S), "
                f"got shape {tuple(weights.shape)}"
            )
        layers = list(weights.unbind(0))
    elif isinstance(weights, Sequence) and not isinstance(weights, (str, bytes)):
        layers = list(weights)
        bad = sorted({type(w).__name__ for w in layers if not isinstance(w, Tensor)})
        if bad:
            raise TypeError(f"weights must be tensors, got {bad}")
    else:
        raise TypeError(
            f"weights must be a tensor or a list of per-layer tensors, got {type(weights).__name__}"
        )
    if not layers:
        raise ValueError("weights is empty: give at least one layer")
    out = []
    for index, w in enumerate(layers):
        if w.dim() == 4:
            if w.shape[0] != 1:
                raise ValueError(
                    f"layer {index} has a batch of {w.shape[0]} examples (shape "
                    f"{tuple(w.shape)}); the explorer shows one: pass weights[{index}][b]"
                )
            w = w[0]
        if w.dim() != 3:
            raise ValueError(
                f"layer {index} must be (H, L, S) or (1, H, L, S), got shape {tuple(w.shape)}"
            )
        out.append(w.detach().to("cpu", torch.float32))
    shapes = sorted({tuple(w.shape) for w in out})
    if len(shapes) != 1:
        raise ValueError(f"every layer must have the same (H, L, S), got {shapes}")
    return torch.stack(out)  # (layers, H, L, S)


def _tokens(tokens: Sequence[str], length: int, name: str) -> list[str]:
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a list of strings, got {type(tokens).__name__}")
    labels = [str(t) for t in tokens]
    if len(labels) != length:
        raise ValueError(f"{name} has {len(labels)} tokens but the weights have {length} positions")
    return labels


def _encode(w: Tensor, precision: Literal["float16", "uint8"]) -> tuple[str, list[list[float]]]:
    """Base64 of the weights, little-endian, and the per-map scales (uint8 only)."""
    if precision == "float16":
        raw = w.to(torch.float16).contiguous().clone()
        scales: list[list[float]] = []
    else:
        peak = w.amax(dim=(-2, -1), keepdim=True).clamp_min(1e-12)  # (layers, H, 1, 1)
        raw = torch.round(w / peak * 255).clamp(0, 255).to(torch.uint8).contiguous().clone()
        scales = peak[..., 0, 0].tolist()
    if sys.byteorder == "big" and precision == "float16":  # pragma: no cover - no such machine
        raw = raw.view(torch.uint8).view(-1, 2).flip(-1).contiguous()
    # the tensor's own bytes, read in one copy (bytes(storage) iterates per element; numpy is
    # not a dependency of the core)
    data = ctypes.string_at(raw.data_ptr(), raw.numel() * raw.element_size())
    return base64.b64encode(data).decode("ascii"), scales


@dataclass(frozen=True)
class ExplorerInput:
    """One input of an explorer page: its tokens and the attention weights of every layer and head.

    A page may hold several inputs of one model (the same layers and heads); a selector above the
    views switches between them.

    Attributes:
        tokens: Labels of the queries (the left column, the heatmaps' rows).
        weights: Attention weights of this input, every layer and head (see :func:`stack_weights`).
        key_tokens: Labels of the keys; defaults to ``tokens`` (self-attention, ``L == S``).
        label: The input's name in the selector (default ``"input K"``).
        note: A line shown under the selector while the input is chosen (plain text).
    """

    tokens: Sequence[str]
    weights: Tensor | Sequence[Tensor]
    key_tokens: Sequence[str] | None = None
    label: str = ""
    note: str = ""


def _check_input(index: int, item: ExplorerInput) -> tuple[Tensor, list[str], list[str]]:
    """The stacked weights and both token lists of one input, checked."""
    if not isinstance(item, ExplorerInput):
        raise TypeError(f"inputs[{index}] must be an ExplorerInput, got {type(item).__name__}")
    w = stack_weights(item.weights)  # (layers, H, L, S)
    _, n_heads, L, S = w.shape
    for side, count in (("L (queries)", L), ("S (keys)", S)):
        if not 2 <= count <= MAX_TOKENS:
            raise ValueError(f"the explorer shows 2 to {MAX_TOKENS} tokens, got {side} = {count}")
    if n_heads < 1:
        raise ValueError(f"weights have no heads: shape {tuple(w.shape)}")
    q_labels = _tokens(item.tokens, L, "tokens")
    if item.key_tokens is None and L != S:
        raise ValueError(f"pass key_tokens: the weights have L={L} queries but S={S} keys")
    keys = item.key_tokens if item.key_tokens is not None else item.tokens
    k_labels = _tokens(keys, S, "key_tokens")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weights contain NaN or inf")
    low, high = float(w.min()), float(w.max())
    if low < -_TOLERANCE or high > 1 + _TOLERANCE:
        raise ValueError(f"attention weights must lie in [0, 1], got min {low:.4g}, max {high:.4g}")
    return w, q_labels, k_labels


def explorer_html(
    tokens: Sequence[str],
    weights: Tensor | Sequence[Tensor],
    *,
    key_tokens: Sequence[str] | None = None,
    title: str = "Attention explorer",
    description: str = "",
    layer_names: Sequence[str] | None = None,
    layer: int = 0,
    precision: Precision = "auto",
) -> str:
    """The explorer page of one input as one self-contained HTML string.

    Args:
        tokens: Labels of the queries (the left column, the heatmaps' rows).
        weights: Attention weights of one example, every layer and head (see
            :func:`stack_weights`); row ``i`` of a map is how query ``i`` spreads over the keys.
        key_tokens: Labels of the keys (right column, heatmaps' columns); defaults to ``tokens``,
            which needs ``L == S`` (self-attention). Pass them for cached decoding or
            cross-attention.
        title: Page title and heading.
        description: A sentence shown under the heading (plain text).
        layer_names: One label per layer; defaults to ``"layer 0"``, ``"layer 1"``, ...
        layer: The layer the head view opens on (negative counts from the end).
        precision: ``"float16"``, ``"uint8"`` or ``"auto"`` (float16 up to 4M weights, else
            uint8); see the module docstring for their errors.

    Returns:
        The HTML page.

    Raises:
        TypeError: If the tokens are not lists of strings or the weights are not tensors.
        ValueError: If the shapes, token counts or names do not match, a side has fewer than 2 or
            more than :data:`MAX_TOKENS` tokens, the weights are not finite and within [0, 1], or
            ``precision`` is unknown.

    Shape:
        weights: ``layers x (H, L, S)`` or ``(layers, H, L, S)``; ``len(tokens) == L``,
        ``len(key_tokens) == S``.
    """
    return explorer_page(
        [ExplorerInput(tokens, weights, key_tokens)],
        title=title,
        description=description,
        layer_names=layer_names,
        layer=layer,
        precision=precision,
    )


def explorer_page(
    inputs: Sequence[ExplorerInput],
    *,
    title: str = "Attention explorer",
    description: str = "",
    layer_names: Sequence[str] | None = None,
    layer: int = 0,
    precision: Precision = "auto",
) -> str:
    """The explorer page of one or more inputs of one model, with a selector over the inputs.

    Args:
        inputs: The inputs; every one has the same layers and heads (lengths may differ). The
            page opens on the first.
        title: Page title and heading.
        description: A sentence shown under the heading (plain text).
        layer_names: One label per layer; defaults to ``"layer 0"``, ``"layer 1"``, ...
        layer: The layer the head view opens on (negative counts from the end).
        precision: ``"float16"``, ``"uint8"`` or ``"auto"`` (float16 up to 4M weights in all,
            else uint8).

    Returns:
        The HTML page.

    Raises:
        TypeError: As :func:`explorer_html`, or if an input is not an :class:`ExplorerInput`.
        ValueError: As :func:`explorer_html`, if ``inputs`` is empty, or if the inputs differ in
            their number of layers or heads.

    Shape:
        each input's weights: ``layers x (H, L, S)`` or ``(layers, H, L, S)``.
    """
    if isinstance(inputs, ExplorerInput) or not isinstance(inputs, Sequence):
        raise TypeError(f"inputs must be a list of ExplorerInput, got {type(inputs).__name__}")
    if not inputs:
        raise ValueError("inputs is empty: give at least one ExplorerInput")
    checked = [_check_input(k, item) for k, item in enumerate(inputs)]
    n_layers, n_heads = checked[0][0].shape[:2]
    sizes = sorted({tuple(w.shape[:2]) for w, _, _ in checked})
    if len(sizes) != 1:
        raise ValueError(f"every input must have the same (layers, heads), got {sizes}")
    names = [f"layer {i}" for i in range(n_layers)] if layer_names is None else list(layer_names)
    if len(names) != n_layers:
        raise ValueError(f"layer_names has {len(names)} names for {n_layers} layers")
    if isinstance(layer, bool) or not isinstance(layer, int) or not -n_layers <= layer < n_layers:
        raise ValueError(f"layer must be an int in [{-n_layers}, {n_layers - 1}], got {layer!r}")
    if precision not in ("auto", "float16", "uint8"):
        raise ValueError(f"precision must be 'auto', 'float16' or 'uint8', got {precision!r}")
    chosen: Literal["float16", "uint8"]
    if precision == "auto":
        total = sum(w.numel() for w, _, _ in checked)
        chosen = "float16" if total <= _FLOAT16_MAX_VALUES else "uint8"
    else:
        chosen = precision
    entries = []
    for k, ((w, q_labels, k_labels), item) in enumerate(zip(checked, inputs, strict=True)):
        data, scales = _encode(w.clamp(0.0, 1.0), chosen)
        entries.append(
            {
                "label": item.label or f"input {k}",
                "note": item.note,
                "queryTokens": q_labels,
                "keyTokens": k_labels,
                "L": w.shape[2],
                "S": w.shape[3],
                "scales": scales,
                "data": data,
            }
        )
    payload = {
        "title": title,
        "description": description,
        "layerNames": names,
        "initialLayer": layer % n_layers,
        "layers": n_layers,
        "heads": n_heads,
        "encoding": chosen,
        "inputs": entries,
    }
    # "<" escaped so that no token can close the script element
    blob = json.dumps(payload, ensure_ascii=False).replace("<", "\\u003c")
    encoding_note = (
        "float16 (base64)"
        if chosen == "float16"
        else "uint8 quantized per map: weight = byte / 255 x the map's max (base64)"
    )
    if len(checked) == 1:
        L, S = checked[0][0].shape[2:]
        shape = f"{L} query tokens x {S} key tokens"
    else:
        longest = max(max(w.shape[2:]) for w, _, _ in checked)
        shape = f"{len(checked)} inputs of up to {longest} tokens"
    body = Template(asset("explorer.html")).substitute(
        title=html.escape(title),
        description=html.escape(description),
        stats=f"{shape}, {n_layers} layers x {n_heads} heads.",
        encoding=html.escape(encoding_note),
        size=_SIZE,
        inputs_hidden="" if len(entries) > 1 else "hidden",
        data=blob,
        script=asset("explorer.js"),
    )
    document = page(title, body, css=asset("explorer.css"), base_css=False)
    # The page reports its own size: substitute until the number no longer changes its length.
    size_text = ""
    for _ in range(4):
        candidate = _human_size(len(document.replace(_SIZE, size_text).encode("utf-8")))
        if candidate == size_text:
            break
        size_text = candidate
    return document.replace(_SIZE, size_text)


def _human_size(n_bytes: int) -> str:
    if n_bytes < 1024:
        return f"{n_bytes} B"
    if n_bytes < 1024**2:
        return f"{n_bytes / 1024:.1f} KB"
    return f"{n_bytes / 1024**2:.2f} MB"


def write_explorer(
    path: str | Path,
    tokens: Sequence[str],
    weights: Tensor | Sequence[Tensor],
    **options: Unpack[ExplorerOptions],
) -> Path:
    """Write the explorer page (see :func:`explorer_html`) to ``path``; parents are created.

    Args:
        path: The HTML file to write.
        tokens: Labels of the queries.
        weights: Attention weights of one example, every layer and head.
        **options: ``key_tokens``, ``title``, ``description``, ``layer_names``, ``layer``,
            ``precision``, as :func:`explorer_html` takes them (see :class:`ExplorerOptions`).

    Returns:
        The path written.

    Raises:
        TypeError: As :func:`explorer_html`, and for an option it does not take.
        ValueError: As :func:`explorer_html`.

    Shape:
        weights: ``layers x (H, L, S)`` or ``(layers, H, L, S)``.
    """
    page = explorer_html(tokens, weights, **options)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
