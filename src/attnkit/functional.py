"""The one attention kernel path of attnkit.

Shape legend (used across the package):
    B batch, H query heads, K key/value heads, L query length, S key length,
    D model dim, E head dim.

Every module in attnkit computes ``softmax(Q K^T * scale + mask) V`` by calling
:func:`scaled_dot_product_attention`; dispatch between kernels lives here and only here:

* no weights requested   -> torch's fused ``scaled_dot_product_attention`` (``is_causal`` instead
  of a materialized mask whenever that is equivalent);
* structured sparsity (``window``, ``segment_ids``, ``key_lengths``) on long sequences
  -> :mod:`attnkit.sparse`, which skips key blocks that are entirely masked;
* weights requested (or no keys at all) -> the explicit math below, which is also the reference
  that the tests check the fused path against.

A query row that may attend no key at all gives an output row of exactly zero (and zero weights,
zero gradients) on every path, never NaN.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import masks as M
from attnkit import sparse

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["scaled_dot_product_attention"]


class Options(M.StructureArgs, total=False):
    """The keyword options of :func:`scaled_dot_product_attention` besides ``return_weights``."""

    scale: float | None
    dropout_p: float


@overload
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = ...,
    *,
    return_weights: Literal[False] = ...,
    **options: Unpack[Options],
) -> Tensor: ...
@overload
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = ...,
    *,
    return_weights: Literal[True],
    **options: Unpack[Options],
) -> tuple[Tensor, Tensor]: ...
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    window: int | None = None,
    segment_ids: Tensor | None = None,
    key_lengths: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention: ``softmax(q k^T * scale + mask) v``.

    Args:
        q: Queries.
        k: Keys. With heads at dim -3, ``k``/``v`` may have fewer heads than ``q``
            (grouped-query attention) when ``H`` is a multiple of ``K``; query head ``h`` uses
            key/value head ``h // (H // K)``.
        v: Values.
        mask: Bool (``True`` = may attend) or float (added to the scores), broadcastable to
            ``(..., L, S)``.
        causal: Query ``i`` may attend key ``j`` iff ``j <= i + (S - L)`` (bottom-right aligned:
            the queries are the last ``L`` positions, as in cached decoding). ANDed with ``mask``.
        window: Sliding window: the query at position ``p`` sees keys ``j`` with
            ``|p - j| < window`` (with ``causal``: ``p - window < j <= p``).
        segment_ids: Integer document ids of the keys, shape ``(B, S)``, for packed sequences;
            the queries take the last ``L`` ids. Attention stays within a document.
        key_lengths: Integer tensor ``(B,)``: key ``j`` of batch ``b`` is real iff
            ``j < key_lengths[b]``.
        scale: Multiplier of the scores; defaults to ``1 / sqrt(E)``.
        dropout_p: Dropout probability on the attention weights (pass 0 at evaluation).
        return_weights: Also return the attention weights (forces the explicit path).

    Returns:
        ``out``, or ``(out, weights)`` when ``return_weights`` is true. ``weights`` are the
        probabilities applied to ``v`` (after dropout), with the query heads expanded.

    Shape:
        q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, Ev)`` (or without a head
        dim: ``(L, E)``, ``(S, E)``, ``(S, Ev)``) -> out ``(..., H, L, Ev)``,
        weights ``(..., H, L, S)``.

    Raises:
        TypeError: Non-tensor inputs, mixed or non-float dtypes, unsupported mask dtype,
            non-integer ``key_lengths``.
        ValueError: Mismatched head dims or lengths, head counts that do not divide, masks that
            do not broadcast, mixed devices, non-finite ``scale``, bad ``dropout_p``/``window``,
            badly shaped or out-of-range ``segment_ids``/``key_lengths`` (or of another batch
            size than ``q``).
    """
    check_inputs(q, k, v, mask, scale, dropout_p)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    structure = M.Structure(causal, window, segment_ids, key_lengths)
    if structure.batched and q.dim() != 4:
        raise ValueError(
            f"segment_ids/key_lengths need q with batch and head dims (B, H, L, E), got "
            f"{tuple(q.shape)}"
        )
    structure.check(L, S, batch=q.shape[0] if structure.batched else None)

    if structure.sparse and mask is None and not return_weights and S > 0:
        plan = sparse.faster_plan(L, S, structure, batch=math.prod(q.shape[:-3]), device=q.device)
        if plan is not None:
            return sparse.tiled_attention(q, k, v, plan, scale=scale, dropout_p=dropout_p)

    # Fold causal/window/documents/padding into one bool constraint, unless plain causal can be
    # expressed as is_causal (L == S: top-left and bottom-right alignment coincide).
    is_causal = causal and not structure.sparse and mask is None and L == S and not return_weights
    constraint = None
    if structure.sparse:
        constraint = structure.mask(L, S, device=q.device)  # (B or 1, 1, L, S)
        if not structure.batched:
            constraint = constraint[0, 0]  # window only: (L, S) broadcasts against any q
    elif causal and not is_causal and L > 1:  # a single query at the end sees every key
        constraint = M.causal_mask(L, S, device=q.device)
    mask = _merge(mask, constraint, q.dtype)

    if return_weights or S == 0:
        out, weights = _explicit_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p)
        return (out, weights) if return_weights else out
    return _fused_attention(
        q, k, v, mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p, gqa=gqa
    )


