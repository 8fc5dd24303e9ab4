"""A paged key/value cache: fixed-size blocks from one pool, a block table per sequence.

Every layer's keys and values live in one preallocated pool of ``num_blocks`` blocks of
``block_size`` token slots (vLLM's PagedAttention layout). A sequence holds a list of block ids,
its *block table*: position ``p`` sits in slot ``p % block_size`` of block
``table[p // block_size]``. Memory held therefore follows the tokens actually held (rounded up to
a block per sequence), not the longest possible sequence times the batch. The pool is allocated
with ``torch.empty`` and the lowest free block is handed out first, so on a CPU the pages the OS
commits stay close to the most blocks ever held.

:class:`BlockPool` does the bookkeeping without touching tensors: reference counts, the free
blocks, and the prefix cache: a full block is known by a chained hash of its parent's hash and
its own token ids, so two sequences with the same first ``n * block_size`` tokens share those
``n`` blocks. A block nobody holds keeps its contents (and its hash) until it is needed again:
such blocks are evicted least recently released first.

:class:`PagedKVCache` owns the tensors. Before each forward the engine describes the packed
batch (:meth:`PagedKVCache.plan`): each sequence's block table, how many of its positions are
cached and how many new tokens it brings, packed one after another along the length dim. The
model's attention layers are handed :meth:`PagedKVCache.layers`; each is an
:class:`attnkit.cache.AttendingCache` that writes the new keys/values into their slots and runs
the attention of every sequence over its own keys (:func:`paged_attention`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit import functional
from attnkit.config import check_sizes
from attnkit.kernels import build, policy
from attnkit.kernels import one_query as one_query_kernels

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from attnkit.cache import AttendOptions

__all__ = [
    "BlockPool",
    "PagedBatch",
    "PagedKVCache",
    "PagedLayer",
    "SequenceSlice",
    "block_hash",
    "paged_attention",
]


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: its parent's key chained with its token ids, so
    equal keys mean equal whole prefixes, not only equal blocks."""
    return hash((parent, tuple(tokens)))


