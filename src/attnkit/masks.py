"""Mask builders and the mask rules. One convention everywhere: bool, ``True`` = may attend.

Every builder returns a bool tensor that broadcasts against attention scores of shape
``(B, H, L, S)``. Float masks are additive (``0`` keeps a score, ``-inf`` removes it); convert with
:func:`to_additive`. Combine constraints with :func:`combine_masks` (logical AND).

The rules themselves (causal, sliding window, key padding, documents) are written once, here; the
builders, :func:`structured_mask` and the block-sparse kernel (:mod:`attnkit.sparse`) all use
them. :class:`Structure` carries the structured constraints of
:func:`attnkit.functional.scaled_dot_product_attention`, validates them once and evaluates them.

Alignment: for ``L != S`` the queries are the *last* ``L`` positions of the key sequence
("bottom-right" alignment), which is what cached decoding needs: query ``i`` sits at absolute
position ``i + S - L``. ``align="top_left"`` puts query ``i`` at position ``i`` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypedDict

import torch
from torch import Tensor

if TYPE_CHECKING:
    from typing_extensions import Unpack

Align = Literal["bottom_right", "top_left"]

__all__ = [
    "NonFinite",
    "Span",
    "Structure",
    "StructureArgs",
    "allowed",
    "as_additive",
    "causal_mask",
    "checked",
    "combine_masks",
    "document_mask",
    "is_finite",
    "may_hide_non_finite",
    "offset_mask",
    "padding_mask",
    "restrict",
    "row_has_key",
    "sliding_window_mask",
    "structured_mask",
    "to_additive",
]


# The mask rules, each written once. Arguments are integer positions (or ids, lengths) that
# broadcast against each other; the builders below and Structure.allows all use these.


def _causal(pos: Tensor, key: Tensor) -> Tensor:
    return key <= pos  # no key after the query


def _in_window(pos: Tensor, key: Tensor, window: int) -> Tensor:
    return (pos - key).abs() < window


def _real_key(key: Tensor, lengths: Tensor) -> Tensor:
    return key < lengths  # keys at or after the length are padding


def _same_doc(query_docs: Tensor, key_docs: Tensor) -> Tensor:
    return query_docs == key_docs


def _query_positions(L: int, S: int, align: Align, device: torch.device | str | None) -> Tensor:
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    offset = S - L if align == "bottom_right" else 0
    return torch.arange(L, device=device) + offset


def _check_lengths(L: int, S: int) -> None:
    if L < 0 or S < 0:
        raise ValueError(f"lengths must be non-negative, got L={L}, S={S}")


def _check_window(window: int | None) -> None:
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be a positive int, got {window!r}")


def _check_key_lengths(name: str, lengths: Tensor, S: int) -> None:
    """``lengths``: integer ``(B,)`` in ``[0, S]``."""
    if (
        not isinstance(lengths, Tensor)
        or lengths.dtype.is_floating_point
        or lengths.dtype == torch.bool
    ):
        raise TypeError(
            f"{name} must be an integer tensor, got {type(lengths).__name__}"
            f"{'' if not isinstance(lengths, Tensor) else ' of dtype ' + str(lengths.dtype)}"
        )
    if lengths.dim() != 1:
        raise ValueError(f"{name} must have shape (B,), got {tuple(lengths.shape)}")
    # a compiled graph cannot branch on values (torch.compile(fullgraph=True)); it skips this
    if (
        not torch.compiler.is_compiling()
        and lengths.numel()
        and (int(lengths.min()) < 0 or int(lengths.max()) > S)
    ):
        raise ValueError(f"{name} must be in [0, S={S}], got {lengths.tolist()}")


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
    return _causal(pos[:, None], keys[None, :])  # (L, S)


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
    _check_window(window)
    pos = _query_positions(L, S, align, device)[:, None]  # (L, 1)
    keys = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = _in_window(pos, keys, window)  # (L, S)
    return allowed & _causal(pos, keys) if causal else allowed


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
    if S is None and isinstance(lengths, Tensor) and lengths.numel():
        S = int(lengths.max())
    S = S or 0
    _check_key_lengths("lengths", lengths, S)
    keys = torch.arange(S, device=lengths.device)
    return _real_key(keys[None, :], lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


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
    return _same_doc(segment_ids[:, :, None], kv[:, None, :])[:, None]  # (B, 1, L, S)


@dataclass(frozen=True)
class Structure:
    """Structured constraints on attention, ANDed: what :func:`structured_mask` turns dense.

    The query ``i`` of ``L`` sits at key position ``p = i + (S - L)`` (bottom-right alignment).

    Attributes:
        causal: Query ``i`` may attend key ``j`` iff ``j <= p``.
        window: Sliding window: keys with ``|p - j| < window``; at least 1.
        segment_ids: Integer document ids of the keys, ``(B, S)``; queries take the last ``L``
            ids (so ``L <= S``). Attention stays within a document; ids need not be contiguous.
        key_lengths: Integer ``(B,)``: key ``j`` of batch ``b`` is real iff ``j < key_lengths[b]``.
    """

    causal: bool = False
    window: int | None = None
    segment_ids: Tensor | None = None
    key_lengths: Tensor | None = None

    @property
    def batched(self) -> bool:
        """Whether the constraints differ per batch element (documents or padding)."""
        return self.segment_ids is not None or self.key_lengths is not None

    @property
    def sparse(self) -> bool:
        """Whether there is more than plain causality (a window, documents or padding)."""
        return self.window is not None or self.batched

    def check(self, L: int, S: int, *, batch: int | None = None) -> int:
        """Validate against query length ``L`` and key length ``S``; return the batch size.

        Args:
            L: Query length.
            S: Key length.
            batch: The batch size of the attention inputs; ``None`` takes it from the ids and
                lengths (1 when neither is given).

        Returns:
            The batch size ``B`` that ``segment_ids``/``key_lengths`` broadcast to.

        Raises:
            TypeError: Non-integer ``key_lengths``.
            ValueError: Negative lengths, ``window < 1``, badly shaped or out-of-range
                ids/lengths, batch sizes that do not match.
        """
        _check_lengths(L, S)
        _check_window(self.window)
        sizes = []
        seg = self.segment_ids
        if seg is not None:
            if not isinstance(seg, Tensor) or seg.is_floating_point():
                raise ValueError(f"segment_ids must be an integer tensor, got {seg!r}")
            if seg.dim() != 2 or seg.shape[1] != S:
                raise ValueError(
                    f"segment_ids must have shape (B, S) with S={S}, got {tuple(seg.shape)}"
                )
            if L > S:
                raise ValueError(
                    f"segment_ids need L <= S (queries take the last L ids), got {L=}, {S=}"
                )
            sizes.append(("segment_ids", seg.shape[0]))
        if self.key_lengths is not None:
            _check_key_lengths("key_lengths", self.key_lengths, S)
            sizes.append(("key_lengths", self.key_lengths.shape[0]))
        # no max(..., default=): torch.compile(fullgraph=True) cannot trace it
        B = batch if batch is not None else (max(n for _, n in sizes) if sizes else 1)
        for name, n in sizes:
            if n not in (1, B):
                raise ValueError(f"{name} has batch size {n}, expected {B} (or 1)")
        return B

    def to(self, B: int, S: int, device: torch.device | str | None) -> Structure:
        """Copy with ids as ``(B, S)`` and lengths as ``(B,)`` long tensors on ``device``.

        A batch of 1 is broadcast to ``B``. Expects a :meth:`check`-ed structure.
        """
        seg, lengths = self.segment_ids, self.key_lengths
        return dataclasses.replace(
            self,
            segment_ids=None if seg is None else seg.to(device, torch.long).expand(B, S),
            key_lengths=None if lengths is None else lengths.to(device, torch.long).expand(B),
        )

    def allows(self, i: Tensor, j: Tensor, b: Tensor, *, L: int, S: int) -> Tensor:
        """The rules on index tensors, for a structure made by :meth:`to`.

        Args:
            i: Query indices in ``[0, L)``.
            j: Key indices in ``[0, S)``.
            b: Batch indices.
            L: Query length.
            S: Key length.

        Returns:
            Bool tensor, the broadcast shape of ``i``, ``j`` and ``b``.
        """
        p = i + (S - L)  # the query's position among the keys
        ok = torch.ones_like(j, dtype=torch.bool)
        if self.causal:
            ok = ok & _causal(p, j)
        if self.window is not None:
            ok = ok & _in_window(p, j, self.window)
        if self.key_lengths is not None:
            ok = ok & _real_key(j, self.key_lengths[b])
        if (seg := self.segment_ids) is not None:
            ok = ok & _same_doc(seg[b, p.clamp(0, S - 1)], seg[b, j.clamp(0, S - 1)])
        return ok

    def mask(self, L: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
        """Dense bool mask of these constraints, for a :meth:`check`-ed structure.

        Args:
            L: Query length.
            S: Key length.
            device: Device of the mask (defaults to that of ``segment_ids``/``key_lengths``).

        Returns:
            Bool ``(B or 1, 1, L, S)``: the batch of ``segment_ids``/``key_lengths``, else 1.
        """
        given = [t for t in (self.segment_ids, self.key_lengths) if t is not None]
        B = max(t.shape[0] for t in given) if given else 1  # no max(default=): see check
        device = given[0].device if device is None and given else device
        i = torch.arange(L, device=device).view(1, L, 1)
        j = torch.arange(S, device=device).view(1, 1, S)
        b = torch.arange(B, device=device).view(B, 1, 1)
        ok = self.to(B, S, device).allows(i, j, b, L=L, S=S)
        return ok.expand(B, L, S).unsqueeze(1)  # (B, 1, L, S)

    def constraint(
        self, L: int, S: int, *, device: torch.device | str | None = None
    ) -> Tensor | None:
        """The constraints as the smallest bool mask that broadcasts against the scores:
        ``(B or 1, 1, L, S)`` with documents or lengths, ``(L, S)`` for a window or causality
        alone, ``None`` when they allow every pair (nothing, or causality for one query, which
        sits after every key)."""
        if self.sparse:
            mask = self.mask(L, S, device=device)  # (B or 1, 1, L, S)
            return mask if self.batched else mask[0, 0]
        if self.causal and L > 1:
            return causal_mask(L, S, device=device)
        return None


class StructureArgs(TypedDict, total=False):
    """The fields of :class:`Structure` as keyword arguments (``**structure``)."""

    causal: bool
    window: int | None
    segment_ids: Tensor | None
    key_lengths: Tensor | None


def structured_mask(
    L: int,
    S: int,
    *,
    device: torch.device | str | None = None,
    **structure: Unpack[StructureArgs],
) -> Tensor:
    """Dense bool mask (``True`` = may attend) of the structured constraints.

    Args:
        L: Query length.
        S: Key length.
        device: Device of the mask (defaults to that of ``segment_ids``/``key_lengths``).
        **structure: ``causal``, ``window``, ``segment_ids``, ``key_lengths``, as in
            :class:`Structure`.

    Returns:
        The mask, with a batch dim of ``B`` when ``segment_ids`` or ``key_lengths`` is given,
        else 1.

    Shape:
        segment_ids ``(B, S)``, key_lengths ``(B,)`` -> ``(B or 1, 1, L, S)``.

    Raises:
        TypeError: Non-integer ``key_lengths``.
        ValueError: Negative lengths, ``window < 1``, badly shaped or out-of-range ids/lengths.
    """
    rules = Structure(**structure)
    rules.check(L, S)
    return rules.mask(L, S, device=device)


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


def restrict(mask: Tensor | None, allowed: Tensor | None) -> Tensor | None:
    """``mask`` (bool, or additive float kept additive) further limited to the ``allowed`` keys.

    Shape: both broadcastable to ``(..., L, S)``; ``allowed`` bool.
    """
    if allowed is None:
        return mask
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


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


def checked(
    structure: Mapping[str, Any],
    L: int,
    S: int,
    *,
    batch: int | None,
    mask: Tensor | None,
    dtype: torch.dtype,
) -> tuple[Structure, Tensor | None]:
    """The checked :class:`Structure` of ``structure`` (see :meth:`Structure.check`), and
    ``mask`` with a float mask in the one float-mask rule (:func:`as_additive` for ``dtype``).

    Raises:
        TypeError: Unknown structure fields, non-integer ``key_lengths``.
        ValueError: As :meth:`Structure.check`.
    """
    rules = Structure(**structure)
    rules.check(L, S, batch=batch)
    if mask is not None and mask.dtype != torch.bool:
        mask = as_additive(mask, dtype)
    return rules, mask


def as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A float mask as ``dtype`` whose masked entries are exactly ``-inf``.

    The one rule for float masks: an entry at or below ``torch.finfo(dtype).min`` counts as
    masked, for the mask's own dtype and for ``dtype`` after the cast (so ``-inf``, Hugging
    Face's ``finfo.min`` masks, and values that overflow to ``-inf`` in ``dtype`` all mask).
    """
    out = mask.to(dtype)
    masked = out <= torch.finfo(dtype).min
    if mask.dtype != dtype:
        masked = masked | (mask <= torch.finfo(mask.dtype).min)
    return out.masked_fill(masked, float("-inf"))


