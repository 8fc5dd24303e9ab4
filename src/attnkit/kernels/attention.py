"""attnkit's attention kernels: FlashAttention's loop, and the soft-capped softmax and forward.

* :func:`flash_attention` and :func:`flash_attention_backward` (``csrc/flash.c``,
  FlashAttention-2's order): tiles of scores from the BLAS ``sgemm`` torch links (or, for bf16
  inputs, MKL's bf16 GEMM or attnkit's own, ``csrc/bf16_gemm.c``, with float32 sums), folded
  into an online softmax while they sit in cache, each block of queries computing only the keys
  its causal/window rules let it reach (torch's CPU kernel computes whole blocks);
  :func:`capped_attention` is the forward with Gemma 2's soft cap, which torch's fused kernels
  cannot apply.
* :func:`capped_softmax_` (``csrc/capped_softmax.c``): the cap, the causal/window masks and the
  softmax of rows of scores in one pass from memory, where torch makes five.

A decoding step's one-query kernel is :mod:`attnkit.kernels.one_query`.
Which of them serves an attention call is the policy's choice (:mod:`attnkit.kernels.policy`).
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit.kernels.binding import view as _view
from attnkit.kernels.build import library, load_library
from attnkit.kernels.probe import capabilities
from attnkit.kernels.tiles import (
    FLASH_KEYS,
    TILE_KEYS,
    FlashOptions,
    TileOptions,
    alibi_slopes,
    first_query,
    tile_options,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "FLASH_PRODUCTS",
    "FlashOptions",
    "TileOptions",
    "capped_attention",
    "capped_softmax_",
    "flash_attention",
    "flash_attention_backward",
    "flash_available",
    "flash_bf16_products_available",
    "flash_products",
]


def _sgemm_address() -> int | None:
    """The address of the Fortran BLAS ``sgemm_`` torch links (MKL in torch's x86 wheels)."""
    torch_cpu = Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"
    for path in (str(torch_cpu), None):  # (then anything loaded globally)
        if path is not None and not torch_cpu.is_file():
            continue
        try:
            address = ctypes.cast(ctypes.CDLL(path).sgemm_, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if address:
            return address
    return None


#: Input dtypes of the flash kernels (bfloat16 widened to float32 block by block, or multiplied
#: in bf16 as ``products`` says).
_FLASH_DTYPES = (torch.float32, torch.bfloat16)
#: How the flash kernels multiply bf16 tiles: ``"widened"`` (float32 copies for ``sgemm``),
#: ``"bf16"`` (MKL's ``cblas_gemm_bf16bf16f32``) or ``"bf16-attnkit"`` (``csrc/bf16_gemm.c``,
#: on the CPU's bf16 pair dot products); both bf16 ones take bf16 operands with float32 sums.
FLASH_PRODUCTS = ("widened", "bf16", "bf16-attnkit")
#: The bf16 GEMM's name in torch's library (looked up by :func:`_gemm_bf16_address`).
_GEMM_BF16 = "cblas_gemm_bf16bf16f32"


def _rows(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy where its rows are not contiguous vectors BLAS can take."""
    rows, dim = t.shape[2], t.shape[3]
    if (t.stride(3) == 1 or dim <= 1) and (rows <= 1 or t.stride(2) >= max(dim, 1)):
        return t
    return t.contiguous()


def _gemm_bf16_address(name: str = _GEMM_BF16) -> int | None:
    """The address of MKL's ``cblas_gemm_bf16bf16f32`` (``name``) where torch links it, as
    :func:`_sgemm_address` finds ``sgemm_``, or None."""
    torch_cpu = Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"
    for path in (str(torch_cpu), None):
        if path is not None and not torch_cpu.is_file():
            continue
        try:
            address = ctypes.cast(getattr(ctypes.CDLL(path), name), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if address:
            return address
    return None


@functools.cache
def _flash_gemm_bf16() -> int | None:
    """``cblas_gemm_bf16bf16f32``'s address where torch links it and a small forward through it
    passes :func:`_bf16_forward_matches`, or None."""
    address = _gemm_bf16_address()
    if _flash_sgemm() is None or address is None:
        return None
    return address if _bf16_forward_matches(address) else None


def _bf16_forward_matches(address: int) -> bool:
    """Whether a small bf16 forward through the GEMM at ``address`` (GQA, causal, a window,
    several tiles) matches the float64 softmax at bf16's precision (which also proves its
    calling convention)."""
    sgemm = _flash_sgemm()
    assert sgemm is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 37, 24, generator=g).bfloat16() for n in (4, 2, 2))
    got, _ = _forward(q, k, v, 0.2, 0.0, True, 9, 0, True, (8, 16), sgemm, 1, False, address)
    q64, k64, v64 = (t.double().repeat_interleave(n, dim=1) for t, n in ((q, 1), (k, 2), (v, 2)))
    pos = torch.arange(37)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 9)
    scores = (q64 @ k64.transpose(-1, -2) * 0.2).masked_fill(~allowed, -math.inf)
    want = torch.softmax(scores, dim=-1) @ v64
    return torch.allclose(got.double(), want, atol=2e-2, rtol=2e-2)


def flash_bf16_products_available() -> bool:
    """Whether a bf16 :func:`flash_attention` or :func:`capped_attention` can multiply its
    tiles in bf16 (``products="bf16"``): the kernels run here and torch links MKL's
    ``cblas_gemm_bf16bf16f32`` (checked by a small call)."""
    return _flash_gemm_bf16() is not None


@functools.cache
def _own_gemm_bf16() -> int | None:
    """``csrc/bf16_gemm.c``'s address, where the CPU has bf16 pair dot products and a small
    call through it matches the float64 softmax at bf16's precision, or None."""
    lib = load_library()[0]
    if lib is None or not capabilities().bf16_pairs or _flash_sgemm() is None:
        return None
    if not lib.attnkit_bf16_gemm_native():  # (a compiler without the instructions)
        return None
    address = ctypes.cast(lib.attnkit_gemm_bf16, ctypes.c_void_p).value
    return address if address and _bf16_forward_matches(address) else None


def flash_products() -> tuple[str, ...]:
    """The :data:`FLASH_PRODUCTS` that run here as asked (the others fall back to
    ``"widened"``)."""
    usable = {
        "widened": True,
        "bf16": flash_bf16_products_available(),
        "bf16-attnkit": _own_gemm_bf16() is not None,
    }
    return tuple(p for p in FLASH_PRODUCTS if usable[p])


@functools.cache
def _flash_sgemm() -> int | None:
    """``sgemm_``'s address for the flash kernels, once a small call through it equals torch's
    math (which also proves its calling convention), or None."""
    if load_library()[0] is None:
        return None
    address = _sgemm_address()
    if address is None:
        return None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 5, 3, generator=g) for n in (2, 1, 1))
    got, _ = _forward(q, k, v, 0.5, 2.0, True, None, 0, False, (4, 3), address, 1, False)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    capped = 2.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 2.0)
    want = torch.softmax(capped.masked_fill(~allowed, -math.inf), dim=-1) @ v
    return address if torch.allclose(got, want, atol=1e-5) else None


