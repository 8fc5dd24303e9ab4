"""Every kernel for one row times one weight matrix, timed as a decode step reads its weights.

:func:`kernel_rows` times every way to multiply one row by each weight matrix of a model (fp32
and bf16 ``F.linear``, the int8 kernels of :class:`attnkit.quantize.Int8Linear` and others,
attnkit's int4 kernel and torch's at each group size, the latter with bf16 and float32
activations), each weight read from memory (a decode step reads each weight once), with its
error against the float64 product of the dequantized weight.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.config import TransformerConfig
from attnkit.models import TransformerLM
from attnkit.profiling import time_calls

__all__ = ["kernel_rows", "model_matrices"]


def model_matrices(config: TransformerConfig) -> dict[str, tuple[int, int]]:
    """``{name: (in_features, out_features)}`` of the linears of a :class:`TransformerLM` of
    ``config`` (the output head counted as a linear over the embedding)."""
    with torch.device("meta"):
        model = TransformerLM(config.replace(num_layers=1))
    out = {
        name.rpartition(".")[2]: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
    if "lm_head" not in out:
        out["lm_head"] = (config.dim, config.vocab_size or 0)
    return out


def _fbgemm(x: Tensor, packed: Any) -> Tensor:
    return torch.ops.quantized.linear_dynamic(x, packed, True)


def _dequantize_into(x: Tensor, codes: Tensor, scale: Tensor, buffer: Tensor) -> Tensor:
    torch.mul(codes, scale[:, None], out=buffer)
    return F.linear(x, buffer)


def _int_mm(x: Tensor, codes_t: Tensor, scale: Tensor) -> Tensor:
    size = x.abs().amax(-1, keepdim=True) / 127
    xq = (x / size).round_().to(torch.int8)
    return torch._int_mm(xq, codes_t).float() * size * scale


def _int4(x: Tensor, packed: Tensor, group: int, scales_and_zeros: Tensor) -> Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)


Kernel = tuple[Callable[..., Tensor], Tensor, tuple[Any, ...], Tensor]


def _kernels(weight: Tensor, x: Tensor) -> dict[str, Kernel]:
    """Every candidate kernel for one row ``x`` times ``weight``: ``(call, the row as the kernel
    takes it, the weight's parts, float64 reference)``; ``call(row, *parts)`` is the product and
    the reference is the row, rounded as the kernel rounds it, times the weight the kernel
    multiplies by (in float64)."""
    from attnkit.native import (
        group_codes,
        int4_dot_linear,
        int8_dot_linear,
        round_activations,
        unpack_int4,
        unpack_int4_scales,
    )
    from attnkit.quantize import Int4Linear, Int8Linear, int8_kernels
    from attnkit.quantized.int8 import _fbgemm_pack

    out_features, in_features = weight.shape
    x64, xb = x.double(), x.bfloat16()
    xb64 = xb.double()
    out: dict[str, Kernel] = {"fp32 F.linear": (F.linear, x, (weight,), x64 @ weight.double().T)}
    wb = weight.bfloat16()
    out["bf16 F.linear"] = (F.linear, xb, (wb,), xb64 @ wb.double().T)
    q = Int8Linear.from_weight(weight, kernel="dequantize")
    deq = q.dequantize().double()
    usable = int8_kernels(in_features)
    for name in usable:
        if name not in _LABELS:  # attnkit's own kernel, whatever the policy names it
            ref = round_activations(x).double() @ deq.T
            grouped = (group_codes(q.weight_int8), q.scale)
            out[_label(name)] = (int8_dot_linear, x, grouped, ref)
    if "fbgemm" in usable:
        scale, zero = torch._choose_qparams_per_tensor(x, True)
        xq = ((x64 / scale).round() + zero).clamp(0, 127)
        ref = ((xq - zero) * scale) @ deq.T
        packed = _fbgemm_pack(q.weight_int8, q.scale)
        out["int8 fbgemm (7-bit activations)"] = (_fbgemm, x, (packed,), ref)
    if "int8pack" in usable:
        mm = torch._weight_int8pack_mm
        parts: tuple[Any, ...] = (q.weight_int8, q.scale_bf16)
        out["int8 int8pack, bf16 activations"] = (mm, xb, parts, xb64 @ deq.T)
        with contextlib.suppress(RuntimeError):  # (a build that takes bf16 only)
            mm(x, q.weight_int8, q.scale)
            parts = (q.weight_int8, q.scale)
            out["int8 int8pack, fp32 activations"] = (mm, x, parts, x64 @ deq.T)
    buffer = torch.empty(out_features, in_features)
    parts = (q.weight_int8, q.scale, buffer)
    out["int8 dequantize into a buffer + F.linear"] = (_dequantize_into, x, parts, x64 @ deq.T)
    with contextlib.suppress(RuntimeError):  # (builds without a CPU int8 matmul)
        _int_mm(x, q.weight_int8.t(), q.scale)
        size = x64.abs().amax(-1, keepdim=True) / 127
        ref = (x64 / size).round() * size @ deq.T
        parts = (q.weight_int8.t(), q.scale)
        out["int8 _int_mm (8-bit activations per row)"] = (_int_mm, x, parts, ref)
    for group in (32, 64, 128, 256):
        if in_features % group:
            continue
        layer = Int4Linear.from_weight(weight, group_size=group)
        deq4 = layer.dequantize().double()
        if layer.kernel == "int4":
            parts = (layer.codes, layer.scales, out_features)
            ref = round_activations(x).double() @ deq4.T
            out[f"int4 g{group} attnkit (int8 activations per 32)"] = (
                int4_dot_linear,
                x,
                parts,
                ref,
            )
        if out_features % 16:
            continue
        # torch's kernel on the same codes: w = (q - 8) * scale + zero.
        codes = unpack_int4(layer.codes, out_features, torch.int32)
        step, low = unpack_int4_scales(layer.scales, out_features)
        zero4 = (low + 8 * step).bfloat16()
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = torch.stack([step.bfloat16().t(), zero4.t()], dim=-1).contiguous()
        groups = (codes.double() - 8).view(out_features, -1, group)
        deq_t = (groups * step.double()[..., None] + zero4.double()[..., None]).flatten(1)
        out[f"int4 g{group} torch, bf16 activations"] = (
            _int4,
            xb,
            (packed4, group, sz),
            xb64 @ deq_t.T,
        )
        with contextlib.suppress(RuntimeError):
            _int4(x, packed4, group, sz.float())
            parts = (packed4, group, sz.float())
            out[f"int4 g{group} torch, fp32 activations"] = (_int4, x, parts, x64 @ deq_t.T)
    return out


def _weight_bytes(kernel: str, in_features: int, out_features: int) -> float:
    """Bytes of the weight a kernel reads: 4, 2, 1 or 1/2 a weight by its name's precision."""
    per = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}[kernel.split()[0]]
    return per * in_features * out_features