class BlockPool:
    """Reference-counted blocks with a prefix cache (bookkeeping only, no tensors).

    Args:
        num_blocks: Blocks in the pool.

    Raises:
        ValueError: If ``num_blocks`` is not a positive int.
    """

    def __init__(self, num_blocks: int) -> None:
        check_sizes({"num_blocks": num_blocks}, what="BlockPool sizes")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks))  # min-heap of unhashed free blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, free, LRU first
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (never used, or cached and held by nobody)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free

    def allocate(self) -> int | None:
        """A block with one reference, or ``None`` when every block is held. An unhashed block
        is taken first (the lowest id), then the least recently released cached one."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            return None
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; a block nobody holds is free again (cached if it has a hash).

        Raises:
            ValueError: If the block is not held.
        """
        if not 0 <= block < self.num_blocks or self.refs[block] < 1:
            raise ValueError(f"block {block} is not held (pool of {self.num_blocks})")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def lookup(self, key: int) -> int | None:
        """The cached block of a prefix key, with one more reference, or ``None``."""
        block = self._by_hash.get(key)
        if block is None:
            return None
        if self.refs[block] == 0:
            del self._evictable[block]
        self.refs[block] += 1
        return block

    def register(self, block: int, key: int) -> None:
        """Record that a held, full block holds the prefix ``key`` (a no-op when another block
        already does: this one stays private to its sequence)."""
        if key not in self._by_hash and block not in self._hash_of:
            self._by_hash[key] = block
            self._hash_of[block] = key


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a packed batch.

    Attributes:
        blocks: The sequence's block table (enough blocks for ``start + length`` positions).
        start: Positions already in the cache (the new tokens' first position).
        length: New tokens this forward brings.
    """

    blocks: Sequence[int]
    start: int
    length: int


@dataclass
class PagedBatch:
    """The layout of a packed batch, shared by every layer's attention in one forward.

    The first ``singles`` sequences bring one token each (decoding steps, attended together);
    the others bring a chunk each (prompt chunks, attended one sequence at a time).

    Attributes:
        slots: ``(T,)`` pool slot of each new token.
        singles: How many leading sequences bring one token.
        single_keys: ``(singles, S)`` slots of those sequences' keys (padded with slot 0).
        single_lengths: ``(singles,)`` their key counts.
        chunks: ``(first packed token, length, key slots (S,))`` of each other sequence.
    """

    slots: Tensor
    singles: int
    single_keys: Tensor
    single_lengths: Tensor
    chunks: list[tuple[int, int, Tensor]]
    _masks: dict[int | None, Tensor] = field(default_factory=dict)
    _spans: dict[int | None, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)

    def single_spans(self, window: int | None) -> tuple[Tensor, Tensor, Tensor]:
        """The one-token sequences' keys for the paged kernel: int32 rows ``(singles, S)`` and
        int64 ``first``/``count`` ``(singles,)`` (the keys within ``window`` of the query)."""
        spans = self._spans.get(window)
        if spans is None:
            lengths = self.single_lengths
            first = torch.zeros_like(lengths) if window is None else (lengths - window).clamp_min(0)
            rows = self.single_keys.to(torch.int32)
            spans = self._spans[window] = (rows, first, lengths - first)
        return spans

    def single_mask(self, window: int | None) -> Tensor:
        """``(singles, 1, 1, S)`` bool: the keys each one-token sequence attends (within
        ``window`` of its query)."""
        mask = self._masks.get(window)
        if mask is None:
            S = self.single_keys.shape[1]
            pos = torch.arange(S, device=self.slots.device)  # (S,)
            lengths = self.single_lengths[:, None]  # (singles, 1)
            keep = pos < lengths
            if window is not None:
                keep &= pos >= lengths - window
            mask = self._masks[window] = keep[:, None, None, :]
        return mask


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention of a packed batch, each sequence over its own keys in the pool.

    The one-token sequences attend together as one decoding step, reading their keys in place
    through the block tables (:func:`attnkit.kernels.one_query.paged_one_query_attention`, or
    gathered and masked where that kernel does not run); each chunk gathers its keys and attends
    them causally through :func:`attnkit.functional.attend`.

    Args:
        q: Queries of the packed tokens, rotated.
        k_pool: The layer's keys ``(slots, K, E)`` (the new ones already written).
        v_pool: The layer's values ``(slots, K, Ev)``.
        batch: The layout (:meth:`PagedKVCache.plan`).
        scale: Score multiplier.
        window: Sliding window of the layer, or ``None``.
        softcap: Attention-logit soft cap of the layer, or ``None``.

    Shape:
        q ``(1, H, T, E)`` -> ``(1, H, T, Ev)``.
    """
    _, H, T, _ = q.shape
    K, Ev = k_pool.shape[1], v_pool.shape[2]
    n = batch.singles
    if n == T:  # only decoding sequences: their output as it is (its heads then merge as a view)
        return _one_token_attention(q[0], k_pool, v_pool, batch, scale, window, softcap)[None]
    out = q.new_empty(1, H, T, Ev)
    if n:
        one = _one_token_attention(q[0, :, :n], k_pool, v_pool, batch, scale, window, softcap)
        out[0, :, :n] = one  # (H, n, Ev)
    for first, length, keys in batch.chunks:
        # A chunk's queries outnumber its copied keys' rows per query: the copy is minor here.
        S = keys.shape[0]
        k = k_pool.index_select(0, keys).view(1, S, K, -1).transpose(1, 2)  # (1, K, S, E)
        v = v_pool.index_select(0, keys).view(1, S, K, Ev).transpose(1, 2)  # (1, K, S, Ev)
        qc = q[:, :, first : first + length]  # (1, H, length, E)
        o, _ = functional.attend(
            qc, k, v, None, causal=True, window=window, scale=scale, softcap=softcap
        )
        out[:, :, first : first + length] = o
    return out


def _one_token_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    """The decoding sequences of a packed batch, together: attnkit's paged one-query kernel
    reads their keys in place where the policy picks attnkit's one-query kernel; otherwise (and
    for a non-finite output, which the general path's rules decide) their keys are gathered and
    attended with a key mask.

    Shape:
        q ``(H, n, E)`` -> ``(H, n, Ev)``.
    """
    qs = q.transpose(0, 1).unsqueeze(2)  # (n, H, 1, E)
    grads = torch.is_grad_enabled() and (q.requires_grad or k_pool.requires_grad)
    if policy.one_query_kernel(q.dtype, q.device.type, grads) and build.kernels_available():
        rows, first, count = batch.single_spans(window)
        o, flags = one_query_kernels.paged_one_query_attention(
            qs, k_pool, v_pool, rows, first, count, scale, softcap=softcap
        )
        if not flags:
            return o[:, :, 0].transpose(0, 1)  # (H, n, Ev)
    n, S = batch.single_keys.shape
    K, Ev = k_pool.shape[1], v_pool.shape[2]
    flat = batch.single_keys.view(-1)
    k = k_pool.index_select(0, flat).view(n, S, K, -1).transpose(1, 2)  # (n, K, S, E)
    v = v_pool.index_select(0, flat).view(n, S, K, Ev).transpose(1, 2)  # (n, K, S, Ev)
    o, _ = functional.attend(qs, k, v, batch.single_mask(window), scale=scale, softcap=softcap)
    return o[:, :, 0].transpose(0, 1)  # (H, n, Ev)


class PagedLayer:
    """One layer's view of a :class:`PagedKVCache`: an :class:`attnkit.cache.AttendingCache`."""

    def __init__(self, cache: PagedKVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **options: Unpack[AttendOptions]) -> Tensor:
        """Write the new keys/values into their slots, then :func:`paged_attention`.

        Shape:
            q ``(1, H, T, E)``, k/v ``(1, K, T, E)`` -> ``(1, H, T, E)``.
        """
        batch = self.cache.batch
        if batch is None:
            raise ValueError("PagedKVCache.plan() must describe the batch before a forward")
        if q.shape[0] != 1 or q.shape[2] != batch.slots.shape[0]:
            raise ValueError(
                f"the planned batch packs {batch.slots.shape[0]} tokens in one row, got queries "
                f"{tuple(q.shape)}"
            )
        k_pool, v_pool = self.cache.storage[self.layer]  # (slots, K, E) each
        k_pool.index_copy_(0, batch.slots, k[0].transpose(0, 1).to(k_pool.dtype))
        v_pool.index_copy_(0, batch.slots, v[0].transpose(0, 1).to(v_pool.dtype))
        return paged_attention(q, k_pool, v_pool, batch, **options)

    def fused_step(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor] | None:
        """What :mod:`attnkit.fused` needs to run this layer in one call with the others: its
        keys and values ``(slots, K, E)``, each new token's slot ``(T,)``, and each token's key
        slots as the paged kernel reads them (int32 ``(T, S)``, ``first`` and ``count``
        ``(T,)``, the keys of the whole sequence); None unless the planned batch brings one
        token of each sequence (a decoding step)."""
        batch = self.cache.batch
        if batch is None or batch.chunks or batch.singles != batch.slots.shape[0]:
            return None
        k_pool, v_pool = self.cache.storage[self.layer]
        keys, first, count = batch.single_spans(None)
        return k_pool, v_pool, batch.slots, keys, first, count


class PagedKVCache:
    """Every layer's keys and values in one pool of blocks (see the module docstring).

    Args:
        num_layers: Attention layers of the model.
        num_blocks: Blocks in the pool.
        block_size: Token slots per block.
        num_kv_heads: Key/value heads ``K``.
        head_dim: Head dim ``E``.
        dtype: Storage dtype.
        device: Storage device.

    Raises:
        TypeError: If a size is not an int.
        ValueError: If a size is not positive.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        sizes = {
            "num_layers": num_layers,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        check_sizes(sizes, what="PagedKVCache sizes")
        self.block_size, self.num_layers = block_size, num_layers
        self.pool = BlockPool(num_blocks)
        shape = (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)
        self.storage = torch.empty(shape, dtype=dtype, device=device)
        self.bytes_per_block = self.storage[:, :, :block_size].numel() * self.storage.itemsize
        self.batch: PagedBatch | None = None
        self._layers = [PagedLayer(self, i) for i in range(num_layers)]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values take over every layer."""
        return self.bytes_per_block // self.block_size

    def layers(self) -> list[PagedLayer]:
        """One :class:`PagedLayer` per layer: the model's ``kv_caches``."""
        return self._layers

    def slots(self, blocks: Sequence[int], start: int, stop: int) -> list[int]:
        """Pool slots of positions ``start .. stop - 1`` of a sequence with this block table.

        Raises:
            ValueError: If the table holds fewer than ``stop`` positions.
        """
        bs = self.block_size
        if stop > len(blocks) * bs:
            raise ValueError(
                f"a block table of {len(blocks)} blocks holds {len(blocks) * bs} positions, "
                f"not {stop}"
            )
        return [blocks[p // bs] * bs + p % bs for p in range(start, stop)]

    def plan(self, parts: Sequence[SequenceSlice]) -> PagedBatch:
        """Describe the next forward's packed batch: ``parts`` in packing order, every
        one-token part before the chunks. Returns (and keeps for the layers) its layout.

        Raises:
            ValueError: If a one-token part follows a chunk, a part brings no token, or a
                table is too short.
        """
        singles = 0
        while singles < len(parts) and parts[singles].length == 1:
            singles += 1
        if any(p.length < 1 for p in parts) or any(p.length == 1 for p in parts[singles:]):
            raise ValueError(
                "plan() takes parts of at least one token, the one-token parts first, got "
                f"lengths {[p.length for p in parts]}"
            )
        device = self.storage.device
        slots: list[int] = []
        for p in parts:
            slots += self.slots(p.blocks, p.start, p.start + p.length)
        lengths = [p.start + 1 for p in parts[:singles]]
        width = max(lengths, default=0)
        keys = [
            self.slots(p.blocks, 0, n) + [0] * (width - n)
            for p, n in zip(parts[:singles], lengths, strict=True)
        ]
        chunks = []
        first = singles
        for p in parts[singles:]:
            cols = torch.tensor(self.slots(p.blocks, 0, p.start + p.length), device=device)
            chunks.append((first, p.length, cols))
            first += p.length
        self.batch = PagedBatch(
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            singles=singles,
            single_keys=torch.tensor(keys, dtype=torch.long, device=device).view(singles, width),
            single_lengths=torch.tensor(lengths, dtype=torch.long, device=device),
            chunks=chunks,
        )
        return self.batch
