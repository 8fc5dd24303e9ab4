"""The candidates the policy times (:mod:`attnkit.kernels.policy`): for each measured choice, one
zero-argument call per option that runs here, on small shapes of the kind a small model's decoding
step multiplies (a 576-wide model's projections), each call walking enough copies of its weight
that they are read one after another, as a step's layers read theirs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.kernels import attention, block_linear, build, linear, rows
from attnkit.kernels.plans import TileKernels

__all__ = [
    "FLASH_BACKWARD_PRODUCTS",
    "bf16_backward",
    "bf16_causal",
    "bf16_prompt",
    "bf16_structured",
    "block_tiles",
    "compiled_row",
    "compiled_step",
    "flash_bf16_products",
    "fp32_prompt",
    "fp32_row",
    "int8",
    "norm_row",
    "provide_attention_kernel",
    "provide_decoding_steps",
]


def _kernels() -> bool:
    """Whether attnkit's C kernels run here (builds them the first time; never while tracing)."""
    if torch.compiler.is_compiling():
        return build.kernels_loaded()
    return build.kernels_available()


def _copies(make: Callable[[], torch.Tensor], total: int = 32 << 20) -> list[torch.Tensor]:
    """Enough copies of ``make()`` to fill ``total`` bytes (at least two): each timed call walks
    them all, one after another, as a decoding step walks its layers' weights."""
    first = make()
    count = max(2, total // max(first.numel() * first.element_size(), 1))
    return [first] + [first.clone() for _ in range(count - 1)]


def _walk(call: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for w in weights:
            call(w)

    return run


#: Rows of the float32 products :func:`fp32_row` times on each weight: a decoding step's one row
#: and a speculative round's few (the layout it chooses serves both).
FP32_ROW_ROWS = (1, 4)
#: Bytes of weights :func:`fp32_row` walks: past the last-level caches of most CPUs, so each
#: product reads its weight from memory, as a model's step does.
FP32_ROW_BYTES = 128 << 20


def fp32_row() -> dict[str, Callable[[], Any]]:
    """Float32 rows (:data:`FP32_ROW_ROWS`) times row-major weights through attnkit's stream,
    and times column-major ones through ``F.linear`` (MKL reads those as one stream too)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, 576, generator=gen) for rows in FP32_ROW_ROWS]
    rowmajor = _copies(lambda: torch.randn(1536, 576, generator=gen), FP32_ROW_BYTES)

    def each(product: Callable[[torch.Tensor, torch.Tensor], Any]) -> Callable[[Any], Any]:
        return lambda w: [product(x, w) for x in xs]

    calls: dict[str, Callable[[], Any]] = {
        "transposed": _walk(each(F.linear), [w.t().contiguous().t() for w in rowmajor])
    }
    if _kernels():
        calls["stream"] = _walk(each(linear.float_dot_linear), rowmajor)
    return calls


def fp32_batch(rows: int, *, onednn: bool) -> dict[str, Callable[[], Any]]:
    """``rows`` float32 rows (a full batch's decoding step) times row-major weights through the
    prompts' GEMM (oneDNN's where ``onednn``, else ``F.linear``) and through attnkit's stream."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=gen)
    weights = _copies(lambda: torch.randn(1536, 576, generator=gen))
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if onednn and op is not None and torch.backends.mkldnn.is_available():
        calls = {"gemm": _walk(lambda w: op(x, w, None, "none", [], ""), weights)}
    else:
        calls = {"gemm": _walk(lambda w: F.linear(x, w), weights)}
    if _kernels():
        calls["stream"] = _walk(lambda w: linear.float_dot_linear(x, w), weights)
    return calls


def block_tiles(bits: int) -> dict[str, Callable[[], Any]]:
    """One float32 row times ``bits``-bit block-quantized weights (groups of 32, a decoding
    step's shape), the kernel taking each count of :data:`block_linear.TILE_ROWS` weight rows a
    pass."""
    if not _kernels():
        return {}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 576, generator=gen)
    width = 576 if bits == 8 else 288
    codes = _copies(lambda: torch.randint(0, 16, (1536, width), generator=gen, dtype=torch.uint8))
    scales = (torch.rand(1536, 18, generator=gen) / 64).half()
    calls: dict[str, Callable[[], Any]] = {}
    for tile in block_linear.TILE_ROWS:
        weights = [
            block_linear.BlockWeight(
                c.view(torch.int8) if bits == 8 else c, scales, None, bits, tile
            )
            for c in codes
        ]
        calls[str(tile)] = functools.partial(
            lambda ws: [block_linear.block_product(x, w) for w in ws], weights
        )
    return calls


def compiled_row(dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """One row of ``dtype`` times weights in a compiled graph: the kernel's op against inductor's
    streaming reduction (what :func:`attnkit.decoding.linear` compiles for either)."""
    if not (_kernels() and build.load_ops()):
        return {}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 576, generator=gen).to(dtype)
    weights = _copies(lambda: torch.randn(1536, 576, generator=gen).to(dtype))

    def kernel(x: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.ops.attnkit.float_dot_linear(x, w, None) for w in ws]

    def reduction(x: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
        row = x.reshape(1, -1).float()
        row = torch.as_strided(row, row.shape, row.stride())  # (stored, as decoding stores it)
        return [(row.unsqueeze(1) * w).sum(-1, dtype=torch.float32).to(x.dtype) for w in ws]

    compiled = {
        name: torch.compile(fn, fullgraph=True, dynamic=False)
        for name, fn in (("kernel", kernel), ("reduction", reduction))
    }
    return {name: functools.partial(fn, x, weights) for name, fn in compiled.items()}


def fp32_prompt() -> dict[str, Callable[[], Any]]:
    """A prompt's float32 GEMM through ``F.linear`` (MKL) and through oneDNN's
    ``mkldnn._linear_pointwise`` (the kernel inductor's CPU linears call), on a small model's
    shape (a prompt of 256 tokens through a 576 -> 1536 projection)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    calls: dict[str, Callable[[], Any]] = {"mkl": lambda: F.linear(x, w)}
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is not None and torch.backends.mkldnn.is_available():
        calls["onednn"] = lambda: op(x, w, None, "none", [], "")
    return calls


def bf16_prompt() -> dict[str, Callable[[], Any]]:
    """A prompt's bf16 GEMM as it is, and in float32 (weight and rows widened, the result rounded
    back): the second wins on CPUs whose bf16 GEMM is emulated."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=gen).bfloat16()
    w = torch.randn(1536, 576, generator=gen).bfloat16()
    return {
        "bf16": lambda: F.linear(x, w),
        "upcast": lambda: F.linear(x.float(), w.float()).bfloat16(),
    }


def int8(int8pack: Callable[[int], bool]) -> dict[str, Callable[[], Any]]:
    """One row times int8 weights through each int8 kernel that runs here (``int8pack``: whether
    torch's int8pack kernel takes a number of inputs)."""
    gen = torch.Generator().manual_seed(0)
    n = out = 1536
    codes = _copies(
        lambda: torch.randint(-127, 128, (out, n), dtype=torch.int8, generator=gen), 16 << 20
    )
    scale = torch.rand(out, generator=gen) / 127
    x = torch.randn(1, n, generator=gen)
    calls: dict[str, Callable[[], Any]] = {}
    if _kernels():
        grouped = [linear.group_codes(c) for c in codes]
        calls["attnkit"] = _walk(lambda c: linear.int8_product(x, c, scale), grouped)
    if linear.fbgemm_engine():
        packed = [[linear.fbgemm_pack(c, scale)] for c in codes]
        empty = torch.empty(out, 0, dtype=torch.int8)
        scale_bf16 = scale.bfloat16()

        def fbgemm() -> None:
            for p in packed:
                linear.fbgemm_product(x, p, empty, scale, scale_bf16, int8pack_tail=False)

        calls["fbgemm"] = fbgemm
    if int8pack(n):
        xb, scale_bf16 = x.bfloat16(), scale.bfloat16()
        calls["int8pack"] = _walk(lambda c: torch._weight_int8pack_mm(xb, c, scale_bf16), codes)
    return calls


def norm_row() -> dict[str, Callable[[], Any]]:
    """One float32 row's RMSNorm as three torch calls, and through attnkit's row kernel."""
    gen = torch.Generator().manual_seed(0)
    x, weight, zero = (
        torch.randn(1, 576, generator=gen),
        torch.rand(576, generator=gen),
        torch.zeros(()),
    )

    def torch_row() -> torch.Tensor:
        norm = float(torch.linalg.vector_norm(x))
        return torch.addcmul(zero, x, weight, value=1.0 / (norm * norm / 576 + 1e-6) ** 0.5)

    calls: dict[str, Callable[[], Any]] = {"torch": lambda: [torch_row() for _ in range(64)]}
    if _kernels():
        calls["kernel"] = lambda: [rows.rms_norm(x, weight, 1e-6) for _ in range(64)]
    return calls


_ATTENTION_KERNELS: dict[str, Callable[..., Any]] = {}


def provide_attention_kernel(name: str, kernel: Callable[..., Any]) -> None:
    """Hand the policy an attention kernel to time (``"flash"``: attnkit's flash forward, the
    signature of :func:`attnkit.native.flash_attention`; ``"tiles"``: a causal window forward on
    torch's flash kernel in tiles, :func:`attnkit.sparse.window_tiles`)."""
    _ATTENTION_KERNELS[name] = kernel


_DECODING_STEPS: list[Callable[[torch.dtype, int], dict[str, Callable[[], Any]]]] = []


def provide_decoding_steps(
    steps: Callable[[torch.dtype, int], dict[str, Callable[[], Any]]],
) -> None:
    """Hand the policy the decoding steps to time for ``decoding.compiled_step.*``:
    ``steps(dtype, batch)`` returns a small model's step of ``batch`` sequences by its fused call
    (``"fused"``) and by its compiled graph (``"graph"``); the models sit above this package, so
    they hand it over at import."""
    _DECODING_STEPS[:] = [steps]


def compiled_step(dtype: torch.dtype, batch: int = 1) -> dict[str, Callable[[], Any]]:
    """A small model's decoding step of ``dtype`` for ``batch`` sequences by its fused call and
    by its compiled graph (see :func:`provide_decoding_steps`)."""
    if not _DECODING_STEPS:  # (not measured, nor cached, before attnkit.models is imported)
        raise LookupError("the models are not imported: import attnkit.models")
    return _DECODING_STEPS[0](dtype, batch)


def bf16_structured() -> dict[str, Callable[[], Any]]:
    """A bfloat16 sliding-window forward (window 256 over 1024 queries, 4 heads of 64) on
    attnkit's flash kernel and on torch's kernel in tiles of 64, 128 and 256 queries."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    calls: dict[str, Callable[[], Any]] = {}
    flash, tiles = _ATTENTION_KERNELS.get("flash"), _ATTENTION_KERNELS.get("tiles")
    if tiles is None:  # (not measured, nor cached, before attnkit.sparse is imported)
        raise LookupError("the attention kernels are not imported: import attnkit.functional")
    if flash is not None:
        calls["flash"] = lambda: flash(q, k, v, scale=0.125, causal=True, window=256)
    if tiles is not None:
        for rows in (64, 128, 256):
            calls[f"tiles-{rows}"] = functools.partial(tiles, q, k, v, rows=rows, window=256)
    return calls


def flash_bf16_products() -> dict[str, Callable[[], Any]]:
    """One bf16 causal forward (1024 queries, 4 heads of 64) of attnkit's flash kernel per tile
    product it can run here."""
    if not attention.flash_available():
        return {}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    usable = attention.flash_products()
    forward = functools.partial(attention.flash_attention, q, k, v, scale=0.125, causal=True)
    return {p: functools.partial(forward, products=p) for p in usable}


#: ``attention.bf16_backward``'s options on attnkit's flash kernels and the tile products each
#: runs with (its other option, ``"torch"``, is torch's kernel in tiles).
FLASH_BACKWARD_PRODUCTS = {
    "flash": "widened",
    "flash-bf16": "bf16",
    "flash-bf16-attnkit": "bf16-attnkit",
}


def bf16_backward() -> dict[str, Callable[[], Any]]:
    """A bfloat16 sliding-window forward and backward (window 256 over 1024 queries, 4 heads of
    64): attnkit's flash kernels as a causal window call runs them (where they run; widened, and
    with each bf16 product that runs here) and torch's flash kernel in tiles of 64 queries."""
    tiles, positional = _ATTENTION_KERNELS.get("tiles"), _ATTENTION_KERNELS.get("positional")
    if tiles is None or positional is None:  # (not measured, nor cached, before attnkit.sparse)
        raise LookupError("the attention kernels are not imported: import attnkit.functional")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    grad = torch.randn(1, 4, 1024, 64, generator=g).bfloat16()

    def forward_backward(attend: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # (gradients flow even where the choice is first asked under no_grad or inference mode)
        with torch.inference_mode(False), torch.enable_grad():
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attend(*leaves)
            return torch.autograd.grad(out, leaves, grad.clone())  # (those of q, k and v)

    torch_tiles = functools.partial(tiles, rows=64, window=256, kernels=TileKernels(False))
    calls: dict[str, Callable[[], Any]] = {
        "torch": functools.partial(forward_backward, torch_tiles)
    }
    if attention.flash_available():
        usable = attention.flash_products()
        for name, products in FLASH_BACKWARD_PRODUCTS.items():
            if products in usable:
                flash = functools.partial(positional, window=256, products=products)
                calls[name] = functools.partial(forward_backward, flash)
    return calls


def bf16_causal() -> dict[str, Callable[[], Any]]:
    """A bfloat16 causal forward (1024 queries, 4 heads of 64) on attnkit's flash kernel and on
    torch's fused kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    calls: dict[str, Callable[[], Any]] = {
        "torch": functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    }
    flash = _ATTENTION_KERNELS.get("flash")
    if flash is not None:
        calls["flash"] = functools.partial(flash, q, k, v, scale=0.125, causal=True)
    return calls
