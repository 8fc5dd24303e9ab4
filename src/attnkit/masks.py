"""Mask builders. One convention everywhere: bool, ``True`` = may attend.

Every builder returns a bool tensor that broadcasts against attention scores of shape
``(B, H, L, S)``. Float masks are additive (``0`` keeps a score, ``-inf`` removes it); convert with
:func:`to_additive`. Combine constraints with :func:`combine_masks` (logical AND).

Alignment: for ``L != S`` the queries are the *last* ``L`` positions of the key sequence
("bottom-right" alignment), which is what cached decoding needs: query ``i`` sits at absolute
position ``i + S - L``. ``align="top_left"`` puts query ``i`` at position ``i`` instead.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Align = Literal["bottom_right", "top_left"]

__all__ = [
    "causal_mask",
    "combine_masks",
    "document_mask",
    "padding_mask",
    "sliding_window_mask",
    "to_additive",
]


def _query_positions(L: int, S: int, align: Align, device: torch.device | str | None) -> Tensor:
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    offset = S - L if align == "bottom_right" else 0
    return torch.arange(L, device=device) + offset


def _check_lengths(L: int, S: int) -> None:
    if L < 0 or S < 0:
        raise ValueError(f"lengths must be non-negative, got L={L}, S={S}")


def causal_mask(
    L: int,
    S: int | None = None,
    *,
    align: Align = "bottom_right",
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal mask: query ``i`` may attend key ``j`` iff ``j <= pos(i)``.

    Args:
        L: Query length.
        S: Key length (defaults to ``L``).
        align: ``"bottom_right"`` (query ``i`` at position ``i + S - L``, as in cached decoding)
            or ``"top_left"`` (query ``i`` at position ``i``). Identical when ``L == S``.
        device: Device of the result.

    Returns:
        Bool tensor of shape ``(L, S)``.
    """
    S = L if S is None else S
    _check_lengths(L, S)
    pos = _query_positions(L, S, align, device)  # (L,)
    keys = torch.arange(S, device=device)  # (S,)
    return keys[None, :] <= pos[:, None]  # (L, S)


def sliding_window_mask(
    L: int,
    S: int | None = None,
    *,
    window: int,
    causal: bool = True,
    align: Align = "bottom_right",
    device: torch.device | str | None = None,
) -> Tensor:
    """Local attention: query at position ``p`` sees keys ``j`` with ``|p - j| < window``.

    With ``causal=True`` (the usual sliding window of Mistral/Longformer-style decoders) this is
    ``p - window < j <= p``: the query itself and the ``window - 1`` keys before it.

    Args:
        L: Query length.
        S: Key length (defaults to ``L``).
        window: Window size, at least 1.
        causal: Also forbid keys after the query.
        align: Query alignment for ``L != S`` (see the module docstring).
        device: Device of the result.

    Returns:
        Bool tensor of shape ``(L, S)``.

    Raises:
        ValueError: If ``window < 1``.
    """
    S = L if S is None else S
    _check_lengths(L, S)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    pos = _query_positions(L, S, align, device)[:, None]  # (L, 1)
    keys = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = (keys > pos - window) & (keys < pos + window)
    if causal:
        allowed &= keys <= pos
    return allowed  # (L, S)


