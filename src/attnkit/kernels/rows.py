"""attnkit's row kernels for a forward pass's row-wise steps (``csrc/rows.c``), which torch runs
as several passes through fresh tensors (fresh memory is what an eager prefill pays most for on
a CPU: page faults):

* :func:`rms_norm`: a row's sum of squares, then its scaled product, in float32 for bf16 rows
  too, where torch's composite makes a float32 copy, its square, the mean, the scale and the
  cast back;
* :func:`rotate`: queries or keys rotated in float32 and rounded once, where torch's form
  (:func:`attnkit.positional.apply_rope`) makes a float32 copy, the product with the cosines,
  the partner's product with the sines, and the cast back.

Which inputs run them is the policy's choice (:mod:`attnkit.kernels.policy`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels.build import library, require_cpu

__all__ = ["rms_norm", "rotate"]


def _row_dtype(name: str, *tensors: Tensor) -> bool:
    """Whether the tensors are bf16 (else float32); a TypeError for other or mixed dtypes."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16}:
        raise TypeError(
            f"{name} takes float32 or bfloat16 tensors of one dtype, got "
            f"{[str(t.dtype) for t in tensors]}"
        )
    return tensors[0].dtype == torch.bfloat16


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` along the last dim, in float32 (bf16 rows are
    widened, and the result rounded once), as a new contiguous tensor.

    The same function as ``F.rms_norm(x, (D,), weight, eps)``, up to the rounding of another
    summation order: torch's CPU composite makes about ten passes through fresh tensors, this
    reads each row twice from cache and writes it once. For eager inference (no gradient).

    Args:
        x: ``(..., D)`` float32 or bfloat16 on the CPU, rows contiguous.
        weight: ``(D,)`` of ``x``'s dtype, or ``None``.
        eps: Added to the mean square.

    Raises:
        TypeError: For other dtypes or mixed ones.
        ValueError: For a weight of another size, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    D = x.shape[-1] if x.dim() else 0
    bf16 = _row_dtype("rms_norm", *(x,) if weight is None else (x, weight))
    if x.dim() < 1 or (weight is not None and weight.shape != (D,)):
        raise ValueError(
            f"rms_norm needs x (..., D) and a weight (D,), got x {tuple(x.shape)} and weight "
            f"{None if weight is None else tuple(weight.shape)}"
        )
    require_cpu("rms_norm", x, *(() if weight is None else (weight,)))
    lib = library()
    x = x if x.stride(-1) == 1 or D <= 1 else x.contiguous()
    flat = x.reshape(-1, D) if x.numel() else x.new_empty(0, D)  # (a view for strided rows)
    weight = None if weight is None else weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if flat.numel():
        lib.attnkit_rms_norm(
            flat.data_ptr(),
            flat.shape[0],
            D,
            flat.stride(0) if flat.shape[0] > 1 else D,
            None if weight is None else weight.data_ptr(),
            out.data_ptr(),
            float(eps),
            int(bf16),
            torch.get_num_threads(),
        )
    return out


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor, *, interleaved: bool) -> Tensor:
    """Rotary positions: ``x * cos + partner(x) * signed_sin`` (see
    :func:`attnkit.positional.apply_rope`) in float32, each product and the sum rounded (as
    torch's vector kernels round them), then once to ``x``'s dtype, as a new contiguous tensor.
    For eager inference (no gradient).

    Args:
        x: ``(B, H, L, E)``, ``(H, L, E)`` or ``(L, E)`` float32 or bfloat16 on the CPU, any
            strides with a contiguous last dim (heads split out of a fused projection are a view).
        cos: Float32 full-width rows ``(L, E)`` shared by every sequence, or ``(B, 1, L, E)``.
        signed_sin: Like ``cos``.
        interleaved: Pairs are adjacent channels (else the two halves).

    Raises:
        TypeError: For dtypes other than these.
        ValueError: For shapes that do not fit, an odd ``E``, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    if x.dtype not in (torch.float32, torch.bfloat16) or {cos.dtype, signed_sin.dtype} != {
        torch.float32
    }:
        raise TypeError(
            f"rotate takes float32 or bfloat16 x and float32 tables, got x {x.dtype}, "
            f"cos {cos.dtype}, signed_sin {signed_sin.dtype}"
        )
    if not 2 <= x.dim() <= 4:
        raise ValueError(f"rotate takes x (B, H, L, E), (H, L, E) or (L, E), got {tuple(x.shape)}")
    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x
    B, H, L, E = x4.shape
    shared = cos.shape == (L, E)
    if (
        E % 2
        or cos.shape != signed_sin.shape
        or not (shared or cos.shape == (B, 1, L, E))
        or x4.stride(-1) != 1
    ):
        raise ValueError(
            f"rotate needs x (B, H, L, E) with an even, contiguous last dim and tables (L, E) or "
            f"(B, 1, L, E), got x {tuple(x.shape)} strides {x.stride()}, cos {tuple(cos.shape)}, "
            f"signed_sin {tuple(signed_sin.shape)}"
        )
    require_cpu("rotate", x, cos, signed_sin)
    lib = library()
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if out.numel():
        lib.attnkit_rotate(
            x4.data_ptr(),
            B,
            H,
            L,
            E,
            *x4.stride()[:3],
            cos.data_ptr(),
            signed_sin.data_ptr(),
            0 if shared else L * E,
            out.data_ptr(),
            int(interleaved),
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
    return out
