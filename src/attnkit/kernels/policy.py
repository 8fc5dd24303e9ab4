"""Every kernel choice attnkit makes, in one place: rules from the probed capabilities, and
measurements where the better kernel depends on the machine.

Each choice is a named :class:`~attnkit.kernels.tuning.Choice` registered here, answered by
:func:`choose` (an ``ATTNKIT_KERNEL_<NAME>`` environment variable, else a measurement cached per
machine, else the rule over :func:`attnkit.kernels.probe.capabilities`; see
:mod:`attnkit.kernels.tuning`). The rest of attnkit asks the named functions below (which path
serves an attention call, which kernel multiplies a linear) and never tests CPU features itself.
``attnkit kernels`` prints the capabilities, the kernels built, and every choice with the
timings it was made on; ``attnkit kernels --retune`` measures again. Measuring never happens
inside ``torch.compile`` tracing: a choice a compiled graph needs is asked before it traces (or
reads its rule).

Sections: attention (docs/guide/core.md, "How a call finds its kernel"), then linear products
and row kernels (docs/guide/kernels.md).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from attnkit.kernels import attention, block_linear, build, linear, timing
from attnkit.kernels.plans import AttentionCall, AttentionPlan, LinearPlan, TileKernels
from attnkit.kernels.probe import Capabilities, capabilities
from attnkit.kernels.timing import provide_attention_kernel, provide_decoding_steps
from attnkit.kernels.tuning import (
    Choice,
    Decision,
    choices,
    choose,
    decision,
    declare,
    env_var,
    on_reset,
    register,
    reset,
    retune,
    tune_file,
)

__all__ = [
    "BLOCK_KERNEL_ROWS",
    "CAPPED_CHUNK_SCORES",
    "CAPPED_MAX_ROWS",
    "CAPPED_MIN_ROWS",
    "COMPILED_STEP_BATCH",
    "FLASH_MIN_SCORES",
    "FLEX_CHUNK_SCORES",
    "INT8_KERNELS",
    "INT8_KERNEL_ALIASES",
    "INT8_KERNEL_ROWS",
    "PROMPT_ROWS",
    "SPARSE_LONG_BACKWARD_MAX_DENSITY",
    "SPARSE_LONG_KEYS",
    "SPARSE_LONG_MAX_DENSITY",
    "SPARSE_MAX_DENSITY",
    "SPARSE_MIN_KEYS",
    "AttentionCall",
    "AttentionPlan",
    "Choice",
    "Decision",
    "LinearPlan",
    "TileKernels",
    "attention_path",
    "attention_plan",
    "bf16_backward_products",
    "bf16_prompt_upcast",
    "bf16_structured",
    "block_kernel_rows",
    "block_sparse",
    "block_tile_rows",
    "capped_chunk_rows",
    "capped_flash_rows",
    "capped_kernel",
    "choices",
    "choose",
    "compiled_row_kernel",
    "compiled_step_fuses",
    "decision",
    "env_var",
    "flash_bf16_products",
    "flash_kernel",
    "flex_block_rows",
    "flex_chunk_keys",
    "fp32_prompt_onednn",
    "int4_kernel",
    "int8_kernel",
    "int8_kernel_name",
    "int8_kernel_rows",
    "int8pack_takes",
    "linear_plan",
    "most_stream_rows",
    "norm_row_kernel",
    "one_query_kernel",
    "provide_attention_kernel",
    "provide_decoding_steps",
    "register",
    "reset",
    "retune",
    "ring_block_kernel",
    "stream_rows",
    "tile_kernels",
    "tile_rows",
    "torch_low_precision",
    "tune_file",
    "weight_layout",
]


# Attention
#
# Which path serves an attention call (docs/guide/core.md, "How a call finds its kernel"). The
# callers hand over what they know of a checked call; nothing here reads tensor values. attnkit's
# compiled kernels sit above this module, so the attention modules hand their entry points over
# at import (:func:`attnkit.kernels.timing.provide_attention_kernel`) for the measured choices
# to time.

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


# Linear products and row kernels
#
# Decoding multiplies a weight by a few rows (one per sequence), so it reads every weight once per
# token: the kernel that streams a weight nearest the memory bandwidth wins. A prompt multiplies it
# by many rows, where a blocked GEMM wins. Which library streams best, which GEMM is faster, and
# whether a compiled graph's single row is better served by attnkit's kernel (an op call) or by
# inductor's own reduction differ from CPU to CPU: those choices are measured on small shapes of
# the kind a small model's decoding step multiplies, the rest follow from the capabilities.

#: Rows from which a product is a prompt's (a blocked GEMM), below which a decoding step's
#: (attnkit's streaming kernel); also where bf16 GEMMs may run in float32
#: (:func:`bf16_prompt_upcast`): a few rows' bf16 products stay bf16 either way.
PROMPT_ROWS = 16
#: Rows up to which an int8 product runs attnkit's kernel with its narrow dots; more rows (a
#: prompt) multiply the dequantized weight by the activations rounded as the kernel rounds them,
#: where the narrow dots fall behind a blocked GEMM. With the wide dots four rows share each
#: block of codes, and the kernel takes every product outside compiled graphs.
INT8_KERNEL_ROWS = 256
#: The int8 kernels :func:`int8_kernel` chooses between (``"dequantize"``: the float product with
#: the dequantized weight, which always runs).
INT8_KERNELS = ("attnkit", "fbgemm", "int8pack", "dequantize")
#: Former names of int8 kernels, still accepted.
INT8_KERNEL_ALIASES = {"avx2": "attnkit"}


#: Sequences of the left-padded batch whose step ``decoding.compiled_step.*_batch`` times.
COMPILED_STEP_BATCH = 4


def _compiled_step_choice(dtype: torch.dtype, batch: bool) -> str:
    return f"decoding.compiled_step.{str(dtype).removeprefix('torch.')}{'_batch' if batch else ''}"


def _compiled_row_choice(dtype: torch.dtype) -> str:
    return f"linear.compiled_row.{str(dtype).removeprefix('torch.')}"


declare(
    "linear.float_dots",
    ("wide", "narrow"),
    "attnkit's float products: eight rows share each weight vector with the wide dots (where "
    "the CPU has 512-bit vectors), two with the narrow ones.",
    lambda caps: "wide" if caps.wide_vectors else "narrow",
)
declare(
    "linear.int8_dots",
    ("wide", "narrow"),
    "attnkit's int8 and int4 products: the wide integer dots take twice the codes per "
    "instruction, with the same bits, where the CPU has them.",
    lambda caps: "wide" if caps.int8_dot else "narrow",
)
declare(
    "linear.fp32_row",
    ("stream", "transposed"),
    "An eager float32 product of one row, and of the few rows a speculative round verifies "
    "(the weight's layout serves both): attnkit's stream over the row-major weight, or "
    "F.linear (MKL) over a column-major one; which reads a weight faster depends on the CPU.",
    lambda caps: "transposed" if caps.matrix_tiles else "stream",
    timing.fp32_row,
    margin=1.05,
)
for _dtype, _rule in ((torch.float32, False), (torch.bfloat16, True)):
    declare(
        _compiled_row_choice(_dtype),
        ("kernel", "reduction"),
        f"A compiled step's product of one {_dtype} row: attnkit's kernel as an op, or "
        "inductor's streaming reduction (no op call). A rule, not a measurement: timed "
        "alone, the reduction wins, while inside a whole compiled step the wide dots' "
        "kernel serves a bf16 row better (inductor fuses the reduction with its "
        "neighbours differently); `timing.compiled_row` times the pair for study.",
        (lambda caps: "kernel" if caps.wide_vectors else "reduction")
        if _rule
        else (lambda caps: "reduction"),
    )
declare(
    "linear.fp32_prompt",
    ("mkl", "onednn"),
    "A prompt's float32 GEMM (eager, no gradients): F.linear's MKL, or oneDNN's GEMM, which "
    "some CPUs run much faster (MKL takes a narrower path on them).",
    lambda caps: "mkl",
    timing.fp32_prompt,
    margin=1.15,
)
declare(
    "linear.fp32_batch",
    ("gemm", "stream"),
    "An eager float32 product of as many rows as a full continuous batch decodes: the "
    "prompts' blocked GEMM, or attnkit's stream (each weight row dotted with every row while "
    "it is in cache); where one overtakes the other depends on the CPU's vectors and cores.",
    lambda caps: "gemm" if caps.matrix_tiles else "stream",
    lambda: timing.fp32_batch(PROMPT_ROWS, onednn=choose("linear.fp32_prompt") == "onednn"),
    margin=1.05,
)
declare(
    "linear.bf16_prompt",
    ("bf16", "upcast"),
    "A prompt's bf16 GEMM: as it is, or in float32 and rounded back, which wins where the "
    "CPU has no bf16 dot products (torch emulates them).",
    lambda caps: "bf16" if caps.bf16_dot else "upcast",
    timing.bf16_prompt,
)
declare(
    "linear.int8",
    INT8_KERNELS[:3],
    "The int8 kernel of quantized linears: attnkit's (streams the codes), fbgemm's dynamic "
    "linear, or torch's int8pack product (bf16 activations).",
    lambda caps: (
        "attnkit"
        if build.kernels_available()
        else "int8pack"
        if caps.matrix_tiles or not linear.fbgemm_engine()
        else "fbgemm"
    ),
    lambda: timing.int8(int8pack_takes),
    margin=1.1,
)
declare(
    "linear.int4",
    ("attnkit", "dequantize"),
    "The int4 kernel of quantized linears: attnkit's (packed nibbles, integer dots), or the "
    "float product with the dequantized weight where it cannot run.",
    lambda caps: "attnkit" if build.kernels_available() else "dequantize",
)
for _dtype, _batch in itertools.product((torch.float32, torch.bfloat16), (False, True)):
    declare(
        _compiled_step_choice(_dtype, _batch),
        ("fused", "graph"),
        f"A compiled decoding step of {'a left-padded batch' if _batch else 'one sequence'} "
        f"through a {str(_dtype).removeprefix('torch.')} stack that runs in one kernel call "
        "(attnkit.fused): that call (attnkit's kernels back to back, no compile) or the compiled "
        "graph (inductor's reductions for the rows where the policy chose them, which some CPUs "
        "read faster; a batch's padding attended with a mask); the faster step wins, as the "
        "caller asked for compiling.",
        lambda caps: "fused",
        functools.partial(timing.compiled_step, _dtype, COMPILED_STEP_BATCH if _batch else 1),
    )
for _bits, _rows in ((8, "2"), (4, "4")):
    declare(
        f"block_linear.q{_bits}_tile",
        tuple(str(t) for t in block_linear.TILE_ROWS),
        f"Weight rows the {_bits}-bit block kernel (GGUF's q{_bits} layouts) multiplies a "
        "pass: more reuse each loaded block of activations, fewer read fewer streams of "
        "codes at once, which some memory systems serve faster.",
        lambda caps, _rows=_rows: _rows,  # type: ignore[misc]
        functools.partial(timing.block_tiles, _bits),
        margin=1.03,
    )
declare(
    "rows.norm_row",
    ("torch", "kernel"),
    "An eager RMSNorm of one float32 row (a decoding step): three torch calls, or attnkit's "
    "row kernel, whose call can cost more than the row.",
    lambda caps: "torch",
    timing.norm_row,
)


_PLAN: LinearPlan | None = None
_PLAN_LOCK = threading.Lock()
#: The plan while tracing before any was decided: torch's kernels only.
_TRACED = LinearPlan(kernels=False)


def linear_plan(*, compiled: bool = False) -> LinearPlan:
    """The linear and row choices of this process, decided at the first call (measured choices
    at their first use on this machine, then read from the cache), and the kernels' wide dots
    switched as chosen. ``compiled`` also decides the compiled-row choices (compiled decoding
    asks so before it traces). While tracing it returns what was decided before."""
    global _PLAN
    plan = _PLAN
    if plan is not None and (plan.with_compiled or not compiled):
        return plan
    if torch.compiler.is_compiling():
        return _TRACED if plan is None else plan
    with _PLAN_LOCK:
        compiled = compiled or (plan is not None and plan.with_compiled)
        kernels = build.kernels_available()
        int8_wide = kernels and choose("linear.int8_dots") == "wide"
        if kernels:
            linear.float_wide_dots(choose("linear.float_dots") == "wide")
            linear.int8_wide_dots(int8_wide)
        compiled_row = frozenset(
            dtype
            for dtype in (torch.float32, torch.bfloat16)
            if compiled and kernels and choose(_compiled_row_choice(dtype)) == "kernel"
        )
        plan = LinearPlan(
            kernels=kernels,
            int8_wide=int8_wide,
            fp32_row=choose("linear.fp32_row") if kernels else "transposed",
            with_compiled=compiled,
            compiled_row=compiled_row,
            fp32_prompt_onednn=choose("linear.fp32_prompt") == "onednn",
            bf16_upcast=choose("linear.bf16_prompt") == "upcast",
            norm_row_kernel=kernels and choose("rows.norm_row") == "kernel",
            fp32_batch_stream=kernels and choose("linear.fp32_batch") == "stream",
        )
        _PLAN = plan
        return plan


def most_stream_rows(dtype: torch.dtype) -> int:
    """The most rows of a ``dtype`` product that attnkit's streaming kernel may take: those of a
    decoding step, fewer than :data:`PROMPT_ROWS`, and :data:`PROMPT_ROWS` themselves in a
    float32 product where ``linear.fp32_batch`` chose the stream (a full continuous batch's step
    of that many sequences). Eager and compiled products take the same rows, so a compiled
    model computes what the eager one does."""
    fp32_batch = dtype == torch.float32 and linear_plan().fp32_batch_stream
    return PROMPT_ROWS if fp32_batch else PROMPT_ROWS - 1


def stream_rows(dtype: torch.dtype, rows: int, *, compiled: bool = False) -> bool:
    """Whether a product of ``rows`` rows (at most :func:`most_stream_rows`) with ``dtype``
    weights runs attnkit's streaming kernel: bf16 and float32 where the kernels run, except an
    eager float32 row where ``linear.fp32_row`` chose MKL, and a compiled single row of a dtype
    ``linear.compiled_row.*`` left to inductor's reduction."""
    plan = linear_plan()
    if not plan.kernels or dtype not in (torch.bfloat16, torch.float32):
        return False
    if rows > most_stream_rows(dtype):
        return False
    if rows >= 2:
        return True
    if compiled:
        return dtype in plan.compiled_row
    return not (dtype == torch.float32 and plan.fp32_row == "transposed")


