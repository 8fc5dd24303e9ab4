"""attnkit's one-query attention kernel (``csrc/one_query.c``): a decoding step's attention.

:func:`one_query_attention` computes one query per head over a key/value cache, the query heads
sharing a key/value head computed together, masked slots of a static cache never read (torch's
fused kernel spends most of such a call on set-up, and reads every slot);
:func:`paged_one_query_attention` reads a paged cache's blocks in place. Compiled graphs call
the first as the op ``attnkit::one_query_attention`` (:mod:`attnkit.kernels.ops`). Whether it
serves a step is the policy's choice (:func:`attnkit.kernels.policy.one_query_kernel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit.kernels.build import library

__all__ = ["NON_FINITE", "NO_KEY", "one_query_attention", "paged_one_query_attention"]

#: The float dtypes of the one-query kernel.
_ONE_QUERY_DTYPES = (torch.bfloat16, torch.float32)

#: Flags of :func:`one_query_attention` (or-ed).
NO_KEY = 1  #: some query may attend no key: its row is zero
NON_FINITE = 2  #: some output value is NaN or infinite
_NO_MEMORY = 4  # a buffer could not be allocated: nothing was written (csrc/one_query.c)
_BAD_INDEX = 8  # a paged key outside its table or the pool: nothing was written


def _one_query(
    name: str,
    call: Callable[..., int],
    q: Tensor,
    K: int,
    keys: tuple[Any, ...],
    scale: float,
    softcap: float | None,
    out: Tensor,
) -> int:
    """The flags of a one-query kernel ``call`` (csrc/one_query.c) writing ``out`` from ``q``
    ``(B, H, 1, E)`` and ``K`` key/value heads; ``keys``: its arguments that say where the keys,
    values (and mask) lie.

    Raises:
        MemoryError: Where the kernel could not allocate its buffers (naming ``name``).
    """
    B, H, _, E = q.shape
    flags = call(
        q.data_ptr(), B, K, H // K, E, *keys, scale, softcap or 0.0, out.data_ptr(),
        q.dtype == torch.bfloat16, torch.get_num_threads(),
    )  # fmt: skip
    if flags & _NO_MEMORY:
        raise MemoryError(f"{name} could not allocate its buffers")
    return flags


def one_query_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
) -> tuple[Tensor, int]:
    """Attention of one query per sequence and head over a key/value cache: a decoding step.

    The ``H / K`` query heads sharing a key/value head are computed together, each key and value
    row read once; keys the mask leaves out are never read. Over the keys a query may attend the
    result is the textbook softmax (a NaN or ``+inf`` score makes the row NaN, a ``-inf`` score
    weighs 0); a query with no allowed key gets a zero row. The flags say where either happened,
    so that a caller with stricter rules can recompute those steps. With a ``softcap`` ``c`` the
    scores are capped to ``c * tanh(s / c)`` first (Gemma 2), and an infinite score makes its row
    NaN.

    Args:
        q: Queries ``(B, H, 1, E)``.
        k: Keys ``(B, K, S, E)`` with ``H % K == 0`` (rows may be strided: a cache's slice).
        v: Values ``(B, K, S, Ev)``.
        mask: Bool ``(B or 1, 1, 1, S)``, ``True`` where a key may be attended, or None.
        scale: Multiplier of the scores.
        softcap: The scores' soft cap ``c > 0``, or None.

    Returns:
        ``(out, flags)``: ``out`` ``(B, H, 1, Ev)`` in the inputs' dtype (all bfloat16 or all
        float32), ``flags`` an or of :data:`NO_KEY` and :data:`NON_FINITE` (0: neither).

    Raises:
        TypeError: For other or mixed dtypes, or a mask that is not bool.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    # (Checks written for speed: a decoding step calls this once a layer, and each microsecond
    # here is a few percent of a small model's step.)
    dtype = q.dtype
    if dtype not in _ONE_QUERY_DTYPES or k.dtype != dtype or v.dtype != dtype:
        raise TypeError(
            f"one_query_attention takes q, k and v all bfloat16 or all float32, got {q.dtype}, "
            f"{k.dtype} and {v.dtype}"
        )
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"one_query_attention takes a bool mask, got {mask.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape
    fits = len(qs) == len(ks) == len(vs) == 4 and q.is_cpu and k.is_cpu and v.is_cpu
    if fits:
        B, H, L, E = qs
        K, S, Ev = ks[1], ks[2], vs[3]
        fits = (
            L == 1
            and K > 0
            and H % K == 0
            and ks[0] == vs[0] == B
            and ks[3] == E
            and vs[1] == K
            and vs[2] == S
            and (
                mask is None
                or (
                    mask.dim() == 4
                    and mask.is_cpu
                    and mask.shape[1] == mask.shape[2] == 1
                    and mask.shape[3] == S
                    and mask.shape[0] in (1, B)
                )
            )
        )
    if not fits:
        raise ValueError(
            f"one_query_attention needs CPU q (B, H, 1, E), k (B, K, S, E), v (B, K, S, Ev) "
            f"with H % K == 0 and a mask (B or 1, 1, 1, S) or None, got {tuple(qs)}, "
            f"{tuple(ks)}, {tuple(vs)} and {None if mask is None else tuple(mask.shape)} on "
            f"{q.device}, {k.device}, {v.device}"
        )
    lib = library()
    q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = q.new_empty(B, H, 1, Ev)
    if out.numel() == 0:
        return out, 0
    k0, k1, k2, _ = k.stride()
    v0, v1, v2, _ = v.stride()
    m0, _, _, m3 = (0, 0, 0, 0) if mask is None else mask.stride()
    keys = (
        k.data_ptr(),
        k0,
        k1,
        k2,
        v.data_ptr(),
        v0,
        v1,
        v2,
        Ev,
        S,
        None if mask is None else mask.data_ptr(),
        m0 if mask is not None and mask.shape[0] > 1 else 0,  # (0: one mask row for all)
        m3,
    )
    name = "one_query_attention"
    return out, _one_query(name, lib.attnkit_one_query_attention, q, K, keys, scale, softcap, out)