def allowed(mask: Tensor) -> Tensor:
    """Bool view of a bool or :func:`as_additive` mask: ``True`` = may attend."""
    return mask if mask.dtype == torch.bool else mask > float("-inf")


def row_has_key(mask: Tensor) -> Tensor:
    """Bool ``(..., L, 1)``: does each query row have at least one allowed key?"""
    return allowed(mask).any(dim=-1, keepdim=True)


class Span(NamedTuple):
    """A span of ``width`` keys starting ``offset`` positions after the first of ``rows``
    consecutive queries, under the positional constraints ``causal`` and ``window``: the
    arguments of :func:`offset_mask`, and the key of the caches of what is built from its
    mask (a call repeats the same few spans)."""

    rows: int
    width: int
    offset: int
    causal: bool
    window: int | None
    device: Any


@functools.lru_cache(maxsize=256)
def offset_mask(
    rows: int, width: int, offset: int, causal: bool, window: int | None, device: Any
) -> Tensor | None:
    """Bool ``(rows, width)`` of the positional constraints (``causal``, ``window``) on a span of
    keys starting ``offset`` positions after the first of ``rows`` consecutive queries, or
    ``None`` if they allow every pair (cached: a call repeats the same few spans; never
    written to)."""
    if not causal and window is None:
        return None
    d = torch.arange(rows, device=device).view(rows, 1) - offset  # query - key position
    d = d - torch.arange(width, device=device).view(1, width)
    ok = torch.ones(rows, width, dtype=torch.bool, device=device)
    if causal:
        ok &= d >= 0
    if window is not None:
        ok &= d.abs() < window
    return None if bool(ok.all()) else ok


