"""The tiled kernel behind :func:`attnkit.flex.flex_attention`: forward and flash-style backward.

Queries go one block of rows at a time. For each, the keys between its first and last non-empty
key block form a span, cut into chunks of at most :func:`attnkit.kernels.policy.flex_chunk_keys`
keys; each chunk is one product ``q k^T``, one ``score_mod`` call on that score tile, a mask
only on its partial blocks (``mask_mod`` on their index tile; full blocks take no mask work,
empty blocks inside a span are set to ``-inf``), and an online softmax across chunks. The
backward recomputes each tile from the saved log-sum-exp (no score matrix is kept) and takes
the gradients of tensors the ``score_mod`` captured by autograd through its call on each tile.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attnkit.flex.blockmask import EMPTY, FULL, PARTIAL, BlockMask, index_tensors
from attnkit.kernels import policy

__all__ = ["Chunk", "Mods", "TilePlan", "backward", "forward", "tile_plan"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Keys ``c0:c1`` of one query block, and the ``(start, stop, state)`` column ranges
    (relative to ``c0``) that need a mask: partial blocks, or empty ones inside the span."""

    c0: int
    c1: int
    masked: tuple[tuple[int, int, int], ...]
    has_full: bool = True


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The work of one call: per query block ``(r0, r1, chunks)``; blocks with no chunk
    produce zero rows (and ``-inf`` log-sum-exp)."""

    rows: tuple[tuple[int, int, tuple[Chunk, ...]], ...]


def tile_plan(
    block_mask: BlockMask | None, L: int, S: int, heads: int, *, fused: bool = False
) -> TilePlan:
    """The :class:`TilePlan` of ``block_mask`` (None: every pair allowed), with states merged
    over batch and heads (a block full for some and empty for others is partial).

    For the fused kernel (``fused``) a chunk is a run of full blocks (no mask at all) or of
    blocks that need one, of any length (the kernel tiles them itself); otherwise chunks hold
    at most :func:`attnkit.kernels.policy.flex_chunk_keys` keys.
    """
    if block_mask is None:
        rows, cols = policy.flex_block_rows(L), S
        states = torch.full((-(-L // rows), 1), FULL, dtype=torch.int8)
    else:
        rows, cols = block_mask.BLOCK_SIZE
        st = block_mask.states.cpu()
        full = (st == FULL).flatten(0, 1).all(0)
        empty = (st == EMPTY).flatten(0, 1).all(0)
        states = torch.full(full.shape, PARTIAL, dtype=torch.int8)
        states[full] = FULL
        states[empty] = EMPTY
    most = S if fused else max(cols, policy.flex_chunk_keys(heads, rows) // cols * cols)
    step = max(1, most // cols)
    plan = []
    for i, line in enumerate(states.tolist()):
        r0, r1 = i * rows, min(L, (i + 1) * rows)
        live = [j for j, s in enumerate(line) if s != EMPTY]
        chunks: list[Chunk] = []
        if live:
            lo, hi = live[0], live[-1] + 1
            bounds = [lo]
            for j in range(lo + 1, hi):  # (cut where fullness changes, or at the chunk size)
                if (fused and (line[j] == FULL) != (line[j - 1] == FULL)) or j - bounds[-1] >= step:
                    bounds.append(j)
            bounds.append(hi)
            for j0, j1 in itertools.pairwise(bounds):
                if all(line[j] == EMPTY for j in range(j0, j1)):
                    continue
                c0, c1 = j0 * cols, min(S, j1 * cols)
                masked = tuple(
                    (j * cols - c0, min(S, (j + 1) * cols) - c0, line[j])
                    for j in range(j0, j1)
                    if line[j] != FULL
                )
                has_full = any(line[j] == FULL for j in range(j0, j1))
                chunks.append(Chunk(c0, c1, masked, has_full))
        plan.append((r0, r1, tuple(chunks)))
    return TilePlan(tuple(plan))


@dataclasses.dataclass
class Mods:
    """The modifications of one call: ``score_mod`` (None: the scores as they are), with
    ``fused`` set for ALiBi (its bias tile is one fused multiply-add, its gradient the
    identity), and ``mask_mod`` for partial blocks."""

    score_mod: ScoreMod | None
    mask_mod: MaskMod | None
    slopes: Tensor | None = None  # ALiBi slopes (H,), when recognised
    identity_grad: bool = False

    #: The modification is an additive bias that needs no gradient (none, or ALiBi) and the
    #: inputs suit torch's fused CPU flash kernel (equal head dims of keys and values): then
    #: each tile is one call of that kernel with the bias and mask as its additive
    #: ``attn_mask``, forward and backward.
    fused: bool = False
    #: ALiBi biases of every offset, ``(H, rows, S + L)`` (see :func:`alibi_table`).
    table: Tensor | None = None
    table_shift: int = 0  # (``L - 1``: the table's column of offset 0)


def _scores(s: Tensor, mods: Mods, idx: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """``score_mod`` on the score tile ``s (B, H, Lt, St)``, as a tensor of that shape."""
    b, h, q, kv = idx
    if mods.slopes is not None:
        rel = (kv - q).to(s.dtype)  # (1, 1, Lt, St)
        return s.addcmul_(mods.slopes.to(s.device, s.dtype).view(1, -1, 1, 1), rel)
    if mods.score_mod is None:
        return s
    out = mods.score_mod(s, b, h, q, kv)
    return out if out.shape == s.shape else out.expand(s.shape)


def _mask(
    s: Tensor, chunk: Chunk, mods: Mods, idx: tuple[Tensor, Tensor, Tensor, Tensor]
) -> Tensor:
    """``s`` with the masked pairs of ``chunk``'s partial and empty blocks set to ``-inf``."""
    if not chunk.masked:
        return s
    if not s.is_contiguous():  # (an expanded score_mod output)
        s = s.contiguous()
    b, h, q, kv = idx
    for a, z, state in chunk.masked:
        if state == EMPTY or mods.mask_mod is None:
            s[..., a:z] = float("-inf")
        else:
            allowed = mods.mask_mod(b, h, q, kv[..., a:z])
            s[..., a:z].masked_fill_(~allowed, float("-inf"))
    return s