def paged_one_query_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    rows: Tensor,
    first: Tensor,
    count: Tensor,
    scale: float,
    *,
    softcap: float | None = None,
) -> tuple[Tensor, int]:
    """:func:`one_query_attention` over a paged cache: each sequence's keys and values are read
    in place from the pool rows its block table names, never gathered into a copy.

    Args:
        q: Queries ``(B, H, 1, E)``.
        k_pool: Keys ``(slots, K, E)`` of every sequence (rows may be strided).
        v_pool: Values ``(slots, K, Ev)``.
        rows: int32 ``(B, W)``: the pool row of each sequence's key ``j``.
        first: int64 ``(B,)``: each sequence's first attended key (a sliding window's start).
        count: int64 ``(B,)``: how many keys from ``first`` on it attends (``first + count <=
            W``).
        scale: Multiplier of the scores.
        softcap: The scores' soft cap ``c > 0``, or None.

    Returns:
        ``(out, flags)`` as :func:`one_query_attention`.

    Raises:
        TypeError: For other or mixed dtypes, or index tensors of other dtypes.
        ValueError: For shapes that do not fit, keys outside the rows, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available.
    """
    dtype = q.dtype
    if dtype not in _ONE_QUERY_DTYPES or k_pool.dtype != dtype or v_pool.dtype != dtype:
        raise TypeError(
            f"paged_one_query_attention takes q, k and v all bfloat16 or all float32, got "
            f"{q.dtype}, {k_pool.dtype} and {v_pool.dtype}"
        )
    if rows.dtype != torch.int32 or first.dtype != torch.int64 or count.dtype != torch.int64:
        raise TypeError(
            f"paged_one_query_attention takes int32 rows and int64 first/count, got "
            f"{rows.dtype}, {first.dtype} and {count.dtype}"
        )
    B, H, _, E = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    K, Ev = k_pool.shape[1], v_pool.shape[-1]
    tensors = (q, k_pool, v_pool, rows, first, count)
    fits = (
        q.dim() == 4
        and q.shape[2] == 1
        and k_pool.dim() == v_pool.dim() == 3
        and k_pool.shape[:2] == v_pool.shape[:2]
        and k_pool.shape[2] == E
        and K > 0
        and H % K == 0
        and rows.dim() == 2
        and rows.shape[0] == B
        and first.shape == count.shape == (B,)
        and all(t.is_cpu for t in tensors)
    )
    if not fits:
        raise ValueError(
            "paged_one_query_attention needs CPU q (B, H, 1, E), pools (slots, K, E/Ev) with "
            "H % K == 0, rows (B, W) within the pool and first/count (B,) within W, got "
            f"{[tuple(t.shape) for t in tensors]} on {[str(t.device) for t in tensors]}"
        )
    lib = library()
    q = q.contiguous()
    k_pool = k_pool if k_pool.stride(-1) == 1 else k_pool.contiguous()
    v_pool = v_pool if v_pool.stride(-1) == 1 else v_pool.contiguous()
    rows, first, count = rows.contiguous(), first.contiguous(), count.contiguous()
    out = q.new_empty(B, H, 1, Ev)
    if out.numel() == 0:
        return out, 0
    keys = (
        k_pool.data_ptr(),
        k_pool.stride(1),
        k_pool.stride(0),
        v_pool.data_ptr(),
        v_pool.stride(1),
        v_pool.stride(0),
        Ev,
        rows.data_ptr(),
        rows.shape[1],
        first.data_ptr(),
        count.data_ptr(),
        k_pool.shape[0],
    )
    call = lib.attnkit_paged_one_query_attention
    flags = _one_query("paged_one_query_attention", call, q, K, keys, scale, softcap, out)
    if flags & _BAD_INDEX:
        raise ValueError(
            f"paged_one_query_attention: a key outside its rows (first {first.tolist()}, count "
            f"{count.tolist()}, width {rows.shape[1]}) or outside the pool ({k_pool.shape[0]} rows)"
        )
    return out, flags
