"""Weight-only int8 and int4 quantization of a model's linears, as a module swap.

Decoding one token reads every weight once, so on a CPU it runs at the read bandwidth divided by
the weight bytes: int8 weights read a quarter of fp32's bytes, int4 an eighth. :func:`quantize`
replaces each plain linear of a model (``nn.Linear`` or :class:`attnkit.decoding.PreparedLinear`)
by an :class:`Int8Linear` (one scale per output channel) or an :class:`Int4Linear` (an asymmetric
scale and offset per group of input channels); the model's own forward runs them, so generation,
``return_weights`` and the explorer work unchanged (attention weights, norms and embeddings are not
quantized). A tied output head gets a quantized copy of the embedding (``lm_head``) while the lookup
keeps the full-precision table.

Kernels: one row inside a compiled graph is a streaming reduction over the int8 weight (inductor
converts the bytes as it reads them); otherwise int8 runs ``torch._weight_int8pack_mm`` (input
sizes that are multiples of 8; others, and other devices, multiply by the dequantized weight)
and int4 torch's CPU int4 kernel (``torch._weight_int4pack_mm_for_cpu``), both with bf16
activations. ``benchmarks/bench_decode.py --quantize`` measures them against fp32 and bf16.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.decoding import PreparedLinear

__all__ = ["MODES", "Int4Linear", "Int8Linear", "Mode", "quantize", "quantize_linear"]

Mode = Literal["int8", "int4"]
MODES: tuple[Mode, ...] = ("int8", "int4")
GROUP_SIZES = (256, 128, 64, 32)


def _finish(layer: Any, y: Tensor, x: Tensor, shape: torch.Size) -> Tensor:
    """A quantized layer's rows ``y`` in the input's dtype, its bias added, the input's shape."""
    y = y.to(x.dtype)
    if layer.bias is not None:
        y = y + layer.bias.to(x.dtype)
    return y.reshape(*shape[:-1], layer.out_features)


def _describe(layer: Any, kind: str) -> str:
    return (
        f"in_features={layer.in_features}, out_features={layer.out_features}, "
        f"bias={layer.bias is not None}, {kind}"
    )


class Int8Linear(nn.Module):
    """A linear whose weight is int8 with one float32 scale per output channel.

    ``weight ≈ weight_int8 * scale[:, None]`` (symmetric, round to nearest, scale
    ``max|row| / 127``). The bias, if any, keeps its dtype. Build it with :meth:`from_linear`.

    Shape: ``(*, in_features) -> (*, out_features)``, in the input's dtype.
    """

    weight_int8: Tensor
    scale: Tensor
    scale_bf16: Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8)
        )
        self.register_buffer("scale", torch.ones(out_features))
        # The scales the int8 kernel reads (it takes them in the activations' dtype).
        self.register_buffer(
            "scale_bf16", torch.ones(out_features, dtype=torch.bfloat16), persistent=False
        )
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """Quantize ``weight`` ``(out, in)`` (any float dtype) per output channel."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"Int8Linear needs a 2-D float weight, got shape {tuple(weight.shape)} "
                f"and dtype {weight.dtype}"
            )
        out_features, in_features = weight.shape
        with torch.device("meta"):  # (the buffers are replaced below: no zeros to fill)
            new = cls(in_features, out_features, bias=False)
        codes = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
        scale = torch.empty(out_features, device=weight.device)
        # Blocks of rows keep the float temporaries small (loading stays near the final size).
        for start in range(0, out_features, _rows_per_block(in_features)):
            w = (
                weight[start : start + _rows_per_block(in_features)]
                .detach()
                .to(torch.float32, copy=True)
            )
            s = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            scale[start : start + len(s)] = s
            codes[start : start + len(s)] = w.div_(s[:, None]).round_().clamp_(-127, 127)
        new.weight_int8, new.scale = codes, scale
        new.scale_bf16 = new.scale.to(torch.bfloat16)
        new.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        return new

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize ``linear``'s weight; its bias is kept as it is."""
        return cls.from_weight(linear.weight, linear.bias)

    def dequantize(self) -> Tensor:
        """The float32 weight this module computes with. Shape: ``(out, in)``."""
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(*, in) -> (*, out)``."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 1 and torch.compiler.is_compiling():
            # One streaming pass over the int8 bytes; float32 sums.
            y = (self.weight_int8.float() * x2.float()).sum(-1) * self.scale
            y = y.reshape(1, -1)
        elif x2.device.type == "cpu" and self.in_features % 8 == 0:
            # (torch's kernel reads out of bounds for other input sizes.)
            xb = x2.to(torch.bfloat16).contiguous()
            # An identity view that makes inductor store the input: its int8 GEMM lowering
            # takes stored tensors, not fused expressions.
            xb = torch.as_strided(xb, xb.shape, xb.stride())
            y = torch._weight_int8pack_mm(xb, self.weight_int8, self.scale_bf16)
        else:
            y = F.linear(x2, self.dequantize().to(x2.dtype))
        return _finish(self, y, x, shape)

    def extra_repr(self) -> str:
        return _describe(self, "int8 per-channel")


