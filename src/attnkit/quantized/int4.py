"""Weight-only int4 linears: an asymmetric bf16 scale and offset per group of inputs, multiplied
by attnkit's int4 kernel with the activations rounded to int8."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.decoding import linear
from attnkit.kernels import policy
from attnkit.kernels.linear import (
    int4_dot_linear,
    int4_product,
    pack_int4,
    pack_int4_scales,
    round_activations,
    rows_per_block,
    unpack_int4,
    unpack_int4_scales,
)
from attnkit.quantized.base import GROUP_SIZES, _by_row_blocks, _describe, _finish, _frozen

__all__ = ["Int4Linear"]


class Int4Linear(nn.Module):
    """A linear whose weight is int4, with a bf16 scale and offset per group of input channels.

    Within each group of ``group_size`` inputs of a row, ``weight ≈ q * scale + offset`` with ``q``
    in ``0..15`` (asymmetric: ``offset`` the group's smallest weight, ``scale = (max - min) / 15``,
    both rounded to bf16 before ``q`` is chosen). The codes are packed two to a byte in the order
    attnkit's int4 kernel reads them (``codes``, :func:`attnkit.kernels.linear.pack_int4`; the rows
    rounded up to a multiple of four), the scales and offsets beside (``scales``,
    :func:`attnkit.kernels.linear.pack_int4_scales`). Build it with :meth:`from_linear`; CPU only.

    Products without gradients (decoding steps and prompts) multiply through
    :func:`attnkit.kernels.linear.int4_dot_linear` (activations rounded to int8 per block of 32
    inputs, as the int8 kernel rounds them), prompts too: it reads the packed codes once, where
    dequantizing makes a float copy of the weight. Products gradients
    flow through multiply the dequantized weight by the activations rounded the same way (the
    gradient passes straight through the rounding), a block of rows at a time. Where attnkit's
    kernels cannot run, every product is the float one with the dequantized weight.

    Shape: ``(*, in_features) -> (*, out_features)``, in the input's dtype.
    """

    codes: Tensor
    scales: Tensor

    def __init__(self, in_features: int, out_features: int, group_size: int) -> None:
        super().__init__()
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
        if in_features % group_size:
            raise ValueError(
                f"in_features={in_features} is not a multiple of group_size={group_size}"
            )
        self.in_features, self.out_features, self.group_size = (
            in_features,
            out_features,
            group_size,
        )
        rows = -(-out_features // 4) * 4
        # Parameters without gradients, as Int8Linear's codes (see _frozen).
        self.codes = _frozen(torch.zeros(rows, in_features // 2, dtype=torch.uint8))
        groups = in_features // group_size
        self.scales = _frozen(torch.zeros(rows // 4, groups * 8, dtype=torch.bfloat16))
        self.bias: nn.Parameter | None = None
        self.kernel = "int4" if policy.int4_kernel() == "attnkit" else "dequantize"

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: Tensor, bias: Tensor | None = None, *, group_size: int = 128
    ) -> Int4Linear:
        """Quantize ``weight`` ``(out, in)`` group-wise; ``in`` must be a multiple of
        ``group_size`` (one of 32, 64, 128, 256)."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"Int4Linear needs a 2-D float weight, got shape {tuple(weight.shape)} "
                f"and dtype {weight.dtype}"
            )
        if weight.device.type != "cpu":
            raise ValueError(f"Int4Linear runs on CPU only, got a weight on {weight.device}")
        out_features, in_features = weight.shape
        with torch.device("meta"):  # (checks the sizes; the tensors are replaced)
            new = cls(in_features, out_features, group_size)
        n_groups = in_features // group_size
        scale = torch.empty(out_features, n_groups)
        offset = torch.empty(out_features, n_groups)
        packed = torch.empty(-(-out_features // 4) * 4, in_features // 2, dtype=torch.uint8)
        # A block of rows (whole groups of four) at a time: the float temporaries and the
        # unpacked codes stay small.
        step = max(4, rows_per_block(in_features) // 4 * 4)
        for start in range(0, out_features, step):
            rows = slice(start, start + step)
            groups = weight[rows].to(torch.float32, copy=True).reshape(-1, n_groups, group_size)
            low, high = groups.amin(-1), groups.amax(-1)
            # Rounded to bf16 (what the kernel reads) before q is chosen.
            s = ((high - low) / 15).clamp(min=1e-6).bfloat16().float()
            m = low.bfloat16().float()
            scale[rows], offset[rows] = s, m
            q = groups.sub_(m[..., None]).div_(s[..., None]).round_().clamp_(0, 15)
            codes = pack_int4(q.reshape(-1, in_features).to(torch.uint8))
            packed[start : start + len(codes)] = codes
        new.codes = _frozen(packed)
        new.scales = _frozen(pack_int4_scales(scale, offset))
        new.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        return new

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = 128) -> Int4Linear:
        """Quantize ``linear``'s weight; its bias is kept as it is."""
        return cls.from_weight(linear.weight, linear.bias, group_size=group_size)

    def _weight_rows(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` (multiples of four, or the end) of the float32 weight."""
        out = min(stop, self.out_features) - start
        codes = unpack_int4(self.codes[start : -(-stop // 4) * 4], out, torch.float32)
        scale, offset = unpack_int4_scales(self.scales[start // 4 : -(-stop // 4)], out)
        groups = codes.view(out, -1, self.group_size)
        return groups.mul_(scale[..., None]).add_(offset[..., None]).view(out, -1)

    def dequantize(self) -> Tensor:
        """The float32 weight this module computes with. Shape: ``(out, in)``."""
        return self._weight_rows(0, self.out_features)

    def _product(self, x: Tensor) -> Tensor:
        """``x @ W.T`` a block of output rows at a time: each block's float weight (about
        1 MiB) is made and multiplied while it is in cache (by
        :func:`attnkit.decoding.linear`: oneDNN's GEMM where it is the faster)."""

        def block(start: int, stop: int) -> Tensor:
            return linear(x, self._weight_rows(start, stop))

        return _by_row_blocks(x, self.out_features, self.in_features, block)

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(*, in) -> (*, out)``."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "int4" and not x2.requires_grad:  # (decoding steps and prompts)
            xf = x2.float()
            if torch.compiler.is_compiling():  # (one opaque op of the graph)
                y = torch.ops.attnkit.int4_dot_linear(
                    xf, self.codes, self.scales, self.out_features
                )
            elif self.scales.dtype == torch.bfloat16:  # (the layer holds the kernel's shapes)
                y = int4_product(xf.contiguous(), self.codes, self.scales, self.out_features)
            else:  # (cast scales, e.g. after .half(): the checks name them)
                y = int4_dot_linear(xf, self.codes, self.scales, self.out_features)
        elif self.kernel == "int4":
            # A product gradients flow through: the float product of the activations rounded
            # as the kernel rounds them (the kernel's result up to float32 summation order).
            rounded = round_activations(x2)
            if x2.requires_grad:  # (straight through the rounding: the float product's gradient)
                rounded = x2.float() + (rounded - x2.float()).detach()
            y = self._product(rounded)
        else:
            y = F.linear(x2, self.dequantize().to(x2.dtype))
        return _finish(self, y, x, shape)

    def extra_repr(self) -> str:
        return _describe(self, f"int4 group_size={self.group_size}")