# Non-finite inputs reach exactly the queries that may attend them, as in the math: the kernels
# run on keys and values whose non-finite entries are zeroed, and the outputs they reach are set
# to NaN afterwards (functional's attention paths do this around every kernel).


def is_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite."""
    # Fast exit: a NaN or inf anywhere makes the 2-norm NaN or inf (one reduction, also fast in
    # bfloat16, whose plain sum is not). A norm that overflows from finite values only costs the
    # exact per-element test, which alone decides.
    if t.numel() == 0:
        return True
    t = t.detach()  # (a check, not part of any graph)
    return bool(torch.isfinite(torch.linalg.vector_norm(t))) or bool(torch.isfinite(t).all())


def may_hide_non_finite(out: Tensor, weights: Tensor | None) -> bool:
    """Whether a non-finite key or value may have leaked into ``out`` or been hidden by it: a
    row that is not finite, or all zero (no key, or all scores NaN)."""
    if weights is not None and not is_finite(weights):
        return True
    if out.numel() == 0:  # Ev = 0 or no rows: no values to hide anything in
        return False
    # Each row's 2-norm must be positive and finite: a NaN or inf entry makes it NaN or inf, an
    # all-zero row 0 (NaN fails both comparisons). A row whose squares overflow or underflow
    # takes the careful path too, which is only slower; the 2-norm is one reduction kernel.
    low, high = torch.aminmax(torch.linalg.vector_norm(out.detach(), dim=-1))
    return not (float(low) > 0 and float(high) < math.inf)


def nan_rows(q: Tensor) -> Tensor:
    """``(..., L, 1)``: NaN for the query rows holding a NaN or inf, else exactly 0.

    torch's fused CPU kernel treats such a row like a fully-masked one and returns zeros;
    attnkit propagates non-finite inputs instead. The test is per element: ``q * 0`` is 0 for a
    finite entry and NaN otherwise, so the row sums are exactly 0 or NaN (no overflow, unlike
    summing ``q``). Its gradient with respect to ``q`` is zero.
    """
    return q.mul(0).sum(dim=-1, keepdim=True)


def _to_query_heads(flags: Tensor, q: Tensor, dim: int) -> Tensor:
    """Per key/value head flags repeated to the query heads along ``dim``."""
    if q.dim() >= 3 and flags.shape[dim] != q.shape[-3]:
        return flags.repeat_interleave(q.shape[-3] // flags.shape[dim], dim=dim)
    return flags


def _nan_where(x: Tensor, where: Tensor) -> Tensor:
    """``x`` with NaN where ``where`` (broadcast) holds; the gradient passes untouched."""
    return x + torch.where(where, float("nan"), 0.0).to(x.dtype)


@dataclass(frozen=True)
class NonFinite:
    """The non-finite entries of ``k`` and ``v``, and the inputs with them zeroed.

    Attributes:
        k: The keys, their non-finite rows zeroed (a key's score needs all its entries).
        v: The values, their non-finite entries zeroed.
        bad_k: Bool ``(..., K, S)`` non-finite key rows, or None when there are none.
        bad_v: Bool ``(..., K, S, Ev)`` non-finite value entries, or None.
    """

    k: Tensor
    v: Tensor
    bad_k: Tensor | None
    bad_v: Tensor | None

    @classmethod
    def search(cls, k: Tensor, v: Tensor) -> NonFinite:
        """Find and zero the non-finite entries of ``k`` and ``v`` (untouched when finite)."""
        bad_k = bad_v = None
        if not is_finite(k):
            rows = ~torch.isfinite(k).all(dim=-1)
            if bool(rows.any()):
                bad_k, k = rows, k.masked_fill(rows.unsqueeze(-1), 0.0)
        if not is_finite(v):
            bad_v = ~torch.isfinite(v)
            v = v.masked_fill(bad_v, 0.0)
        return cls(k, v, bad_k, bad_v)

    def key_scores(
        self,
        q: Tensor,
        k: Tensor,
        mask: Tensor | None,
        *,
        scale: float,
        softcap: float | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """What the math makes of the non-finite keys: which rows they poison, which pairs
        they drop.

        Only the scores against the flagged key positions are computed (in float32 for half
        precision, like the kernels): a NaN or ``+inf`` score makes the softmax of its row NaN,
        a ``-inf`` score gives its key weight 0 in that row. With ``softcap`` an infinite score
        is capped to a finite one that the zeroed key cannot reproduce, so every row that may
        attend a non-finite key is poisoned.

        Args:
            q: Queries ``(..., H, L, E)``.
            k: The keys as given, non-finite entries included ``(..., K, S, E)``.
            mask: Bool ``True`` = may attend, broadcastable to the scores, or None (all may).
            scale: Multiplier of the scores.
            softcap: The scores' soft cap, or None.

        Returns:
            ``(poisoned, drop)``: bool ``(..., H, L, 1)`` rows with a NaN or ``+inf`` score on
            a key they may attend (None without non-finite keys), and bool ``(..., H, L, S)``
            pairs with a ``-inf`` score (None if none).
        """
        if self.bad_k is None:
            return None, None
        S = k.shape[-2]
        cols = self.bad_k.reshape(-1, S).any(dim=0).nonzero().squeeze(-1)  # (n,) positions
        dtype = torch.promote_types(q.dtype, torch.float32)
        keys = _to_query_heads(k.index_select(-2, cols).to(dtype), q, -3)  # (..., H, n, E)
        scores = (q.to(dtype) @ keys.transpose(-2, -1)) * scale  # (..., H, L, n)
        bad = _to_query_heads(self.bad_k, q, -2).index_select(-1, cols).unsqueeze(-2)
        if mask is not None:  # bad: (..., H, 1, n) -> (..., H, L or 1, n)
            bad = bad & (mask if mask.shape[-1] == 1 else mask.index_select(-1, cols))
        if softcap is not None:
            return bad.any(dim=-1, keepdim=True).expand(*scores.shape[:-1], 1), None
        poisoned = (bad & ~(scores < float("inf"))).any(dim=-1, keepdim=True)  # NaN or +inf
        dropped = bad & (scores == float("-inf"))
        if not bool(dropped.any()):
            return poisoned, None
        drop = torch.zeros((*dropped.shape[:-1], S), dtype=torch.bool, device=q.device)
        return poisoned, drop.index_copy(-1, cols, dropped)

    def propagate(
        self,
        out: Tensor,
        weights: Tensor | None,
        q: Tensor,
        poisoned: Tensor | None,
        mask: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Set to NaN the outputs that a non-finite key or value reaches: the rows
        ``poisoned`` by a key (see :meth:`key_scores`; their weights too), and in each row that
        may attend a non-finite value entry, the output column of that entry (as in the math:
        a value reaches only its own column; the weights stay finite).

        Args:
            out: Attention output ``(..., H, L, Ev)`` computed on the zeroed inputs.
            weights: Attention weights ``(..., H, L, S)``, or None.
            q: The queries.
            poisoned: Bool ``(..., H, L, 1)`` rows poisoned by a key, or None.
            mask: The bool mask (``True`` = may attend) broadcastable to the scores, or None
                when every key may be attended.

        Returns:
            ``(out, weights)``.
        """
        if poisoned is not None:
            out = _nan_where(out, poisoned)
            if weights is not None:
                weights = _nan_where(weights, poisoned)
        if self.bad_v is not None:
            S = self.bad_v.shape[-2]
            cols = self.bad_v.any(dim=-1).reshape(-1, S).any(dim=0).nonzero().squeeze(-1)
            bad = _to_query_heads(self.bad_v.index_select(-2, cols), q, -3)  # (..., H, n, Ev)
            if mask is None:
                reached = bad.any(dim=-2, keepdim=True)  # (..., H, 1, Ev)
            else:
                may = mask if mask.shape[-1] == 1 else mask.index_select(-1, cols)
                may = may.expand(*may.shape[:-1], len(cols)).to(torch.float32)
                reached = (may @ bad.to(torch.float32)) > 0  # (..., H, L, Ev)
            out = _nan_where(out, reached)
        return out, weights
