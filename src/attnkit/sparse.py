"""Block-sparse attention for structured masks: sliding windows, packed documents, key padding.

A dense kernel given a structured mask still computes all ``L * S`` scores and then throws most
of them away. Here the queries are cut into tiles of ``block_size`` rows; for each tile (and each
batch element) we compute the one contiguous key range that any of its queries may attend, gather
only those keys, build the small bool mask of that tile, and hand all tiles of equal width to
torch's fused ``scaled_dot_product_attention`` as one batched call. The cost therefore grows as
``L * (W + block_size)`` for a window ``W`` and as roughly ``sum(doc_len^2)`` for documents,
instead of ``L * S``. Autograd differentiates through the gather, so no custom backward is needed.

Mask semantics are those of :func:`attnkit.functional.scaled_dot_product_attention`: the query
``i`` sits at key position ``p = i + (S - L)`` (bottom-right alignment) and may attend key ``j``
iff every given constraint holds:

* ``causal``: ``j <= p``;
* ``window``: ``|p - j| < window``;
* ``segment_ids`` ``(B, S)``: ``segment_ids[b, j] == segment_ids[b, p]``;
* ``key_lengths`` ``(B,)``: ``j < key_lengths[b]``.

A query that may attend no key gets an output row of exactly zero with zero gradients.

FlexAttention (``torch.nn.attention.flex_attention`` + ``create_block_mask``) was measured as an
alternative on the 2-core CPU this was written on (torch 2.13): ``torch.compile`` makes its first
call cost ~23 s cold (~2.5 s with a warm inductor cache) per new shape/mask, after which the
window forward at N=8192 was comparable to the tiled path (0.15-0.35 s vs 0.1-1.2 s, noisy), but
torch 2.13 has no FlexAttention backward on CPU. It is therefore not used here; ``attnkit bench
--flex`` measures it.

Shape legend: B batch, H query heads, K key/value heads, L query length, S key length,
E head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["block_sparse_attention", "should_use_block_sparse", "structured_mask"]

#: Below this many keys the dense fused kernel wins: tiling overhead (gather, per-tile masks)
#: outweighs the skipped work. Measured on CPU, see ``should_use_block_sparse``.
MIN_KEYS = 1024
#: Use the block-sparse path only when it computes at most this fraction of the dense scores.
MAX_DENSITY = 0.25
#: From this many keys on, the tiled path wins even at half density (causal + padding, padding
#: of half the keys: 1.4-1.9x at N=4096 and 8192 on a quiet 2-core CPU, ``attnkit bench``).
LONG_KEYS = 4096
#: The density bound for ``S >= LONG_KEYS``.
LONG_MAX_DENSITY = 0.5
#: At most this many differently sized batched calls; widths are rounded up until they fit.
_MAX_BUCKETS = 16


def structured_mask(
    L: int,
    S: int,
    *,
    causal: bool = False,
    window: int | None = None,
    segment_ids: Tensor | None = None,
    key_lengths: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Dense bool mask (``True`` = may attend) of the structured constraints.

    Args:
        L: Query length.
        S: Key length.
        causal: Query ``i`` may attend key ``j`` iff ``j <= i + (S - L)`` (bottom-right aligned).
        window: Keys within ``|i + (S - L) - j| < window`` of the query's position.
        segment_ids: Integer document ids of the keys; queries take the last ``L`` ids.
        key_lengths: Key ``j`` of batch ``b`` is real iff ``j < key_lengths[b]``.
        device: Device of the mask (defaults to that of ``segment_ids``/``key_lengths``).

    Returns:
        The mask, with a batch dim of ``B`` when ``segment_ids`` or ``key_lengths`` is given,
        else 1.

    Shape:
        segment_ids ``(B, S)``, key_lengths ``(B,)`` -> ``(B or 1, 1, L, S)``.

    Raises:
        ValueError: Negative lengths, ``window < 1``, badly shaped or out-of-range ids/lengths.
    """
    B = _validate_structure(
        L, S, window=window, segment_ids=segment_ids, key_lengths=key_lengths, batch=None
    )
    if device is None:
        ref = segment_ids if segment_ids is not None else key_lengths
        device = ref.device if ref is not None else None
    i = torch.arange(L, device=device).view(1, L, 1)
    j = torch.arange(S, device=device).view(1, 1, S)
    b = torch.arange(B, device=device).view(B, 1, 1)
    seg, lengths = _prepare(segment_ids, key_lengths, B, S, device)
    ok = _allowed(i, j, b, L=L, S=S, causal=causal, window=window, seg=seg, lengths=lengths)
    return ok.expand(B, L, S).unsqueeze(1)  # (B, 1, L, S)


