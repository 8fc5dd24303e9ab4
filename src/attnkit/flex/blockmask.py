"""Block masks: which key blocks each query block may reach, and mask combination.

A :class:`BlockMask` splits the ``(L, S)`` score matrix into blocks of ``BLOCK_SIZE`` queries by
``BLOCK_SIZE`` keys and records, per batch, head and block, one of three states: *empty* (no
pair may attend: skipped), *full* (every pair may attend: computed with no mask work) or
*partial* (the kernel evaluates ``mask_mod`` on that block's index tile). Masks follow the one
attnkit convention: ``mask_mod(b, h, q_idx, kv_idx)`` is ``True`` where the query may attend the
key, called with broadcastable index tensors ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``,
``q_idx (1, 1, L, 1)``, ``kv_idx (1, 1, 1, S)``.

Masks that depend only on the offset ``q_idx - kv_idx`` (causal, sliding window) declare the
allowed offsets as a *band*; their block states are computed from block corners instead of
evaluating the mask on every pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMask",
    "MaskMod",
    "and_masks",
    "create_block_mask",
    "mod_name",
    "noop_mask",
    "or_masks",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

#: Block states of :attr:`BlockMask.states`.
EMPTY, PARTIAL, FULL = 0, 1, 2


def mod_name(fn: object) -> str:
    """The name that error messages give ``fn`` (its ``__name__``, else its type's)."""
    return str(getattr(fn, "__name__", type(fn).__name__))


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The mask that allows every pair."""
    return torch.ones((), dtype=torch.bool, device=q_idx.device).expand(
        torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    )


noop_mask.structure = {}  # type: ignore[attr-defined]
noop_mask.band = (-math.inf, math.inf)  # type: ignore[attr-defined]


class CombinedMask:
    """``and_masks``/``or_masks`` of several masks: callable as a ``mask_mod``, with the parts
    kept so that their structure (:attr:`structure`, :attr:`band`) stays recognisable."""

    def __init__(self, op: str, parts: Sequence[MaskMod]) -> None:
        if not parts:
            raise ValueError(f"{op}_masks needs at least one mask_mod")
        for part in parts:
            if not callable(part):
                raise TypeError(f"{op}_masks takes callables, got {type(part).__name__}")
        self.op = op
        self.parts = tuple(parts)
        self.__name__ = f"{op}_masks({', '.join(mod_name(p) for p in parts)})"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = self.parts[0](b, h, q_idx, kv_idx)
        for part in self.parts[1:]:
            nxt = part(b, h, q_idx, kv_idx)
            out = (out & nxt) if self.op == "and" else (out | nxt)
        return out

    @property
    def structure(self) -> dict[str, Any] | None:
        """The options of :func:`attnkit.functional.scaled_dot_product_attention` equal to this
        mask (queries and keys aligned, ``L == S``), or None where they cannot say it."""
        parts = [getattr(p, "structure", None) for p in self.parts]
        if any(p is None for p in parts):
            return None
        if self.op == "or":
            return {} if any(not p for p in parts) else None
        merged: dict[str, Any] = {}
        for part in parts:
            for name, value in part.items():  # type: ignore[union-attr]
                if name not in merged:
                    merged[name] = value
                elif name == "window":
                    merged[name] = min(merged[name], value)
                elif name == "causal":
                    merged[name] = merged[name] or value
                else:  # two id or length tensors: no single option says both
                    return None
        if "window" in merged and not merged.get("causal"):
            return None
        return merged

    @property
    def band(self) -> tuple[float, float] | None:
        """The allowed offsets ``q_idx - kv_idx`` as ``(lo, hi)`` where the mask depends on
        nothing else, else None."""
        bands = [getattr(p, "band", None) for p in self.parts]
        if any(b is None for b in bands):
            return None
        los = [b[0] for b in bands]  # type: ignore[index]
        his = [b[1] for b in bands]  # type: ignore[index]
        if self.op == "and":
            return max(los), min(his)
        lo, hi = min(los), max(his)  # a union of bands is a band only where they touch
        spans = sorted(zip(los, his, strict=True))
        reach = spans[0][1]
        for a, z in spans[1:]:
            if a > reach + 1:
                return None
            reach = max(reach, z)
        return lo, hi


def and_masks(*mask_mods: MaskMod) -> CombinedMask:
    """A ``mask_mod`` allowing a pair where every one of ``mask_mods`` allows it."""
    return CombinedMask("and", mask_mods)


def or_masks(*mask_mods: MaskMod) -> CombinedMask:
    """A ``mask_mod`` allowing a pair where any one of ``mask_mods`` allows it."""
    return CombinedMask("or", mask_mods)


class BlockMask:
    """Which blocks of the ``(Q_LEN, KV_LEN)`` score matrix are empty, full or partial.

    Built by :func:`create_block_mask` (or :meth:`from_torch` from torch's
    ``torch.nn.attention.flex_attention.BlockMask``). The states are computed when first needed:
    a mask that :func:`attnkit.flex.flex_attention` hands to attnkit's structured kernels never
    needs them.

    Attributes:
        mask_mod: The mask, ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
        B: Batch size of the states (1 broadcasts over the batch).
        H: Heads of the states (1 broadcasts over heads).
        seq_lengths: ``(Q_LEN, KV_LEN)``.
        BLOCK_SIZE: ``(query rows, key columns)`` per block.
    """

    def __init__(
        self,
        mask_mod: MaskMod,
        *,
        B: int,
        H: int,
        Q_LEN: int,
        KV_LEN: int,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        device: torch.device | str = "cpu",
        states: Tensor | None = None,
    ) -> None:
        sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
        if len(sizes) != 2 or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"BLOCK_SIZE must be a positive int or pair, got {BLOCK_SIZE!r}")
        for name, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.mask_mod = mask_mod
        self.B, self.H = B, H
        self.seq_lengths = (Q_LEN, KV_LEN)
        self.BLOCK_SIZE: tuple[int, int] = (int(sizes[0]), int(sizes[1]))
        self.device = torch.device(device)
        self._states = states

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Q_LEN, KV_LEN)``."""
        return (self.B, self.H, *self.seq_lengths)

    @property
    def num_blocks(self) -> tuple[int, int]:
        """Query and key blocks: ``(ceil(Q_LEN / rows), ceil(KV_LEN / cols))``."""
        (L, S), (r, c) = self.seq_lengths, self.BLOCK_SIZE
        return -(-L // r), -(-S // c)

    @property
    def states(self) -> Tensor:
        """int8 ``(B, H, query blocks, key blocks)``: :data:`EMPTY`, :data:`PARTIAL` or
        :data:`FULL`."""
        if self._states is None:
            self._states = _block_states(self)
        return self._states

    def to_dense(self) -> Tensor:
        """Bool ``(B, H, query blocks, key blocks)``: ``True`` where a block is not empty."""
        return self.states != EMPTY

    def sparsity(self) -> float:
        """Percentage of blocks that are empty (computed nowhere)."""
        return 100.0 * float((self.states == EMPTY).float().mean())

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
            f"mask_mod={mod_name(self.mask_mod)})"
        )

    @classmethod
    def from_torch(cls, block_mask: Any) -> BlockMask:
        """The :class:`BlockMask` of torch's FlexAttention ``BlockMask`` (same mask_mod, block
        size and block states)."""
        nb = block_mask.kv_num_blocks
        B, H, nq = nb.shape
        L, S = block_mask.seq_lengths
        rows, cols = block_mask.BLOCK_SIZE
        nk = -(-S // cols)
        states = torch.zeros(B, H, nq, nk + 1, dtype=torch.int8)

        def mark(num: Tensor | None, idx: Tensor | None, state: int) -> None:
            if num is None or idx is None:
                return
            width = idx.shape[-1]
            keep = torch.arange(width).view(1, 1, 1, width) < num.cpu().unsqueeze(-1)
            where = torch.where(keep, idx.cpu().long().clamp(0, nk - 1), nk)
            states.scatter_(-1, where, state)

        mark(nb, block_mask.kv_indices, PARTIAL)
        mark(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)
        return cls(
            block_mask.mask_mod,
            B=int(B),
            H=int(H),
            Q_LEN=int(L),
            KV_LEN=int(S),
            BLOCK_SIZE=(int(rows), int(cols)),
            device=nb.device,
            states=states[..., :nk].contiguous(),
        )


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str = "cpu",
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    """The :class:`BlockMask` of ``mask_mod`` over ``(B, H, Q_LEN, KV_LEN)``.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (``True`` = may attend), called with
            broadcastable index tensors.
        B: Batch size, or None for a mask that is the same for every batch entry.
        H: Heads, or None for a mask that is the same for every head.
        Q_LEN: Query length.
        KV_LEN: Key length.
        device: Where the states live.
        BLOCK_SIZE: Queries and keys per block (an int or a ``(rows, cols)`` pair).

    Raises:
        TypeError: If ``mask_mod`` is not callable, or does not return a bool tensor.
        ValueError: If a size is not positive, or ``mask_mod`` fails on index tensors or returns
            a shape that does not broadcast to the index tile.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    block_mask = BlockMask(
        mask_mod,
        B=1 if B is None else B,
        H=1 if H is None else H,
        Q_LEN=Q_LEN,
        KV_LEN=KV_LEN,
        BLOCK_SIZE=BLOCK_SIZE,
        device=device,
    )
    probe_mask_mod(mask_mod, block_mask.B, block_mask.H, Q_LEN, KV_LEN, device)
    return block_mask


def index_tensors(
    B: int, H: int, rows: Tensor, cols: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q_idx (1,1,Lt,1)``, ``kv_idx (1,1,1,St)``."""
    dev = rows.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    return b, h, rows.view(1, 1, -1, 1), cols.view(1, 1, 1, -1)


def probe_mask_mod(
    mask_mod: MaskMod, B: int, H: int, L: int, S: int, device: torch.device | str = "cpu"
) -> None:
    """Call ``mask_mod`` on a tiny index tile and check what it returns (see
    :func:`create_block_mask` for the errors)."""
    rows = torch.arange(min(L, 2), device=device)
    cols = torch.arange(min(S, 3), device=device)
    b, h, q, kv = index_tensors(min(B, 2), min(H, 2), rows, cols)
    name = mod_name(mask_mod)
    try:
        out = mask_mod(b, h, q, kv)
    except Exception as err:
        raise ValueError(
            f"mask_mod {name} failed on index tensors b {tuple(b.shape)}, h {tuple(h.shape)}, "
            f"q_idx {tuple(q.shape)}, kv_idx {tuple(kv.shape)}: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(out, Tensor):
        raise TypeError(f"mask_mod {name} must return a bool tensor, got {type(out).__name__}")
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod {name} must return a bool tensor, got dtype {out.dtype}")
    tile = (b.shape[0], h.shape[1], q.shape[2], kv.shape[3])
    if not _broadcasts(out.shape, tile):
        raise ValueError(
            f"mask_mod {name} returned shape {tuple(out.shape)}, which does not broadcast to "
            f"the index tile {tile}"
        )


def _broadcasts(shape: Sequence[int], tile: Sequence[int]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(shape), tuple(tile))) == tuple(tile)
    except RuntimeError:
        return False


def _block_states(block_mask: BlockMask) -> Tensor:
    """The states of ``block_mask``: from block corners for a band mask, else by evaluating
    the mask one row of blocks at a time."""
    B, H = block_mask.B, block_mask.H
    (L, S), (r, c) = block_mask.seq_lengths, block_mask.BLOCK_SIZE
    nq, nk = block_mask.num_blocks
    dev = block_mask.device
    band = getattr(block_mask.mask_mod, "band", None)
    if band is not None:
        q0 = torch.arange(nq, device=dev).view(nq, 1) * r
        q1 = torch.clamp(q0 + r, max=L) - 1
        k0 = torch.arange(nk, device=dev).view(1, nk) * c
        k1 = torch.clamp(k0 + c, max=S) - 1
        lo, hi = band
        dmin, dmax = q0 - k1, q1 - k0  # (nq, nk) offset range of each block
        full = (dmin >= lo) & (dmax <= hi)
        empty = (dmax < lo) | (dmin > hi)
        states = torch.full((nq, nk), PARTIAL, dtype=torch.int8, device=dev)
        states[full] = FULL
        states[empty] = EMPTY
        return states.expand(B, H, nq, nk).contiguous()
    states = torch.empty(B, H, nq, nk, dtype=torch.int8, device=dev)
    cols = torch.arange(S, device=dev)
    pad = nk * c - S
    for i in range(nq):
        rows = torch.arange(i * r, min(L, (i + 1) * r), device=dev)
        b, h, q, kv = index_tensors(B, H, rows, cols)
        m = block_mask.mask_mod(b, h, q, kv).expand(B, H, len(rows), S)
        anyb = torch.nn.functional.pad(m, (0, pad), value=False).view(B, H, -1, nk, c)
        allb = torch.nn.functional.pad(m, (0, pad), value=True).view(B, H, -1, nk, c)
        full = allb.all(dim=-1).all(dim=2)
        some = anyb.any(dim=-1).any(dim=2)
        states[:, :, i] = torch.where(full, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)
    return states
