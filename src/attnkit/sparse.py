"""Block-sparse attention for structured masks: sliding windows, packed documents, key padding.

A dense kernel given a structured mask still computes all ``L * S`` scores and then throws most
of them away. Here the queries are cut into tiles of ``block_size`` rows; for each tile (and each
batch element) we compute the one contiguous key range that any of its queries may attend, gather
only those keys, build the small bool mask of that tile, and hand all tiles of equal width to
torch's fused ``scaled_dot_product_attention`` as one batched call. The cost therefore grows as
``L * (W + block_size)`` for a window ``W`` and as roughly ``sum(doc_len^2)`` for documents,
instead of ``L * S``. Autograd differentiates through the gather, so no custom backward is needed.

Mask semantics are those of :func:`attnkit.functional.scaled_dot_product_attention`, defined
once in :mod:`attnkit.masks` (:class:`~attnkit.masks.Structure`): the query ``i`` sits at key
position ``p = i + (S - L)`` (bottom-right alignment) and may attend key ``j`` iff every given
constraint holds (``causal``: ``j <= p``; ``window``: ``|p - j| < window``; ``segment_ids``: same
document; ``key_lengths``: ``j < key_lengths[b]``).

Two steps: :func:`faster_plan` finds each tile's key range (:class:`TilePlan`), and
:func:`tiled_attention` runs a plan on inputs that :mod:`attnkit.functional` has validated.
:func:`should_use_block_sparse` and :func:`faster_plan` decide when a plan beats the dense
kernel.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.masks import Structure, StructureArgs, structured_mask

if TYPE_CHECKING:
    from typing_extensions import Unpack


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


@dataclass(frozen=True)
class TilePlan:
    """Which keys each query tile reads; :func:`tiled_attention` runs it.

    Attributes:
        structure: The constraints, ids and lengths as ``(B, S)``/``(B,)`` long tensors.
        L: Query length.
        S: Key length.
        B: Batch size (the product of the inputs' leading dims).
        block_size: Query rows per tile.
        lo: ``(B, n_blk)``: first key of each tile's range.
        hi: ``(B, n_blk)``: end of each tile's range (exclusive); ``hi <= lo``: attends nothing.
    """

    structure: Structure
    L: int
    S: int
    B: int
    block_size: int
    lo: Tensor
    hi: Tensor

    @property
    def covered(self) -> int:
        """How many of the ``B * L * S`` scores the tiles compute (tile rows included)."""
        return int((self.hi - self.lo).clamp(min=0).sum().item()) * self.block_size


def should_use_block_sparse(
    L: int, S: int, *, block_size: int | None = None, **structure: Unpack[StructureArgs]
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
        block_size: As in :func:`block_sparse_attention`.
        **structure: ``causal``, ``window``, ``segment_ids``, ``key_lengths``, as in
            :class:`~attnkit.masks.Structure`.

    Returns:
        ``True`` when the block-sparse path should be used.

    Raises:
        TypeError: Non-integer ``key_lengths``.
        ValueError: Negative lengths, ``window < 1``, badly shaped or out-of-range ids/lengths.
    """
    rules = Structure(**structure)
    B = rules.check(L, S)
    device = next((t.device for t in (rules.segment_ids, rules.key_lengths) if t is not None), None)
    return faster_plan(L, S, rules, batch=B, device=device, block_size=block_size) is not None


def faster_plan(
    L: int,
    S: int,
    structure: Structure,
    *,
    batch: int,
    device: torch.device | str | None,
    block_size: int | None = None,
) -> TilePlan | None:
    """The tile plan when it should beat the dense kernel (see :func:`should_use_block_sparse`).

    Args:
        L: Query length.
        S: Key length.
        structure: Constraints already validated by :meth:`~attnkit.masks.Structure.check`.
        batch: Batch size, the product of the inputs' leading dims.
        device: Device of the inputs.
        block_size: Query rows per tile; defaults to a value picked from the window.

    Returns:
        The plan, or ``None`` when the dense kernel should be used.
    """
    if S < MIN_KEYS or L < 1 or not (structure.sparse or structure.causal):
        return None
    plan = _plan_tiles(L, S, structure, batch, device, _block_size(block_size, structure.window, L))
    max_density = LONG_MAX_DENSITY if S >= LONG_KEYS else MAX_DENSITY
    return plan if plan.covered <= max_density * batch * L * S else None


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    **structure: Unpack[StructureArgs],
) -> Tensor:
    """Attention under structured masks that skips key blocks that are entirely masked.

    Same result as dense attention with :func:`structured_mask` as the mask, at a cost that
    follows the number of allowed (query, key) pairs rather than ``L * S``.

    Args:
        q: Queries.
        k: Keys; may have fewer heads than ``q`` (grouped-query, ``H % K == 0``).
        v: Values.
        block_size: Query rows per tile; defaults to a value picked from ``window``.
        scale: Multiplier of the scores; defaults to ``1 / sqrt(E)``.
        dropout_p: Dropout probability on the attention weights.
        **structure: ``causal``, ``window``, ``segment_ids``, ``key_lengths``, as in
            :class:`~attnkit.masks.Structure`.

    Returns:
        The attention output; rows with no allowed key are exactly zero.

    Shape:
        q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, Ev)`` (or ``(L, E)``,
        ``(S, E)``, ``(S, Ev)`` without heads), segment_ids ``(B, S)``, key_lengths ``(B,)``
        where ``B`` is the product of the leading dims -> ``(..., H, L, Ev)``.

    Raises:
        TypeError: Non-tensor or non-float inputs, mismatched dtypes, non-integer lengths.
        ValueError: Mismatched shapes, ``H % K != 0``, ``window < 1``, badly shaped or
            out-of-range ``segment_ids``/``key_lengths``, bad ``scale``/``dropout_p``/
            ``block_size``.
    """
    from attnkit.functional import check_inputs  # functional imports this module

    check_inputs(q, k, v, None, scale, dropout_p)
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    B = math.prod(q.shape[:-3])
    rules = Structure(**structure)
    rules.check(L, S, batch=B)
    plan = _plan_tiles(L, S, rules, B, q.device, _block_size(block_size, rules.window, L))
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    return tiled_attention(q, k, v, plan, scale=scale, dropout_p=dropout_p)


