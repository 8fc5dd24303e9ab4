"""Structured attention as a few batched calls of a flash kernel on strided tiles.

Where the policy picks attnkit's flash kernels (:func:`attnkit.kernels.policy.flash_kernel`),
causal and sliding-window structures need no tiles: the kernels
(:func:`attnkit.kernels.attention.flash_attention` and its backward) take the rules themselves
and compute, per block of queries, only the keys that block may reach
(:func:`attend_positional`).
Everything below is for documents, padding and the calls the policy gives torch's kernel; its
unmasked runs (documents' causal squares, whole spans) also run attnkit's kernels where the
policy picks them, its masked runs torch's.

For causal, sliding-window, packed-document (``segment_ids``) and padding (``key_lengths``)
constraints, every query tile of ``rows`` consecutive queries may attend keys in one contiguous
span only (the hull of its queries' allowed keys); keys outside it are skipped. Tiles whose spans
have the same size and advance by a fixed step (the interior tiles of a window, the same offset
in equally long documents) form a *run*: one call of
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` on ``as_strided`` views of ``q``,
``k``, ``v``, so nothing is gathered or copied. Like FlashAttention's block classification, each
run is classified: a span whose every (query, key) pair is allowed gets no mask; a span where
only causality or the window cuts (the band of a window, a document's causal triangle) gets one
small additive mask shared by all tiles of the run, or none with the kernel's ``is_causal`` when
it is a square diagonal tile; padding only shortens spans; only tiles of a document whose id
occurs in pieces get their own mask. The backward is a custom
:class:`torch.autograd.Function` that calls the kernel's own backward per run and adds the
key/value gradients of overlapping spans; memory stays linear in the sequence length.

Why one span per tile and not several pieces merged by log-sum-exp (FlashAttention's split-KV,
ring attention): torch's CPU kernel costs the same per score with or without an additive mask,
and ``is_causal`` saves nothing at these tile sizes, so splitting a tile into an unmasked and a
masked piece computes the same number of scores and adds the merge
(``python -m attnkit.bench.structured --variants``). What pays is a small tile height: the band
computed per query is ``rows + window`` wide.

Semantics are those of :class:`attnkit.masks.Structure`: query ``i`` sits at key position
``p = i + (S - L)`` (bottom-right alignment) and may attend key ``j`` iff every given constraint
holds: ``causal``: ``j <= p``; ``window``: ``|p - j| < window``; ``segment_ids`` ``(B, S)``:
``segment_ids[b, j] == segment_ids[b, p]``; ``key_lengths`` ``(B,)``: ``j < key_lengths[b]``.
A query with no allowed key gets a zero row and zero gradients. Inputs come validated from
:mod:`attnkit.sparse` / :mod:`attnkit.functional`, which also keeps non-finite inputs away from
the queries that may not attend them.

Shape legend: B batch, H query heads, K key/value heads, L query length, S key length,
E head dim, Ev value head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.kernels import attention as attention_kernels
from attnkit.kernels import policy
from attnkit.kernels.tiles import FlashOptions
from attnkit.masks import Span, Structure, offset_mask

__all__ = [
    "TileRun",
    "attend_positional",
    "attend_runs",
    "plan_runs",
    "positional_flash",
]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
#: Dtypes the CPU flash kernel accepts.
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TileRun:
    """``count`` query tiles that one kernel call computes on strided views.

    Tile ``u`` holds queries ``i + u * di .. + rows`` of batch ``b + u * db`` and attends keys
    ``j + u * dj .. + width`` of the same batch element.

    Attributes:
        b: Batch index of the first tile.
        i: First query index of the first tile.
        j: First key index of the first tile's span.
        db: Batch step between consecutive tiles.
        di: Query step between consecutive tiles.
        dj: Key step between consecutive tiles.
        count: Number of tiles.
        rows: Queries per tile.
        width: Keys per span.
        allowed: Bool ``(count or 1, rows, width)`` (``True`` = may attend), or ``None`` when
            every pair is allowed.
        causal: ``allowed`` is exactly top-left causal on square tiles, which the kernel's
            ``is_causal`` computes without a mask and skipping the blocks above the diagonal.
        shared: The :class:`~attnkit.masks.Span` of every tile when ``allowed`` is shared by
            them all (positional constraints only), so the additive mask comes from a cache.
        empty: Bool ``(count or 1, 1, rows, 1)``: queries that may attend no key of the span
            (their output is set to zero, which the kernel gives only for finite queries), or
            ``None`` when every query has a key.
    """

    b: int
    i: int
    j: int
    db: int
    di: int
    dj: int
    count: int
    rows: int
    width: int
    allowed: Tensor | None
    causal: bool = False
    shared: Span | None = None
    empty: Tensor | None = None


def plan_runs(
    B: int,
    L: int,
    S: int,
    structure: Structure,
    *,
    rows: int | None = None,
    device: torch.device | str | None = None,
) -> list[TileRun]:
    """Cut the queries into tiles, find each tile's key span and group the tiles into runs.

    Tiles start every ``rows`` queries, counted from each document start, so the queries of a
    tile share one document. A tile's span is the hull of the keys its queries may attend; as
    padding only shortens it, a span needs a mask only where causality or the window cuts it
    (the same mask for every tile at the same offset: shared along a run) or where a document
    id occurs in pieces (then the tile gets its own mask, from :meth:`Structure.allows`).

    Args:
        B: Batch size.
        L: Query length.
        S: Key length.
        structure: The checked constraints (ids and lengths of batch ``B`` or 1).
        rows: Queries per tile; defaults to :func:`attnkit.kernels.policy.tile_rows`.
        device: Where the inputs (and so the masks) live; defaults to that of ``segment_ids``
            or ``key_lengths``, else the CPU.

    Returns:
        The runs; tiles whose queries may attend no key at all belong to none.
    """
    if min(B, L, S) == 0:
        return []
    if device is None:
        given = (structure.segment_ids, structure.key_lengths)
        device = next((t.device for t in given if t is not None), None)
    device = torch.device("cpu" if device is None else device)
    rules = structure.to(B, S, device)  # ids (B, S), lengths (B,): long, on device
    causal, window = rules.causal, rules.window
    seg, lengths = rules.segment_ids, rules.key_lengths
    R = policy.tile_rows(L, window) if rows is None else max(1, min(rows, L))

    idx = torch.arange(L, device=device).expand(B, L)
    if seg is None:
        starts = idx % R == 0
    else:  # the grid restarts at every document start
        q_seg = seg[:, S - L :]  # (B, L) ids of the queries
        doc = F.pad(q_seg[:, 1:] != q_seg[:, :-1], (1, 0), value=True)
        doc_start = torch.where(doc, idx, 0).cummax(1).values
        starts = (idx - doc_start) % R == 0
    tb, first = starts.nonzero(as_tuple=True)  # (T,) batch and first query of each tile
    flat = tb * L + first
    height = torch.diff(flat, append=flat.new_full((1,), B * L))  # every batch starts at 0
    p0 = first + (S - L)  # position of each tile's first query
    lo = torch.zeros_like(first)
    hi = torch.full_like(first, S)
    if causal:
        hi = hi.minimum(p0 + height)
    if window is not None:
        lo = lo.maximum(p0 - window + 1)
        hi = hi.minimum(p0 + height - 1 + window)
    if lengths is not None:
        hi = hi.minimum(lengths[tb])
    lo = lo.clamp(min=0)
    cut = torch.zeros_like(first, dtype=torch.bool)
    if seg is not None:
        # The hull of the tile's id: its first to last occurrence in the batch element.
        uniq, inv = torch.unique(seg, return_inverse=True)  # inv (B, S)
        key = inv + torch.arange(B, device=device).view(B, 1) * len(uniq)
        pos = torch.arange(S, device=device).expand(B, S).flatten()
        first_occ = torch.full((B * len(uniq),), S, device=device)
        last_occ = torch.full((B * len(uniq),), -1, device=device)
        first_occ = first_occ.scatter_reduce(0, key.flatten(), pos, "amin")
        last_occ = last_occ.scatter_reduce(0, key.flatten(), pos, "amax")
        tkey = key[tb, p0]
        lo, hi = lo.maximum(first_occ[tkey]), hi.minimum(last_occ[tkey] + 1)
        # Cut: the span holds another id (the id occurs in pieces).
        runs_id = F.pad((seg[:, 1:] != seg[:, :-1]).long().cumsum(1), (1, 0))  # (B, S)
        a, z = lo.clamp(0, S - 1), (hi - 1).clamp(0, S - 1)
        cut = (runs_id[tb, a] != runs_id[tb, z]) | (key[tb, a] != tkey)
    width = (hi - lo).clamp(min=0)

    groups: dict[tuple[int, int, int, bool], list[tuple[int, int, int]]] = {}
    columns = (tb, first, lo, height, width, lo - p0, cut)
    for b, i, j, h, w, off, c in zip(*(t.tolist() for t in columns), strict=True):
        if w > 0:
            groups.setdefault((h, w, off, c), []).append((b, i, j))
    runs = []
    for (h, w, off, has_cut), tiles in groups.items():
        for start, stop in _arithmetic_runs(tiles):
            (b0, i0, j0), count = tiles[start], stop - start
            db, di, dj = (
                (x1 - x0 for x0, x1 in zip(tiles[start], tiles[start + 1], strict=True))
                if count > 1
                else (0, 0, 0)
            )
            tile = TileRun(b0, i0, j0, db, di, dj, count, h, w, None)
            shared = None
            if has_cut:
                allowed = _tile_masks(L, S, tile, rules)
            else:
                shared = Span(h, w, off, causal, window, device)
                band = offset_mask(*shared)
                allowed = None if band is None else band.unsqueeze(0)
            square = causal and off == 0 and h == w and (window is None or window >= h)
            empty = None
            if allowed is not None and not square:
                no_key = ~allowed.any(-1)  # (count or 1, rows)
                empty = no_key[:, None, :, None] if bool(no_key.any()) else None
            runs.append(replace(tile, allowed=allowed, causal=square, shared=shared, empty=empty))
    return runs


def attend_runs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    runs: list[TileRun],
    *,
    scale: float,
    dropout_p: float,
    kernels: policy.TileKernels,
) -> Tensor:
    """Run a plan of :func:`plan_runs` on inputs validated by :mod:`attnkit.functional`.

    Non-finite inputs are :mod:`attnkit.functional`'s concern (``attend_tiles`` zeroes them and
    marks the rows that may attend them): the kernels here would let a NaN reach every query of
    a span (``0 * NaN``).

    A flash kernel on strided views with a custom backward where it applies (CPU, no dropout,
    ``Ev == E``, a dtype it takes): attnkit's for unmasked runs where ``kernels.flash``, torch's
    otherwise; else ``torch.nn.functional.scaled_dot_product_attention`` on gathered tiles with
    autograd. bfloat16/float16 inputs are computed in float32 and the result rounded where
    ``kernels.widen``, unless every run takes attnkit's kernel.

    Args:
        q: Queries.
        k: Keys.
        v: Values.
        runs: The plan for these inputs' ``B``, ``L`` and ``S``.
        scale: Multiplier of the scores.
        dropout_p: Dropout on the attention weights.
        kernels: The policy's :func:`~attnkit.kernels.policy.tile_kernels`.

    Returns:
        The attention output; rows with no allowed key are exactly zero.

    Shape:
        q ``(B, H, L, E)``, k ``(B, K, S, E)``, v ``(B, K, S, Ev)`` -> ``(B, H, L, Ev)``.
    """
    E, Ev = q.shape[3], v.shape[3]
    if (
        q.device.type == "cpu"
        and kernels.widen
        and not (kernels.flash and all(r.causal or r.allowed is None for r in runs))
    ):
        wide = policy.TileKernels(kernels.flash_wide)
        out = attend_runs(
            q.float(), k.float(), v.float(), runs, scale=scale, dropout_p=dropout_p, kernels=wide
        )
        return out.to(q.dtype)
    if dropout_p == 0.0 and Ev == E and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES:
        flashed: Tensor = _FlashRuns.apply(q, k, v, runs, scale, kernels)
        return flashed
    return _sdpa_runs(q, k, v, runs, scale=scale, dropout_p=dropout_p)


# --------------------------------------------------------------------------------------------
# executors


def _run_forward(
    r: TileRun,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    kernels: policy.TileKernels,
) -> tuple[Tensor, Tensor, bool]:
    """One run's ``(out, lse, attnkit's kernel ran)``: attnkit's flash kernel (with
    ``kernels.products``) for a run without an additive mask (square causal tiles or whole
    spans) where ``kernels.flash``, else torch's."""
    if mask is None and kernels.flash:
        o, lse = attention_kernels.flash_attention(
            *_views(r, q, k, v), scale=scale, causal=r.causal, first=0, products=kernels.products
        )
        return o, lse, True
    o, lse = _flash(*_views(r, q, k, v), 0.0, r.causal, attn_mask=mask, scale=scale)
    return o, lse, False


