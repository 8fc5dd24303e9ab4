"""The linear and row choices of the policy: which kernel multiplies a linear (float, int8, int4,
block-quantized), whether a row kernel runs, and how a compiled decoding step runs
(docs/guide/kernels.md).

Decoding multiplies a weight by a few rows (one per sequence), so it reads every weight once per
token: the kernel that streams a weight nearest the memory bandwidth wins. A prompt multiplies it
by many rows, where a blocked GEMM wins. Which library streams best, which GEMM is faster, and
whether a compiled graph's single row is better served by attnkit's kernel (an op call) or by
inductor's own reduction differ from CPU to CPU: those choices are measured on small shapes of
the kind a small model's decoding step multiplies, the rest follow from the capabilities.
"""

from __future__ import annotations

import functools
import itertools
import threading

import torch

from attnkit.kernels import block_linear, build, linear, timing
from attnkit.kernels.plans import LinearPlan
from attnkit.kernels.probe import capabilities
from attnkit.kernels.tuning import choose, declare, on_reset

__all__ = [
    "BLOCK_KERNEL_ROWS",
    "COMPILED_STEP_BATCH",
    "INT8_KERNELS",
    "INT8_KERNEL_ALIASES",
    "INT8_KERNEL_ROWS",
    "PROMPT_ROWS",
    "bf16_prompt_upcast",
    "block_kernel_rows",
    "block_tile_rows",
    "compiled_row_kernel",
    "compiled_step_fuses",
    "fp32_prompt_onednn",
    "int4_kernel",
    "int8_kernel",
    "int8_kernel_name",
    "int8_kernel_rows",
    "int8pack_takes",
    "linear_plan",
    "most_stream_rows",
    "norm_row_kernel",
    "stream_rows",
    "weight_layout",
]


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
    margin=1.05,
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
