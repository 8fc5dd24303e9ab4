"""A small, typed key/value cache for autoregressive decoding (gpt-fast style).

The cache is preallocated to ``capacity`` positions so decoding never reallocates; each call to
:meth:`KVCache.update` writes the new keys/values after the ones already stored and returns views
of everything seen so far.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.config import check_sizes

__all__ = ["KVCache"]


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

    k: Tensor  # buffers registered in __init__
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
        self.length = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` and return all keys/values so far.

        Shape:
            k, v ``(B, K, L, E)`` -> ``(B, K, length + L, E)`` each (views into the cache).

        Raises:
            TypeError: If ``k``/``v`` are not tensors of the cache's dtype (the cache never
                casts silently).
            ValueError: If the new positions exceed the capacity, shapes do not match, or
                ``k``/``v`` are on another device.
        """
        if not isinstance(k, Tensor) or not isinstance(v, Tensor):
            raise TypeError(
                f"KVCache.update takes tensors, got k={type(k).__name__}, v={type(v).__name__}"
            )
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(
                f"KVCache.update needs k and v of the same shape (B, K, L, E), got "
                f"k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        B, K, L, E = k.shape
        if (self.k.shape[0], self.k.shape[1], self.k.shape[3]) != (B, K, E):
            raise ValueError(
                f"KVCache holds (B, K, *, E)={tuple(self.k.shape[:2])}+(E={self.k.shape[3]}), "
                f"got k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        if k.dtype != self.k.dtype or v.dtype != self.k.dtype:
            raise TypeError(
                f"KVCache stores {self.k.dtype}, got k {k.dtype} and v {v.dtype}; build the "
                "cache with the keys' dtype"
            )
        if k.device != self.k.device or v.device != self.k.device:
            raise ValueError(
                f"KVCache is on {self.k.device}, got k on {k.device} and v on {v.device}"
            )
        end = self.length + L
        if end > self.capacity:
            raise ValueError(
                f"KVCache capacity exceeded: {self.length} cached + {L} new = {end} > "
                f"capacity {self.capacity}"
            )
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reset(self) -> None:
        """Forget every cached position (the storage is kept)."""
        self.length = 0