def _merge(mask: Tensor | None, constraint: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """AND a bool constraint into a user mask (bool, or additive float kept additive)."""
    if constraint is None:
        return mask
    if mask is None:
        return constraint
    if mask.dtype == torch.bool:
        return mask & constraint
    return mask.to(dtype).masked_fill(~constraint, float("-inf"))


def _row_ok(mask: Tensor) -> Tensor:
    """Bool ``(..., L, 1)``: does each query row have at least one allowed key?"""
    allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
    return allowed.any(dim=-1, keepdim=True)


def _fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    gqa: bool,
) -> Tensor:
    row_ok = None
    if mask is not None:
        row_ok = _row_ok(mask)
        # Rows without any allowed key would be softmax over all -inf (NaN on some backends):
        # let them attend everywhere, then zero them. Gradients through them are then zero.
        if mask.dtype == torch.bool:
            mask = mask | ~row_ok
        else:
            mask = mask.to(q.dtype).masked_fill(~row_ok, 0.0)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=gqa,
    )
    # torch's fused CPU kernel treats a query row containing NaN like a fully-masked row and
    # returns zeros; attnkit propagates non-finite inputs instead of silently hiding them. One
    # float32 sum per row finds them (inf or NaN anywhere makes the sum non-finite). Adding the
    # (..., L, 1) poison costs one pass and its backward passes the gradient through untouched.
    finite = torch.isfinite(q.sum(dim=-1, keepdim=True, dtype=torch.float32))  # (..., L, 1)
    out = out + torch.where(finite, 0.0, float("nan")).to(out.dtype)
    if row_ok is not None:
        out = torch.where(row_ok, out, 0.0)  # no key to attend: zero, even for a NaN query
    return out


def _explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """The textbook math, with the softmax in float32 and fully-masked rows defined as zero."""
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)  # (..., H, S, E)
        v = v.repeat_interleave(groups, dim=-3)  # (..., H, S, Ev)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., H, L, S)
    row_ok = None
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
        row_ok = _row_ok(mask)
        scores = scores.masked_fill(~row_ok, 0.0)  # finite softmax input, zeroed below
    # Low-precision inputs get a float32 softmax; float64 stays float64.
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    if row_ok is not None:
        weights = weights.masked_fill(~row_ok, 0.0)
    weights = weights.to(v.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights  # (..., H, L, Ev), (..., H, L, S)


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, dropout_p: float
) -> None:
    """The checks of :func:`scaled_dot_product_attention` on everything but the structure.

    Raises:
        TypeError: Non-tensor inputs, mixed or non-float dtypes, unsupported mask dtype.
        ValueError: Mismatched shapes, head counts that do not divide, masks that do not
            broadcast, mixed devices, non-finite ``scale``, bad ``dropout_p``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(
            f"q, k, v must share one floating dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    if not (q.dim() == k.dim() == v.dim()) or q.dim() < 2:
        raise ValueError(
            "q, k, v must have the same number (>= 2) of dims, got shapes "
            f"q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k head dims differ: q={tuple(q.shape)} (E={q.shape[-1]}), "
            f"k={tuple(k.shape)} (E={k.shape[-1]})"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must agree in all but the last dim, got k={tuple(k.shape)}, "
            f"v={tuple(v.shape)}"
        )
    if q.dim() >= 3:
        H, K = q.shape[-3], k.shape[-3]
        if q.shape[:-3] != k.shape[:-3]:
            raise ValueError(f"q and k batch dims differ: q={tuple(q.shape)}, k={tuple(k.shape)}")
        if K == 0 or H % K:
            raise ValueError(
                f"query heads ({H}) must be a multiple of key/value heads ({K}) "
                f"(q={tuple(q.shape)}, k={tuple(k.shape)})"
            )
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(
                f"mask must be bool (True = may attend) or float (additive), got {mask.dtype}"
            )
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
        target = (*q.shape[:-1], k.shape[-2])
        try:
            ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                f"{tuple(target)}"
            )
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