def _run_backward(
    r: TileRun,
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    scale: float,
    attnkit_kernel: bool,
    products: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """One run's ``(dq, dk, dv)`` from the kernel that ran its forward (``attnkit_kernel``, as
    :func:`_run_forward` said, with the forward's ``products``); ``grad_out`` and ``o`` are the
    run's query tiles."""
    if attnkit_kernel:
        return attention_kernels.flash_attention_backward(
            grad_out, *_views(r, q, k, v), o, lse, scale=scale, causal=r.causal, first=0,
            products=products,
        )  # fmt: skip
    gq, gk, gv = _flash_backward(
        grad_out, *_views(r, q, k, v), o, lse, 0.0, r.causal, attn_mask=mask, scale=scale
    )
    return gq, gk, gv


def attend_positional(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    structure: Structure,
    *,
    scale: float,
    products: str = "widened",
) -> Tensor:
    """Causal and sliding-window attention as one call of attnkit's flash kernels (no
    documents, lengths or dropout; where the policy's
    :func:`~attnkit.kernels.policy.flash_kernel` says).

    The kernels take the rules themselves (a block of queries computes only the keys it may
    reach), so the sequence needs no tiles. ``products`` says how bf16 tiles are multiplied,
    forward and backward (:func:`attnkit.kernels.policy.tile_kernels`).

    Shape:
        q ``(B, H, L, E)``, k ``(B, K, S, E)``, v ``(B, K, S, Ev)`` -> ``(B, H, L, Ev)``.
    """
    options: FlashOptions = {
        "scale": scale,
        "causal": structure.causal,
        "window": structure.window,
    }
    return positional_flash(q, k, v, options, products)[0]


def positional_flash(
    q: Tensor, k: Tensor, v: Tensor, options: FlashOptions, products: str = "widened"
) -> tuple[Tensor, Tensor]:
    """:func:`attnkit.kernels.attention.flash_attention` with ``options`` (its keyword options:
    the structure, where the queries sit, ALiBi's slopes) and its backward, as one autograd
    call: ``(out, lse)``, the log-sum-exp without a gradient."""
    out, lse = _PositionalFlash.apply(q, k, v, options, products)
    return out, lse


class _PositionalFlash(torch.autograd.Function):
    """:func:`attnkit.kernels.attention.flash_attention` and its backward over the whole
    sequence."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, options: FlashOptions, products: str
    ) -> tuple[Tensor, Tensor]:
        ctx.options = options
        ctx.products = products
        out, lse = attention_kernels.flash_attention(q, k, v, products=products, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_kernels.flash_attention_backward(
            grad_out, q, k, v, out, lse, products=ctx.products, **ctx.options
        )
        return dq, dk, dv, None, None


class _FlashRuns(torch.autograd.Function):
    """One flash-kernel call per run on strided views; the backward calls the kernel's own.

    When a single run's tiles cover the queries in order (documents of equal length, a short
    causal sequence per batch element), the kernel's output, written ``(count, rows, H, Ev)``
    in memory, already is the ``(B, L, H, Ev)`` layout of the result: it is returned as a view,
    and when the run's key spans also cover the keys in order the backward returns the
    kernel's gradients as views too (no zero-filled buffers, copies or additions).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        runs: list[TileRun],
        scale: float,
        kernels: policy.TileKernels,
    ) -> Tensor:
        B, H, L, _ = q.shape
        S, Ev = k.shape[2], v.shape[3]
        ctx.runs, ctx.scale, ctx.products = runs, scale, kernels.products
        if len(runs) == 1 and runs[0].empty is None and _in_order(runs[0], B, L, rows=True):
            r = runs[0]
            mask = _kernel_mask(r, q.dtype)
            o, lse, own = _run_forward(r, q, k, v, mask, scale, kernels)
            ctx.natives = [own]
            out = _whole(o, B, L)
            ctx.save_for_backward(q, k, v, out)
            ctx.masks, ctx.lses, ctx.outs, ctx.direct = [mask], [lse], None, True
            ctx.keys_in_order = _in_order(r, B, S, rows=False)
            return out
        covered = sum(r.count * r.rows for r in runs) == B * L
        alloc = torch.empty if covered else torch.zeros
        out = alloc(B, L, H, Ev, dtype=q.dtype, device=q.device).transpose(1, 2)  # (B,H,L,Ev)
        masks, outs, lses, natives = [], [], [], []
        for r in runs:
            mask = _kernel_mask(r, q.dtype)
            o, lse, own = _run_forward(r, q, k, v, mask, scale, kernels)
            # o (count, H, rows, Ev), lse (count, H, rows)
            if r.empty is not None:
                o = o.masked_fill(r.empty, 0.0)
            _q_view(out, r).copy_(o)
            natives.append(own)
            masks.append(mask)
            outs.append(o)
            lses.append(lse)
        ctx.save_for_backward(q, k, v)
        ctx.masks, ctx.outs, ctx.lses, ctx.direct = masks, outs, lses, False
        ctx.natives = natives
        ctx.covered = covered
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if ctx.direct:
            q, k, v, out = ctx.saved_tensors
            (r,) = ctx.runs
            B, L, S = q.shape[0], q.shape[2], k.shape[2]
            gq, gk, gv = _run_backward(
                r,
                _q_view(grad_out, r),
                q,
                k,
                v,
                _q_view(out, r),
                ctx.lses[0],
                ctx.masks[0],
                ctx.scale,
                ctx.natives[0],
                ctx.products,
            )
            dq = _whole(gq, B, L)
            if ctx.keys_in_order:
                return dq, _whole(gk, B, S), _whole(gv, B, S), None, None, None
            acc = torch.promote_types(q.dtype, torch.float32)
            dk = torch.zeros_like(k, dtype=acc)
            dv = torch.zeros_like(v, dtype=acc)
            _add_spans(dk, gk, r)
            _add_spans(dv, gv, r)
            return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None
        q, k, v = ctx.saved_tensors
        # Overlapping spans add into dk/dv; accumulate low precision in float32.
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.empty_like(q) if ctx.covered else torch.zeros_like(q)  # every row written
        dk = torch.zeros_like(k, dtype=acc)
        dv = torch.zeros_like(v, dtype=acc)
        runs = zip(ctx.runs, ctx.masks, ctx.outs, ctx.lses, ctx.natives, strict=True)
        for r, mask, o, lse, own in runs:
            gq, gk, gv = _run_backward(
                r, _q_view(grad_out, r), q, k, v, o, lse, mask, ctx.scale, own, ctx.products
            )
            _q_view(dq, r).copy_(gq)
            _add_spans(dk, gk, r)
            _add_spans(dv, gv, r)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _in_order(r: TileRun, B: int, n: int, *, rows: bool) -> bool:
    """Whether the run's query tiles (``rows``) or key spans cover all ``B * n`` positions,
    one after the other in ``(batch, position)`` order."""
    first, step, size = (r.i, r.di, r.rows) if rows else (r.j, r.dj, r.width)
    flat_step = r.db * n + step if r.count > 1 else size
    return r.b == 0 and first == 0 and flat_step == size and r.count * size == B * n