def flash_available() -> bool:
    """Whether :func:`flash_attention`, :func:`flash_attention_backward` and
    :func:`capped_attention` run here: the kernels build and torch's BLAS ``sgemm`` is found
    (and checked)."""
    return _flash_sgemm() is not None


def _check_flash(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int | None,
    dtypes: tuple[torch.dtype, ...],
    products: str = "widened",
) -> None:
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{name} takes q, k and v all of one dtype of {[str(d) for d in dtypes]}, got "
            f"{q.dtype}, {k.dtype} and {v.dtype}"
        )
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (
        q.dim() == k.dim() == v.dim() == 4
        and q.is_cpu
        and k.is_cpu
        and v.is_cpu
        and ks[1] > 0
        and qs[1] % ks[1] == 0
        and qs[0] == ks[0] == vs[0]
        and qs[3] == ks[3]
        and ks[1:3] == vs[1:3]
    ):
        raise ValueError(
            f"{name} needs CPU q (B, H, L, E), k (B, K, S, E) and v (B, K, S, Ev) with "
            f"H % K == 0, got {tuple(qs)}, {tuple(ks)} and {tuple(vs)} on {q.device}, "
            f"{k.device} and {v.device}"
        )
    if window is not None and window < 1:
        raise ValueError(f"{name} needs window >= 1 or None, got window={window}")
    if products not in FLASH_PRODUCTS:
        raise ValueError(f"{name} takes products in {FLASH_PRODUCTS}, got products={products!r}")
    if _flash_sgemm() is None:
        why = load_library()[1] or "torch's BLAS sgemm was not found"
        raise RuntimeError(f"{name} cannot run here: {why}")


