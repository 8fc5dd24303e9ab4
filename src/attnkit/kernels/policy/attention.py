"""The attention choices of the policy: which path serves an attention call, and the tile sizes
and products of attnkit's attention kernels (docs/guide/core.md, "How a call finds its kernel").

The callers hand over what they know of a checked call; nothing here reads tensor values.
attnkit's compiled kernels sit above this package, so the attention modules hand their entry
points over at import (:func:`attnkit.kernels.timing.provide_attention_kernel`) for the
measured choices to time.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from attnkit.kernels import attention, timing
from attnkit.kernels.plans import AttentionCall, AttentionPlan, TileKernels
from attnkit.kernels.probe import Capabilities, capabilities
from attnkit.kernels.tuning import choose, declare

__all__ = [
    "CAPPED_CHUNK_SCORES",
    "CAPPED_MAX_ROWS",
    "CAPPED_MIN_ROWS",
    "FLASH_MIN_SCORES",
    "FLEX_CHUNK_SCORES",
    "SPARSE_LONG_BACKWARD_MAX_DENSITY",
    "SPARSE_LONG_KEYS",
    "SPARSE_LONG_MAX_DENSITY",
    "SPARSE_MAX_DENSITY",
    "SPARSE_MIN_KEYS",
    "alibi_kernel",
    "attention_path",
    "attention_plan",
    "bf16_backward_products",
    "bf16_structured",
    "block_sparse",
    "capped_chunk_rows",
    "capped_flash_rows",
    "capped_kernel",
    "flash_bf16_products",
    "flash_kernel",
    "flex_block_rows",
    "flex_chunk_keys",
    "one_query_kernel",
    "ring_block_kernel",
    "tile_kernels",
    "tile_rows",
    "torch_low_precision",
]


#: Scores per head below which causal/window attention stays on torch's fused kernel: there the
#: BLAS calls' set-up outweighs the keys attnkit's flash kernels skip.
FLASH_MIN_SCORES = 64 * 64
#: Below this many keys the dense fused kernel beats the block-sparse tiles: planning and
#: per-call overhead outweigh the skipped work.
SPARSE_MIN_KEYS = 2048
#: The tiles run when they compute at most this fraction of the dense scores ...
SPARSE_MAX_DENSITY = 0.25
#: ... or, from this many keys on, ...
SPARSE_LONG_KEYS = 4096
#: ... this fraction without a backward ...
SPARSE_LONG_MAX_DENSITY = 0.5
#: ... and this one with a backward (the flash backward costs a larger multiple of its forward
#: than the dense one does).
SPARSE_LONG_BACKWARD_MAX_DENSITY = 0.35
#: Most scores a soft-capped chunk computes (all heads of the batch together): the buffer stays
#: bounded for long keys.
CAPPED_CHUNK_SCORES = 2**21
#: Most queries per soft-capped chunk: taller products run faster, but a causal chunk computes
#: ``rows**2 / 2`` masked scores on its diagonal.
CAPPED_MAX_ROWS = 128
#: Fewest queries per soft-capped chunk (below it the per-call overhead dominates).
CAPPED_MIN_ROWS = 16


def attention_plan(call: AttentionCall) -> AttentionPlan:
    """Every choice for a checked attention call with more than one query, in one answer
    (``call.dispatch_mode`` is read here, from torch)."""
    call = dataclasses.replace(call, dispatch_mode=is_in_torch_dispatch_mode())
    path = attention_path(call)
    tiled = path in ("flash", "tiles")  # (only these ask the measured choices)
    return AttentionPlan(
        call,
        path,
        capped_kernel(call) if path == "capped" else "chunks",
        tile_kernels(call) if tiled else TileKernels(False),
        tile_rows(call.L, call.window, call.dtype) if path == "tiles" else None,
    )


def attention_path(call: AttentionCall) -> str:
    """The path of a checked attention call with more than one query.

    * ``"capped"``: soft-capped scores, which torch's fused kernels cannot compute
      (:func:`capped_kernel` says which capped kernel; it returns weights too).
    * ``"explicit"``: the weights are requested, or there is no key: the textbook math (the
      tests' reference).
    * ``"flash"``: causal or sliding-window attention on attnkit's flash kernels over the whole
      sequence (:func:`flash_kernel`), from :data:`FLASH_MIN_SCORES` scores per head: each block
      of queries computes only the keys it may reach.
    * ``"tiles"``: structured attention on long sequences: the block-sparse tiles, when
      :func:`block_sparse` finds that they skip enough of the scores, else ``"fused"``.
    * ``"fused"``: torch's fused ``scaled_dot_product_attention``.
    """
    if call.softcap:
        return "capped"
    if call.weights or call.S == 0:
        return "explicit"
    if (
        call.structured
        and not (call.batched or call.masked or call.dropout)
        and call.L * call.S >= FLASH_MIN_SCORES
        and flash_kernel(call)
    ):
        return "flash"
    if (call.window is not None or call.batched) and not call.masked and call.S >= SPARSE_MIN_KEYS:
        return "tiles"
    return "fused"


def flash_kernel(call: AttentionCall) -> bool:
    """Whether attnkit's flash kernels (forward and backward) should compute ``call`` rather than
    torch's flash kernel: where they may run (:attr:`AttentionCall.eager` and
    :attr:`AttentionCall.ready`), in float32 always (they skip finer blocks of a causal or
    windowed structure than torch's kernel), in bfloat16 by the measured choices
    ``attention.bf16_backward`` (with gradients), ``attention.bf16_causal`` (causal prefixes,
    plain or per document) and :func:`bf16_structured` (windows): which kernel multiplies bf16
    faster depends on the CPU's bf16 units, and a band skips more work than a causal prefix."""
    if not (call.eager and call.ready):
        return False
    if call.dtype == torch.float32:
        return True
    if call.dtype != torch.bfloat16:
        return False
    if call.grads:
        return choose("attention.bf16_backward") != "torch"
    if call.window is None:  # (whole causal prefixes, or one per document: no band to skip)
        return choose("attention.bf16_causal") == "flash"
    return bf16_structured(call.window)[0] == "flash"


def torch_low_precision(dtype: torch.dtype, *, backward: bool) -> bool:
    """Whether torch's CPU flash kernel should compute ``dtype`` (bfloat16 or float16) itself
    rather than on float32 copies of the inputs.

    A bfloat16 forward alone: always (it is torch's own bf16 path; float32 copies cost fresh
    allocations on every call). With a backward, only where the CPU multiplies ``dtype``
    natively (AVX512-BF16 or AMX tiles for bfloat16, AMX-FP16 for float16): elsewhere torch's
    kernel converts every block it multiplies, which costs more than one float32 pass and a
    rounding at the end. float16 forward likewise needs AMX-FP16.
    """
    if dtype == torch.bfloat16:
        return not backward or capabilities().bf16_dot
    return dtype == torch.float16 and _torch_has_amx_fp16()


def _torch_has_amx_fp16() -> bool:
    probe = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    return bool(probe()) if probe is not None else False


def tile_kernels(call: AttentionCall) -> TileKernels:
    """The kernels of the block-sparse tiles for ``call``: :func:`flash_kernel`, float32 copies
    for half precision where :func:`torch_low_precision` says torch's kernel should not take it,
    and how attnkit's flash kernels multiply bf16 tiles: :func:`flash_bf16_products` for a
    forward alone, ``attention.bf16_backward`` with gradients (forward and backward alike)."""
    low = call.dtype in (torch.bfloat16, torch.float16)
    widen = low and not torch_low_precision(call.dtype, backward=call.grads)
    wide = dataclasses.replace(call, dtype=torch.float32)
    flash = flash_kernel(call)
    products = "widened"
    if flash and call.dtype == torch.bfloat16:
        products = bf16_backward_products() if call.grads else flash_bf16_products()
    return TileKernels(flash, widen, widen and flash_kernel(wide), products)


def block_sparse(
    L: int, S: int, *, covered: int, batch: int, backward: bool, structured: bool = True
) -> bool:
    """Whether the block-sparse tiles should replace the dense fused kernel: at least
    :data:`SPARSE_MIN_KEYS` keys and tiles that compute at most :data:`SPARSE_MAX_DENSITY` of the
    ``batch * L * S`` scores (from :data:`SPARSE_LONG_KEYS` keys on
    :data:`SPARSE_LONG_MAX_DENSITY`, or :data:`SPARSE_LONG_BACKWARD_MAX_DENSITY` when a backward
    follows). ``covered`` is the number of scores the tiles compute."""
    if S < SPARSE_MIN_KEYS or L < 1 or not structured:
        return False
    density = SPARSE_MAX_DENSITY
    if S >= SPARSE_LONG_KEYS:
        density = SPARSE_LONG_BACKWARD_MAX_DENSITY if backward else SPARSE_LONG_MAX_DENSITY
    return covered <= density * batch * L * S


def tile_rows(L: int, window: int | None, dtype: torch.dtype = torch.float32) -> int:
    """Queries per block-sparse tile.

    With a window the band computed per query is ``rows + window`` keys wide, so tiles stay
    small: 64 rows, 128 past a window of 2048 (half the calls and overlapping key gradients for
    a few percent more scores); a bfloat16 window forward on torch's kernel takes the measured
    height of :func:`bf16_structured`. Without one (documents, padding, plain causal) a span is
    a whole document or prefix, and large tiles mean fewer, larger kernel calls: 1024 rows.
    """
    if window is None:
        return max(1, min(1024, L))
    rows = 128 if window > 2048 else 64
    if dtype == torch.bfloat16:
        kernel, measured = bf16_structured(window)
        if kernel == "tiles" and window <= 2048:
            rows = measured
    return max(1, min(rows, L))


declare(
    "attention.bf16_structured",
    ("flash", "tiles-64", "tiles-128", "tiles-256"),
    "A bfloat16 causal/sliding-window forward: attnkit's flash kernel (bf16 widened to "
    "float32 blocks) or torch's flash kernel on tiles of that many queries (bf16 products "
    "where the CPU has bf16 units). Which wins depends on those units and on the tile size.",
    lambda caps: "tiles-64" if caps.matrix_tiles else "flash",
    timing.bf16_structured,
)


def _flash_products_rule(caps: Capabilities) -> str:
    """The tile products a bf16 flash forward takes before (or without) a measurement: MKL's on
    matrix tiles, else attnkit's on pair dot products, else MKL's on other bf16 units, else
    widened (each only where it runs here)."""
    usable = attention.flash_products()
    if caps.matrix_tiles and "bf16" in usable:
        return "bf16"
    if caps.bf16_pairs and "bf16-attnkit" in usable:
        return "bf16-attnkit"
    return "bf16" if caps.bf16_dot and "bf16" in usable else "widened"


def bf16_structured(window: int | None = None) -> tuple[str, int]:
    """``(kernel, rows)`` for a bfloat16 causal/window forward: ``"flash"`` (attnkit's) or
    ``"tiles"`` (torch's kernel in tiles of ``rows`` queries), from the measured
    ``attention.bf16_structured`` choice. Without a window a tile is a whole prefix, so only
    the kernel is taken from the measurement."""
    option = choose("attention.bf16_structured")
    if option == "flash":
        return "flash", 0
    return "tiles", int(option.split("-")[1])


declare(
    "attention.bf16_backward",
    (*timing.FLASH_BACKWARD_PRODUCTS, "torch"),
    "A bfloat16 causal/window attention with a backward: attnkit's flash kernels with blocks "
    "widened to float32 (flash) or with bf16 products and float32 sums (flash-bf16 on MKL's "
    "bf16 GEMM, where torch links it; flash-bf16-attnkit on attnkit's, where the CPU has bf16 "
    "pair dot products), or torch's bf16 flash kernel in tiles; which wins depends on the "
    "CPU's bf16 units and on the work each skips.",
    lambda caps: {"bf16": "torch", "bf16-attnkit": "flash-bf16-attnkit"}.get(
        _flash_products_rule(caps), "torch" if caps.bf16_dot else "flash"
    ),
    timing.bf16_backward,
)


def bf16_backward_products() -> str:
    """How attnkit's flash kernels multiply bf16 tiles when a backward follows (choice
    ``attention.bf16_backward``): the products of its flash option, ``"widened"`` for
    ``torch``."""
    return timing.FLASH_BACKWARD_PRODUCTS.get(choose("attention.bf16_backward"), "widened")


declare(
    "attention.bf16_causal",
    ("flash", "torch"),
    "A bfloat16 causal forward without a window: attnkit's flash kernel or torch's fused "
    "kernel. A whole causal prefix leaves attnkit's finer blocks little to skip, so which "
    "wins depends on how each multiplies bf16 on this CPU.",
    lambda caps: "torch" if caps.matrix_tiles else "flash",
    timing.bf16_causal,
)
declare(
    "attention.flash_bf16_products",
    ("bf16", "bf16-attnkit", "widened"),
    "A bf16 flash forward's tile products: bf16 operands with float32 sums (MKL's bf16 GEMM, "
    "or attnkit's on the CPU's bf16 pair dot products), or widened to float32 for sgemm, which "
    "wins where the CPU has no bf16 dot products (they would only be emulated); whether MKL's "
    "bf16 GEMM pays on small tiles also depends on the CPU's vendor, so it is measured on a "
    "causal prefill's shape.",
    _flash_products_rule,
    timing.flash_bf16_products,
    margin=1.05,
)


def flash_bf16_products() -> str:
    """How a bf16 flash forward multiplies its tiles (choice ``attention.flash_bf16_products``):
    the ``products`` argument of :func:`attnkit.kernels.attention.flash_attention` and
    :func:`attnkit.kernels.attention.capped_attention`."""
    return choose("attention.flash_bf16_products")


def capped_kernel(call: AttentionCall) -> str:
    """Which kernel computes soft-capped attention.

    * ``"flash"``: attnkit's flash loop with the cap, where it may run, without gradients,
      masks, documents, lengths, weights or dropout, in float32 or bfloat16 (widened): the
      scores never leave the caches.
    * ``"one-pass"``: chunks of queries over their key spans, with the cap, the causal/window
      masks and the softmax as one in-place pass of attnkit's row kernel (no gradients, masks,
      documents or lengths; float32 or widened bf16/fp16 in float32).
    * ``"chunks"``: the same chunks with torch's operations (anything else).
    """
    simple = (
        not call.grads
        and not call.masked
        and not call.batched
        and not call.weights
        and not call.dropout
    )
    wide = torch.promote_types(call.dtype, torch.float32) == torch.float32
    if simple and wide and call.eager and call.ready:
        return "flash"
    if (
        not call.grads
        and not call.masked
        and not call.batched
        and wide
        and call.device == "cpu"
        and call.ready
    ):
        return "one-pass"
    return "chunks"


def capped_flash_rows(window: int | None) -> int:
    """Queries per block of the capped flash kernel: 64 for a window (a block computes
    ``rows + window`` keys per query), else 128 (taller products run faster)."""
    return 64 if window is not None else 128


def capped_chunk_rows(heads: int, width: int, L: int, window: int | None = None) -> int:
    """Queries per soft-capped chunk: :data:`CAPPED_MAX_ROWS` (a quarter of a ``window``, if
    that is less), fewer when ``heads * rows * width`` would pass :data:`CAPPED_CHUNK_SCORES`
    (but at least :data:`CAPPED_MIN_ROWS`), never more than ``L``.

    A window's chunk computes ``rows * (window + rows)`` scores for ``rows * window`` allowed
    pairs, so its rows stay small beside the window.

    Args:
        heads: Batch times query heads.
        width: Keys a chunk attends at most (``S``, or ``window + rows`` for a window).
        L: Query length.
        window: The sliding window, if any.
    """
    most = CAPPED_MAX_ROWS
    if window is not None:
        most = min(CAPPED_MAX_ROWS, window // 4 // CAPPED_MIN_ROWS * CAPPED_MIN_ROWS)
    rows = CAPPED_CHUNK_SCORES // max(1, heads * width)
    rows = max(CAPPED_MIN_ROWS, min(most, rows // CAPPED_MIN_ROWS * CAPPED_MIN_ROWS))
    return max(1, min(rows, L))


#: Most scores one tile of :mod:`attnkit.flex.tiles` computes (all heads of the batch
#: together): a span of keys longer than that is cut into chunks merged by an online softmax.
#: The passes over a tile (product, modification, mask, softmax) run in cache when it is small.
FLEX_CHUNK_SCORES = 2**19


def flex_block_rows(L: int) -> int:
    """Queries per tile of :mod:`attnkit.flex.tiles` without a block mask: 128 (taller products
    run faster; with a block mask its ``BLOCK_SIZE`` decides), never more than ``L``."""
    return max(1, min(128, L))


def flex_chunk_keys(heads: int, rows: int) -> int:
    """Keys per chunk of a :mod:`attnkit.flex.tiles` tile of ``rows`` queries over ``heads``
    (batch times query heads): as many as keep the tile within :data:`FLEX_CHUNK_SCORES`
    scores (at least one key block)."""
    return max(1, FLEX_CHUNK_SCORES // max(1, heads * rows))


def alibi_kernel(call: AttentionCall) -> str | None:
    """How attnkit's flash kernels multiply the tiles of an ALiBi call (the ``products`` of
    :func:`attnkit.kernels.attention.flash_attention`), or None where they should not compute
    it. ALiBi is :mod:`attnkit.flex`'s ``alibi`` score modification over no mask, a causal one
    or a causal window: the flash kernels add each score's bias as they compute the tile, where
    the alternative (the flex tiles on torch's flash kernel) reads a bias tensor as an additive
    mask and computes whole blocks. They take it where they may run (:attr:`AttentionCall.eager`
    and :attr:`AttentionCall.ready`), in float32, or in bfloat16 with the products the measured
    choices pick (``attention.bf16_backward`` with gradients, ``attention.flash_bf16_products``
    without), and with no other mask, documents, weights, dropout or soft cap."""
    if call.batched or call.masked or call.weights or call.dropout or call.softcap:
        return None
    if not (call.eager and call.ready) or call.dtype not in (torch.float32, torch.bfloat16):
        return None
    if call.dtype == torch.float32:
        return "widened"
    return bf16_backward_products() if call.grads else flash_bf16_products()


def one_query_kernel(dtype: torch.dtype, device: str, grads: bool) -> bool:
    """Whether attnkit's one-query kernel computes a decoding step (one query per sequence over
    a cache) rather than torch's fused kernel: float32 or bfloat16 on the CPU, no gradients,
    outside torch dispatch modes (the caller checks that the kernels load; under
    ``torch.compile`` it is one operation of the graph). It reads each key/value row once for the
    query heads that share it, and skips the slots a static cache's mask leaves out, which
    torch's kernel reads."""
    return (
        dtype in (torch.float32, torch.bfloat16)
        and device == "cpu"
        and not grads
        and not is_in_torch_dispatch_mode()
    )


_TORCH_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def ring_block_kernel(call: AttentionCall) -> str:
    """The kernel of one block of ring attention (:mod:`attnkit.distributed`): ``"flash"``
    (attnkit's flash kernels, where :func:`flash_kernel` says), ``"torch-flash"`` (torch's CPU
    flash kernel: CPU tensors of a dtype it takes) or ``"explicit"`` (the math, any device)."""
    if flash_kernel(call):
        return "flash"
    if call.device == "cpu" and call.dtype in _TORCH_FLASH_DTYPES:
        return "torch-flash"
    return "explicit"
