"""attnkit's linear products for decoding: a weight times a few rows, each reading the weight as
one sequential stream per thread, prefetched ahead.

* int8 weights (``csrc/int8_dot.c``, :func:`int8_dot_linear`): integer dot products over the
  codes in :func:`group_codes`' order, the activations rounded to int8 per block of
  :data:`INT8_DOT_BLOCK` inputs (as llama.cpp's ``q8_0`` dot; more exact than fbgemm's one 7-bit
  scale per row). It streams the codes, where torch's int8 kernels on CPUs without bf16 units
  convert as they go.
* int4 weights (``csrc/int4_dot.c``, :func:`int4_dot_linear`): a bf16 scale and offset per group
  of inputs, the codes packed two to a byte (:func:`pack_int4`), unpacked by a shift and two
  masks and multiplied in integers by the activations rounded as for int8 (torch's CPU int4
  kernel converts its codes to floats).
* bf16 and float32 weights (``csrc/float_dot.c``, :func:`float_dot_linear`): float dots summed in
  float32, every row dotted with each weight row while it is in cache.
* fbgemm's dynamic quantized linear over its prepacked weight (:func:`fbgemm_pack`,
  :func:`fbgemm_product`), one of the int8 kernels the policy chooses between.

Each product has narrow and wide dots (:func:`int8_wide_dots`, :func:`float_wide_dots`); which
run, and which kernel serves a product, is the policy's choice (:mod:`attnkit.kernels.policy`).
Compiled graphs call the products as ops (:mod:`attnkit.kernels.ops`).
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from attnkit.kernels.build import library, require_cpu

__all__ = [
    "GROUP",
    "INT8_DOT_BLOCK",
    "fbgemm_engine",
    "fbgemm_inputs",
    "fbgemm_linear",
    "fbgemm_pack",
    "fbgemm_product",
    "float_dot_linear",
    "float_wide_dots",
    "group_codes",
    "int4_dot_linear",
    "int4_product",
    "int8_dot_linear",
    "int8_product",
    "int8_round_rows",
    "int8_scales",
    "int8_wide_dots",
    "pack_int4",
    "pack_int4_scales",
    "register_packed",
    "release_packed",
    "round_activations",
    "rows_per_block",
    "ungroup_codes",
    "unpack_int4",
    "unpack_int4_scales",
]

#: Inputs per activation scale; the weight's input count must be a multiple of it.
INT8_DOT_BLOCK = 32
#: Output rows whose codes :func:`group_codes` lays side by side.
GROUP = 4
_GROUP = GROUP


def group_codes(codes: Tensor) -> Tensor:
    """Int8 ``codes`` ``(out, n)`` in the order :func:`int8_dot_linear` reads them: one
    sequential stream for a one-row product.

    Output rows in groups of four, each group's codes block by block, the four rows' 32 codes of
    a block side by side (``(out // 4, n // 32, 4, 32)``), then the ``out % 4`` last rows as they
    are. The same shape and bytes, another order (a new tensor); :func:`ungroup_codes` undoes it.
    """
    out, n = codes.shape
    if n % INT8_DOT_BLOCK:
        raise ValueError(f"group_codes needs a multiple of {INT8_DOT_BLOCK} inputs, got {n}")
    whole = out // _GROUP * _GROUP
    grouped = torch.empty_like(codes, memory_format=torch.contiguous_format)
    blocks = n // INT8_DOT_BLOCK
    head = codes[:whole].reshape(-1, _GROUP, blocks, INT8_DOT_BLOCK)
    grouped[:whole].view(-1, blocks, _GROUP, INT8_DOT_BLOCK).copy_(head.transpose(1, 2))
    grouped[whole:] = codes[whole:]
    return grouped


def ungroup_codes(grouped: Tensor, dtype: torch.dtype = torch.int8) -> Tensor:
    """The row-major codes ``(out, n)`` of :func:`group_codes`' order (a new tensor), converted
    to ``dtype`` in the same pass."""
    out, n = grouped.shape
    whole = out // _GROUP * _GROUP
    rows = torch.empty(out, n, dtype=dtype, device=grouped.device)
    head = grouped[:whole].view(-1, n // INT8_DOT_BLOCK, _GROUP, INT8_DOT_BLOCK)
    rows[:whole].view(-1, _GROUP, n // INT8_DOT_BLOCK, INT8_DOT_BLOCK).copy_(head.transpose(1, 2))
    rows[whole:] = grouped[whole:]
    return rows


def round_activations(x: Tensor) -> Tensor:
    """``x`` ``(..., n)`` rounded as :func:`int8_dot_linear` rounds its activations, in float32:
    per block of 32 inputs to ``q * max|block| / 127`` with ``q`` an integer in -127..127 (a block
    holding a NaN or an infinity becomes NaN). ``F.linear`` of it with the dequantized weight is
    the kernel's product up to float32 summation order: how layers multiply many rows at once."""
    blocks = x.float().unflatten(-1, (-1, INT8_DOT_BLOCK))
    top = blocks.abs().amax(-1, keepdim=True)
    nonzero = torch.where(top > 0, top, torch.ones_like(top))  # (0 / 0: an all-zero block)
    codes = (blocks / nonzero * 127).round_()
    return (codes * (top / 127)).flatten(-2)


def _check(x: Tensor, codes: Tensor, scale: Tensor) -> None:
    if x.dtype != torch.float32 or codes.dtype != torch.int8 or scale.dtype != torch.float32:
        raise TypeError(
            f"int8_dot_linear takes float32 x, int8 codes and float32 scale, got {x.dtype}, "
            f"{codes.dtype} and {scale.dtype}"
        )
    if (
        x.dim() != 2
        or codes.dim() != 2
        or x.shape[1] != codes.shape[1]
        or scale.shape != codes.shape[:1]
        or codes.shape[1] % INT8_DOT_BLOCK
    ):
        raise ValueError(
            f"int8_dot_linear needs x (rows, n), codes (out, n) and scale (out,) with n a "
            f"multiple of {INT8_DOT_BLOCK}, got {tuple(x.shape)}, {tuple(codes.shape)} and "
            f"{tuple(scale.shape)}"
        )
    require_cpu("int8_dot_linear", x, codes, scale)


def _switch(call: Any, use: bool | None) -> bool:
    return bool(call(-1 if use is None else int(use)))


def int8_wide_dots(use: bool | None = None) -> bool:
    """Whether :func:`int8_dot_linear` and :func:`int4_dot_linear` run their wide dots: twice the
    codes per instruction of the narrow ones, with the same bits. ``use`` switches them on or off
    (on only where the CPU has them); until switched they run where they can. The policy switches
    them (:func:`attnkit.kernels.policy.linear_plan`).

    Raises:
        RuntimeError: Where the kernels are not available.
    """
    return _switch(library().attnkit_int8_wide, use)


def float_wide_dots(use: bool | None = None) -> bool:
    """Whether :func:`float_dot_linear` runs its wide dots: eight activation rows share each
    weight vector (against two with the narrow ones), so a few rows' product reads the weight
    near the bandwidth. The two sum in different orders, so their results differ in the last
    bits; a row's result does not depend on the rows beside it with either. ``use`` switches them
    on or off (on only where the CPU has the vector units); until switched they run where they
    can. The policy switches them (:func:`attnkit.kernels.policy.linear_plan`).

    Raises:
        RuntimeError: Where the kernels are not available.
    """
    return _switch(library().attnkit_float_wide, use)


def int8_dot_linear(x: Tensor, codes: Tensor, scale: Tensor, *, wide: bool | None = None) -> Tensor:
    """``x @ (ungroup_codes(codes) * scale[:, None]).T`` with ``x``'s rows rounded to int8 per
    block of 32 inputs.

    Compiled graphs call it as one op, ``torch.ops.attnkit.int8_dot_linear`` (an op call costs
    several times a small product in eager mode, so eager code calls this function).

    Args:
        x: Float32 activations ``(rows, n)``, ``n`` a multiple of :data:`INT8_DOT_BLOCK`.
        codes: Int8 weight codes ``(out, n)`` in :func:`group_codes`' order.
        scale: Float32 scale per output row ``(out,)``.
        wide: Switch the wide dots on or off first (:func:`int8_wide_dots`); None leaves them.

    Returns:
        ``(rows, out)``, float32.

    Raises:
        TypeError: For other dtypes.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where the kernel is not available (:func:`kernels_unavailable`).
    """
    _check(x, codes, scale)
    if wide is not None:
        int8_wide_dots(wide)
    library()
    return int8_product(x.contiguous(), codes.contiguous(), scale.contiguous())


def int8_product(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """:func:`int8_dot_linear` without its checks, for callers that hold the invariants (an
    :class:`attnkit.quantize.Int8Linear` in eager mode, as :func:`int4_product`)."""
    lib = library()
    y = x.new_empty(x.shape[0], codes.shape[0])
    failed = lib.attnkit_int8_linear(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        codes.data_ptr(),
        scale.data_ptr(),
        codes.shape[0],
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"int8_dot_linear could not allocate {x.shape[0]} quantized rows")
    return y


def _int4_rows(out: int) -> int:
    """Rows of an int4 weight as :func:`pack_int4` stores it: ``out`` rounded up to groups."""
    return -(-out // _GROUP) * _GROUP


def pack_int4(codes: Tensor) -> Tensor:
    """Int4 ``codes`` ``(out, n)`` (integers 0..15, any integer dtype) packed two to a byte in
    the order :func:`int4_dot_linear` reads them: ``(out4, n // 2)`` uint8 with ``out4`` the
    rows rounded up to a multiple of four (the added rows' codes are 0).

    Rows in groups of four, each group's codes block by block, the four rows' 16 bytes of a
    block of 32 inputs side by side; byte ``j`` of a row's block holds input ``j`` in its low
    nibble and input ``16 + j`` in its high one. :func:`unpack_int4` undoes it.
    """
    out, n = codes.shape
    if n % INT8_DOT_BLOCK:
        raise ValueError(f"pack_int4 needs a multiple of {INT8_DOT_BLOCK} inputs, got {n}")
    padded = codes.new_zeros(_int4_rows(out), n, dtype=torch.uint8)
    padded[:out] = codes
    blocks = padded.view(-1, _GROUP, n // INT8_DOT_BLOCK, 2, INT8_DOT_BLOCK // 2).transpose(1, 2)
    return (blocks[:, :, :, 0] | blocks[:, :, :, 1] << 4).reshape(len(padded), n // 2)


def unpack_int4(packed: Tensor, out: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """The codes ``(out, n)`` of :func:`pack_int4`'s ``packed`` (a new tensor), in ``dtype``."""
    rows, half = packed.shape
    blocks = packed.view(-1, half * 2 // INT8_DOT_BLOCK, _GROUP, INT8_DOT_BLOCK // 2)
    nibbles = torch.stack([blocks & 15, blocks >> 4], dim=3)  # (groups, blocks, 4, 2, 16)
    codes = nibbles.transpose(1, 2).reshape(rows, half * 2)[:out]
    return codes.to(dtype)


def pack_int4_scales(scale: Tensor, offset: Tensor) -> Tensor:
    """Per-group ``scale`` and ``offset`` ``(out, n // group)`` as :func:`int4_dot_linear` reads
    them: bf16, ``(out4 // 4, groups * 8)``: for each group of four rows and each input group,
    the four rows' scales, then their offsets (rows added to fill a group get 0)."""
    out, groups = scale.shape
    both = scale.new_zeros(_int4_rows(out), groups, 2, dtype=torch.bfloat16)
    both[:out, :, 0], both[:out, :, 1] = scale, offset
    return both.view(-1, _GROUP, groups, 2).permute(0, 2, 3, 1).reshape(-1, groups * 2 * _GROUP)


def unpack_int4_scales(packed: Tensor, out: int) -> tuple[Tensor, Tensor]:
    """``(scale, offset)``, each ``(out, groups)`` float32, of :func:`pack_int4_scales`."""
    groups = packed.shape[1] // (2 * _GROUP)
    both = packed.view(-1, groups, 2, _GROUP).permute(0, 3, 1, 2).reshape(-1, groups, 2)[:out]
    return both[..., 0].float(), both[..., 1].float()


def _check_int4(x: Tensor, codes: Tensor, scales: Tensor, out: int) -> None:
    """Raise for inputs :func:`int4_dot_linear` does not take, naming them (as :func:`_check`)."""
    if x.dtype != torch.float32 or codes.dtype != torch.uint8 or scales.dtype != torch.bfloat16:
        raise TypeError(
            f"int4_dot_linear takes float32 x, uint8 codes and bfloat16 scales, got {x.dtype}, "
            f"{codes.dtype} and {scales.dtype}"
        )
    n = codes.shape[1] * 2 if codes.dim() == 2 else -1
    groups = scales.shape[1] // (2 * _GROUP) if scales.dim() == 2 else 0
    if (
        x.dim() != 2
        or x.shape[1] != n
        or n % INT8_DOT_BLOCK
        or codes.shape[0] != _int4_rows(out)
        or out < 0
        or scales.shape != (codes.shape[0] // _GROUP, groups * 2 * _GROUP)
        or groups == 0
        or n % groups
        or (n // groups) % INT8_DOT_BLOCK
    ):
        raise ValueError(
            f"int4_dot_linear needs x (rows, n), codes (ceil(out / 4) * 4, n / 2) and scales "
            f"(ceil(out / 4), groups * 8) with n a multiple of groups * {INT8_DOT_BLOCK}, got "
            f"{tuple(x.shape)}, {tuple(codes.shape)} and {tuple(scales.shape)} for out={out}"
        )
    require_cpu("int4_dot_linear", x, codes, scales)


def int4_dot_linear(
    x: Tensor, codes: Tensor, scales: Tensor, out: int, *, wide: bool | None = None
) -> Tensor:
    """``x @ W.T`` for the int4 weight ``W[o, i] = q[o, i] * scale[o, g] + offset[o, g]``
    (``g`` the input group of ``i``), with ``x``'s rows rounded to int8 per block of 32 inputs
    as :func:`int8_dot_linear` rounds them (:func:`round_activations`).

    The weight is read once as packed nibbles (half a byte a weight, plus 4 bytes a group), the
    products summed in integers a block at a time (the wide dots where :func:`int8_wide_dots`
    runs them, else the narrow ones; the same bits). Compiled graphs call it as one op,
    ``torch.ops.attnkit.int4_dot_linear``.

    Args:
        x: Float32 activations ``(rows, n)``.
        codes: :func:`pack_int4`'s codes, ``(ceil(out / 4) * 4, n / 2)`` uint8.
        scales: :func:`pack_int4_scales`' scales and offsets (bf16); the group size is ``n``
            over their groups, a multiple of 32.
        out: The weight's output rows.
        wide: As :func:`int8_dot_linear`'s.

    Returns:
        ``(rows, out)``, float32.

    Raises:
        TypeError, ValueError, RuntimeError: As :func:`int8_dot_linear`.
    """
    _check_int4(x, codes, scales, out)
    if wide is not None:
        int8_wide_dots(wide)
    library()
    return int4_product(x.contiguous(), codes.contiguous(), scales.contiguous(), out)


def int4_product(x: Tensor, codes: Tensor, scales: Tensor, out: int) -> Tensor:
    """:func:`int4_dot_linear` without its checks, for callers that hold the invariants (an
    :class:`attnkit.quantize.Int4Linear` in eager mode, whose checks would cost more than a
    small product): contiguous CPU tensors of the right dtypes and shapes, the kernels loaded."""
    lib = library()
    n = x.shape[1]
    y = x.new_empty(x.shape[0], out)
    failed = lib.attnkit_int4_linear(
        x.data_ptr(),
        x.shape[0],
        n,
        codes.data_ptr(),
        scales.data_ptr(),
        out,
        n // (scales.shape[1] // (2 * _GROUP)),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"int4_dot_linear could not allocate {x.shape[0]} quantized rows")
    return y


def _float_mismatch(x: Tensor, weight: Tensor, bias: Tensor | None) -> Exception:
    """The error for inputs :func:`float_dot_linear` does not take."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    if weight.dtype not in (torch.bfloat16, torch.float32) or any(
        t.dtype != weight.dtype for t in tensors
    ):
        got = ", ".join(str(t.dtype) for t in tensors)
        return TypeError(
            f"float_dot_linear takes x, weight and bias all bfloat16 or all float32, got {got}"
        )
    if any(t.device.type != "cpu" for t in tensors):
        return ValueError(
            f"float_dot_linear runs on CPU tensors, got {', '.join(str(t.device) for t in tensors)}"
        )
    return ValueError(
        f"float_dot_linear needs x (..., n), weight (out, n) and bias (out,) or None, got "
        f"{tuple(x.shape)}, {tuple(weight.shape)} and "
        f"{None if bias is None else tuple(bias.shape)}"
    )


def float_dot_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, wide: bool | None = None
) -> Tensor:
    """``F.linear(x, weight, bias)`` for a few rows, summed in float32 with the weight read as one
    stream per thread (bf16 results are rounded to nearest even).

    Meant for decoding's one-row products: every row is dotted with each weight row while it is in
    cache, so many rows (a prompt) are better served by ``F.linear``'s blocked GEMM. Compiled
    graphs call it as one op, ``torch.ops.attnkit.float_dot_linear``. Decoding makes over a
    hundred calls a token, so the checks are few and cheap.

    Args:
        x: Activations ``(..., n)``.
        weight: ``(out, n)``, row-major or not (a copy is made if not).
        bias: ``(out,)`` or ``None``. All three bfloat16, or all float32.
        wide: Switch the wide dots on or off first (:func:`float_wide_dots`); None leaves them.

    Returns:
        ``(..., out)``, in the inputs' dtype.

    Raises:
        TypeError: For other dtypes or mixed ones.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where the kernel is not available (:func:`kernels_unavailable`).
    """
    dtype = weight.dtype
    out, n = weight.shape if weight.dim() == 2 else (-1, -1)
    if (
        x.dtype != dtype
        or dtype not in _FLOAT_CALLS
        or x.dim() < 1
        or x.shape[-1] != n
        or not x.is_cpu
        or not weight.is_cpu
        or (bias is not None and (bias.dtype != dtype or bias.shape != (out,) or not bias.is_cpu))
    ):
        raise _float_mismatch(x, weight, bias)
    lib = library()
    if wide is not None:
        float_wide_dots(wide)
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()  # (held: the kernel reads its memory)
    rows = math.prod(x.shape[:-1])
    y = x.new_empty((*x.shape[:-1], out))  # (x.dtype is dtype; new_empty costs half of empty)
    failed = getattr(lib, _FLOAT_CALLS[dtype])(
        x.data_ptr(),
        rows,
        n,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"float_dot_linear could not allocate {rows} float32 rows")
    return y


_FLOAT_CALLS = {torch.bfloat16: "attnkit_bf16_linear", torch.float32: "attnkit_float_linear"}


# Rounding float weights to int8 codes, a block of rows at a time.


def rows_per_block(in_features: int) -> int:
    """Rows of a weight quantized at a time: about 4 MiB of float32."""
    return max(1, (1 << 20) // in_features)


def int8_scales(weight: Tensor) -> Tensor:
    """Per-row scales ``max|row| / 127`` of a float ``weight`` ``(out, in)``, float32."""
    step = rows_per_block(weight.shape[1])
    blocks = (weight[start : start + step] for start in range(0, len(weight), step))
    tiny = torch.finfo(torch.float32).tiny
    return torch.cat([(w.float().abs().amax(dim=1) / 127).clamp(min=tiny) for w in blocks])


def int8_round_rows(weight: Tensor, scale: Tensor, start: int, stop: int) -> Tensor:
    """The int8 codes of rows ``start:stop`` of ``weight`` with their ``scale``."""
    rows = weight[start:stop]
    codes = torch.empty(rows.shape, dtype=torch.int8, device=weight.device)
    step = rows_per_block(weight.shape[1])
    # Blocks of rows keep the float temporaries small (loading stays near the final size).
    for i in range(0, len(rows), step):
        w = rows[i : i + step].to(torch.float32, copy=True)
        s = scale[start + i : start + i + len(w), None]
        codes[i : i + len(w)] = w.div_(s).round_().clamp_(-127, 127)
    return codes


# fbgemm's dynamic quantized linear, over its prepacked copies of a weight's codes.

# Prepacked weights by handle, for the compiled graphs' op calls (an entry goes with its layer):
# the packed blocks, and whether the tail codes run ``torch._weight_int8pack_mm``.
_PACKED: dict[int, tuple[list[Any], bool]] = {}
_HANDLES = itertools.count()


def fbgemm_engine() -> bool:
    """Whether this torch has fbgemm's quantized engine (``fbgemm`` or ``x86``)."""
    return any(e in torch.backends.quantized.supported_engines for e in ("fbgemm", "x86"))


def fbgemm_pack(codes: Tensor, scale: Tensor) -> Any:
    """fbgemm's prepacked copy of int8 ``codes`` ``(out, in)`` with per-row ``scale``.

    Packed by fbgemm itself where it is available (the ``x86`` engine hands some CPUs to
    oneDNN, whose packed weight keeps a second copy of the codes).
    """
    zeros = torch.zeros(len(scale), dtype=torch.long)
    engines = torch.backends.quantized.supported_engines
    engine = "fbgemm" if "fbgemm" in engines else torch.backends.quantized.engine
    before = torch.backends.quantized.engine
    with warnings.catch_warnings():  # (torch.ao's deprecation notice for its quantized tensors)
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(codes, scale.double(), zeros, 0)
        try:
            torch.backends.quantized.engine = engine
            return torch.ops.quantized.linear_prepack(q, None)
        finally:
            torch.backends.quantized.engine = before


def fbgemm_inputs(in_features: int) -> int:
    """How many leading inputs of a weight fbgemm packs: all where they fill whole blocks of
    512 or are fewer than 512, else the largest multiple of 512 (the rest would be padded)."""
    return in_features if in_features <= 512 else in_features // 512 * 512


def _fbgemm_call(x: Tensor, packed: list[Any]) -> Tensor:
    """fbgemm's dynamic linear on each prepacked block of rows of a weight, side by side."""
    parts = [torch.ops.quantized.linear_dynamic(x, p, True) for p in packed]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _fbgemm_rows(x: Tensor, packed: list[Any]) -> Tensor:
    """``x @ W^T`` through fbgemm's dynamic quantized linear, one activation scale per row.

    fbgemm quantizes the whole input with one scale; rows of other sizes are divided by their
    largest magnitude first (and the products multiplied back), so each row keeps its own
    resolution. 7-bit activations (``reduce_range``): the 8-bit multiply-add of unsigned
    activations and signed weights saturates 16-bit pair sums.
    """
    if x.shape[0] == 1:
        return _fbgemm_call(x, packed)
    size = x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
    return _fbgemm_call(x / size, packed).mul_(size)


def fbgemm_product(
    x: Tensor,
    packed: list[Any],
    tail: Tensor,
    scale: Tensor,
    scale_bf16: Tensor,
    *,
    int8pack_tail: bool,
) -> Tensor:
    """``x @ W^T`` of an fbgemm layer: the prepacked blocks of rows of the leading inputs
    (:func:`fbgemm_inputs`) and the ``tail`` codes ``(out, rest)`` of the remaining ones, the
    tail through ``torch._weight_int8pack_mm`` where ``int8pack_tail`` (the policy says whether
    it takes that many inputs), else the float product.

    Shape: ``(rows, in) -> (rows, out)``, float32.
    """
    main = x.shape[1] - tail.shape[1]
    y = _fbgemm_rows(x[:, :main].contiguous() if tail.shape[1] else x, packed)
    if not tail.shape[1]:
        return y
    rest = x[:, main:]
    if int8pack_tail:
        return y.add_(torch._weight_int8pack_mm(rest.bfloat16().contiguous(), tail, scale_bf16))
    return torch.addmm(y, rest, (tail.float() * scale[:, None]).T)


def register_packed(packed: list[Any], *, int8pack_tail: bool) -> int:
    """Keep a layer's prepacked weight for :func:`fbgemm_linear`; its handle."""
    handle = next(_HANDLES)
    _PACKED[handle] = (packed, int8pack_tail)
    return handle


def release_packed(handle: int) -> None:
    """Forget the prepacked weight of ``handle`` (its layer is gone)."""
    _PACKED.pop(handle, None)


def fbgemm_linear(
    x: Tensor, handle: Tensor, tail: Tensor, scale: Tensor, scale_bf16: Tensor
) -> Tensor:
    """:func:`fbgemm_product` with the prepacked weight of ``handle``: the op compiled graphs
    call (``attnkit::int8_fbgemm_linear``). Shape: ``(rows, in) -> (rows, out)``, float32."""
    packed, int8pack_tail = _PACKED[int(handle)]
    return fbgemm_product(
        x.contiguous(), packed, tail, scale, scale_bf16, int8pack_tail=int8pack_tail
    )