def _gemm_bf16_for(q: Tensor, products: str) -> int | None:
    """The bf16 GEMM the kernels run with on ``q`` (``products`` other than ``"widened"`` on
    bf16 inputs, where it runs: see :func:`flash_products`), else None: the widened products."""
    if products == "widened" or q.dtype != torch.bfloat16:
        return None
    return _flash_gemm_bf16() if products == "bf16" else _own_gemm_bf16()


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    cap: float,
    causal: bool,
    window: int | None,
    first: int,
    finite: bool,
    blocks: tuple[int, int],
    sgemm: int,
    threads: int,
    with_lse: bool,
    gemm_bf16: int | None = None,
    slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """csrc/flash.c's forward on checked inputs: ``(out, lse or None)``, ``out`` laid out
    ``(B, L, H, Ev)`` in memory (as torch's flash kernel lays out its output). ``gemm_bf16``:
    the bf16 GEMM a bf16 call multiplies its tiles with, or None (widened for ``sgemm``);
    ``slopes``: checked ALiBi slopes (:func:`~attnkit.kernels.tiles.alibi_slopes`), or None."""
    lib = library()
    B, H, L, _ = q.shape
    K, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    out = q.new_empty(B, L, H, Ev).transpose(1, 2)
    lse = q.new_empty(B, H, L, dtype=torch.float32) if with_lse else None
    if out.numel() == 0:
        return out, lse
    q, k, v = _rows(q), _rows(k), _rows(v)
    dims = (ctypes.c_int64 * 7)(B, H, K, L, S, q.shape[3], Ev)
    failed = lib.attnkit_flash_forward(
        _view(q), _view(k), _view(v), _view(out),
        None if lse is None else lse.data_ptr(), H * L, L,
        dims, first, int(causal), window or 0, scale, cap, int(finite),
        None if slopes is None else slopes.data_ptr(), *blocks, q.dtype == torch.bfloat16, sgemm,
        gemm_bf16, threads,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the flash forward could not allocate its buffers ({threads} threads)")
    return out, lse


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    blocks: tuple[int, int] = (128, 512),
    products: str = "widened",
    **options: Unpack[FlashOptions],
) -> tuple[Tensor, Tensor]:
    """Attention in FlashAttention's loop on the CPU, with the log-sum-exp the backward needs.

    Each thread takes ``blocks[0]`` queries of one head at a time and walks the blocks of at most
    ``blocks[1]`` keys they may attend, each tile only as wide as the block's reach (a causal
    block of queries computes the keys up to its last query): a tile of scores from torch's BLAS
    ``sgemm``, folded into a running maximum and sum per query, multiplied with the block's
    values, all while it stays in the CPU's caches. Query ``i`` sits at key position
    ``first + i`` (default ``S - L``: bottom-right aligned, as :class:`attnkit.masks.Structure`);
    a query that may attend no key gets a zero row and log-sum-exp ``-inf``. Inputs must be
    finite (a NaN score makes its row NaN).

    Args:
        q: Queries ``(B, H, L, E)``, float32 or bfloat16 (see ``products``; widened, each
            thread keeps a float32 copy of the keys and values of the head it works on) on the
            CPU, any strides (rows are copied where their last dim is not contiguous).
        k: Keys ``(B, K, S, E)`` with ``H % K == 0`` (grouped-query attention).
        v: Values ``(B, K, S, Ev)``.
        scale: Multiplier of the scores.
        causal: Keys after a query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        first: Key position of the first query.
        alibi_slopes: ALiBi's slope of each query head ``(H,)``: query head ``h``'s scaled
            score of key ``j`` at position ``p`` gets ``alibi_slopes[h] * (j - p)`` added, in
            the kernel (no bias tensor).
        blocks: Queries per block and most keys per tile.
        products: How bf16 tiles are multiplied: ``"widened"`` (float32 copies, ``sgemm``),
            ``"bf16"`` (MKL's bf16 GEMM) or ``"bf16-attnkit"`` (attnkit's), both with float32
            sums (the scores and the softmax stay float32, the probabilities are rounded to
            bf16 for the product with the values); either bf16 one falls back to
            ``"widened"`` where it does not run here (:func:`flash_products`). Which one pays
            is the policy's choice (:func:`attnkit.kernels.policy.flash_bf16_products`).
            Float32 inputs ignore it.

    Returns:
        ``(out, lse)``: ``out`` ``(B, H, L, Ev)`` in ``q``'s dtype (laid out ``(B, L, H, Ev)``
        in memory), ``lse`` ``(B, H, L)`` float32, the log-sum-exp of each query's scaled
        (and biased) scores.

    Raises:
        TypeError: For other or mixed dtypes.
        ValueError: For shapes that do not fit, tensors not on the CPU, or a bad argument.
        RuntimeError: Where it cannot run here (:func:`flash_available`).
    """
    scale, causal, window = tile_options("flash_attention", options, FLASH_KEYS)
    _check_flash("flash_attention", q, k, v, window, _FLASH_DTYPES, products)
    first = first_query(options, q, k)
    slopes = alibi_slopes("flash_attention", options, q.shape[1])
    sgemm = _flash_sgemm()
    assert sgemm is not None
    out, lse = _forward(
        q, k, v, scale, 0.0, causal, window, first, True, blocks, sgemm, torch.get_num_threads(),
        True, _gemm_bf16_for(q, products), slopes,
    )  # fmt: skip
    assert lse is not None
    return out, lse