def weight_layout(dtype: torch.dtype, *, cpu: bool, compiled: bool, batch: int) -> str:
    """How a linear's weight is stored for decoding steps of ``batch`` sequences:
    ``"stream"`` (row-major, attnkit's kernel reads it) where CPU steps stream (a compiled step
    of one row may still run inductor's reduction over it), ``"transposed"`` (column-major,
    MKL's one-row product reads it as one stream) for other eager float32 CPU steps, else
    ``"linear"`` (as it is).

    Steps of ``batch`` sequences bring any number of rows up to ``batch`` (a continuous batch
    fills and drains), so a larger batch is laid out for the most rows that stream
    (:func:`most_stream_rows`): more rows run a blocked GEMM, which takes either layout."""
    rows = min(batch, most_stream_rows(dtype))
    rows = max(2, rows) if compiled else rows  # (a compiled single row reads row-major)
    if cpu and stream_rows(dtype, rows):
        return "stream"
    if cpu and not compiled and dtype == torch.float32:
        return "transposed"
    return "linear"


def compiled_row_kernel(dtype: torch.dtype) -> bool:
    """Whether one row of ``dtype`` in a compiled graph runs the kernel's op (else inductor's
    reduction): the ``linear.compiled_row.*`` choices, read from the plan decided before the
    trace."""
    return dtype in linear_plan().compiled_row