def _plan_tiles(
    L: int, S: int, structure: Structure, B: int, device: torch.device | str | None, bq: int
) -> TilePlan:
    """Per (batch, query tile of ``bq`` rows), the key range ``[lo, hi)`` of its allowed keys."""
    window, structure = structure.window, structure.to(B, S, device)
    seg, lengths = structure.segment_ids, structure.key_lengths
    n_blk = -(-L // bq)
    first = torch.arange(n_blk, device=device) * bq  # first query of each tile
    last = (first + bq).clamp(max=L) - 1  # last real query of each tile
    p_first, p_last = first + (S - L), last + (S - L)
    lo = torch.zeros(B, n_blk, dtype=torch.long, device=device)
    hi = torch.full((B, n_blk), S, dtype=torch.long, device=device)
    if structure.causal:
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
    return TilePlan(structure, L, S, B, bq, lo.clamp(min=0), hi)


def tiled_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, *, scale: float, dropout_p: float
) -> Tensor:
    """Run a :class:`TilePlan` on validated inputs (see :func:`block_sparse_attention`).

    Args:
        q: Queries, validated by :func:`attnkit.functional.check_inputs`.
        k: Keys.
        v: Values.
        plan: The tile plan for these inputs' ``L``, ``S`` and batch.
        scale: Multiplier of the scores.
        dropout_p: Dropout probability on the attention weights.

    Returns:
        The attention output; rows with no allowed key are exactly zero.

    Shape:
        As :func:`block_sparse_attention`.
    """
    squeeze = q.dim() == 2
    if squeeze:  # no head dim: (L, E) -> (1, L, E)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    batch_shape, (H, L, E), (K, S, Ev) = q.shape[:-3], q.shape[-3:], v.shape[-3:]
    B = plan.B
    q, k, v = q.reshape(B, H, L, E), k.reshape(B, K, S, E), v.reshape(B, K, S, Ev)
    out = _run_tiles(q, k, v, plan, scale=scale, dropout_p=dropout_p)  # (B, H, L, Ev)
    out = out.reshape(*batch_shape, H, L, Ev)
    return out.squeeze(0) if squeeze else out


def _run_tiles(
    q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, *, scale: float, dropout_p: float
) -> Tensor:
    """:func:`tiled_attention` on ``(B, H, L, E)`` inputs."""
    (B, H, L, E), (K, S, Ev) = q.shape, v.shape[1:]
    if min(B, H, L, S) == 0:
        return _connected_zeros(q, k, v, (B, H, L, Ev))

    device = q.device
    bq, structure = plan.block_size, plan.structure
    n_blk = -(-L // bq)
    lo, width = plan.lo.flatten(), (plan.hi - plan.lo).clamp(min=0).flatten()  # tile b * n_blk + t
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
        ok = (i < L) & (j < S) & structure.allows(i, j, bb, L=L, S=S)  # (U, m * bq, w)
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


def _connected_zeros(q: Tensor, k: Tensor, v: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Exact zeros that stay in the graph, so every input gets a zero (not ``None``) gradient."""
    if min(q.numel(), k.numel(), v.numel()) == 0:
        return q.new_zeros(shape)
    anchor = q.flatten()[0] + k.flatten()[0] + v.flatten()[0]
    false = torch.zeros((), dtype=torch.bool, device=q.device)
    return torch.where(false, anchor, 0.0).expand(shape)
