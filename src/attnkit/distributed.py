"""Attention over a sequence sharded across processes: ring attention (context parallelism).

Each rank of a ``torch.distributed`` process group holds one shard of the sequence: its
queries, keys and values. :func:`ring_attention` passes the key/value shards around the ring
of ranks with point-to-point sends (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``,
the next shard's transfer overlapping the current shard's compute), computes each (query shard,
key shard) block with torch's fused CPU flash kernel, which also returns the block's
log-sum-exp, and merges the blocks by log-sum-exp, so the result equals attention over the
gathered sequence. The backward walks the ring again: each rank adds its query shard's
contribution to the key/value gradients of the block it holds and passes them on with the block,
and after a full turn every rank holds the gradients of its own keys and values.

Causal attention skips the blocks entirely in the future. With the contiguous layout (rank
``r`` holds positions ``r * n .. (r + 1) * n - 1``) that leaves rank 0 one half block per
turn and the last rank ``world - 0.5`` blocks: the ring runs at the pace of the last rank.
The ``"zigzag"`` layout cuts the sequence into ``2 * world`` chunks and gives rank ``r``
chunks ``r`` and ``2 * world - 1 - r``, so every rank computes the same area
(:func:`shard` and :func:`shard_positions` lay a sequence out either way).

Shape legend: B batch, H query heads, K key/value heads (``H % K == 0``), L query shard
length, S key shard length, E head dim.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.functional import check_heads
from attnkit.kernels import attention as attention_kernels
from attnkit.kernels import build, policy

__all__ = [
    "LAYOUTS",
    "RingKernel",
    "ring_attention",
    "shard",
    "shard_positions",
    "unshard",
]

Layout = Literal["contiguous", "zigzag"]
#: The ways a sequence can be laid out over the ranks.
LAYOUTS: tuple[Layout, ...] = get_args(Layout)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


# --------------------------------------------------------------------------------------------
# layouts


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_positions(length: int, rank: int, world: int, *, layout: Layout = "contiguous") -> Tensor:
    """The positions of the sequence that rank ``rank`` holds.

    Args:
        length: Length of the whole sequence (a multiple of ``world``, of ``2 * world`` for
            ``"zigzag"``).
        rank: The rank, ``0 <= rank < world``.
        world: Number of ranks.
        layout: ``"contiguous"`` (rank ``r`` holds the ``r``-th of ``world`` equal pieces) or
            ``"zigzag"`` (pieces ``r`` and ``2 * world - 1 - r`` of ``2 * world``).

    Returns:
        Long tensor ``(length // world,)`` of increasing positions.

    Raises:
        ValueError: A bad ``layout``, ``rank`` or ``world``, or ``length`` not divisible.
    """
    _check_layout(layout)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    pieces = world if layout == "contiguous" else 2 * world
    if length % pieces:
        raise ValueError(
            f"sequence length {length} must be divisible by {pieces} for the {layout!r} "
            f"layout over {world} ranks"
        )
    n = length // pieces
    chunks = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
    return torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks])


def shard(x: Tensor, dim: int, rank: int, world: int, *, layout: Layout = "contiguous") -> Tensor:
    """This rank's shard of a whole sequence ``x`` along ``dim`` (see :func:`shard_positions`).

    Args:
        x: The whole sequence.
        dim: The sequence dim.
        rank: The rank.
        world: Number of ranks.
        layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
        The shard, ``x.shape[dim] // world`` long along ``dim``.
    """
    pos = shard_positions(x.shape[dim], rank, world, layout=layout).to(x.device)
    return x.index_select(dim, pos)


def unshard(shards: list[Tensor], dim: int, *, layout: Layout = "contiguous") -> Tensor:
    """Reassemble the whole sequence from every rank's shard (inverse of :func:`shard`).

    Args:
        shards: The shards of ranks ``0 .. world - 1``.
        dim: The sequence dim.
        layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
        The whole sequence.
    """
    _check_layout(layout)
    if layout == "contiguous":
        return torch.cat(shards, dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


# --------------------------------------------------------------------------------------------
# blocks


def _block_kernel(q: Tensor, k: Tensor, causal: bool) -> str:
    """The policy's kernel for one block (the same for its forward and its backward)."""
    eager = build.eager_cpu(q)
    call = policy.AttentionCall(
        dtype=q.dtype,
        device=q.device.type,
        L=q.shape[2],
        S=k.shape[2],
        causal=causal,
        grads=q.requires_grad,
        eager=eager,
        ready=eager and attention_kernels.flash_available(),
    )
    return policy.ring_block_kernel(call)


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of one block and its log-sum-exp ``(B, H, L)`` (top-left causal if asked), on
    the policy's :func:`~attnkit.kernels.policy.ring_block_kernel`."""
    kernel = _block_kernel(q, k, causal)
    if kernel == "flash":
        return attention_kernels.flash_attention(q, k, v, scale=scale, causal=causal, first=0)
    if kernel == "torch-flash":
        out, lse = _flash(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _heads(v, q.shape[1])), lse


def _block_backward(
    g: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    into: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Gradients of one block given the *merged* output and log-sum-exp of its queries (the
    full ``dq`` contribution of these keys and the full ``dk``/``dv`` from these queries), added
    to ``into`` (``dq``, ``dk``, ``dv`` slices of the running sums, float32 or wider); attnkit's
    kernel adds them itself, without a buffer per block."""
    kernel = _block_kernel(q, k, causal)  # (the forward's: the same call)
    if kernel == "flash":  # (float32 or bf16 inputs: the sums are float32)
        attention_kernels.flash_attention_backward(
            g, q, k, v, out, lse, scale=scale, causal=causal, first=0, into=into
        )
        return
    if kernel == "torch-flash":
        grads = _flash_backward(g, q, k, v, out, lse, 0.0, causal, scale=scale)
    else:
        H, K = q.shape[1], k.shape[1]
        p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))  # (B, H, L, S)
        dv = torch.matmul(p.transpose(-1, -2), g)
        dp = torch.matmul(g, _heads(v, H).transpose(-1, -2))
        ds = p * (dp - (g * out).sum(-1, keepdim=True)) * scale
        dq = torch.matmul(ds, _heads(k, H))
        dk = torch.matmul(ds.transpose(-1, -2), q)
        if H != K:  # sum the query heads of each key/value head
            dk = dk.unflatten(1, (K, H // K)).sum(2)
            dv = dv.unflatten(1, (K, H // K)).sum(2)
        grads = (dq, dk, dv)
    for acc, grad in zip(into, grads, strict=True):
        acc += grad


def _heads(x: Tensor, H: int) -> Tensor:
    """Key/value heads repeated to the ``H`` query heads."""
    return x if x.shape[1] == H else x.repeat_interleave(H // x.shape[1], dim=1)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    s = torch.matmul(q, _heads(k, q.shape[1]).transpose(-1, -2)) * scale
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s


def _merge(out: Tensor, lse: Tensor, o: Tensor, blk_lse: Tensor) -> None:
    """Fold a block's ``(o, blk_lse)`` into the running ``(out, lse)`` in place."""
    new = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o * torch.exp(blk_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _pieces(
    rank: int, src: int, causal: bool, layout: str, L: int, S: int
) -> list[tuple[slice, slice, bool]]:
    """Which (query rows, key rows, causal) pieces of the block of rank ``src``'s keys the
    queries of ``rank`` attend: none for a block entirely in the future."""
    every = slice(None)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]  # the diagonal: causal in local order in both layouts
    if layout == "contiguous":
        return [(every, every, False)] if src < rank else []
    if src < rank:  # zigzag: every query attends the key chunk ``src``, not ``2w-1-src``
        return [(every, slice(0, S // 2), False)]
    return [(slice(L // 2, L), every, False)]  # only the query chunk ``2w-1-rank`` attends


# --------------------------------------------------------------------------------------------
# the ring

#: Keys per travelling piece: a block crosses the ring in pieces this long, each one computed and
#: passed on before the next, so a rank holds a few pieces of key/value (and gradient) blocks
#: instead of whole blocks; kernel calls take at most twice as many query rows, which bounds
#: their gradient buffers, so a rank's peak memory stays a fraction of one process's
#: (``python -m attnkit.bench.ring`` measures it).
CHUNK = 512


def _bounds(n: int, chunk: int) -> list[int]:
    """Boundaries of ``n`` keys cut into near-equal pieces of at most ``chunk``."""
    c = max(1, -(-n // chunk))
    return [n * j // c for j in range(c + 1)]


def _calls(
    rank: int, src: int, causal: bool, layout: str, L: int, S: int, a: int, b: int, rows: int
) -> list[tuple[slice, slice, bool]]:
    """The kernel calls of keys ``a .. b - 1`` of rank ``src``'s block: (query rows, keys
    within the piece, causal), at most ``rows`` query rows each."""
    calls = []
    for q_rows, keys, is_causal in _pieces(rank, src, causal, layout, L, S):
        k0, k1, _ = keys.indices(S)
        lo, hi = max(k0, a), min(k1, b)
        if lo >= hi:
            continue
        r0, r1, _ = q_rows.indices(L)
        piece = slice(lo - a, hi - a)
        if is_causal:  # the diagonal (L == S): query i attends keys <= i
            calls.append((slice(lo, hi), piece, True))  # top-left causal on the square
            r0 = hi  # later queries attend every key of the piece
        calls += [(slice(x, min(x + rows, r1)), piece, False) for x in range(r0, r1, rows)]
    return calls


class _Ring:
    """The point-to-point neighbours of this rank in ``group``."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world, self.rank = 1, 0
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = self._global((self.rank + 1) % self.world)
        self.prev = self._global((self.rank - 1) % self.world)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, tensors: list[Tensor]) -> list[Any]:
        """Start sending ``tensors`` to the next rank."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        return list(dist.batch_isend_irecv(ops))

    def receive(self, into: list[Tensor]) -> list[Any]:
        """Start receiving tensors from the previous rank into ``into``."""
        ops = [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in into]
        return list(dist.batch_isend_irecv(ops))


class _Pieces:
    """Two alternating sets of piece buffers (the one computed on, the one being received
    into), allocated once per call: a new buffer per piece and step would leave the freed ones
    resident in the allocator's heap, which measured as much as the pieces saved."""

    def __init__(self, like: list[Tensor], widest: int, dtype: torch.dtype | None = None) -> None:
        self.shapes = [(t.shape[0], t.shape[1], t.shape[3]) for t in like]
        self.sets = [
            [torch.empty(b * h * widest * e, dtype=dtype or t.dtype, device=t.device)
             for t, (b, h, e) in zip(like, self.shapes, strict=True)]
            for _ in range(2)
        ]  # fmt: skip
        self.flip = 0

    def views(self, width: int, which: int) -> list[Tensor]:
        """Set ``which`` (0: current, 1: other) as ``(B, heads, width, E)`` tensors."""
        flat = self.sets[(self.flip + which) % 2]
        return [x[: b * h * width * e].view(b, h, width, e)
                for x, (b, h, e) in zip(flat, self.shapes, strict=True)]  # fmt: skip

    def swap(self) -> None:
        """The other set becomes the current one."""
        self.flip ^= 1


def _wait(requests: list[Any]) -> None:
    for req in requests:
        req.wait()


@dataclass(frozen=True)
class _RingCall:
    """What a ring attention call does besides its tensors: causal masking, the scale, the
    process group, how the sequence is laid out over the ranks, and the keys per piece."""

    causal: bool
    scale: float
    group: Any
    layout: str
    chunk: int


class _RingAttention(torch.autograd.Function):
    """Ring attention; the blocks travel in pieces of ``chunk`` keys.

    Piece ``j`` of every block goes once around the ring before piece ``j + 1`` starts: at
    step ``s`` rank ``r`` holds piece ``j`` of rank ``r - s``'s block, starts receiving the
    same piece of the next block from ``r - 1`` and sending its own to ``r + 1``, computes, and
    waits. Every rank posts both transfers of a step before waiting on either, so the ring
    cannot deadlock. The backward's pieces carry the key/value gradients accumulated so far;
    after the last step they go to the block's owner.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, call: _RingCall) -> Tensor:  # type: ignore[override]
        ctx.call = call
        ring = _Ring(call.group)
        causal, scale, layout, chunk = call.causal, call.scale, call.layout, call.chunk
        if ring.world == 1:  # plain attention on the local sequence
            out, lse = _block_forward(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        B, H, L = q.shape[:3]
        S, Ev = k.shape[2], v.shape[3]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(B, H, L, Ev, dtype=acc, device=q.device)
        lse = torch.full((B, H, L), -math.inf, dtype=acc, device=q.device)
        bounds = _bounds(S, chunk)
        widest = max(b - a for a, b in itertools.pairwise(bounds))
        pieces = _Pieces([k, v], widest)
        for j in range(len(bounds) - 1):
            a, b = bounds[j], bounds[j + 1]
            kv = pieces.views(b - a, 0)
            kv[0].copy_(k[:, :, a:b])
            kv[1].copy_(v[:, :, a:b])
            for step in range(ring.world):
                more = step + 1 < ring.world
                if more:  # the next piece travels while this one is computed
                    requests = ring.receive(pieces.views(b - a, 1)) + ring.send(kv)
                src = (ring.rank - step) % ring.world
                for rows, keys, is_causal in _calls(
                    ring.rank, src, causal, layout, L, S, a, b, 2 * chunk
                ):
                    o, blk = _block_forward(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                            is_causal, scale)  # fmt: skip
                    _merge(out[:, :, rows], lse[:, :, rows], o.to(acc), blk.to(acc))
                if more:
                    _wait(requests)
                    pieces.swap()
                    kv = pieces.views(b - a, 0)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        call: _RingCall = ctx.call
        ring = _Ring(call.group)
        none = (None,)
        acc = torch.promote_types(q.dtype, torch.float32)
        if ring.world == 1:
            dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
            _block_backward(grad_out, q, k, v, out, lse, call.causal, call.scale, (dq, dk, dv))
            return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *none)
        L, S = q.shape[2], k.shape[2]
        grad_out = grad_out.contiguous()
        lse = lse.to(torch.float32) if q.dtype != torch.float64 else lse
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.empty(k.shape, dtype=acc, device=q.device)
        dv = torch.empty(v.shape, dtype=acc, device=q.device)
        bounds = _bounds(S, call.chunk)
        widest = max(b - a for a, b in itertools.pairwise(bounds))
        pieces, grads = _Pieces([k, v], widest), _Pieces([k, v], widest, acc)
        for j in range(len(bounds) - 1):
            a, b = bounds[j], bounds[j + 1]
            kv, dkv = pieces.views(b - a, 0), grads.views(b - a, 0)
            kv[0].copy_(k[:, :, a:b])
            kv[1].copy_(v[:, :, a:b])
            dkv[0].zero_()
            dkv[1].zero_()
            for step in range(ring.world):
                more = step + 1 < ring.world
                requests = []
                if more:
                    requests = ring.receive(pieces.views(b - a, 1)) + ring.send(kv)
                # The gradients of the next piece, or (last step) this rank's own, finished.
                incoming = grads.views(b - a, 1)
                grad_requests = ring.receive(incoming)
                src = (ring.rank - step) % ring.world
                for rows, keys, is_causal in _calls(
                    ring.rank, src, call.causal, call.layout, L, S, a, b, 2 * call.chunk
                ):
                    _block_backward(
                        grad_out[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                        out[:, :, rows], lse[:, :, rows], is_causal, call.scale,
                        (dq[:, :, rows], dkv[0][:, :, keys], dkv[1][:, :, keys]),
                    )  # fmt: skip
                # On to the next holder of this piece; after the last step, to its owner.
                grad_requests += ring.send(dkv)
                _wait(requests)
                _wait(grad_requests)
                grads.swap()
                if more:
                    pieces.swap()
                    kv, dkv = pieces.views(b - a, 0), grads.views(b - a, 0)
                else:
                    dk[:, :, a:b] = incoming[0]
                    dv[:, :, a:b] = incoming[1]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *none)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    group: Any = None,
    scale: float | None = None,
    layout: Layout = "contiguous",
    chunk: int = CHUNK,
) -> Tensor:
    """Attention of this rank's query shard over the keys and values of every rank.

    Call it on every rank of ``group`` with shards of equal shapes (see :func:`shard`). The
    result equals attention over the gathered sequence (the rank's rows of it), and it is
    differentiable: the backward passes the key/value gradients around the ring. Without an
    initialized process group (or in a group of one) it is plain local attention.

    Args:
        q: This rank's queries.
        k: This rank's keys; may have fewer heads than ``q`` (grouped-query, ``H % K == 0``).
        v: This rank's values.
        causal: Each query attends only keys at its position or before (needs ``L == S``).
        group: The process group; defaults to the whole world.
        scale: Multiplier of the scores; defaults to ``1 / sqrt(E)``.
        layout: How the sequence is laid out over the ranks, ``"contiguous"`` or ``"zigzag"``
            (see :func:`shard_positions`; it matters only with ``causal``).
        chunk: Keys per travelling piece of a block (see :data:`CHUNK`): smaller pieces hold
            less memory per rank and make more, smaller kernel calls.

    Returns:
        This rank's output shard.

    Shape:
        q ``(B, H, L, E)``, k ``(B, K, S, E)``, v ``(B, K, S, Ev)`` -> ``(B, H, L, Ev)``.

    Raises:
        TypeError: Non-tensor or non-float inputs, or mismatched dtypes.
        ValueError: Inputs not 4-d or on different devices, mismatched batch/head/length/dims,
            ``H % K != 0``, ``causal`` with ``L != S``, an odd zigzag shard, a bad ``scale``,
            ``layout`` or ``chunk``.
    """
    check_heads(q, k, v, ("q", "k", "v"))
    (B, H, L, E), (Bk, K, S, Ek) = q.shape, k.shape
    if Bk != B or v.shape[:3] != k.shape[:3] or Ek != E:
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if K == 0 or H % K:
        raise ValueError(f"query heads {H} must be a multiple of key/value heads {K}")
    _check_layout(layout)
    if causal and L != S:
        raise ValueError(f"causal ring attention needs equal shards, got L={L}, S={S}")
    if causal and layout == "zigzag" and L % 2:
        raise ValueError(f"zigzag shards hold two equal chunks, got odd length {L}")
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    result: Tensor = _RingAttention.apply(
        q, k, v, _RingCall(causal, float(scale), group, layout, chunk)
    )
    return result


class RingKernel:
    """:func:`ring_attention` with the signature of :func:`attnkit.functional.attend`, to set
    as a :class:`~attnkit.attention.MultiHeadAttention`'s ``kernel`` so a model attends over a
    sequence sharded across ``group``.

    Only what ring attention computes is accepted: no mask, window, documents, padding,
    dropout or weights (a :class:`ValueError` names the option otherwise).

    Args:
        group: The process group; defaults to the whole world.
        layout: ``"contiguous"`` or ``"zigzag"``, as the sequence was sharded.
    """

    def __init__(self, group: Any = None, *, layout: Layout = "contiguous") -> None:
        _check_layout(layout)
        self.group = group
        self.layout: Layout = layout

    def __repr__(self) -> str:
        return f"RingKernel(layout={self.layout!r})"

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, **options: Any
    ) -> tuple[Tensor, None]:
        """Ring attention of this rank's shard as ``(out, None)``.

        Takes :func:`attnkit.functional.attend`'s options; only ``causal`` and ``scale`` may be
        set (other options at their defaults: ``None``, ``False`` or ``0``).

        Shape:
            q ``(B, H, L, E)``, k/v ``(B, K, S, E)`` -> out ``(B, H, L, E)``.
        """
        causal, scale = bool(options.pop("causal", False)), options.pop("scale", None)
        given = {
            n: "a tensor" if isinstance(x, Tensor) else x
            for n, x in options.items()
            if isinstance(x, Tensor) or x not in (None, False, 0)
        }
        if mask is not None:
            given["mask"] = "a tensor"
        if given:
            raise ValueError(f"ring attention supports only causal and scale, got {given}")
        out = ring_attention(
            q, k, v, causal=causal, group=self.group, scale=scale, layout=self.layout
        )
        return out, None