def _whole(t: Tensor, B: int, n: int) -> Tensor:
    """A kernel result ``(count, heads, size, E)``, laid out ``(count, size, heads, E)`` in
    memory and covering all positions in order, as the ``(B, heads, n, E)`` view."""
    return t.transpose(1, 2).reshape(B, n, t.shape[1], t.shape[3]).transpose(1, 2)


def _sdpa_runs(
    q: Tensor, k: Tensor, v: Tensor, runs: list[TileRun], *, scale: float, dropout_p: float
) -> Tensor:
    """The runs through torch's ``scaled_dot_product_attention`` and autograd (any device,
    dropout, ``Ev != E``), gathering tiles with ``index_select``."""
    B, H, L, E = q.shape
    K, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    q_rows = q.transpose(1, 2).reshape(B * L, H, E)  # one row per query
    k_rows = k.transpose(1, 2).reshape(B * S, K, E)
    v_rows = v.transpose(1, 2).reshape(B * S, K, Ev)
    pieces, index = [], []
    for r in runs:
        qi = _tile_index(r.b, r.i, r.db, r.di, r.count, r.rows, L, q.device)  # (count, rows)
        kj = _tile_index(r.b, r.j, r.db, r.dj, r.count, r.width, S, q.device)  # (count, width)
        qt = q_rows.index_select(0, qi.flatten()).view(r.count, r.rows, H, E).transpose(1, 2)
        kt = k_rows.index_select(0, kj.flatten()).view(r.count, r.width, K, E).transpose(1, 2)
        vt = v_rows.index_select(0, kj.flatten()).view(r.count, r.width, K, Ev).transpose(1, 2)
        mask = None
        row_ok = None
        if r.allowed is not None:
            row_ok = r.allowed.any(-1, keepdim=True)  # (count or 1, rows, 1)
            # A row with no allowed key attends everything and is zeroed below, so the kernel
            # never sees an all-masked row (NaN on some backends); its gradients are zero.
            mask = (r.allowed | ~row_ok).unsqueeze(1)  # (count or 1, 1, rows, width)
        o = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=H != K
        )  # (count, H, rows, Ev)
        if row_ok is not None:
            o = torch.where(row_ok.unsqueeze(1), o, 0.0)
        pieces.append(o.transpose(1, 2).reshape(r.count * r.rows, H, Ev))
        index.append(qi.flatten())
    out = q.new_zeros(B * L, H, Ev)
    if pieces:
        out = out.index_copy(0, torch.cat(index), torch.cat(pieces))
    else:  # nothing to attend: zeros that stay in the graph, so every input gets a zero grad
        out = out + 0.0 * (q.sum() + k.sum() + v.sum())
    return out.view(B, L, H, Ev).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# planning helpers


