"""Block-quantized linears in GGUF's layouts: ``q8_0``, ``q4_0`` and ``q4_1``.

Each group of ``group_size`` inputs of a weight row (32 in GGUF's files) has its own f16 scale:

=========  ========================================================================
``q8_0``   int8 codes, ``w = d * q`` with ``d = max|w| / 127``
``q4_0``   4-bit codes, symmetric: ``w = d * (q - 8)`` with ``d = -max_abs_signed / 8``
``q4_1``   4-bit codes, asymmetric: ``w = d * q + m``, ``m`` the group's minimum,
           ``d = (max - min) / 15``
=========  ========================================================================

The scales (and minimums) are rounded to f16 before the codes are chosen, as llama.cpp rounds
them, so a layer quantized here and a GGUF tensor of the same layout hold the same kind of values,
and a GGUF tensor's blocks load into a :class:`BlockLinear` as they are
(:meth:`BlockLinear.from_codes`): no dequantizing and quantizing again.

Products of a few rows without gradients (decoding steps) run
:func:`attnkit.kernels.block_linear.block_dot_linear`: float32 activations, each block of codes
widened to floats in the kernel, float32 sums; the result is the float product of the dequantized
weight up to summation order. More rows (a prompt; :func:`attnkit.kernels.policy.block_kernel_rows`
decides) multiply the dequantized weight a block of output rows at a time.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.decoding import linear
from attnkit.kernels import policy
from attnkit.kernels.block_linear import (
    BLOCK,
    BlockWeight,
    block_product,
    pack_nibbles,
    unpack_nibbles,
)
from attnkit.kernels.build import kernels_available
from attnkit.kernels.linear import round_activations
from attnkit.quantized.base import GROUP_SIZES, _by_row_blocks, _describe, _finish, _frozen

__all__ = ["ACTIVATIONS", "BLOCK_LAYOUTS", "BlockLayout", "BlockLinear", "set_activations"]

BlockLayout = Literal["q8_0", "q4_0", "q4_1"]
#: How a :class:`BlockLinear` takes its activations: ``"float"`` as they are (exact: the float
#: product of the dequantized weight), ``"int8"`` rounded per block of 32 for integer dots
#: (faster where integer dots outrun float ones, less exact).
ACTIVATIONS = ("float", "int8")
#: The block layouts, by GGUF's names.
BLOCK_LAYOUTS: tuple[BlockLayout, ...] = ("q8_0", "q4_0", "q4_1")


def _check_layout(layout: str, group_size: int, in_features: int) -> None:
    if layout not in BLOCK_LAYOUTS:
        raise ValueError(f"layout must be one of {BLOCK_LAYOUTS}, got {layout!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}")


def quantize_groups(
    weight: Tensor, layout: BlockLayout, group_size: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(codes, scales, offsets)`` of ``weight`` ``(out, in)`` in ``layout``: codes int8
    ``(out, in)`` or 4-bit values ``(out, in)`` uint8 (unpacked), f16 scales and (``q4_1``)
    offsets ``(out, in // group_size)``."""
    out, n = weight.shape
    groups = weight.detach().to(torch.float32).reshape(out, n // group_size, group_size)
    offsets = None
    if layout == "q8_0":
        scales = (groups.abs().amax(-1) / 127).half()
        s = scales.float()[..., None]
        q = torch.where(s > 0, groups / s, 0).round_().clamp_(-127, 127).to(torch.int8)
    elif layout == "q4_0":
        # The weight of largest magnitude, with its sign, maps to code 0 (-8 * d).
        at = groups.abs().argmax(-1, keepdim=True)
        scales = (groups.gather(-1, at).squeeze(-1) / -8).half()
        s = scales.float()[..., None]
        q = torch.where(s != 0, groups / s, 0).round_().add_(8).clamp_(0, 15).to(torch.uint8)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        scales, offsets = ((high - low) / 15).half(), low.half()
        s = scales.float()[..., None]
        shifted = groups - offsets.float()[..., None]
        q = torch.where(s > 0, shifted / s, 0).round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(out, n), scales, offsets


class BlockLinear(nn.Module):
    """A linear whose weight is block-quantized (``q8_0``, ``q4_0`` or ``q4_1``; see the module's
    docstring), with f16 scales (and ``q4_1`` minimums) per group of ``group_size`` inputs.

    ``codes`` holds int8 codes ``(out, in)`` (``q8_0``) or 4-bit codes packed two to a byte in
    ggml's order ``(out, in // 2)``; ``scales`` and ``offsets`` (``q4_1``; ``None`` otherwise) are
    ``(out, in // group_size)`` f16. Build it with :meth:`from_linear`, :meth:`from_weight` or,
    from codes quantized elsewhere (a GGUF file), :meth:`from_codes`. CPU kernels; other devices
    multiply the dequantized weight.

    Shape: ``(*, in_features) -> (*, out_features)``, in the input's dtype.

    Raises:
        ValueError: An unknown ``layout``, a ``group_size`` not in 32, 64, 128, 256, or
            ``in_features`` not a multiple of it.
    """

    codes: Tensor
    scales: Tensor
    offsets: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        layout: BlockLayout = "q8_0",
        group_size: int = BLOCK,
        bias: bool = False,
    ) -> None:
        super().__init__()
        _check_layout(layout, group_size, in_features)
        self.in_features, self.out_features = in_features, out_features
        self.layout, self.group_size = layout, group_size
        self.bits = 8 if layout == "q8_0" else 4
        dtype = torch.int8 if self.bits == 8 else torch.uint8
        width = in_features * self.bits // 8
        groups = in_features // group_size
        # Parameters without gradients (see attnkit.quantized.base._frozen).
        self.codes = _frozen(torch.zeros(out_features, width, dtype=dtype))
        self.scales = _frozen(torch.zeros(out_features, groups, dtype=torch.float16))
        self.offsets = (
            _frozen(torch.zeros(out_features, groups, dtype=torch.float16))
            if layout == "q4_1"
            else None
        )
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernel = "block" if kernels_available() else "dequantize"
        self.activations = "float"  # (see ACTIVATIONS and set_activations)

    @classmethod
    def from_codes(
        cls,
        codes: Tensor,
        scales: Tensor,
        offsets: Tensor | None = None,
        bias: Tensor | None = None,
        *,
        layout: BlockLayout,
    ) -> BlockLinear:
        """The layer holding ``codes``, ``scales`` and ``offsets`` as they are (not copied): int8
        ``(out, in)`` for ``q8_0``, packed ``(out, in // 2)`` uint8 (ggml's nibble order) for the
        4-bit layouts; f16 ``(out, groups)`` scales and (``q4_1`` only) offsets.

        Raises:
            ValueError: Codes, scales or offsets that do not fit ``layout`` (naming their
                shapes and dtypes).
        """
        bits = 8 if layout == "q8_0" else 4
        want = torch.int8 if bits == 8 else torch.uint8
        out = codes.shape[0] if codes.dim() == 2 else -1
        n = codes.shape[1] * 8 // bits if codes.dim() == 2 else -1
        groups = scales.shape[1] if scales.dim() == 2 else 0
        fits = (
            codes.dtype == want
            and scales.dtype == torch.float16
            and scales.shape[0] == out
            and groups > 0
            and n % groups == 0
            and (offsets is None) == (layout != "q4_1")
            and (offsets is None or offsets.shape == scales.shape)
            and (offsets is None or offsets.dtype == torch.float16)
        )
        if not fits:
            raise ValueError(
                f"{layout} needs {want} codes (out, in{'' if bits == 8 else ' // 2'}), float16 "
                f"scales (out, groups){' and offsets' if layout == 'q4_1' else ''}; got codes "
                f"{codes.dtype} {tuple(codes.shape)}, scales {scales.dtype} "
                f"{tuple(scales.shape)}, offsets "
                f"{None if offsets is None else (offsets.dtype, tuple(offsets.shape))}"
            )
        with torch.device("meta"):  # (checks the sizes; the tensors are replaced)
            new = cls(n, out, layout=layout, group_size=n // groups)
        new.codes, new.scales = _frozen(codes), _frozen(scales)
        new.offsets = None if offsets is None else _frozen(offsets)
        new.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        return new

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls,
        weight: Tensor,
        bias: Tensor | None = None,
        *,
        layout: BlockLayout = "q8_0",
        group_size: int = BLOCK,
    ) -> BlockLinear:
        """Quantize ``weight`` ``(out, in)`` (any float dtype) in ``layout``.

        Raises:
            ValueError: A weight that is not 2-D float, an unknown ``layout``, a bad
                ``group_size`` or ``in`` not a multiple of it.
        """
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"BlockLinear needs a 2-D float weight, got shape {tuple(weight.shape)} "
                f"and dtype {weight.dtype}"
            )
        _check_layout(layout, group_size, weight.shape[1])
        q, scales, offsets = quantize_groups(weight, layout, group_size)
        codes = q if layout == "q8_0" else pack_nibbles(q)
        return cls.from_codes(codes, scales, offsets, bias, layout=layout)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, layout: BlockLayout = "q8_0", group_size: int = BLOCK
    ) -> BlockLinear:
        """Quantize ``linear``'s weight; its bias is kept as it is."""
        return cls.from_weight(linear.weight, linear.bias, layout=layout, group_size=group_size)

    def _weight_rows(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of the float32 weight."""
        codes = self.codes[start:stop]
        q = codes.float() if self.bits == 8 else unpack_nibbles(codes, torch.float32)
        out = q.shape[0]
        groups = q.view(out, -1, self.group_size)
        scale = self.scales[start:stop].float()[..., None]
        if self.bits == 8:
            return groups.mul_(scale).view(out, -1)
        if self.offsets is None:
            return groups.sub_(8).mul_(scale).view(out, -1)
        offset = self.offsets[start:stop].float()[..., None]
        return groups.mul_(scale).add_(offset).view(out, -1)

    def dequantize(self) -> Tensor:
        """The float32 weight this module computes with. Shape: ``(out, in)``."""
        return self._weight_rows(0, self.out_features)

    def _prepared(self) -> BlockWeight:
        """The weight as the kernel takes it, kept while it computes with the layer's tensors
        (prepared again where they were replaced or moved; never kept for a copy of them)."""
        prepared = self.__dict__.get("_block_weight")
        if prepared is None or not prepared.holds(self.codes, self.scales, self.offsets):
            tile = policy.block_tile_rows(self.bits)
            prepared = BlockWeight(self.codes, self.scales, self.offsets, self.bits, tile)
            if prepared.holds(self.codes, self.scales, self.offsets):
                self.__dict__["_block_weight"] = prepared  # (not a parameter or buffer)
        return prepared

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(*, in) -> (*, out)``."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        native = (
            x2.is_cpu
            and self.codes.is_cpu
            and not x2.requires_grad
            and self.scales.dtype == torch.float16  # (not cast, e.g. by .to(torch.bfloat16))
            and self.kernel == "block"
        )
        rounded = self.activations == "int8"
        if native and policy.block_kernel_rows(x2.shape[0]):
            xf = x2.float()
            if torch.compiler.is_compiling():  # (one opaque op of the graph)
                y = torch.ops.attnkit.block_dot_linear(
                    xf, self.codes, self.scales, self.offsets, self.bits, rounded
                )
            else:
                y = block_product(xf.contiguous(), self._prepared(), rounded)
        elif native:  # (a prompt: the float product, a block of output rows at a time)
            xf = round_activations(x2) if rounded else x2.float()
            y = _by_row_blocks(
                xf,
                self.out_features,
                self.in_features,
                lambda start, stop: linear(xf, self._weight_rows(start, stop)),
            )
        else:
            y = F.linear(x2, self.dequantize().to(x2.dtype))
        return _finish(self, y, x, shape)

    def extra_repr(self) -> str:
        return _describe(
            self, f"{self.layout} group_size={self.group_size}, activations={self.activations}"
        )


def set_activations(model: nn.Module, activations: str) -> nn.Module:
    """Set how every :class:`BlockLinear` of ``model`` takes its activations (one of
    :data:`ACTIVATIONS`) and return ``model``: the explicit choice between exactness
    (``"float"``, the default) and the integer dots' speed (``"int8"``).

    Raises:
        ValueError: For another value.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    for m in model.modules():
        if isinstance(m, BlockLinear):
            m.activations = activations
    model.__dict__.pop("_attnkit_step", None)  # (a compiled step holds the former choice)
    return model