class Int4Linear(nn.Module):
    """A linear whose weight is int4, with a bf16 scale and offset per group of input channels.

    Within each group of ``group_size`` inputs of a row, ``weight ≈ (q - 8) * scale + zero`` with
    ``q`` in ``0..15`` (asymmetric: ``scale = (max - min) / 15``, ``zero = min + 8 * scale``),
    packed by ``torch._convert_weight_to_int4pack_for_cpu`` for torch's CPU int4 kernel. Build it
    with :meth:`from_linear`; CPU only.

    Shape: ``(*, in_features) -> (*, out_features)``, in the input's dtype.
    """

    packed: Tensor
    scales_and_zeros: Tensor

    def __init__(self, in_features: int, out_features: int, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = (
            in_features,
            out_features,
            group_size,
        )
        self.register_buffer("packed", torch.zeros(0, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.zeros(0, dtype=torch.bfloat16))
        self.bias: nn.Parameter | None = None

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: Tensor, bias: Tensor | None = None, *, group_size: int = 128
    ) -> Int4Linear:
        """Quantize ``weight`` ``(out, in)`` group-wise; ``in`` must be a multiple of
        ``group_size`` (one of 32, 64, 128, 256), ``out`` a multiple of 16."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"Int4Linear needs a 2-D float weight, got shape {tuple(weight.shape)} "
                f"and dtype {weight.dtype}"
            )
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValueError(
                f"in_features={in_features} is not a multiple of group_size={group_size}"
            )
        if out_features % 16:
            raise ValueError(f"Int4Linear needs out_features divisible by 16, got {out_features}")
        if weight.device.type != "cpu":
            raise ValueError(f"Int4Linear runs on CPU only, got a weight on {weight.device}")
        new = cls(in_features, out_features, group_size)
        n_groups = in_features // group_size
        scale_b = torch.empty(out_features, n_groups, dtype=torch.bfloat16)
        zero_b = torch.empty(out_features, n_groups, dtype=torch.bfloat16)
        # The packing is row-block independent in blocks of 64 rows: pack a block at a time so
        # the int32 codes never exist for the whole weight.
        step = max(64, _rows_per_block(in_features) // 64 * 64)
        packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        for start in range(0, out_features, step):
            rows = slice(start, start + step)
            groups = (
                weight[rows].detach().to(torch.float32, copy=True).reshape(-1, n_groups, group_size)
            )
            low, high = groups.amin(-1), groups.amax(-1)
            scale = ((high - low) / 15).clamp(min=1e-6)
            # Round the scale and offset to bf16 (what the kernel reads) before choosing q.
            scale_b[rows], zero_b[rows] = scale.bfloat16(), (low + 8 * scale).bfloat16()
            q = groups.sub_(zero_b[rows].float()[..., None]).div_(scale_b[rows].float()[..., None])
            q_int = q.add_(8).round_().clamp_(0, 15).reshape(-1, in_features).to(torch.int32)
            packed[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_int, 1)
        new.packed = packed
        # (in / group, out, 2): [scale, zero] per group and output channel.
        new.scales_and_zeros = torch.stack([scale_b.t(), zero_b.t()], dim=-1).contiguous()
        new.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        return new

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = 128) -> Int4Linear:
        """Quantize ``linear``'s weight; its bias is kept as it is."""
        return cls.from_weight(linear.weight, linear.bias, group_size=group_size)

    def dequantize(self) -> Tensor:
        """The float32 weight this module computes with. Shape: ``(out, in)``."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        # Columns of W^T through the kernel itself: I @ W^T = W^T.
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, self.scales_and_zeros
        )
        return w_t.float().t().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(*, in) -> (*, out)``."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group_size, self.scales_and_zeros
        )
        return _finish(self, y, x, shape)

    def extra_repr(self) -> str:
        return _describe(self, f"int4 group_size={self.group_size}")


def _rows_per_block(in_features: int) -> int:
    """Rows of a weight quantized at a time: about 4 MiB of float32."""
    return max(1, (1 << 20) // in_features)


def _group_for(in_features: int, group_size: int) -> int | None:
    """``group_size`` if it divides ``in_features``, else the largest smaller one that does."""
    for size in GROUP_SIZES:
        if size <= group_size and in_features % size == 0:
            return size
    return None


def _quantized(weight: Tensor, bias: Tensor | None, mode: Mode, group_size: int) -> nn.Module:
    if mode == "int4" and weight.device.type == "cpu" and weight.shape[0] % 16 == 0:
        group = _group_for(weight.shape[1], group_size)
        if group is not None:
            return Int4Linear.from_weight(weight, bias, group_size=group)
    # int4 weights the kernel cannot pack (inputs no group size divides, outputs not a multiple
    # of 16, other devices) fall back to int8.
    return Int8Linear.from_weight(weight, bias)


def _check_options(mode: str, group_size: int) -> None:
    """Raise a ValueError naming an unknown ``mode`` or ``group_size``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")


def quantize_linear(linear: nn.Linear, mode: Mode, *, group_size: int = 128) -> nn.Module:
    """``linear`` as an :class:`Int8Linear` or :class:`Int4Linear` (the rule of :func:`quantize`).

    Loading with ``quantize=`` calls this on each linear as soon as its weight is streamed in.

    Raises:
        ValueError: Unknown ``mode`` or ``group_size``.
    """
    _check_options(mode, group_size)
    with torch.no_grad():
        return _quantized(linear.weight, linear.bias, mode, group_size)


@torch.no_grad()
def quantize(
    model: nn.Module, mode: Mode, *, group_size: int = 128, head: bool = True
) -> nn.Module:
    """Quantize ``model``'s linear weights in place (weight-only) and return it.

    Args:
        model: Any module. Its plain linears (``nn.Linear`` and
            :class:`attnkit.decoding.PreparedLinear`, exactly those types) are swapped;
            subclasses (a LoRA wrapper, a user's own) and already quantized modules stay.
        mode: ``"int8"`` (per output channel) or ``"int4"`` (group-wise; a linear whose input
            size no group size of at most ``group_size`` divides, or whose output size is not a
            multiple of 16, gets int8).
        group_size: int4 group size: 32, 64, 128 or 256.
        head: Also quantize a tied output head: a model with an ``embedding`` and an
            ``lm_head`` of ``None`` (a tied :class:`attnkit.TransformerLM`) gets an ``lm_head``
            holding the quantized embedding; the embedding itself stays for the lookup.

    Returns:
        ``model``.

    Raises:
        ValueError: Unknown ``mode`` or ``group_size``.
    """
    _check_options(mode, group_size)
    swaps = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, PreparedLinear)
    ]
    for parent, name in swaps:  # (no list of the old linears: each goes once it is swapped)
        child = getattr(parent, name)
        setattr(parent, name, _quantized(child.weight, child.bias, mode, group_size))
        del child
    embedding = getattr(model, "embedding", None)
    if head and isinstance(embedding, nn.Embedding) and getattr(model, "lm_head", 0) is None:
        model.lm_head = _quantized(embedding.weight, None, mode, group_size)
    # A compiled step traced before the swap would run the old modules.
    model.__dict__.pop("_attnkit_step", None)
    return model