def _arithmetic_runs(tiles: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Split tiles into maximal ``[start, stop)`` runs whose coordinates advance by one step."""
    runs, start = [], 0
    while start < len(tiles):
        stop = start + 1
        if stop < len(tiles):
            step = tuple(x1 - x0 for x0, x1 in zip(tiles[start], tiles[stop], strict=True))
            while stop < len(tiles) and all(
                x1 - x0 == s for x0, x1, s in zip(tiles[stop - 1], tiles[stop], step, strict=True)
            ):
                stop += 1
        runs.append((start, stop))
        start = stop
    return runs


def _tile_masks(L: int, S: int, tile: TileRun, rules: Structure) -> Tensor | None:
    """Bool ``(count, rows, width)``: the rules evaluated on each tile of a run (``None`` if
    they allow every pair); ``rules`` as made by :meth:`Structure.to`."""
    seg = rules.segment_ids
    device = seg.device if seg is not None else None
    u = torch.arange(tile.count, device=device).view(tile.count, 1, 1)
    i = tile.i + u * tile.di + torch.arange(tile.rows, device=device).view(1, tile.rows, 1)
    j = tile.j + u * tile.dj + torch.arange(tile.width, device=device).view(1, 1, tile.width)
    b = tile.b + u * tile.db
    ok = rules.allows(i, j, b, L=L, S=S).expand(tile.count, tile.rows, tile.width)
    return None if bool(ok.all()) else ok


@functools.lru_cache(maxsize=256)
def _offset_additive(span: Span, dtype: torch.dtype) -> Tensor | None:
    """:func:`attnkit.masks.offset_mask` as the kernel's additive mask in ``dtype`` (cached)."""
    band = offset_mask(*span)
    return None if band is None else _additive(band.unsqueeze(0), dtype)


def _tile_index(
    b: int, x: int, db: int, dx: int, count: int, size: int, n: int, device: torch.device
) -> Tensor:
    """Flat row indices ``(count, size)`` of a run's tiles in a ``(B * n)`` row layout."""
    u = torch.arange(count, device=device).view(count, 1)
    return (b + u * db) * n + x + u * dx + torch.arange(size, device=device).view(1, size)


def _additive(allowed: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Bool mask -> additive mask in the kernel's dtype (``(rows, width)`` when shared)."""
    if allowed is None:
        return None
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask[0] if len(mask) == 1 else mask.unsqueeze(1)  # (rows, w) or (count, 1, rows, w)


def _kernel_mask(r: TileRun, dtype: torch.dtype) -> Tensor | None:
    """The additive mask the kernel gets for run ``r``: none for ``is_causal`` or unmasked runs,
    a cached one when the mask is shared by every tile."""
    if r.causal or r.allowed is None:
        return None
    if r.shared is not None:
        return _offset_additive(r.shared, dtype)
    return _additive(r.allowed, dtype)


def _views(r: TileRun, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The run's query tiles and key/value spans as strided views (see :func:`_q_view`)."""
    return _q_view(q, r), _k_view(k, r), _k_view(v, r)


def _q_view(t: Tensor, r: TileRun) -> Tensor:
    """The run's query tiles of ``t`` ``(B, H, L, E)`` as a ``(count, H, rows, E)`` view."""
    sb, sh, sl, se = t.stride()
    return t.as_strided(
        (r.count, t.shape[1], r.rows, t.shape[3]),
        (r.db * sb + r.di * sl, sh, sl, se),
        t.storage_offset() + r.b * sb + r.i * sl,
    )


def _k_view(t: Tensor, r: TileRun, start: int = 0, width: int | None = None) -> Tensor:
    """The run's key spans of ``t`` ``(B, K, S, E)`` (or a slice of them) as a view."""
    sb, sh, sl, se = t.stride()
    return t.as_strided(
        (r.count, t.shape[1], r.width if width is None else width, t.shape[3]),
        (r.db * sb + r.dj * sl, sh, sl, se),
        t.storage_offset() + r.b * sb + (r.j + start) * sl,
    )


def _add_spans(acc: Tensor, grad: Tensor, r: TileRun) -> None:
    """Add per-span gradients into ``acc``, in slices that do not overlap within the run."""
    if r.db == 0 and r.dj == 0:  # every tile attends the same span
        one = TileRun(r.b, r.i, r.j, 0, 0, 0, 1, r.rows, r.width, None)
        _k_view(acc, one).add_(grad.sum(0, keepdim=True))
        return
    step = abs(r.dj) if r.db == 0 and abs(r.dj) < r.width else r.width
    for start in range(0, r.width, step):
        w = min(step, r.width - start)
        _k_view(acc, r, start, w).add_(grad[:, :, start : start + w])


def _timed_flash(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """attnkit's flash forward as the policy times it for bf16 structured attention: with the
    tile products a bf16 forward would use."""
    return attention_kernels.flash_attention(*args, products=policy.flash_bf16_products(), **kwargs)


def _timed_positional(q: Tensor, k: Tensor, v: Tensor, *, window: int, products: str) -> Tensor:
    """A causal window on attnkit's flash kernels with autograd (:func:`attend_positional`, what
    such a call runs where the policy picks them), as the policy times it for bf16 attention
    with gradients."""
    structure = Structure(causal=True, window=window)
    return attend_positional(q, k, v, structure, scale=q.shape[-1] ** -0.5, products=products)


policy.provide_attention_kernel("flash", _timed_flash)
policy.provide_attention_kernel("positional", _timed_positional)
