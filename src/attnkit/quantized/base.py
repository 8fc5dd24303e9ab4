"""What the quantized linears share: how they hold codes, finish a product, and describe
themselves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["GROUP_SIZES"]

#: The group sizes (inputs sharing a scale) of int4 and block layouts.
GROUP_SIZES = (256, 128, 64, 32)


def _finish(layer: Any, y: Tensor, x: Tensor, shape: torch.Size) -> Tensor:
    """A quantized layer's rows ``y`` in the input's dtype, its bias added, the input's shape."""
    y = y.to(x.dtype)
    if layer.bias is not None:
        y = y + layer.bias.to(x.dtype)
    return y.reshape(*shape[:-1], layer.out_features)


def _frozen(t: Tensor) -> nn.Parameter:
    """``t`` (not copied) as a parameter without gradients: how quantized layers hold their codes
    and scales. A compiled step checks a parameter's guards only where they tell graphs apart, a
    buffer's on every call (dynamo's rule), a share of a small model's step. torchao's quantized
    weights are parameters too."""
    return nn.Parameter(t, requires_grad=False)


def _describe(layer: Any, kind: str) -> str:
    return (
        f"in_features={layer.in_features}, out_features={layer.out_features}, "
        f"bias={layer.bias is not None}, {kind}"
    )


def _by_row_blocks(x: Tensor, out: int, n: int, block: Callable[[int, int], Tensor]) -> Tensor:
    """``(rows, out)`` float32 product of ``x`` filled a block of output rows at a time:
    ``block(start, stop)`` gives the columns ``start:stop``, made from about 1 MiB of float
    weight (whole groups of four rows, the kernels' order) while it is in cache."""
    step = max(4, (1 << 20) // (4 * n) // 4 * 4)
    y = x.new_empty(x.shape[0], out)
    for start in range(0, out, step):
        y[:, start : start + step] = block(start, min(start + step, out))
    return y