def should_use_block_sparse(
    L: int,
    S: int,
    *,
    causal: bool = False,
    window: int | None = None,
    segment_ids: Tensor | None = None,
    key_lengths: Tensor | None = None,
    block_size: int | None = None,
) -> bool:
    """Whether :func:`block_sparse_attention` should beat the dense fused kernel.

    The rule is measured, not derived: on CPU the tiled path wins once there are at least
    ``MIN_KEYS`` keys and the tiles cover at most ``MAX_DENSITY`` of the ``L * S`` scores
    (``LONG_MAX_DENSITY`` from ``LONG_KEYS`` keys on)
    (``benchmarks/bench_sparse.py`` prints the numbers). Below that the gather and per-tile
    masks cost more than the skipped blocks save.

    Args:
        L: Query length.
        S: Key length.
        causal: As in :func:`block_sparse_attention`.
        window: As in :func:`block_sparse_attention`.
        segment_ids: As in :func:`block_sparse_attention`.
        key_lengths: As in :func:`block_sparse_attention`.
        block_size: As in :func:`block_sparse_attention`.

    Returns:
        ``True`` when the block-sparse path should be used.
    """
    if S < MIN_KEYS or L < 1:
        return False
    if window is None and segment_ids is None and key_lengths is None and not causal:
        return False
    B = _validate_structure(
        L, S, window=window, segment_ids=segment_ids, key_lengths=key_lengths, batch=None
    )
    bq = _block_size(block_size, window, L)
    device = next((t.device for t in (segment_ids, key_lengths) if t is not None), None)
    seg, lengths = _prepare(segment_ids, key_lengths, B, S, device)
    lo, hi = _tile_ranges(L, S, bq, causal=causal, window=window, seg=seg, lengths=lengths, B=B)
    covered = (hi - lo).clamp(min=0).sum().item() * bq
    max_density = LONG_MAX_DENSITY if S >= LONG_KEYS else MAX_DENSITY
    return covered <= max_density * B * L * S


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    segment_ids: Tensor | None = None,
    key_lengths: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_size: int | None = None,
) -> Tensor:
    """Attention under structured masks that skips key blocks that are entirely masked.

    Same result as dense attention with :func:`structured_mask` as the mask, at a cost that
    follows the number of allowed (query, key) pairs rather than ``L * S``.

    Args:
        q: Queries.
        k: Keys; may have fewer heads than ``q`` (grouped-query, ``H % K == 0``).
        v: Values.
        causal: Query ``i`` may attend key ``j`` iff ``j <= i + (S - L)``.
        window: Sliding window ``|i + (S - L) - j| < window``; at least 1.
        segment_ids: Integer document ids of the keys; queries take the last ``L`` ids
            (so ``L <= S``). Attention stays within a document; ids need not be contiguous.
        key_lengths: Key ``j`` of batch ``b`` is real iff ``j < key_lengths[b]``.
        scale: Multiplier of the scores; defaults to ``1 / sqrt(E)``.
        dropout_p: Dropout probability on the attention weights.
        block_size: Query rows per tile; defaults to a value picked from ``window``.

    Returns:
        The attention output; rows with no allowed key are exactly zero.

    Shape:
        q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, Ev)`` (or ``(L, E)``,
        ``(S, E)``, ``(S, Ev)`` without heads), segment_ids ``(B, S)``, key_lengths ``(B,)``
        where ``B`` is the product of the leading dims -> ``(..., H, L, Ev)``.

    Raises:
        TypeError: Non-tensor or non-float inputs, mismatched dtypes.
        ValueError: Mismatched shapes, ``H % K != 0``, ``window < 1``, badly shaped or
            out-of-range ``segment_ids``/``key_lengths``, bad ``dropout_p``/``block_size``.
    """
    squeeze = _validate_qkv(q, k, v)
    if squeeze:  # no head dim: (L, E) -> (1, L, E)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    batch_shape = q.shape[:-3]
    H, L, E = q.shape[-3:]
    K, S, Ev = k.shape[-3], k.shape[-2], v.shape[-1]
    B = math.prod(batch_shape)
    _validate_structure(
        L, S, window=window, segment_ids=segment_ids, key_lengths=key_lengths, batch=B
    )
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    out = _tiled_attention(
        q.reshape(B, H, L, E), k.reshape(B, K, S, E), v.reshape(B, K, S, Ev),
        causal=causal, window=window, segment_ids=segment_ids, key_lengths=key_lengths,
        scale=scale, dropout_p=dropout_p, block_size=block_size,
    )  # fmt: skip
    out = out.reshape(*batch_shape, H, L, Ev)
    return out.squeeze(0) if squeeze else out