def _run_copies(call: Callable[..., Tensor], row: Tensor, copies: list[tuple[Any, ...]]) -> None:
    for parts in copies:
        call(row, *parts)


# The kernel_rows label of each of torch's Int8Linear kernels; attnkit's own is _label's.
_LABELS = {
    "fbgemm": "int8 fbgemm (7-bit activations)",
    "int8pack": "int8 int8pack, bf16 activations",
    "dequantize": "int8 dequantize into a buffer + F.linear",
}


def _label(kernel: str) -> str:
    """The kernel_rows label of the :class:`attnkit.quantize.Int8Linear` kernel ``kernel``."""
    return _LABELS.get(kernel, f"int8 {kernel} (attnkit, int8 activations per 32)")


@torch.no_grad()
def kernel_rows(
    matrices: dict[str, tuple[int, int]],
    *,
    rounds: int = 5,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Seconds per one-row product of each kernel on each ``{name: (in, out)}`` matrix.

    Timed the way :func:`attnkit.quantize.int8_kernel_seconds` times the int8 kernels: one call
    on each of enough copies of the weight to fill 1.5x the last-level cache (32 copies at most),
    so each reads its weight from memory, one after another, as the layers of a decode step do;
    all kernels of a matrix interleaved over ``rounds`` rounds, medians. Random weights (speed
    does not depend on their values).

    Returns:
        One row per matrix and kernel: ``matrix``, ``shape`` (in, out), ``kernel``,
        ``seconds``, ``vs_fp32`` (fp32 ``F.linear``'s time over this one's), ``bytes_per_s``
        (the weight's bytes at the kernel's precision over the time), ``relative_error``
        (largest absolute difference from the float64 reference, over the reference's largest
        magnitude),
        ``chosen`` (the kernel :func:`attnkit.quantize.choose_int8_kernel` takes for the
        shape), ``is_choice`` (this row is that kernel).
    """
    from attnkit.quantize import choose_int8_kernel, last_level_cache_bytes

    say = progress or (lambda _msg: None)
    fill = 3 * last_level_cache_bytes() // 2
    rows = []
    for name, (in_features, out_features) in matrices.items():
        say(f"kernels: {name} ({in_features} -> {out_features})")
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
        x = torch.randn(1, in_features, generator=gen)
        kernels = _kernels(weight, x)
        size = {k: _weight_bytes(k, in_features, out_features) for k in kernels}
        copies = {
            k: [parts] + [copy.deepcopy(parts) for _ in range(min(32, -int(-fill // size[k])) - 1)]
            for k, (_, _, parts, _) in kernels.items()
        }
        runs = {
            k: functools.partial(_run_copies, kernels[k][0], kernels[k][1], copies[k])
            for k in kernels
        }
        seconds = time_calls(runs, rounds=rounds)
        chosen = choose_int8_kernel(in_features, out_features)
        for kernel, took in seconds.items():
            call, row, parts, ref = kernels[kernel]
            took /= len(copies[kernel])
            err = (call(row, *parts).double() - ref).abs().max() / ref.abs().max()
            rows.append(
                {
                    "matrix": name,
                    "shape": [in_features, out_features],
                    "kernel": kernel,
                    "seconds": took,
                    "vs_fp32": seconds["fp32 F.linear"] / len(copies["fp32 F.linear"]) / took,
                    "bytes_per_s": size[kernel] / took,
                    "relative_error": float(err),
                    "chosen": chosen,
                    "is_choice": kernel == _label(chosen),
                }
            )
        del copies, kernels
    return rows
