"""The attention explorer in a notebook: ``attnkit.show`` and ``attnkit.show_model``.

::

    import attnkit
    attnkit.show(weights, tokens)                 # weights of every layer and head
    attnkit.show(model, ids, labels=tokens)       # runs an attnkit model on the ids
    attnkit.show_model(encoder, "The cat sat.")   # a SentenceEncoder, from a text
    attnkit.show_model(lm, "Hello", tokenizer=tok)  # a TransformerLM and its tokenizer

Each returns an :class:`ExplorerView`: Jupyter (and anything else that calls ``_repr_html_``)
shows the interactive explorer of :mod:`attnkit.explorer` inside a sandboxed ``<iframe srcdoc>``,
so the page needs no file, server or network, and several views on one page keep their own
element ids, styles and scripts. Outside a notebook, :meth:`ExplorerView.save` writes the page.

Only torch is needed (the sentence encoder needs the ``models`` extra, as always).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from attnkit.explorer import ExplorerInput, Precision, explorer_page
from attnkit.pages import iframe

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from attnkit.explorer import ExplorerOptions

__all__ = ["ExplorerView", "show", "show_model"]

_ROW_PX = 20  # the head view's row height for short inputs (see LAYOUT in explorer.js)
_CHROME_PX = 330  # heading, selector, tabs, controls and hint above the tokens


class _Tokenizer(Protocol):
    def encode(self, text: str) -> Any: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ExplorerView:
    """An explorer page that shows itself in a notebook and can be saved.

    Attributes:
        page: The whole, self-contained HTML page.
        height: The frame's height in a notebook (CSS pixels).
        title: The page's title.
    """

    page: str
    height: int = 720
    title: str = "Attention explorer"

    def _repr_html_(self) -> str:
        """The page inside a sandboxed ``<iframe srcdoc>`` (what Jupyter displays)."""
        return iframe(self.page, height=self.height, title=self.title)

    def save(self, path: str | Path) -> Path:
        """Write the page (openable in any browser, offline); parents are created.

        Returns:
            The path written.
        """
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.page, encoding="utf-8")
        return out


def _height(tokens: int, height: int | None) -> int:
    if height is not None:
        return height
    return _CHROME_PX + min(tokens, 24) * _ROW_PX  # longer inputs scroll inside the frame


def _model_weights(model: nn.Module, ids: Tensor) -> Tensor:
    """Run an attnkit model on one sequence and return its weights ``(layers, H, L, S)``."""
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"with a model, tokens must be a tensor of token ids, got {type(ids).__name__}"
            + (f" of {ids.dtype}" if isinstance(ids, Tensor) else "")
        )
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be (L,) or (1, L): one sequence, got shape {tuple(ids.shape)}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(ids.to(device), return_weights=True)
    finally:
        model.train(was_training)
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(
            f"{type(model).__name__}(ids, return_weights=True) must return (output, weights), "
            f"got {type(out).__name__}"
        )
    weights = out[1]
    if isinstance(weights, Tensor):
        return weights.float()
    return torch.stack([w.float() for w in weights])  # layers x (1, H, L, S)


def show(
    weights_or_model: Tensor | Sequence[Tensor] | nn.Module,
    tokens: Sequence[str] | Tensor,
    *,
    labels: Sequence[str] | None = None,
    height: int | None = None,
    **options: Unpack[ExplorerOptions],
) -> ExplorerView:
    """The interactive explorer of one input, for a notebook cell (or :meth:`~ExplorerView.save`).

    Args:
        weights_or_model: Attention weights of every layer and head of one input (what
            :func:`attnkit.explorer.stack_weights` accepts), or an attnkit model
            (``TransformerEncoder``, ``TransformerLM``, ...: called as
            ``model(ids, return_weights=True)`` and returning ``(output, weights)``).
        tokens: With weights, the query tokens' labels. With a model, the token ids
            (``(L,)`` or ``(1, L)``).
        labels: With a model, the ids' labels (default: the ids as text).
        height: The frame's height in pixels (default: from the number of tokens).
        **options: ``key_tokens``, ``title``, ``description``, ``layer_names``, ``layer``,
            ``precision``, as :func:`attnkit.explorer.explorer_html` takes them.

    Returns:
        The view; display it (the last expression of a cell) or save it.

    Raises:
        TypeError: If the tokens do not fit what was given (labels with weights, ids with a
            model), the model does not return ``(output, weights)``, or an option is unknown.
        ValueError: As :func:`attnkit.explorer.explorer_html`; if ids are not one sequence.

    Shape:
        weights: ``layers x (H, L, S)`` or ``(layers, H, L, S)``; ids: ``(L,)`` or ``(1, L)``.
    """
    if isinstance(weights_or_model, nn.Module):
        if not isinstance(tokens, Tensor):
            raise TypeError(
                "with a model, tokens must be a tensor of token ids (give their text as labels=)"
            )
        weights: Tensor | Sequence[Tensor] = _model_weights(weights_or_model, tokens)
        names = [str(int(i)) for i in tokens.flatten()] if labels is None else list(labels)
    else:
        if isinstance(tokens, Tensor):
            raise TypeError("with weights, tokens must be a list of strings, got a tensor")
        if labels is not None:
            raise TypeError("labels= is for a model's ids; with weights, tokens are the labels")
        weights, names = weights_or_model, list(tokens)
    return _view(names, weights, height, dict(options))


def _view(
    tokens: list[str],
    weights: Tensor | Sequence[Tensor],
    height: int | None,
    options: dict[str, Any],
) -> ExplorerView:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown options {unknown}; known: {sorted(_OPTIONS)}")
    key_tokens = options.pop("key_tokens", None)
    title = options.get("title", "Attention explorer")
    page = explorer_page([ExplorerInput(tokens, weights, key_tokens)], **options)
    longest = max(len(tokens), len(key_tokens) if key_tokens is not None else 0)
    return ExplorerView(page, _height(longest, height), title)


_OPTIONS = ("key_tokens", "title", "description", "layer_names", "layer", "precision")


def show_model(
    model: nn.Module,
    text: str,
    *,
    tokenizer: _Tokenizer | None = None,
    height: int | None = None,
    title: str | None = None,
    layer: int = 0,
    precision: Precision = "auto",
) -> ExplorerView:
    """The explorer of a model's attention on a text.

    Args:
        model: A :class:`attnkit.interop.SentenceEncoder` (it tokenizes the text itself), or an
            attnkit model called as ``model(ids, return_weights=True)`` (a ``TransformerLM``
            from ``from_pretrained``, ...), which needs ``tokenizer``.
        text: The text.
        tokenizer: For models without their own: a ``tokenizers.Tokenizer`` (``encode`` returns an
            object with ``.ids``) or a transformers tokenizer (``encode`` returns a list of ids);
            ``decode([id])`` labels each token.
        height: The frame's height in pixels (default: from the number of tokens).
        title: The page's title (default: the model's class and the text).
        layer: The layer the head view opens on.
        precision: How the weights are embedded (see :mod:`attnkit.explorer`).

    Returns:
        The view.

    Raises:
        TypeError: If ``text`` is not a string, or a model without a tokenizer gets none.
        ValueError: As :func:`show`; if the text gives fewer than 2 tokens.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    name = type(model).__name__
    shown = text if len(text) <= 60 else text[:59] + "…"
    options: dict[str, Any] = {
        "title": title if title is not None else f"{name}: {shown}",
        "description": f"Attention of every layer and head of {name} on: {text}",
        "layer": layer,
        "precision": precision,
    }
    attention_weights = getattr(model, "attention_weights", None)
    if tokenizer is None and callable(attention_weights):
        tokens, weights = attention_weights(text)  # SentenceEncoder: (layers, H, L, L)
        return _view(list(tokens), weights, height, options)
    if tokenizer is None:
        raise TypeError(f"{name} has no tokenizer of its own: pass tokenizer=")
    encoded = tokenizer.encode(text)
    ids = list(getattr(encoded, "ids", encoded))
    if len(ids) < 2:
        raise ValueError(f"{text!r} gives {len(ids)} token(s); the explorer needs at least 2")
    labels = [tokenizer.decode([i]) or str(i) for i in ids]
    weights = _model_weights(model, torch.tensor([ids]))
    return _view(labels, weights, height, options)
