"""The keyword options of the flash loop (:mod:`attnkit.kernels.attention`), declared once:
the scale and reach of its tiles' scores (:class:`TileOptions`) and where the queries sit
(:class:`FlashOptions`), read with their defaults."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
from torch import Tensor

if TYPE_CHECKING:
    from typing_extensions import Required

__all__ = [
    "FLASH_KEYS",
    "TILE_KEYS",
    "FlashOptions",
    "TileOptions",
    "alibi_slopes",
    "first_query",
    "tile_options",
]


class TileOptions(TypedDict, total=False):
    """The scores of the flash loop's tiles: their scale and which keys each query may attend
    (options of :func:`~attnkit.kernels.attention.flash_attention`,
    :func:`~attnkit.kernels.attention.flash_attention_backward` and
    :func:`~attnkit.kernels.attention.capped_attention`).

    Attributes:
        scale: Multiplier of the scores (required).
        causal: Keys after a query are masked (default ``False``).
        window: Keys ``window`` or more positions away are masked (default None: no window).
    """

    scale: Required[float]
    causal: bool
    window: int | None


TILE_KEYS = frozenset(TileOptions.__required_keys__ | TileOptions.__optional_keys__)


class FlashOptions(TileOptions, total=False):
    """:class:`TileOptions` with where the queries sit and ALiBi's slopes: the options the flash
    forward and its backward share (the backward takes the forward's).

    Attributes:
        first: Key position of the first query (default ``S - L``: bottom-right aligned).
        alibi_slopes: ALiBi's slope of each query head, ``(H,)`` (default None: no bias): query
            head ``h``'s scaled score of key ``j`` at query position ``p`` gets
            ``alibi_slopes[h] * (j - p)`` added.
    """

    first: int | None
    alibi_slopes: Tensor | None


FLASH_KEYS = frozenset(FlashOptions.__required_keys__ | FlashOptions.__optional_keys__)


def tile_options(
    name: str, options: TileOptions, known: frozenset[str]
) -> tuple[float, bool, int | None]:
    """``(scale, causal, window)`` of ``options`` with their defaults.

    Raises:
        TypeError: Without ``scale``, or for an option not in ``known`` (naming ``name``).
    """
    unknown = sorted(set(options) - known)
    if unknown or "scale" not in options:
        raise TypeError(
            f"{name} takes scale and the options {sorted(known - {'scale'})}, got {sorted(options)}"
        )
    return options["scale"], options.get("causal", False), options.get("window")


def first_query(options: FlashOptions, q: Tensor, k: Tensor) -> int:
    """The key position of the first query: ``first``, or ``S - L`` (bottom-right aligned)."""
    first = options.get("first")
    return k.shape[2] - q.shape[2] if first is None else first


def alibi_slopes(name: str, options: FlashOptions, heads: int) -> Tensor | None:
    """``options``' ALiBi slopes as ``heads`` contiguous float32 values on the CPU, or None.

    Raises:
        TypeError: For slopes that are not a float tensor (naming ``name``).
        ValueError: For slopes not of shape ``(heads,)``, or not finite.
    """
    slopes = options.get("alibi_slopes")
    if slopes is None:
        return None
    if not isinstance(slopes, Tensor) or not slopes.is_floating_point():
        raise TypeError(f"{name} takes alibi_slopes as a float tensor, got {slopes!r}")
    if slopes.shape != (heads,):
        raise ValueError(
            f"{name} needs alibi_slopes of shape ({heads},) (one per query head), got "
            f"{tuple(slopes.shape)}"
        )
    slopes = slopes.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(slopes).all()):
        raise ValueError(f"{name} needs finite alibi_slopes, got {slopes.tolist()}")
    return slopes