def padding_mask(lengths: Tensor, S: int | None = None) -> Tensor:
    """Key padding mask from lengths: key ``j`` of batch ``b`` is real iff ``j < lengths[b]``.

    Args:
        lengths: Integer tensor of shape ``(B,)``.
        S: Padded key length (defaults to ``lengths.max()``).

    Returns:
        Bool tensor of shape ``(B, 1, 1, S)`` (broadcasts over heads and queries).

    Raises:
        TypeError: If ``lengths`` is not an integer tensor.
        ValueError: If ``lengths`` is not 1-D, is negative, or exceeds ``S``.
    """
    if (
        not isinstance(lengths, Tensor)
        or lengths.dtype.is_floating_point
        or lengths.dtype == torch.bool
    ):
        raise TypeError(
            f"lengths must be an integer tensor, got {type(lengths).__name__}"
            f"{'' if not isinstance(lengths, Tensor) else ' of dtype ' + str(lengths.dtype)}"
        )
    if lengths.dim() != 1:
        raise ValueError(f"lengths must have shape (B,), got {tuple(lengths.shape)}")
    max_len = int(lengths.max()) if lengths.numel() else 0
    S = max_len if S is None else S
    if lengths.numel() and (int(lengths.min()) < 0 or max_len > S):
        raise ValueError(f"lengths must lie in [0, S={S}], got {lengths.tolist()}")
    keys = torch.arange(S, device=lengths.device)
    return (keys[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


def document_mask(segment_ids: Tensor, kv_segment_ids: Tensor | None = None) -> Tensor:
    """Block-diagonal mask for packed sequences: attend only within the same document.

    Args:
        segment_ids: Integer document ids of the queries, shape ``(B, L)``.
        kv_segment_ids: Document ids of the keys, shape ``(B, S)`` (defaults to ``segment_ids``).

    Returns:
        Bool tensor of shape ``(B, 1, L, S)``.

    Raises:
        ValueError: If the ids are not 2-D or their batch sizes differ.
    """
    kv = segment_ids if kv_segment_ids is None else kv_segment_ids
    if segment_ids.dim() != 2 or kv.dim() != 2 or segment_ids.shape[0] != kv.shape[0]:
        raise ValueError(
            "segment ids must have shapes (B, L) and (B, S), got "
            f"{tuple(segment_ids.shape)} and {tuple(kv.shape)}"
        )
    return (segment_ids[:, :, None] == kv[:, None, :])[:, None]  # (B, 1, L, S)


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """AND together bool masks (``None`` entries are ignored); shapes broadcast.

    Returns:
        The combined bool mask, or ``None`` if every argument is ``None``.

    Raises:
        TypeError: If a mask is not a bool tensor.
    """
    out: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        if not isinstance(m, Tensor) or m.dtype != torch.bool:
            dtype = m.dtype if isinstance(m, Tensor) else type(m).__name__
            raise TypeError(f"combine_masks takes bool masks (True = may attend), got {dtype}")
        out = m if out is None else out & m
    return out


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Convert a bool mask (True = may attend) to an additive float mask (0 or -inf)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"to_additive expects a bool mask, got {mask.dtype}")
    zeros = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zeros, torch.tensor(float("-inf"), dtype=dtype, device=mask.device))


def attention_mask_from_padding(
    mask: Tensor | None = None, lengths: Tensor | None = None, *, seq_len: int | None = None
) -> Tensor | None:
    """Turn a key-padding mask or lengths into a mask for attention scores ``(B, H, L, S)``.

    Args:
        mask: ``(B, S)`` bool (``True`` = real token) -> ``(B, 1, 1, S)``; ``(B, L, S)`` ->
            ``(B, 1, L, S)``; a 4-D bool or additive float mask is returned unchanged.
        lengths: Integer ``(B,)`` real lengths (alternative to ``mask``), padded to ``seq_len``.
        seq_len: Key length for ``lengths``.

    Returns:
        A mask broadcastable to ``(B, H, L, S)``, or ``None``.

    Raises:
        ValueError: If both ``mask`` and ``lengths`` are given, or ``mask`` has 1 dim.
    """
    if mask is not None and lengths is not None:
        raise ValueError("pass either mask or lengths, not both")
    if lengths is not None:
        return padding_mask(lengths, seq_len)
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask[:, None, None, :]  # (B, 1, 1, S)
    if mask.dim() == 3:
        return mask[:, None]  # (B, 1, L, S)
    if mask.dim() == 4:
        return mask
    raise ValueError(f"mask must be (B, S), (B, L, S) or (B, H, L, S), got {tuple(mask.shape)}")


def token_mask(
    mask: Tensor | None, lengths: Tensor | None, L: int, device: torch.device
) -> Tensor | None:
    """``(B, L)`` bool of real tokens (``True`` = real), if the padding is known per token.

    Args:
        mask: A ``(B, L)`` bool key-padding mask (returned as is); other masks give ``None``.
        lengths: Integer ``(B,)`` real lengths (used instead of ``mask`` when given).
        L: Sequence length.
        device: Device of the result built from ``lengths``.

    Returns:
        ``(B, L)`` bool, or ``None`` when the padding is not known per token.
    """
    if lengths is not None:
        return torch.arange(L, device=device)[None, :] < lengths.to(device)[:, None]
    if mask is not None and mask.dim() == 2 and mask.dtype == torch.bool:
        return mask
    return None