Index = tuple[Tensor, Tensor, Tensor, Tensor]
# One tile of the forward: (grouped query rows, key chunk, value chunk, chunk, r0, r1, index
# tensors) -> (output (B, H, Lt, Ev), log-sum-exp (B, H, Lt, 1), -inf where nothing attended).
TileFn = Callable[[Tensor, Tensor, Tensor, Chunk, int, int, Index], tuple[Tensor, Tensor]]


def _online(q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, tile: TileFn) -> tuple[Tensor, Tensor]:
    """Run ``tile`` over every chunk of ``plan`` and merge the chunks of each query block by an
    online softmax; returns :func:`forward`'s ``(out, lse)``."""
    B, H, L, E = q.shape
    K, Ev = k.shape[1], v.shape[-1]
    G = H // K
    out = q.new_zeros(B, H, L, Ev)
    lse = q.new_full((B, H, L), float("-inf"))
    dev = q.device
    for r0, r1, chunks in plan.rows:
        if not chunks:
            continue
        Lt = r1 - r0
        qt = q[:, :, r0:r1].reshape(B, K, G * Lt, E)  # (B, K, G*Lt, E)
        rows = torch.arange(r0, r1, device=dev)
        lse_run = acc = None
        for chunk in chunks:
            kc, vc = k[:, :, chunk.c0 : chunk.c1], v[:, :, chunk.c0 : chunk.c1]
            idx = index_tensors(B, H, rows, torch.arange(chunk.c0, chunk.c1, device=dev))
            o, lse_c = tile(qt, kc, vc, chunk, r0, r1, idx)
            if acc is None:
                lse_run, acc = lse_c, o
                continue
            assert lse_run is not None
            lse_new = torch.logaddexp(lse_run, lse_c)
            known = lse_new > float("-inf")
            a_old = torch.where(known, torch.exp(lse_run - lse_new), 0.0)
            a_new = torch.where(known, torch.exp(lse_c - lse_new), 0.0)
            acc = acc * a_old + o * a_new
            lse_run = lse_new
        assert lse_run is not None and acc is not None
        out[:, :, r0:r1] = acc
        lse[:, :, r0:r1] = lse_run.squeeze(-1)
    return out, lse