def fp32_prompt_onednn() -> bool:
    """Whether a prompt's float32 GEMM runs oneDNN's (choice ``linear.fp32_prompt``)."""
    return linear_plan().fp32_prompt_onednn


def bf16_prompt_upcast() -> bool:
    """Whether a prompt's bf16 GEMM runs in float32 (choice ``linear.bf16_prompt``)."""
    return linear_plan().bf16_upcast


def norm_row_kernel() -> bool:
    """Whether one eager float32 row's RMSNorm runs the row kernel (choice ``rows.norm_row``)."""
    return linear_plan().norm_row_kernel


@torch.compiler.assume_constant_result
def _matrix_tiles() -> bool:
    """The probe's answer, a constant to compiled graphs (which cannot trace the probe)."""
    return capabilities().matrix_tiles


def int8pack_takes(in_features: int) -> bool:
    """Whether ``torch._weight_int8pack_mm`` takes ``in_features`` inputs: multiples of 8 (it
    reads out of bounds otherwise), and of 16 on CPUs with matrix tiles, where its tile kernel
    crashed the process on bf16 activations of several rows otherwise."""
    return in_features % (16 if _matrix_tiles() else 8) == 0


def int8_kernel_name(name: str) -> str:
    """``name`` of an int8 kernel, a former name mapped to today's."""
    return INT8_KERNEL_ALIASES.get(name, name)


