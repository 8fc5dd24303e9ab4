"""A small, typed, static key/value cache for autoregressive decoding (gpt-fast style).

The cache is preallocated to ``capacity`` slots so decoding never reallocates. It serves two
callers with the same storage:

* eager code appends: :meth:`KVCache.update` writes the new keys/values after the ones already
  stored (a Python counter, :attr:`KVCache.length`) and returns views of the slots filled so far;
* a compiled one-token step writes at a slot given as a tensor (:meth:`KVCache.write`,
  ``cache_position``), so that one graph serves every step, and attends over every slot with a
  mask (:meth:`KVCache.slot_mask`).

Left padding is the caller's key mask over the slots (``(B, capacity)``, ``True`` = real token,
passed as the model's ``mask``): padded prompt slots are never attended to, now or later.

A layer may instead be handed an :class:`AttendingCache`: storage whose layout one
``(B, K, S, E)`` tensor cannot describe (the serving engine's paged cache: blocks from a shared
pool, a block table and a length per sequence). It stores the new keys/values and runs the
attention over what it holds itself, through :mod:`attnkit.functional`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

import torch
from torch import Tensor, nn

from attnkit.config import check_sizes

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AttendOptions", "AttendingCache", "KVCache"]


class AttendOptions(TypedDict):
    """What an attention layer tells an :class:`AttendingCache` besides the tensors.

    Attributes:
        scale: Multiplier of the scores.
        window: Keys ``window`` or more positions before a query are masked (None: no window).
        softcap: The scores' soft cap ``c > 0`` (``c * tanh(s / c)``), or None.
    """

    scale: float
    window: int | None
    softcap: float | None


@runtime_checkable
class AttendingCache(Protocol):
    """A layer's key/value storage that also attends: the attention layer hands it the new
    queries, keys and values (rotated) and gets the attention output back.

    The token layout is the cache's own (e.g. several sequences packed along ``L``, each at its
    own position, attending only its own keys); the caller passes explicit ``positions``.
    """

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **options: Unpack[AttendOptions]) -> Tensor:
        """Store ``k``/``v`` and return the attention of ``q`` over the keys it may see.

        Shape:
            q ``(B, H, L, E)``, k/v ``(B, K, L, E)`` -> ``(B, H, L, E)``.
        """
        ...


class KVCache(nn.Module):
    """Preallocated key/value storage of one attention layer.

    Args:
        batch_size: Number of sequences decoded together.
        num_kv_heads: Key/value heads ``K`` of the layer.
        capacity: Maximum number of positions the cache can hold.
        head_dim: Head dim ``E`` of keys and values.
        dtype: Storage dtype.
        device: Storage device.

    Raises:
        TypeError: If a size is not an int.
        ValueError: If a size is not positive.
    """

    k: Tensor  # buffers registered in __init__: (B, K, C, E)
    v: Tensor

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        sizes = {
            "batch_size": batch_size,
            "num_kv_heads": num_kv_heads,
            "capacity": capacity,
            "head_dim": head_dim,
        }
        check_sizes(sizes, what="KVCache sizes")
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.capacity = capacity
        self.length = 0  # slots filled by update() (eager appends)

    def _check(self, k: Tensor, v: Tensor, ck: Tensor) -> None:
        """Raise unless ``k``/``v`` fit the cache ``ck`` (its keys) holds."""
        if not isinstance(k, Tensor) or not isinstance(v, Tensor):
            raise TypeError(
                f"KVCache takes tensors, got k={type(k).__name__}, v={type(v).__name__}"
            )
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(
                f"KVCache needs k and v of the same shape (B, K, L, E), got "
                f"k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        held, given = ck.shape, k.shape
        if held[0] != given[0] or held[1] != given[1] or held[3] != given[3]:
            raise ValueError(
                f"KVCache holds (B, K, *, E)={tuple(held[:2])}+(E={held[3]}), "
                f"got k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        if k.dtype != ck.dtype or v.dtype != ck.dtype:
            raise TypeError(
                f"KVCache stores {ck.dtype}, got k {k.dtype} and v {v.dtype}; build the "
                "cache with the keys' dtype"
            )
        if k.device != ck.device or v.device != ck.device:
            raise ValueError(f"KVCache is on {ck.device}, got k on {k.device} and v on {v.device}")

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` after the filled slots and return all keys/values so far.

        Shape:
            k, v ``(B, K, L, E)`` -> ``(B, K, length + L, E)`` each (views into the cache).

        Raises:
            TypeError: If ``k``/``v`` are not tensors of the cache's dtype (the cache never
                casts silently).
            ValueError: If the new positions exceed the capacity, shapes do not match, or
                ``k``/``v`` are on another device.
        """
        ck, cv = self.k, self.v
        self._check(k, v, ck)
        L = k.shape[2]
        start, end = self.length, self.length + L
        if end > self.capacity:
            raise ValueError(
                f"KVCache capacity exceeded: {self.length} cached + {L} new = {end} > "
                f"capacity {self.capacity}"
            )
        ck.narrow(2, start, L).copy_(k)
        cv.narrow(2, start, L).copy_(v)
        # A plain int: set without nn.Module.__setattr__'s parameter and buffer bookkeeping.
        self.__dict__["length"] = end
        return ck.narrow(2, 0, end), cv.narrow(2, 0, end)

    def write(self, k: Tensor, v: Tensor, cache_position: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k``/``v`` at the slots ``cache_position`` and return the whole storage.

        The compile-friendly form: no Python state changes and no shapes depend on how many
        slots are filled, so one compiled graph serves every step. The written slots count as
        real tokens; attend with :meth:`slot_mask`. Checks that read values are left out.

        Shape:
            k, v ``(B, K, L, E)``, cache_position ``(L,)`` -> ``(B, K, C, E)`` each.
        """
        self._check(k, v, self.k)
        self.k.index_copy_(2, cache_position, k)
        self.v.index_copy_(2, cache_position, v)
        return self.k, self.v

    def slot_mask(self, cache_position: Tensor, *, window: int | None = None) -> Tensor:
        """Which slots each new token may attend: not after its own, within the window.

        Shape:
            cache_position ``(L,)`` -> ``(L, C)`` bool.
        """
        slots = torch.arange(self.capacity, device=self.k.device)  # (C,)
        query = cache_position[:, None]  # (L, 1)
        allowed = slots <= query  # (L, C)
        if window is not None:
            allowed = allowed & (slots > query - window)
        return allowed

    def slots(self, row: int, start: int, rows: int = 1) -> KVCache:
        """An empty cache of the ``rows`` sequences from ``row`` on whose slots are this one's
        from ``start`` on: views of this storage, so what it stores lands here.

        Generation fills a left-padded batch's prompts this way, a few sequences at a time from
        their first real tokens, so that most padding costs no compute.

        Raises:
            ValueError: If ``row``, ``rows`` or ``start`` is out of range.
        """
        batch = self.k.shape[0]
        if not (row >= 0 and rows >= 1 and row + rows <= batch and 0 <= start < self.capacity):
            raise ValueError(
                f"need 0 <= row, rows >= 1, row + rows <= {batch} and 0 <= start < "
                f"{self.capacity}, got row={row}, start={start}, rows={rows}"
            )
        part = KVCache.__new__(KVCache)
        nn.Module.__init__(part)
        for name in ("k", "v"):
            storage = getattr(self, name)[row : row + rows, :, start:]  # (rows, K, C - start, E)
            part.register_buffer(name, storage, persistent=False)
        part.capacity, part.length = self.capacity - start, 0
        return part

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (speculative decoding's rollback of rejected
        tokens); the next :meth:`update` writes at slot ``length``.

        Raises:
            ValueError: Unless ``0 <= length <=`` the filled slots.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"can truncate to 0..{self.length} filled slots, got {length}")
        self.__dict__["length"] = length

    def reset(self) -> None:
        """Forget every cached position (the storage is kept)."""
        self.length = 0