def flash_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    blocks: tuple[int, int] = (64, 512),
    into: tuple[Tensor, Tensor, Tensor] | None = None,
    products: str = "widened",
    **options: Unpack[FlashOptions],
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`flash_attention` in FlashAttention-2's loop order.

    Each thread takes one key/value head and the query heads that share it; for each block of
    ``blocks[1]`` keys, every block of ``blocks[0]`` queries that reaches it recomputes its
    scores (only as wide as its reach), takes the probabilities from ``lse`` and makes the five
    products of the backward; the key and value gradients of the block accumulate in cache and
    are written once, the query gradients accumulate over the key blocks. With bf16 inputs and
    bf16 ``products`` the five products take bf16 operands with float32 sums, the
    probabilities and score gradients rounded to bf16 for theirs (as FlashAttention-2 does on
    GPUs); ``"widened"`` multiplies float32 copies.

    Args:
        grad_out: The gradient of ``out``, ``(B, H, L, Ev)``.
        q: Queries, as given to :func:`flash_attention` (with ``k``, ``v`` and the options).
        k: Keys.
        v: Values.
        out: :func:`flash_attention`'s output.
        lse: :func:`flash_attention`'s log-sum-exp.
        scale: Multiplier of the scores.
        causal: Keys after a query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        first: Key position of the first query (default ``S - L``).
        alibi_slopes: ALiBi's slopes, as given to :func:`flash_attention`.
        blocks: Queries per block and keys per block.
        into: float32 ``(dq, dk, dv)`` to add the gradients to (views are fine, with contiguous
            rows), instead of new tensors: ring attention sums its blocks' gradients without a
            buffer per block.
        products: How bf16 tiles are multiplied, as in :func:`flash_attention`.

    Returns:
        ``(dq, dk, dv)`` in ``q``'s dtype (accumulated in float32), laid out
        ``(B, L or S, heads, dim)`` in memory; or ``into``.

    Raises:
        TypeError: For other or mixed dtypes.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where it cannot run here (:func:`flash_available`).
    """
    name = "flash_attention_backward"
    scale, causal, window = tile_options(name, options, FLASH_KEYS)
    _check_flash(name, q, k, v, window, _FLASH_DTYPES, products)
    B, H, L, E = q.shape
    K, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    if grad_out.shape != (B, H, L, Ev) or out.shape != (B, H, L, Ev) or lse.shape != (B, H, L):
        raise ValueError(
            f"flash_attention_backward needs grad_out and out {(B, H, L, Ev)} and lse "
            f"{(B, H, L)}, got {tuple(grad_out.shape)}, {tuple(out.shape)} and "
            f"{tuple(lse.shape)}"
        )
    lib, sgemm = library(), _flash_sgemm()
    assert sgemm is not None
    first = first_query(options, q, k)
    slopes = alibi_slopes(name, options, H)
    dtype = q.dtype
    if into is not None:
        dq, dk, dv = into
        shapes = ((B, H, L, E), (B, K, S, E), (B, K, S, Ev))
        if any(
            t.dtype != torch.float32 or t.shape != shape or not t.is_cpu or _rows(t) is not t
            for t, shape in zip(into, shapes, strict=True)
        ):
            raise ValueError(
                f"flash_attention_backward's into needs float32 CPU tensors {shapes} with "
                f"contiguous rows, got {[(t.dtype, tuple(t.shape), t.stride()) for t in into]}"
            )
    else:
        dq = q.new_empty(B, L, H, E, dtype=torch.float32).transpose(1, 2)
        dk = k.new_empty(B, S, K, E, dtype=torch.float32).transpose(1, 2)
        dv = v.new_empty(B, S, K, Ev, dtype=torch.float32).transpose(1, 2)
    if min(B * H, L, S) == 0:  # no (query, key) pair: nothing to add, or zero gradients
        if into is not None:
            return into
        return dq.zero_().to(dtype), dk.zero_().to(dtype), dv.zero_().to(dtype)
    q, k, v = _rows(q), _rows(k), _rows(v)
    grad_out, out = _rows(grad_out.to(dtype)), _rows(out.to(dtype))
    lse = lse.float().contiguous()
    dims = (ctypes.c_int64 * 7)(B, H, K, L, S, E, Ev)
    threads = torch.get_num_threads()
    failed = lib.attnkit_flash_backward(
        _view(q), _view(k), _view(v), _view(out), _view(grad_out), lse.data_ptr(), H * L, L,
        _view(dq), _view(dk), _view(dv), dims, first, int(causal), window or 0, scale,
        None if slopes is None else slopes.data_ptr(), *blocks, dtype == torch.bfloat16,
        into is not None, sgemm, _gemm_bf16_for(q, products), threads,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the flash backward could not allocate its buffers ({threads} threads)")
    if into is not None:
        return into
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def capped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softcap: float,
    finite: bool = False,
    query_block: int = 64,
    key_block: int = 512,
    products: str = "widened",
    **options: Unpack[TileOptions],
) -> Tensor:
    """Soft-capped attention without gradients, ``softmax(c * tanh(q k^T * scale / c)) v`` over
    the keys each query may attend: :func:`flash_attention`'s loop with the cap applied to each
    tile of scores (Gemma 2's attention-logit soft-capping, which torch's fused kernels cannot
    do).

    Query ``i`` sits at key position ``S - L + i``; a query that may attend no key gets a zero
    row. A NaN score makes its row NaN; unless ``finite``, so does an infinite one (capped it
    would look finite).

    Args:
        q: Queries ``(B, H, L, E)``, float32 or bfloat16 (widened as in
            :func:`flash_attention`) on the CPU.
        k: Keys ``(B, K, S, E)`` with ``H % K == 0`` (grouped-query attention).
        v: Values ``(B, K, S, Ev)``.
        softcap: The cap ``c > 0``.
        scale: Multiplier of the scores.
        causal: Keys after a query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        finite: ``q`` and ``k`` are known to be finite (skips turning infinite scores into NaN).
        query_block: Queries a thread works on at a time (small blocks suit a window: a block
            computes ``query_block + window`` keys per query; without one, larger blocks share
            each tile of keys among more queries).
        key_block: Most keys of a tile of scores.
        products: How bf16 tiles are multiplied, as in :func:`flash_attention`.

    Returns:
        ``out`` ``(B, H, L, Ev)`` in ``q``'s dtype.

    Raises:
        TypeError: For other or mixed dtypes.
        ValueError: For shapes that do not fit, tensors not on the CPU, or a bad argument.
        RuntimeError: Where it cannot run here (:func:`flash_available`).
    """
    if not (softcap > 0 and math.isfinite(softcap)) or query_block < 1 or key_block < 1:
        raise ValueError(
            f"capped_attention needs a finite softcap > 0 and blocks >= 1, got "
            f"softcap={softcap}, query_block={query_block}, key_block={key_block}"
        )
    scale, causal, window = tile_options("capped_attention", options, TILE_KEYS)
    _check_flash("capped_attention", q, k, v, window, _FLASH_DTYPES, products)
    sgemm = _flash_sgemm()
    assert sgemm is not None
    first = k.shape[2] - q.shape[2]
    out, _ = _forward(
        q, k, v, scale, softcap, causal, window, first, finite, (query_block, key_block), sgemm,
        torch.get_num_threads(), False, _gemm_bf16_for(q, products),
    )  # fmt: skip
    return out


def capped_softmax_(
    scores: Tensor,
    softcap: float,
    *,
    first: int = 0,
    period: int | None = None,
    causal: bool = False,
    window: int | None = None,
    finite: bool = False,
) -> Tensor:
    """The softmax of soft-capped scores along the last dim, in place, in one pass from memory.

    ``scores`` holds ``t = 2 x / c`` for raw scores ``x`` and cap ``c = softcap`` (fold the
    factor into the product that makes them); each row becomes
    ``softmax(c * tanh(x / c))`` over the keys it may attend, and 0 elsewhere (a row that may
    attend no key is all 0). Row ``k`` (over all leading dims) is the query at position
    ``first + k % period`` counted from the row's first key: ``causal`` keeps the keys at or
    before it, ``window`` the keys less than ``window`` away (:class:`attnkit.masks.Structure`'s
    rules). A NaN makes its row NaN; unless ``finite``, so does an infinite ``t``.

    Args:
        scores: Float32, contiguous, on the CPU, at least one dim.
        softcap: The cap ``c > 0``.
        first: Position of the first row's query, relative to the first key.
        period: Rows per run of query positions (default: all rows, one position each).
        causal: Keys after the query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        finite: The raw scores are known to be finite (skips a pass that turns inf into NaN).

    Returns:
        ``scores``.

    Raises:
        TypeError: For a dtype other than float32.
        ValueError: For a tensor that is not contiguous or not on the CPU, or a bad argument.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    if scores.dtype != torch.float32:
        raise TypeError(f"capped_softmax_ takes float32 scores, got {scores.dtype}")
    if scores.device.type != "cpu" or not scores.is_contiguous() or scores.dim() < 1:
        raise ValueError(
            f"capped_softmax_ needs contiguous CPU scores with at least one dim, got shape "
            f"{tuple(scores.shape)} strides {scores.stride()} on {scores.device}"
        )
    rows = math.prod(scores.shape[:-1])
    period = max(rows, 1) if period is None else period
    if not softcap > 0 or period < 1 or (window is not None and window < 1):
        raise ValueError(
            f"capped_softmax_ needs softcap > 0, period >= 1 and window >= 1 or None, got "
            f"softcap={softcap}, period={period}, window={window}"
        )
    lib = library()
    width = scores.shape[-1]
    if rows and width:
        lib.attnkit_capped_softmax(
            scores.data_ptr(),
            rows,
            width,
            width,
            period,
            first,
            int(causal),
            window or 0,
            softcap,
            int(finite),
            torch.get_num_threads(),
        )
    return scores