def int8_kernel(usable: tuple[str, ...] | list[str]) -> str:
    """The int8 kernel a quantized linear runs, of the ``usable`` ones (those that take its
    shape): the ``linear.int8`` choice where it is usable, else the first usable of the rule's
    order (attnkit, fbgemm where the CPU has no matrix tiles, int8pack), else ``"dequantize"``."""
    chosen = choose("linear.int8")
    if chosen in usable:
        return chosen
    order = ("attnkit",) if capabilities().matrix_tiles else ("attnkit", "fbgemm")
    for kernel in (*order, "int8pack"):
        if kernel in usable:
            return kernel
    return "dequantize"


def int8_kernel_rows(rows: int, *, compiling: bool) -> bool:
    """Whether an int8 product of ``rows`` rows runs attnkit's kernel (else the dequantized
    GEMM): up to :data:`INT8_KERNEL_ROWS` rows, and every row outside compiled graphs where the
    wide dots run."""
    return rows <= INT8_KERNEL_ROWS or (not compiling and linear_plan().int8_wide)


#: Most rows a block-quantized product (:mod:`attnkit.kernels.block_linear`) runs through its
#: kernel, which widens every weight block once per row; more rows widen the weight once into a
#: float block of rows and multiply it with the GEMM.
BLOCK_KERNEL_ROWS = 4


