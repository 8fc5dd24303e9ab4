"""Single-row products through every weight of a Llama-shaped model, per kernel and layout: the
measurement behind the weight layouts of cached decoding (``python -m attnkit.bench.decoding
--kernels``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import native

__all__ = ["layout_kernels", "layout_table"]


def layout_kernels(weight: Tensor) -> dict[str, Callable[[Tensor], Tensor]]:
    """Ways to compute ``F.linear(x, weight)`` for one row, each with the weight prepared once.

    ``"F.linear"`` uses the weight as is; ``"transposed (addmm)"`` keeps a contiguous
    ``(in, out)`` copy multiplied with ``torch.mm``; ``"oneDNN packed"`` reorders it into
    oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) applied with
    ``torch.ops.mkldnn._linear_pointwise``, the kernel inductor uses for frozen CPU linears
    (absent from torch builds without oneDNN); ``"stream"`` is attnkit's own kernel over the
    weight as is (:func:`attnkit.native.float_dot_linear`, where it is built).

    Args:
        weight: ``(out, in)`` weight.

    Returns:
        Name -> ``fn(x)`` with ``x`` of shape ``(N, in)`` -> ``(N, out)``.
    """
    weight = weight.detach()
    transposed = weight.t().contiguous()
    kernels: dict[str, Callable[[Tensor], Tensor]] = {
        "F.linear": lambda x: F.linear(x, weight),
        "transposed (addmm)": lambda x: torch.mm(x, transposed),
    }
    if native.kernels_available():
        kernels["stream"] = lambda x: native.float_dot_linear(x, weight)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    except (AttributeError, RuntimeError):  # a torch build without the op
        return kernels
    kernels["oneDNN packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
        x, packed, None, "none", [], ""
    )
    return kernels


def layout_table(
    *,
    dim: int = 768,
    hidden: int = 2048,
    layers: int = 12,
    vocab: int = 32000,
    kv_dim: int = 256,
    repeats: int = 7,
) -> list[dict[str, Any]]:
    """Single-row products through every weight of a Llama-shaped model, per kernel and layout.

    The measurement behind the weight layouts of cached decoding: one pass multiplies a row by
    each matrix of ``layers`` blocks (fused q/k/v, output, fused gate/up, down) and the head, with
    each kernel of :func:`layout_kernels` in fp32 (and bf16 where it converts nothing per call);
    passes of every variant are interleaved ``repeats`` times (medians). A ``sum`` over the fp32
    weights gives the pure read for reference.

    Returns:
        Rows with ``kernel``, ``seconds``, ``bytes_per_s`` and ``vs_f32_linear`` (speed ratio).
    """
    shapes = [(dim + 2 * kv_dim, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)] * layers
    shapes.append((vocab, dim))
    weights = [torch.randn(n, d) * 0.02 for n, d in shapes]
    rows32 = {d: torch.randn(1, d) for d in (dim, hidden)}
    rows16 = {d: x.bfloat16() for d, x in rows32.items()}
    per_weight = {
        torch.float32: [layout_kernels(w) for w in weights],
        torch.bfloat16: [layout_kernels(w.bfloat16()) for w in weights],
    }
    variants: dict[str, tuple[list[Callable[[Tensor], Tensor]], dict[int, Tensor]]] = {}
    for name, dtype, kernel in (
        ("f32 F.linear", torch.float32, "F.linear"),
        ("f32 transposed (addmm)", torch.float32, "transposed (addmm)"),
        ("f32 oneDNN packed", torch.float32, "oneDNN packed"),
        ("f32 stream (attnkit)", torch.float32, "stream"),
        ("bf16 F.linear", torch.bfloat16, "F.linear"),
        ("bf16 oneDNN packed", torch.bfloat16, "oneDNN packed"),
        ("bf16 stream (attnkit)", torch.bfloat16, "stream"),
    ):
        fns = [kernels[kernel] for kernels in per_weight[dtype] if kernel in kernels]
        if len(fns) == len(weights):
            variants[name] = (fns, rows16 if dtype == torch.bfloat16 else rows32)
    fp32_bytes = sum(w.numel() * 4 for w in weights)

    def run(name: str) -> None:
        if name == "f32 sum (read only)":
            for w in weights:
                w.sum()
            return
        fns, xs = variants[name]
        for w, fn in zip(weights, fns, strict=True):
            fn(xs[w.shape[1]])

    names = ["f32 sum (read only)", *variants]
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        run(n)
    for _ in range(repeats):
        for n in names:
            start = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - start)
    base = statistics.median(times["f32 F.linear"])
    out = []
    for n in names:
        t = statistics.median(times[n])
        nbytes = fp32_bytes // 2 if n.startswith("bf16") else fp32_bytes
        out.append(
            {"kernel": n, "seconds": t, "bytes_per_s": nbytes / t, "vs_f32_linear": base / t}
        )
    return out