def _bias_tile(
    chunk: Chunk, mods: Mods, idx: tuple[Tensor, Tensor, Tensor, Tensor], dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """The additive ``attn_mask`` of ``chunk`` (ALiBi bias, ``-inf`` where masked) as
    ``(Bm, Hm, Lt, St)`` with ``Bm``/``Hm`` 1 where it does not vary, or None where there is
    nothing to add; and the bool ``(Bm, Hm, Lt, 1)`` queries that may attend no key of the
    chunk (None where each has one)."""
    b, h, q, kv = idx
    Lt, St = q.shape[2], kv.shape[3]
    tile = None
    if mods.slopes is not None:
        tile = _alibi_tile(mods, int(q[0, 0, 0, 0]), Lt, int(kv[0, 0, 0, 0]), St, dtype)
    if not chunk.masked:
        return tile, None
    if tile is not None:
        tile = tile.clone()  # (a view of the shared table)
    parts: list[tuple[int, int, Tensor | None]] = []
    shape = [1, 1] if tile is None else list(tile.shape[:2])
    for a, z, state in chunk.masked:
        allowed = None
        if state != EMPTY and mods.mask_mod is not None:
            allowed = mods.mask_mod(b, h, q, kv[..., a:z])
            full = torch.broadcast_shapes(allowed.shape, (1, 1, Lt, z - a))
            shape = [max(shape[0], full[0]), max(shape[1], full[1])]
        parts.append((a, z, allowed))
    if tile is None:
        tile = torch.zeros(*shape, Lt, St, dtype=dtype, device=q.device)
    elif tuple(tile.shape[:2]) != tuple(shape):
        tile = tile.expand(*shape, Lt, St).contiguous()
    for a, z, allowed in parts:
        if allowed is None:
            tile[..., a:z] = float("-inf")
        else:
            tile[..., a:z].masked_fill_(~allowed, float("-inf"))
    empty = None if chunk.has_full else (tile == float("-inf")).all(dim=-1, keepdim=True)
    return tile, empty


def alibi_table(slopes: Tensor, rows: int, L: int, S: int, dtype: torch.dtype) -> Tensor:
    """``table[h, i, x] = slopes[h] * (x - (L - 1) - i)``, ``(H, rows, S + L)``: the ALiBi bias
    of query ``r0 + i`` and key ``c`` is ``table[h, i, c - r0 + L - 1]``, so every tile's bias is
    a view of it (the bias depends only on the offset ``kv - q``)."""
    x = torch.arange(S + L, device=slopes.device).view(1, -1) - (L - 1)
    offsets = (x - torch.arange(rows, device=slopes.device).view(-1, 1)).to(dtype)  # (rows, S+L)
    return slopes.to(dtype).view(-1, 1, 1) * offsets


def _alibi_tile(mods: Mods, r0: int, Lt: int, c0: int, St: int, dtype: torch.dtype) -> Tensor:
    """The ALiBi bias ``(1, H, Lt, St)`` of queries ``r0:r0 + Lt`` and keys ``c0:c0 + St``."""
    assert mods.table is not None and mods.slopes is not None
    x0 = c0 - r0 + mods.table_shift
    return mods.table[:, :Lt, x0 : x0 + St].unsqueeze(0)


def _causal_square(chunk: Chunk, r0: int, r1: int, mods: Mods) -> bool:
    """Whether ``chunk`` of queries ``r0:r1`` is their diagonal square under a band mask that
    is plain causal there (offsets ``0 .. >= r1 - r0 - 1``): the fused kernel's ``is_causal``
    then masks it, skipping the blocks above the diagonal and building no mask."""
    band = getattr(mods.mask_mod, "band", None)
    return (
        band is not None
        and band[0] == 0
        and band[1] >= r1 - r0 - 1
        and (chunk.c0, chunk.c1) == (r0, r1)
        and not chunk.has_full
    )


def _causal_bias(
    mods: Mods, idx: tuple[Tensor, Tensor, Tensor, Tensor], dtype: torch.dtype
) -> tuple[Tensor | None, None]:
    """The bias of a :func:`_causal_square` chunk (no mask: the kernel's ``is_causal`` masks)."""
    if mods.slopes is None:
        return None, None
    _, _, q, kv = idx
    Lt, St = q.shape[2], kv.shape[3]
    return _alibi_tile(mods, int(q[0, 0, 0, 0]), Lt, int(kv[0, 0, 0, 0]), St, dtype), None


def _grouped(tile: Tensor | None, K: int, G: int) -> Tensor | None:
    """``tile (Bm, Hm, Lt, St)`` in the layout of queries grouped by key head,
    ``(Bm, K or 1, G * Lt, St)``."""
    if tile is None or G == 1:
        return tile
    Bm, Hm, Lt, St = tile.shape
    if Hm == 1:
        return tile.unsqueeze(2).expand(Bm, 1, G, Lt, St).reshape(Bm, 1, G * Lt, St)
    return tile.reshape(Bm, K, G * Lt, St)


def _fused_tile_mask(
    chunk: Chunk, r0: int, r1: int, mods: Mods, idx: Index, dtype: torch.dtype, G: int
) -> tuple[bool, Tensor | None, Tensor | None]:
    """How the fused kernel masks one tile: ``(causal, bias, empty)`` (its own causal flag on a
    causal square without query groups, else the additive bias tile and the rows it empties)."""
    causal = G == 1 and _causal_square(chunk, r0, r1, mods)
    bias, empty = _causal_bias(mods, idx, dtype) if causal else _bias_tile(chunk, mods, idx, dtype)
    return causal, bias, empty


def forward(
    q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, mods: Mods, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention over the tiles of ``plan``; :attr:`Mods.fused` modifications make one fused
    kernel call per tile.

    Shape:
        q ``(B, H, L, E)``, k ``(B, K, S, E)``, v ``(B, K, S, Ev)`` ->
        out ``(B, H, L, Ev)``, lse ``(B, H, L)`` (natural log; ``-inf`` for rows that attend
        nothing, whose output is zero).
    """
    B, H = q.shape[0], q.shape[1]
    K, Ev = k.shape[1], v.shape[-1]
    G = H // K

    def fused_tile(
        qt: Tensor, kc: Tensor, vc: Tensor, chunk: Chunk, r0: int, r1: int, idx: Index
    ) -> tuple[Tensor, Tensor]:
        Lt = r1 - r0
        causal, bias, empty = _fused_tile_mask(chunk, r0, r1, mods, idx, q.dtype, G)
        o, lse_c = _flash(qt, kc, vc, 0.0, causal, attn_mask=_grouped(bias, K, G), scale=scale)
        o, lse_c = o.reshape(B, H, Lt, Ev), lse_c.reshape(B, H, Lt, 1)
        if empty is not None:
            o = o.masked_fill(empty, 0.0)
            lse_c = lse_c.masked_fill(empty, float("-inf"))
        return o, lse_c

    def tile(
        qt: Tensor, kc: Tensor, vc: Tensor, chunk: Chunk, r0: int, r1: int, idx: Index
    ) -> tuple[Tensor, Tensor]:
        Lt, St = r1 - r0, chunk.c1 - chunk.c0
        s = torch.matmul(qt, kc.transpose(-1, -2)).view(B, H, Lt, St)
        s = _mask(_scores(s, mods, idx), chunk, mods, idx)
        lse_c = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, H, Lt, 1)
        p = torch.softmax(s, dim=-1)  # (NaN rows where every key is masked)
        o = torch.matmul(p.view(B, K, G * Lt, St), vc).view(B, H, Lt, Ev)
        return torch.where(lse_c == float("-inf"), 0.0, o), lse_c

    if mods.fused:
        return _online(q, k, v, plan, fused_tile)
    return _online(q * scale, k, v, plan, tile)


# One tile of a backward: (key chunk, value chunk, chunk, index tensors) -> the gradients of
# the query block's rows ``(B, K, G*Lt, E)`` (a tensor of the tile's own: later tiles of the
# block are added to it in place) and of the chunk's keys and values ``(B, K, St, E or Ev)``.
BackwardTileFn = Callable[[Tensor, Tensor, Chunk, Index], tuple[Tensor, Tensor, Tensor]]


def _tiled_backward(
    q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, rows: Callable[[int, int], BackwardTileFn]
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the tile backward that ``rows(r0, r1)`` gives for each query block of ``plan`` (it
    slices the block's rows once) over each chunk of the block, summing the block's query
    gradients and each chunk's key and value gradients; returns ``(dq, dk, dv)``."""
    B, H, _, E = q.shape
    dev = q.device
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r0, r1, chunks in plan.rows:
        if not chunks:
            continue
        tile = rows(r0, r1)
        queries = torch.arange(r0, r1, device=dev)
        dq_t = None
        for chunk in chunks:
            c0, c1 = chunk.c0, chunk.c1
            idx = index_tensors(B, H, queries, torch.arange(c0, c1, device=dev))
            dqc, dkc, dvc = tile(k[:, :, c0:c1], v[:, :, c0:c1], chunk, idx)
            dq_t = dqc if dq_t is None else dq_t.add_(dqc)
            dk[:, :, c0:c1] += dkc
            dv[:, :, c0:c1] += dvc
        assert dq_t is not None
        dq[:, :, r0:r1] = dq_t.reshape(B, H, r1 - r0, E)
    return dq, dk, dv


def backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    plan: TilePlan,
    mods: Mods,
    scale: float,
    captured: Sequence[Tensor],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """Gradients of :func:`forward`'s output for ``grad_out``, recomputed tile by tile from
    ``lse``: ``(dq, dk, dv, d captured)`` (``captured``: tensors the ``score_mod`` reads that
    need gradients; None where one received none).

    :attr:`Mods.fused` modifications take the fused kernel's backward per tile, with the whole
    rows' output and log-sum-exp; the captured tensors get none (a fused modification is an
    additive bias that needs no gradient).
    """
    B, H = q.shape[0], q.shape[1]
    K = k.shape[1]
    G = H // K
    lse = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    dcap: list[Tensor | None] = [None] * len(captured)

    def grouped(x: Tensor, r0: int, r1: int) -> Tensor:
        """Rows ``r0:r1`` of ``x (B, H, L, D)`` grouped by key head: ``(B, K, G * Lt, D)``."""
        return x[:, :, r0:r1].reshape(B, K, G * (r1 - r0), x.shape[-1])

    def fused_rows(r0: int, r1: int) -> BackwardTileFn:
        qt, dot, ot = grouped(q, r0, r1), grouped(grad_out, r0, r1), grouped(out, r0, r1)
        lt = lse[:, :, r0:r1].reshape(B, K, G * (r1 - r0))

        def tile(kc: Tensor, vc: Tensor, chunk: Chunk, idx: Index) -> tuple[Tensor, Tensor, Tensor]:
            causal, bias, _ = _fused_tile_mask(chunk, r0, r1, mods, idx, q.dtype, G)
            dqc, dkc, dvc = _flash_backward(
                dot, qt, kc, vc, ot, lt, 0.0, causal, attn_mask=_grouped(bias, K, G), scale=scale
            )
            return dqc, dkc, dvc

        return tile

    if mods.fused:
        dq, dk, dv = _tiled_backward(q, k, v, plan, fused_rows)
        return dq, dk, dv, dcap

    qs = q * scale
    delta = (grad_out * out).sum(dim=-1)  # (B, H, L)
    autograd = mods.score_mod is not None and not mods.identity_grad

    def score_rows(r0: int, r1: int) -> BackwardTileFn:
        Lt = r1 - r0
        qt, dot = grouped(qs, r0, r1), grouped(grad_out, r0, r1)
        lse_t = lse[:, :, r0:r1].unsqueeze(-1)
        delta_t = delta[:, :, r0:r1].unsqueeze(-1)

        def tile(kc: Tensor, vc: Tensor, chunk: Chunk, idx: Index) -> tuple[Tensor, Tensor, Tensor]:
            St = chunk.c1 - chunk.c0
            s_raw = torch.matmul(qt, kc.transpose(-1, -2)).view(B, H, Lt, St)
            s_in: Tensor | None
            s_mod: Tensor | None
            if autograd:
                assert mods.score_mod is not None
                with torch.enable_grad():
                    s_in = s_raw.detach().requires_grad_()
                    s_mod = mods.score_mod(s_in, *idx)
                s = s_mod.detach().expand(B, H, Lt, St).clone()
            else:
                s_mod = s_in = None
                s = _scores(s_raw, mods, idx)
            s = _mask(s, chunk, mods, idx)
            p = s.sub_(lse_t).exp_()  # (B, H, Lt, St)
            pk = p.view(B, K, G * Lt, St)
            dvc = torch.matmul(pk.transpose(-1, -2), dot)
            dp = torch.matmul(dot, vc.transpose(-1, -2)).view(B, H, Lt, St)
            ds = p.mul_(dp.sub_(delta_t))  # (B, H, Lt, St)
            if autograd:
                assert s_mod is not None and s_in is not None
                wanted = [s_in, *captured]
                grads = torch.autograd.grad(
                    s_mod, wanted, grad_outputs=ds.sum_to_size(s_mod.shape), allow_unused=True
                )
                for n, g in enumerate(grads[1:]):
                    if g is not None:
                        dcap[n] = g if dcap[n] is None else dcap[n] + g  # type: ignore[operator]
                ds = grads[0] if grads[0] is not None else torch.zeros_like(ds)
            dsk = ds.reshape(B, K, G * Lt, St)
            return torch.matmul(dsk, kc), torch.matmul(dsk.transpose(-1, -2), qt), dvc

        return tile

    dq, dk, dv = _tiled_backward(q, k, v, plan, score_rows)
    return dq.mul_(scale), dk, dv, dcap