def _tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    window: int | None,
    segment_ids: Tensor | None,
    key_lengths: Tensor | None,
    scale: float,
    dropout_p: float,
    block_size: int | None,
) -> Tensor:
    """:func:`block_sparse_attention` on validated ``(B, H, L, E)`` inputs."""
    (B, H, L, E), (K, S, Ev) = q.shape, v.shape[1:]
    if min(B, H, L, S) == 0:
        return _connected_zeros(q, k, v, (B, H, L, Ev))

    device = q.device
    bq = _block_size(block_size, window, L)
    n_blk = -(-L // bq)
    seg, lengths = _prepare(segment_ids, key_lengths, B, S, device)
    lo, hi = _tile_ranges(L, S, bq, causal=causal, window=window, seg=seg, lengths=lengths, B=B)
    lo, width = lo.flatten(), (hi - lo).clamp(min=0).flatten()  # (B * n_blk,), tile = b * n_blk + t
    width = _bucket_widths(width, bq)
    if not bool((width > 0).any()):
        return _connected_zeros(q, k, v, (B, H, L, Ev))

    q_t = F.pad(q, (0, 0, 0, n_blk * bq - L))  # (B, H, n_blk * bq, E)
    q_t = q_t.view(B, H, n_blk, bq, E).transpose(1, 2).reshape(B * n_blk, H, bq, E)
    k_flat = k.transpose(1, 2).reshape(B * S, K * E)  # one row per key
    v_flat = v.transpose(1, 2).reshape(B * S, K * Ev)

    outs, order = [], []
    width_list = width.tolist()
    for w in sorted(set(width_list)):
        tiles = torch.tensor(
            [t for t, wt in enumerate(width_list) if wt == w], device=device, dtype=torch.long
        )
        order.append(tiles)
        if w == 0:  # no key allowed anywhere in these tiles
            outs.append(q_t.new_zeros(len(tiles), H, bq, Ev))
            continue
        # Tiles sharing one key range (e.g. padding only) become one taller tile, so their keys
        # are gathered once instead of once per tile.
        m = _shared_run(tiles // n_blk * S + lo[tiles])
        U = len(tiles) // m
        b = tiles[::m] // n_blk  # (U,)
        first = (tiles[::m] % n_blk) * bq  # first query index of each merged tile
        i = first[:, None, None] + torch.arange(m * bq, device=device).view(1, -1, 1)
        j = lo[tiles[::m], None, None] + torch.arange(w, device=device).view(1, 1, w)  # (U,1,w)
        bb = b.view(-1, 1, 1)
        ok = _allowed(i, j, bb, L=L, S=S, causal=causal, window=window, seg=seg, lengths=lengths)
        row_ok = ok.any(-1, keepdim=True)  # (U, m * bq, 1)
        # Rows with no allowed key attend everything, then are zeroed below: the fused kernel
        # then never sees an all-masked row (NaN on some backends) and, since their output
        # gradient is zero, they add exactly zero to the gradients of k and v.
        ok = (ok | ~row_ok).unsqueeze(1)  # (U, 1, m * bq, w)
        rows = (bb.view(-1, 1) * S + j.view(-1, w).clamp(max=S - 1)).flatten()  # (U * w,)
        k_t = k_flat.index_select(0, rows).view(-1, w, K, E).transpose(1, 2)  # (U, K, w, E)
        v_t = v_flat.index_select(0, rows).view(-1, w, K, Ev).transpose(1, 2)  # (U, K, w, Ev)
        q_u = q_t.index_select(0, tiles).view(U, m, H, bq, E).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q_u.reshape(U, H, m * bq, E), k_t, v_t, attn_mask=ok,
            dropout_p=dropout_p, scale=scale, enable_gqa=H != K,
        )  # fmt: skip  # (U, H, m * bq, Ev)
        o = torch.where(row_ok.unsqueeze(1), o, 0.0).view(U, H, m, bq, Ev).transpose(1, 2)
        outs.append(o.reshape(U * m, H, bq, Ev))

    out = torch.cat(outs).index_select(0, torch.cat(order).argsort())  # (B * n_blk, H, bq, Ev)
    out = out.view(B, n_blk, H, bq, Ev).transpose(1, 2).reshape(B, H, n_blk * bq, Ev)
    return out[:, :, :L]


# --------------------------------------------------------------------------------------------
# helpers


def _allowed(
    i: Tensor,
    j: Tensor,
    b: Tensor,
    *,
    L: int,
    S: int,
    causal: bool,
    window: int | None,
    seg: Tensor | None,
    lengths: Tensor | None,
) -> Tensor:
    """The mask predicate on broadcastable query indices ``i``, key indices ``j``, batch ``b``."""
    p = i + (S - L)  # the query's position among the keys
    ok = (i < L) & (j >= 0) & (j < S)
    if causal:
        ok = ok & (j <= p)
    if window is not None:
        ok = ok & ((p - j).abs() < window)
    if lengths is not None:
        ok = ok & (j < lengths[b])
    if seg is not None:
        ok = ok & (seg[b, j.clamp(0, S - 1)] == seg[b, p.clamp(0, S - 1)])
    return ok


def _tile_ranges(
    L: int,
    S: int,
    bq: int,
    *,
    causal: bool,
    window: int | None,
    seg: Tensor | None,
    lengths: Tensor | None,
    B: int,
) -> tuple[Tensor, Tensor]:
    """Per (batch, query tile), the half-open key range ``[lo, hi)`` holding all allowed keys.

    Returns:
        ``lo``, ``hi`` of shape ``(B, n_blk)``; ``hi <= lo`` means the tile attends nothing.
    """
    device = next((t.device for t in (seg, lengths) if t is not None), None)
    n_blk = -(-L // bq)
    first = torch.arange(n_blk, device=device) * bq  # first query of each tile
    last = (first + bq).clamp(max=L) - 1  # last real query of each tile
    p_first, p_last = first + (S - L), last + (S - L)
    lo = torch.zeros(B, n_blk, dtype=torch.long, device=device)
    hi = torch.full((B, n_blk), S, dtype=torch.long, device=device)
    if causal:
        hi = hi.clamp(max=p_last + 1)
    if window is not None:
        lo = torch.maximum(lo, p_first - window + 1)
        hi = torch.minimum(hi, p_last + window)
    if lengths is not None:
        hi = torch.minimum(hi, lengths.view(B, 1))
    if seg is not None:
        # First/last occurrence of every (batch, id): a tile needs the span of its queries' ids.
        uniq, inv = torch.unique(seg, return_inverse=True)  # inv (B, S)
        key = inv + torch.arange(B, device=seg.device).view(B, 1) * len(uniq)
        pos = torch.arange(S, device=seg.device).expand(B, S)
        first_occ = torch.full((B * len(uniq),), S, dtype=torch.long, device=seg.device)
        last_occ = torch.full((B * len(uniq),), -1, dtype=torch.long, device=seg.device)
        first_occ = first_occ.scatter_reduce(0, key.flatten(), pos.flatten(), "amin")
        last_occ = last_occ.scatter_reduce(0, key.flatten(), pos.flatten(), "amax")
        qkey = F.pad(key[:, S - L :], (0, n_blk * bq - L), value=-1).view(B, n_blk, bq)
        pad = qkey < 0
        q_lo = first_occ[qkey.clamp(min=0)].masked_fill(pad, S).amin(-1)
        q_hi = last_occ[qkey.clamp(min=0)].masked_fill(pad, -1).amax(-1) + 1
        lo, hi = torch.maximum(lo, q_lo), torch.minimum(hi, q_hi)
    return lo.clamp(min=0), hi


def _shared_run(keys: Tensor) -> int:
    """Largest ``m`` such that ``keys`` is made of equal-valued runs of exactly ``m``."""
    counts = torch.unique_consecutive(keys, return_counts=True)[1]
    m = int(counts[0])
    return m if bool((counts == m).all()) and len(keys) == m * len(counts) else 1


def _bucket_widths(width: Tensor, granule: int) -> Tensor:
    """Round widths up to a multiple of a granule, coarsened until few distinct widths remain."""
    g = granule
    while True:
        rounded = -(-width // g) * g
        if len(torch.unique(rounded)) <= _MAX_BUCKETS:
            return rounded
        g *= 2


def _block_size(block_size: int | None, window: int | None, L: int) -> int:
    """Query tile height: given, or 128..256 (measured best on CPU)."""
    if block_size is not None:
        return block_size
    bq = 128 if window is None or window <= 512 else 256
    return max(1, min(bq, L))


def _prepare(
    segment_ids: Tensor | None,
    key_lengths: Tensor | None,
    B: int,
    S: int,
    device: torch.device | str | None,
) -> tuple[Tensor | None, Tensor | None]:
    """Ids as (B, S) long and lengths as (B,) long on ``device`` (broadcasting a batch of 1)."""
    seg = None if segment_ids is None else segment_ids.to(device, torch.long).expand(B, S)
    lengths = None if key_lengths is None else key_lengths.to(device, torch.long).expand(B)
    return seg, lengths


def _validate_structure(
    L: int,
    S: int,
    *,
    window: int | None,
    segment_ids: Tensor | None,
    key_lengths: Tensor | None,
    batch: int | None,
) -> int:
    """Check the structural arguments; return the batch size they imply (1 if none)."""
    if L < 0 or S < 0:
        raise ValueError(f"lengths must be non-negative, got L={L}, S={S}")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    sizes = []
    if segment_ids is not None:
        if not isinstance(segment_ids, Tensor) or segment_ids.is_floating_point():
            raise ValueError(f"segment_ids must be an integer tensor, got {segment_ids!r}")
        if segment_ids.dim() != 2 or segment_ids.shape[1] != S:
            raise ValueError(
                f"segment_ids must have shape (B, S) with S={S}, got {tuple(segment_ids.shape)}"
            )
        if L > S:
            raise ValueError(
                f"segment_ids need L <= S (queries take the last L ids), got {L=}, {S=}"
            )
        sizes.append(("segment_ids", segment_ids.shape[0]))
    if key_lengths is not None:
        if not isinstance(key_lengths, Tensor) or key_lengths.is_floating_point():
            raise ValueError(f"key_lengths must be an integer tensor, got {key_lengths!r}")
        if key_lengths.dim() != 1:
            raise ValueError(f"key_lengths must have shape (B,), got {tuple(key_lengths.shape)}")
        if key_lengths.numel() and (key_lengths.min() < 0 or key_lengths.max() > S):
            raise ValueError(f"key_lengths must be in [0, S={S}], got {key_lengths.tolist()}")
        sizes.append(("key_lengths", key_lengths.shape[0]))
    B = batch if batch is not None else max([n for _, n in sizes], default=1)
    for name, n in sizes:
        if n not in (1, B):
            raise ValueError(f"{name} has batch size {n}, expected {B} (or 1)")
    return B


def _validate_qkv(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Check q/k/v; return whether they lack a head dim (2-D inputs)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.dim() == k.dim() == v.dim() or q.dim() < 2:
        raise ValueError(
            f"q, k, v must have the same number (>= 2) of dims, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dim() == 2:
        squeeze = True
        qs, ks, vs = (1, *q.shape), (1, *k.shape), (1, *v.shape)
    else:
        squeeze = False
        qs, ks, vs = q.shape, k.shape, v.shape
    if qs[:-3] != ks[:-3] or ks[:-1] != vs[:-1] or qs[-1] != ks[-1]:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
            "need q (..., H, L, E), k (..., K, S, E), v (..., K, S, Ev)"
        )
    if ks[-3] == 0 or qs[-3] % ks[-3]:
        raise ValueError(f"query heads ({qs[-3]}) must be a multiple of key heads ({ks[-3]})")
    return squeeze


def _connected_zeros(q: Tensor, k: Tensor, v: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Exact zeros that stay in the graph, so every input gets a zero (not ``None``) gradient."""
    if min(q.numel(), k.numel(), v.numel()) == 0:
        return q.new_zeros(shape)
    anchor = q.flatten()[0] + k.flatten()[0] + v.flatten()[0]
    false = torch.zeros((), dtype=torch.bool, device=q.device)
    return torch.where(false, anchor, 0.0).expand(shape)
