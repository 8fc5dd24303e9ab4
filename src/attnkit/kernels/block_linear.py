"""Products with block-quantized weights (GGUF's ``Q8_0``, ``Q4_0`` and ``Q4_1`` layouts) and
float32 activations (``csrc/block_dot.c``).

Each group of ``group`` inputs of a weight row (a multiple of :data:`BLOCK`) has an f16 scale
``d`` and, for 4-bit codes, an f16 offset ``m``: ``w = d * q`` (int8 ``q``) or ``w = d * q + m``
(``q`` in ``0..15``; ``m = -8 d`` where the layer has no offsets, GGUF's ``Q4_0``). The kernel
widens each block's codes to floats and multiplies them by the activations as they are, so its
result is the float product of the dequantized weight up to float32 summation order (the int8
and int4 kernels of :mod:`attnkit.kernels.linear` round the activations to int8 instead).

4-bit codes are packed as ggml packs them: 16 bytes a block of 32 inputs, byte ``j`` holding
input ``j`` in its low nibble and input ``16 + j`` in its high one (:func:`pack_nibbles`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels.build import library, require_cpu

__all__ = [
    "BLOCK",
    "TILE_ROWS",
    "BlockWeight",
    "block_dot_linear",
    "block_product",
    "pack_nibbles",
    "unpack_nibbles",
]

#: Inputs per block: the kernel reads codes and scales a block at a time.
BLOCK = 32
#: The weight rows the kernel can multiply a pass (each block of activations it loads serves
#: them all; fewer rows read fewer streams of codes at once).
TILE_ROWS = (2, 4)


def pack_nibbles(codes: Tensor) -> Tensor:
    """4-bit ``codes`` ``(out, n)`` (values ``0..15``, ``n`` a multiple of 32) packed two to a
    byte in ggml's order: ``(out, n // 2)`` uint8. :func:`unpack_nibbles` undoes it."""
    out, n = codes.shape
    if n % BLOCK:
        raise ValueError(f"pack_nibbles needs a multiple of {BLOCK} inputs, got {n}")
    blocks = codes.to(torch.uint8).reshape(out, n // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, n // 2)


def unpack_nibbles(packed: Tensor, dtype: torch.dtype = torch.uint8) -> Tensor:
    """The codes ``(out, n)`` of :func:`pack_nibbles`' ``packed`` (a new tensor), in ``dtype``."""
    out, half = packed.shape
    blocks = packed.reshape(out, -1, 1, BLOCK // 2)
    both = torch.cat([blocks & 0x0F, blocks >> 4], dim=2)  # (out, blocks, 2, 16)
    return both.reshape(out, 2 * half).to(dtype)


def _check(x: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor | None, bits: int) -> None:
    """Raise for inputs :func:`block_dot_linear` does not take, naming them."""
    if bits not in (4, 8):
        raise ValueError(f"block_dot_linear takes 4 or 8 bits, got {bits}")
    want = torch.int8 if bits == 8 else torch.uint8
    if (
        x.dtype != torch.float32
        or codes.dtype != want
        or scales.dtype != torch.float16
        or (offsets is not None and offsets.dtype != torch.float16)
    ):
        raise TypeError(
            f"block_dot_linear takes float32 x, {want} codes and float16 scales and offsets, "
            f"got {x.dtype}, {codes.dtype}, {scales.dtype} and "
            f"{None if offsets is None else offsets.dtype}"
        )
    n = codes.shape[1] * (8 // bits) if codes.dim() == 2 else -1
    groups = scales.shape[1] if scales.dim() == 2 and scales.shape[1] else 0
    fits = (
        x.dim() == 2
        and x.shape[1] == n
        and groups > 0
        and n % groups == 0
        and (n // groups) % BLOCK == 0
        and scales.shape[0] == codes.shape[0]
        and (offsets is None or (offsets.shape == scales.shape and bits == 4))
    )
    if not fits:
        raise ValueError(
            f"block_dot_linear needs x (rows, n), codes (out, n * bits / 8) and scales (and "
            f"offsets) (out, groups) with n a multiple of groups * {BLOCK}, got "
            f"{tuple(x.shape)}, {tuple(codes.shape)} and {tuple(scales.shape)} for {bits} bits"
        )
    require_cpu("block_dot_linear", x, codes, scales, *([] if offsets is None else [offsets]))


class BlockWeight:
    """A block-quantized weight prepared for :func:`block_product`: its tensors (contiguous) and
    the kernel's arguments that depend only on them, worked out once rather than on every call
    (a decoding step multiplies by every layer's weight, one row at a time).

    Args:
        codes: ``(out, n)`` int8 (8 bits) or :func:`pack_nibbles`' ``(out, n // 2)`` uint8.
        scales: Float16 ``(out, groups)``; the group size is ``n // groups``, a multiple of 32.
        offsets: Float16 ``(out, groups)`` (4 bits only), or None: ``-8 * scales`` for 4 bits.
        bits: 8 or 4.
        tile: Weight rows the kernel multiplies a pass, 2 or 4
            (:func:`attnkit.kernels.policy.block_tile_rows` measures which serves this machine).
    """

    __slots__ = ("args", "codes", "offsets", "out", "scales", "tile")

    def __init__(
        self,
        codes: Tensor,
        scales: Tensor,
        offsets: Tensor | None,
        bits: int,
        tile: int = TILE_ROWS[-1],
    ) -> None:
        # (held, so that no other tensor takes their memory while the pointers are kept)
        self.codes, self.scales = codes.contiguous(), scales.contiguous()
        self.offsets = None if offsets is None else offsets.contiguous()
        self.out = codes.shape[0]
        n = codes.shape[1] * 8 // bits
        # (the C functions' arguments after the activations' pointer and rows)
        self.args = (
            n,
            self.codes.data_ptr(),
            self.scales.data_ptr(),
            None if self.offsets is None else self.offsets.data_ptr(),
            self.out,
            bits,
            n // scales.shape[1],
        )
        self.tile = tile

    def holds(self, codes: Tensor, scales: Tensor, offsets: Tensor | None) -> bool:
        """Whether this computes with these tensors' current data (False where preparing it
        copied them: they were not contiguous)."""
        _, held_codes, held_scales, held_offsets, *_ = self.args
        return (
            held_codes == codes.data_ptr()
            and held_scales == scales.data_ptr()
            and held_offsets == (None if offsets is None else offsets.data_ptr())
        )


def block_dot_linear(
    x: Tensor,
    codes: Tensor,
    scales: Tensor,
    offsets: Tensor | None,
    bits: int,
    rounded: bool = False,
) -> Tensor:
    """``x @ W.T`` for the block-quantized weight ``W`` (see the module's docstring).

    Compiled graphs call it as one op, ``torch.ops.attnkit.block_dot_linear``.

    Args:
        x: Float32 activations ``(rows, n)``.
        codes: ``(out, n)`` int8 (8 bits) or :func:`pack_nibbles`' ``(out, n // 2)`` uint8.
        scales: Float16 ``(out, groups)``; the group size is ``n // groups``, a multiple of 32.
        offsets: Float16 ``(out, groups)`` (4 bits only), or None: ``-8 * scales`` for 4 bits.
        bits: 8 or 4.
        rounded: Round the activations to int8 per block of 32 (as
            :func:`attnkit.kernels.linear.int8_dot_linear` rounds them) and sum each block's
            products in integers: faster where integer dots outrun float ones, less exact.

    Returns:
        ``(rows, out)``, float32.

    Raises:
        TypeError: For other dtypes.
        ValueError: For shapes that do not fit, another bit count, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available.
    """
    _check(x, codes, scales, offsets, bits)
    library()
    return block_product(x.contiguous(), BlockWeight(codes, scales, offsets, bits), rounded)


def block_product(x: Tensor, weight: BlockWeight, rounded: bool = False) -> Tensor:
    """:func:`block_dot_linear` of ``x`` and a prepared ``weight``, without the checks: for
    callers that hold the invariants (``x`` a contiguous float32 CPU tensor whose rows fit the
    weight, the kernels loaded)."""
    lib = library()
    rows = x.shape[0]
    y = torch.empty(rows, weight.out)
    call = lib.attnkit_block_linear_rounded if rounded else lib.attnkit_block_linear
    threads = torch.get_num_threads()
    if call(x.data_ptr(), rows, *weight.args, y.data_ptr(), threads, weight.tile):
        raise MemoryError(f"block_dot_linear could not allocate {rows} rows of block sums")
    return y