def block_kernel_rows(rows: int) -> bool:
    """Whether a block-quantized product of ``rows`` rows runs its kernel (else the float product
    of the dequantized weight, a block of output rows at a time): up to
    :data:`BLOCK_KERNEL_ROWS` rows, in compiled graphs (one op) and eager calls alike."""
    return rows <= BLOCK_KERNEL_ROWS


def block_tile_rows(bits: int) -> int:
    """Weight rows the block kernel of ``bits`` bits (8 or 4) multiplies a pass on this machine
    (one of :data:`attnkit.kernels.block_linear.TILE_ROWS`)."""
    return int(choose(f"block_linear.q{bits}_tile"))


def compiled_step_fuses(dtype: torch.dtype, batch: int = 1) -> bool:
    """Whether ``generate(compile=True)`` steps a fused stack of ``dtype`` activations by its
    one call, not a graph, for ``batch`` sequences (float32 and bf16; other dtypes do not
    fuse)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    return choose(_compiled_step_choice(dtype, batch > 1)) == "fused"


def int4_kernel() -> str:
    """The int4 kernel of quantized linears: ``"attnkit"`` or ``"dequantize"``."""
    return choose("linear.int4")


def _forget_plan() -> None:
    global _PLAN
    _PLAN = None


on_reset(_forget_plan)
