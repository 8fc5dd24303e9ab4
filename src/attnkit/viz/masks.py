"""Pictures of attention variants: which keys a ``mask_mod`` lets each query see (with the block
structure :func:`attnkit.flex.create_block_mask` would find) and the bias a ``score_mod`` adds.

Both evaluate the mod with plain torch on broadcast index tensors, as
:mod:`attnkit.flex` calls it: ``b (1, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, L, 1)``,
``kv_idx (1, 1, 1, S)``, so any mod written for :mod:`attnkit.flex` (or torch's FlexAttention,
where it uses tensor operations only) can be drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict, cast

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from attnkit.viz._common import new_figure

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GridOptions", "bias_values", "block_states", "mask_grid", "mask_picture", "score_bias"]

#: Colours of a key a query may not see / may see.
MASK_COLOURS = ("#f2f2f2", "#3b75af")
#: Edge colours of the blocks: every score inside allowed / some / none (empty blocks: no edge).
BLOCK_COLOURS = {"full": "#2ca02c", "partial": "#ff7f0e"}
BIAS_CMAP = "RdBu_r"


def _name(mod: Callable[..., Any]) -> str:
    return str(getattr(mod, "__name__", type(mod).__name__))


def _index(L: int, S: int, heads: int) -> tuple[torch.Tensor, ...]:
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(heads).view(1, heads, 1, 1)
    return b, h, torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)


def _check_lengths(L: int, S: int | None) -> int:
    S = L if S is None else S
    bad = {n: v for n, v in {"L": L, "S": S}.items() if isinstance(v, bool) or
           not isinstance(v, int) or v < 1}  # fmt: skip
    if bad:
        raise ValueError(f"lengths must be positive ints, got {bad}")
    return S


class GridOptions(TypedDict, total=False):
    """Which batch entry and head a ``mask_mod`` is drawn for (options of :func:`mask_grid` and
    :func:`mask_picture`).

    Attributes:
        batch: The batch entry ``b`` (default 0).
        head: The head ``h`` (default 0).
    """

    batch: int
    head: int


def mask_grid(
    mask_mod: Callable[..., Any], L: int, S: int | None = None, **grid: Unpack[GridOptions]
) -> torch.Tensor:
    """``mask_mod`` evaluated on every (query, key) pair of one batch entry and head.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
        L: Queries.
        S: Keys (default ``L``).
        batch: The batch entry ``b``.
        head: The head ``h``.

    Returns:
        Bool ``(L, S)``: ``True`` where query ``i`` may see key ``j``.

    Raises:
        TypeError: For an option besides ``batch`` and ``head``.
        ValueError: For bad lengths, or a ``mask_mod`` that fails on index tensors or returns
            something that is not a bool tensor broadcastable to ``(L, S)`` (naming it).
    """
    unknown = sorted(set(grid) - GridOptions.__optional_keys__)
    if unknown:
        raise TypeError(f"unknown grid options {unknown}; known: batch, head")
    batch, head = grid.get("batch", 0), grid.get("head", 0)
    S = _check_lengths(L, S)
    b, _, q, kv = _index(L, S, 1)
    try:
        out = mask_mod(b + batch, torch.full_like(b, head), q, kv)
    except Exception as err:
        raise ValueError(
            f"mask_mod {_name(mask_mod)} failed on index tensors: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"mask_mod {_name(mask_mod)} must return a bool tensor, got {got}")
    try:
        return out.expand(1, 1, L, S)[0, 0].clone()
    except RuntimeError as err:
        raise ValueError(
            f"mask_mod {_name(mask_mod)} returned shape {tuple(out.shape)}, which does not "
            f"broadcast to ({L}, {S})"
        ) from err


def block_states(allowed: torch.Tensor, block_size: int) -> np.ndarray:
    """The state of each ``block_size`` x ``block_size`` block of a ``(L, S)`` bool mask.

    Returns:
        int array ``(query blocks, key blocks)``: 0 empty (skipped), 1 partial (the mask is
        evaluated there), 2 full (no mask work).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    L, S = allowed.shape
    nq, nk = -(-L // block_size), -(-S // block_size)
    padded = torch.zeros(nq * block_size, nk * block_size, dtype=torch.int32)
    counts = torch.zeros_like(padded)
    padded[:L, :S] = allowed.int()
    counts[:L, :S] = 1
    tiles = padded.view(nq, block_size, nk, block_size).sum((1, 3))
    sizes = counts.view(nq, block_size, nk, block_size).sum((1, 3))
    states = torch.where(tiles == 0, 0, torch.where(tiles == sizes, 2, 1))
    return states.numpy()


def mask_picture(
    mask_mod: Callable[..., Any],
    L: int,
    S: int | None = None,
    *,
    block_size: int | None = None,
    title: str | None = None,
    ax: Axes | None = None,
    **grid: Unpack[GridOptions],
) -> Figure:
    """Which keys each query may see under ``mask_mod``, with its block structure.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (a preset of
            :mod:`attnkit.flex.presets` or your own).
        L: Queries (rows).
        S: Keys (columns; default ``L``).
        batch: The batch entry drawn.
        head: The head drawn.
        block_size: Draw the blocks of this size over the mask: a green edge where every score
            of the block is allowed (computed with no mask work), orange where some are (the
            mask is evaluated), none where the block is skipped. ``None``: no blocks.
        title: Figure title (default: the mod's name).
        ax: Draw into this axes instead of a new figure.

    Returns:
        The figure (``ax.figure`` when ``ax`` is given).

    Raises:
        ValueError: See :func:`mask_grid` and :func:`block_states`.
    """
    allowed = mask_grid(mask_mod, L, S, **grid)
    L, S = allowed.shape
    if ax is None:
        cell = min(0.3, 6.0 / max(L, S))
        fig = new_figure(1.6 + cell * S, 1.4 + cell * L)
        ax = fig.add_subplot()
    else:
        fig = cast(Figure, ax.get_figure())
    ax.imshow(allowed.numpy(), cmap=ListedColormap(MASK_COLOURS), vmin=0, vmax=1,
              interpolation="nearest", aspect="equal")  # fmt: skip
    ax.set_xlabel("key kv_idx")
    ax.set_ylabel("query q_idx")
    share = float(allowed.double().mean())
    label = title if title is not None else _name(mask_mod)
    if block_size is not None:
        states = block_states(allowed, block_size)
        for (i, j), state in np.ndenumerate(states):
            if state == 0:
                continue
            colour = BLOCK_COLOURS["full" if state == 2 else "partial"]
            corner = (j * block_size - 0.5, i * block_size - 0.5)
            ax.add_patch(Rectangle(corner, block_size, block_size, fill=False, lw=1.5,
                                   edgecolor=colour))  # fmt: skip
        computed = int((states > 0).sum())
        label += f"\n{computed} of {states.size} blocks computed ({int((states == 2).sum())} full)"
    ax.set_title(f"{label}\n{share:.0%} of the scores kept", fontsize=10)
    return fig


def bias_values(
    score_mod: Callable[..., Any],
    L: int,
    S: int | None = None,
    *,
    num_heads: int = 1,
    batch: int = 0,
) -> torch.Tensor:
    """What ``score_mod`` adds to a zero score, for every head, query and key.

    For a bias (ALiBi, a relative-bias table) this is the bias itself; a ``score_mod`` that
    rescales the score (soft-capping) leaves zero at zero.

    Returns:
        float64 ``(num_heads, L, S)``.

    Raises:
        ValueError: For bad sizes, or a ``score_mod`` that fails on index tensors or returns the
            wrong shape (naming it).
    """
    S = _check_lengths(L, S)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    b, h, q, kv = _index(L, S, num_heads)
    zero = torch.zeros(1, num_heads, L, S)
    try:
        out = score_mod(zero, b + batch, h, q, kv)
    except Exception as err:
        raise ValueError(
            f"score_mod {_name(score_mod)} failed on index tensors: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(out, torch.Tensor) or out.shape != zero.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"score_mod {_name(score_mod)} must return a score tensor of shape "
            f"{tuple(zero.shape)}, got {got}"
        )
    return out[0].detach().double()


def score_bias(
    score_mod: Callable[..., Any],
    L: int,
    S: int | None = None,
    *,
    num_heads: int = 1,
    title: str | None = None,
) -> Figure:
    """One heatmap per head of :func:`bias_values`, on one symmetric colour scale (blue:
    the score is lowered, red: raised).

    Raises:
        ValueError: See :func:`bias_values`.

    Returns:
        The figure.
    """
    bias = bias_values(score_mod, L, S, num_heads=num_heads).numpy()
    H = bias.shape[0]
    cols = min(H, 4)
    rows = -(-H // cols)
    fig = new_figure(2.4 * cols + 1.2, 2.4 * rows + 0.8)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    vmax = max(float(np.abs(bias).max()), 1e-12)
    image = None
    for h, ax in enumerate(axes):
        if h >= H:
            ax.set_axis_off()
            continue
        image = ax.imshow(bias[h], cmap=BIAS_CMAP, vmin=-vmax, vmax=vmax, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=10)
        ax.set_xlabel("key kv_idx", fontsize=9)
        ax.set_ylabel("query q_idx", fontsize=9)
    assert image is not None  # H >= 1: the first axes holds a head
    fig.colorbar(image, ax=list(axes), label="added to the score", shrink=0.85)
    fig.suptitle(title if title is not None else f"Bias of {_name(score_mod)}")
    return fig
