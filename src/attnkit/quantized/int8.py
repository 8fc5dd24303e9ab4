"""Weight-only int8 linears with one scale per output channel, and the choice of their kernel.

Kernels. An :class:`Int8Linear` multiplies with one of four (``int8_kernel=``); the default is
the policy's choice (:func:`default_int8_kernel`: choice ``linear.int8`` of
:mod:`attnkit.kernels.policy`, measured once per machine and cached, so every load of a model
gives the same layers); ``int8_kernel="auto"`` instead times the candidates per shape
(:func:`choose_int8_kernel`):

* ``"attnkit"`` (its former name is still accepted):
  :func:`attnkit.kernels.linear.int8_dot_linear`, attnkit's own kernel of integer dot products,
  for the rows :func:`attnkit.kernels.policy.int8_kernel_rows` gives it (decoding and small
  batches; every row without gradients where its wide dots run); activations rounded to int8 per
  block of 32 inputs (as llama.cpp's ``q8_0`` dot); inputs a multiple of 32. It streams the codes
  at about the read bandwidth. More rows (a prompt) multiply the dequantized weight by the
  activations rounded the same way (:func:`attnkit.kernels.linear.round_activations`), so the
  result does not depend on the row count beyond float32 summation order. Compiled graphs call it
  as one op (``attnkit::int8_dot_linear``).
* ``"fbgemm"``: torch's dynamic quantized linear on fbgemm's prepacked weight (the only copy
  of the codes; see :class:`Int8Linear`): each call quantizes the activations to 7-bit integers
  (one asymmetric scale per row). Compiled graphs call it as one opaque op
  (``attnkit::int8_fbgemm_linear``).
* ``"int8pack"``: ``torch._weight_int8pack_mm`` with bf16 activations (input sizes it takes,
  :func:`attnkit.kernels.policy.int8pack_takes`). Where the CPU has no bf16 units it converts as
  it goes. One row inside a compiled graph is a streaming float32 reduction over the int8 bytes
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.decoding import linear
from attnkit.kernels import policy
from attnkit.kernels.build import kernels_available
from attnkit.kernels.linear import (
    INT8_DOT_BLOCK,
    fbgemm_engine,
    fbgemm_inputs,
    fbgemm_pack,
    fbgemm_product,
    group_codes,
    int8_dot_linear,
    int8_product,
    int8_round_rows,
    int8_scales,
    register_packed,
    release_packed,
    round_activations,
    rows_per_block,
    ungroup_codes,
)
from attnkit.kernels.probe import last_level_cache_bytes  # (re-exported)
from attnkit.profiling import time_calls  # (re-exported: quantize.time_calls)
from attnkit.quantized.base import _by_row_blocks, _describe, _finish, _frozen

__all__ = [
    "INT8_KERNELS",
    "Int8Kernel",
    "Int8Linear",
    "choose_int8_kernel",
    "default_int8_kernel",
    "int8_kernel_seconds",
    "int8_kernels",
]

#: The ways an :class:`Int8Linear` multiplies (see the module's docstring); ``"auto"`` measures.
INT8_KERNELS = policy.INT8_KERNELS
Int8Kernel = Literal["default", "auto", "attnkit", "fbgemm", "int8pack", "dequantize"]


class Int8Linear(nn.Module):
    """A linear whose weight is int8 with one float32 scale per output channel.

    ``weight ≈ codes * scale[:, None]`` (symmetric, round to nearest, scale ``max|row| / 127``).
    The bias, if any, keeps its dtype. Build it with :meth:`from_linear`; ``kernel`` names how it
    multiplies (:data:`INT8_KERNELS`; see the module's docstring).

    The codes are stored once: in ``weight_int8`` (in the ``"attnkit"`` kernel's order with that
    kernel, :func:`attnkit.kernels.linear.group_codes`), or, with the ``"fbgemm"`` kernel, in
    fbgemm's prepacked copy (:meth:`codes` gives them row-major either way). fbgemm pads the inputs
    of its packed weight to a multiple of 512 (its cache block), so where ``in_features`` is larger
    and not a multiple, only the leading multiple is packed and ``weight_int8`` keeps the remaining
    inputs' codes (``(out, in % 512)``, multiplied by ``torch._weight_int8pack_mm`` where it takes
    them); otherwise it is empty. Either way the state dict holds ``weight_int8`` with all the
    codes, row-major, so a state dict saved from a layer with one kernel loads into a layer with any
    other.

    Shape: ``(*, in_features) -> (*, out_features)``, in the input's dtype.
    """

    weight_int8: Tensor
    scale: Tensor
    scale_bf16: Tensor
    fbgemm_handle: Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # Codes and scales are parameters without gradients (see _frozen), in the state dict.
        self.weight_int8 = _frozen(torch.zeros(out_features, in_features, dtype=torch.int8))
        self.scale = _frozen(torch.ones(out_features))
        # The scales the int8 kernel reads (it takes them in the activations' dtype).
        self.register_buffer(
            "scale_bf16", torch.ones(out_features, dtype=torch.bfloat16), persistent=False
        )
        # Which prepacked weight a compiled graph's fbgemm call reads (a tensor, so that graphs
        # of models of the same shape are shared; -1: none).
        self.register_buffer(
            "fbgemm_handle", torch.tensor(-1, dtype=torch.long, device="cpu"), persistent=False
        )
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernel = "dequantize"
        self._packed: Any = None  # fbgemm's prepacked weight (kernel "fbgemm")

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: Tensor, bias: Tensor | None = None, *, kernel: Int8Kernel = "default"
    ) -> Int8Linear:
        """Quantize ``weight`` ``(out, in)`` (any float dtype) per output channel.

        ``kernel="default"`` is :func:`default_int8_kernel`'s choice for the shape (the same on
        every run on a machine); ``kernel="auto"`` takes :func:`choose_int8_kernel`'s measured
        choice.

        Raises:
            ValueError: A weight that is not 2-D float, an unknown ``kernel``, or one that
                cannot run this weight (:func:`int8_kernels`).
        """
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"Int8Linear needs a 2-D float weight, got shape {tuple(weight.shape)} "
                f"and dtype {weight.dtype}"
            )
        out_features, in_features = weight.shape
        usable = int8_kernels(in_features, weight.device)
        kernel = policy.int8_kernel_name(kernel)  # type: ignore[assignment]
        if kernel == "default":
            kernel = default_int8_kernel(in_features, weight.device)  # type: ignore[assignment]
        elif kernel == "auto":
            kernel = choose_int8_kernel(in_features, out_features, weight.device)  # type: ignore[assignment]
        elif kernel not in usable:
            raise ValueError(
                f"kernel {kernel!r} cannot run a {in_features}-input weight on "
                f"{weight.device}; usable: {usable}"
            )
        weight = weight.detach()
        scale = int8_scales(weight)
        if kernel == "fbgemm":  # (packed a block of rows at a time: no whole int8 copy)
            new = cls._empty(in_features, out_features, scale, bias, kernel)
            new._set_packed(functools.partial(int8_round_rows, weight, scale))
            return new
        if kernel == "attnkit":  # (rounded and put in the kernel's order a block of rows at a time)
            new = cls._empty(in_features, out_features, scale, bias, kernel)
            new.weight_int8 = _frozen(torch.empty(out_features, in_features, dtype=torch.int8))
            step = max(4, rows_per_block(in_features) // 4 * 4)  # (whole groups of four)
            for start in range(0, out_features, step):
                codes = int8_round_rows(weight, scale, start, start + step)
                new.weight_int8[start : start + step] = group_codes(codes)
            return new
        codes = int8_round_rows(weight, scale, 0, out_features)
        return cls.from_codes(codes, scale, bias, kernel=kernel)  # type: ignore[arg-type]

    @classmethod
    def from_codes(
        cls,
        codes: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        *,
        kernel: str = "dequantize",
    ) -> Int8Linear:
        """The layer of int8 ``codes`` ``(out, in)`` and float32 ``scale`` ``(out,)``,
        multiplying with ``kernel`` (one of :func:`int8_kernels`). ``codes`` are kept (not
        copied), except with ``"fbgemm"``, which keeps only its prepacked copy of them, and
        ``"attnkit"``, which keeps them in its kernel's order
        (:func:`attnkit.kernels.linear.group_codes`)."""
        kernel = policy.int8_kernel_name(kernel)
        if kernel not in INT8_KERNELS:
            raise ValueError(f"kernel must be one of {INT8_KERNELS}, got {kernel!r}")
        out_features, in_features = codes.shape
        new = cls._empty(in_features, out_features, scale, bias, kernel)
        if kernel == "fbgemm":
            new._set_packed(lambda start, stop: codes[start:stop])
        elif kernel == "attnkit":
            new.weight_int8 = _frozen(group_codes(codes))
        else:
            new.weight_int8 = _frozen(codes)
        return new

    @classmethod
    def _empty(
        cls, in_features: int, out_features: int, scale: Tensor, bias: Tensor | None, kernel: str
    ) -> Int8Linear:
        """The layer with its scales, bias and kernel, before its codes are set."""
        with torch.device("meta"):  # (the buffers are replaced: no zeros to fill)
            new = cls(in_features, out_features, bias=False)
        new.scale = _frozen(scale)
        new.scale_bf16 = new.scale.to(torch.bfloat16)
        new.fbgemm_handle = torch.tensor(-1)
        new.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        new.kernel = kernel
        return new

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, kernel: Int8Kernel = "default") -> Int8Linear:
        """Quantize ``linear``'s weight; its bias is kept as it is."""
        return cls.from_weight(linear.weight, linear.bias, kernel=kernel)

    def _set_packed(self, rows: Callable[[int, int], Tensor]) -> None:
        """Keep the int8 codes as fbgemm's prepacked copies of the leading inputs, in blocks of
        rows (so the codes never exist twice whole), and the other inputs' in ``weight_int8``.

        Args:
            rows: ``rows(start, stop)`` gives the codes of rows ``start:stop``, ``(rows, in)``.
        """
        main = fbgemm_inputs(self.in_features)
        step = _pack_rows(main)
        rest = self.in_features - main
        self.weight_int8 = _frozen(torch.empty(self.out_features, rest, dtype=torch.int8))
        packed = []
        for start in range(0, self.out_features, step):
            codes = rows(start, start + step)
            packed.append(
                fbgemm_pack(codes[:, :main].contiguous(), self.scale[start : start + step])
            )
            self.weight_int8[start : start + step] = codes[:, main:]
        self._packed = packed
        self._register_packed()

    def _register_packed(self) -> None:
        """Give the prepacked weight a handle for compiled graphs (the old one's entry goes)."""
        previous = _FINALIZERS.pop(self, None)
        if previous is not None:
            previous()
        handle = register_packed(self._packed, int8pack_tail=self._int8pack_tail())
        _FINALIZERS[self] = weakref.finalize(self, release_packed, handle)
        self.fbgemm_handle = torch.tensor(handle)

    def _int8pack_tail(self) -> bool:
        """Whether the inputs fbgemm does not pack run ``torch._weight_int8pack_mm``."""
        return policy.int8pack_takes(self.in_features - fbgemm_inputs(self.in_features))

    def codes(self) -> Tensor:
        """The int8 codes, ``(out, in)``, row-major: ``weight_int8``, or (a new tensor) unpacked
        from fbgemm's prepacked copy where that is the only one, or ``weight_int8`` put back
        in row order from the ``"attnkit"`` kernel's order."""
        if self.kernel == "attnkit":
            return ungroup_codes(self.weight_int8)
        if self._packed is None:
            return self.weight_int8
        with warnings.catch_warnings():  # (torch.ao's deprecation notice for quantized tensors)
            warnings.simplefilter("ignore")
            main = [torch.ops.quantized.linear_unpack(p)[0].int_repr() for p in self._packed]
        return torch.cat([torch.cat(main), self.weight_int8.cpu()], dim=1)

    @property
    def packed_bytes(self) -> int:
        """Bytes of fbgemm's prepacked weight: one a packed weight (fbgemm pads inputs to a
        multiple of 512, so fewer inputs take 512 bytes a row); 0 for other kernels."""
        if self._packed is None:
            return 0
        return self.out_features * -(-fbgemm_inputs(self.in_features) // 512) * 512

    def dequantize(self) -> Tensor:
        """The float32 weight this module computes with. Shape: ``(out, in)``."""
        return self.codes().to(self.scale.device).float() * self.scale[:, None]

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._packed is not None or self.kernel == "attnkit":  # (the codes, row-major)
            destination[prefix + "weight_int8"] = self.codes()

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight_int8"
        given = state_dict.get(key)
        shape = (self.out_features, self.in_features)
        if self.kernel == "attnkit" and isinstance(given, Tensor) and given.shape == shape:
            state_dict = {**state_dict, key: group_codes(given)}  # (in the kernel's order)
        codes = given if self._packed is not None else None
        if codes is not None:  # (the placeholder takes them; the prepacked copy is rebuilt)
            state_dict = {**state_dict, key: self.weight_int8}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self.scale_bf16 = self.scale.to(torch.bfloat16)
        if self._packed is None:
            return
        if codes is None:  # (a non-strict load without codes: the new scales, the old codes)
            codes = self.codes()
        elif not isinstance(codes, Tensor) or codes.shape != shape or codes.dtype != torch.int8:
            error_msgs.append(
                f"size mismatch for {key}: copying {getattr(codes, 'dtype', type(codes))} "
                f"{tuple(getattr(codes, 'shape', ()))} from checkpoint, the layer holds int8 "
                f"codes of shape {shape}."
            )
            return
        codes = codes.detach().cpu()
        self._set_packed(lambda start, stop: codes[start:stop])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self._packed is not None:  # (a copy: its prepacked weight gets a handle of its own)
            self._register_packed()

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(*, in) -> (*, out)``."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        compiling = torch.compiler.is_compiling()
        kernel = self.kernel if x2.device.type == "cpu" else "dequantize"
        if (
            kernel == "attnkit"
            and not x2.requires_grad
            and policy.int8_kernel_rows(x2.shape[0], compiling=compiling)
        ):
            xf = x2.float()
            if compiling:  # (one opaque op of the graph)
                y = torch.ops.attnkit.int8_dot_linear(xf, self.weight_int8, self.scale)
            elif self.scale.dtype == torch.float32:  # (the layer holds the kernel's shapes)
                y = int8_product(xf.contiguous(), self.weight_int8, self.scale)
            else:  # (a cast scale, e.g. after .half(): the checks name it)
                y = int8_dot_linear(xf, self.weight_int8, self.scale)
        elif kernel == "attnkit":
            # A prompt, or a product gradients flow through (e.g. to an adapter's input): the
            # float product of the activations rounded as the kernel rounds them, so a row's
            # output does not depend on how many rows came with it.
            rounded = round_activations(x2)
            if x2.requires_grad:  # (straight through the rounding: the float product's gradient)
                rounded = x2.float() + (rounded - x2.float()).detach()
            y = _dequantized_product(rounded, self.weight_int8, self.scale)
        elif kernel == "fbgemm" and compiling:
            # (an opaque call in the graph: dynamo cannot trace the prepacked weight)
            y = torch.ops.attnkit.int8_fbgemm_linear(
                x2.float(), self.fbgemm_handle, self.weight_int8, self.scale, self.scale_bf16
            )
        elif kernel == "fbgemm":
            y = fbgemm_product(
                x2.float(),
                self._packed,
                self.weight_int8,
                self.scale,
                self.scale_bf16,
                int8pack_tail=self._int8pack_tail(),
            )
        elif x2.shape[0] == 1 and compiling:
            # One streaming pass over the int8 bytes; float32 sums.
            y = (self.weight_int8.float() * x2.float()).sum(-1) * self.scale
            y = y.reshape(1, -1)
        elif kernel == "int8pack" and policy.int8pack_takes(self.in_features):
            xb = x2.to(torch.bfloat16).contiguous()
            # An identity view that makes inductor store the input: its int8 GEMM lowering
            # takes stored tensors, not fused expressions.
            xb = torch.as_strided(xb, xb.shape, xb.stride())
            y = torch._weight_int8pack_mm(xb, self.weight_int8, self.scale_bf16)
        else:
            y = F.linear(x2, self.dequantize().to(x2.dtype))
        return _finish(self, y, x, shape)

    def extra_repr(self) -> str:
        return _describe(self, f"int8 per-channel, kernel={self.kernel}")


# Each fbgemm layer's finalizer, which forgets its prepacked weight's handle.
_FINALIZERS: weakref.WeakKeyDictionary[Int8Linear, weakref.finalize[Any, Any]] = (
    weakref.WeakKeyDictionary()
)
#: fbgemm's packing under its former name (:func:`attnkit.kernels.linear.fbgemm_pack`).
_fbgemm_pack = fbgemm_pack


def _pack_rows(inputs: int) -> int:
    """Rows of an fbgemm weight with ``inputs`` packed inputs per prepacked block: about
    8 MiB, a multiple of 96 (fbgemm's column blocks are 8, 32 or 48 by CPU)."""
    return max(96, (8 << 20) // max(inputs, 1) // 96 * 96)


def _dequantized_product(x: Tensor, grouped: Tensor, scale: Tensor) -> Tensor:
    """``x @ (codes * scale[:, None]).T`` for the codes in the ``"attnkit"`` kernel's order, a
    block of output rows at a time: each block's float weight (about 1 MiB) is made and
    multiplied while it is in cache (by :func:`attnkit.decoding.linear`: oneDNN's GEMM where it
    is the faster), and the scales go on the product's columns.

    Shape: ``(rows, in) -> (rows, out)``, float32.
    """

    def block(start: int, stop: int) -> Tensor:
        weight = ungroup_codes(grouped[start:stop], torch.float32)
        return linear(x, weight) * scale[start:stop]

    out, n = grouped.shape
    return _by_row_blocks(x, out, n, block)


def int8_kernels(in_features: int, device: torch.device | str = "cpu") -> tuple[str, ...]:
    """The :data:`INT8_KERNELS` that can run a weight with ``in_features`` inputs on ``device``
    (``"dequantize"`` always can; ``"int8pack"`` where
    :func:`attnkit.kernels.policy.int8pack_takes`)."""
    if torch.device(device).type != "cpu":
        return ("dequantize",)
    usable = ["attnkit"] if in_features % INT8_DOT_BLOCK == 0 and kernels_available() else []
    if fbgemm_engine():
        usable.append("fbgemm")
    if policy.int8pack_takes(in_features):
        usable.append("int8pack")
    return (*usable, "dequantize")


def default_int8_kernel(in_features: int, device: torch.device | str = "cpu") -> str:
    """The kernel ``int8_kernel="default"`` takes: the policy's choice ``linear.int8`` where it
    runs the shape, else the first of its rule's order that does
    (:func:`attnkit.kernels.policy.int8_kernel`); ``"dequantize"`` on other devices.
    ``int8_kernel="auto"`` measures per shape instead (:func:`choose_int8_kernel`).
    """
    usable = int8_kernels(in_features, device)
    if usable == ("dequantize",):
        return "dequantize"
    return policy.int8_kernel(usable)


@functools.cache
def _measured_seconds(in_features: int, out_features: int, threads: int) -> dict[str, float]:
    candidates = tuple(k for k in int8_kernels(in_features) if k != "dequantize")
    if len(candidates) < 2:
        return {}
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    scale = torch.rand(out_features, generator=gen) / 127
    x = torch.randn(1, in_features, generator=gen)
    # Copies of the weight, 1.5x the last-level cache in all (32 at most): each timed call reads
    # its weight from memory, one after another, as the layers of a decode step do.
    count = min(32, -(-3 * last_level_cache_bytes() // (2 * codes.numel())))
    copies = [codes] + [codes.clone() for _ in range(count - 1)]
    layers = {k: [Int8Linear.from_codes(c, scale, kernel=k) for c in copies] for k in candidates}

    def run(kernel: str) -> None:
        for layer in layers[kernel]:
            layer(x)

    with torch.no_grad():
        seconds = time_calls({k: functools.partial(run, k) for k in layers}, rounds=5)
    return {k: t / len(copies) for k, t in seconds.items()}


def int8_kernel_seconds(in_features: int, out_features: int) -> dict[str, float]:
    """Seconds per one-row product of each CPU int8 kernel (:func:`int8_kernels` but
    ``"dequantize"``) on an ``(out, in)`` weight, as :func:`choose_int8_kernel` measured them
    (empty where fewer than two kernels can run the shape).

    Measured at the first call for each shape and thread count, then cached for the process:
    one call on each of enough copies of a random weight to fill 1.5x the last-level cache (32
    copies at most), so each reads its weight from memory, one after another, as the layers of a
    decode step do; interleaved rounds, medians.
    """
    return dict(_measured_seconds(in_features, out_features, torch.get_num_threads()))


def choose_int8_kernel(
    in_features: int, out_features: int, device: torch.device | str = "cpu"
) -> str:
    """The fastest of :func:`int8_kernels` at multiplying one row by an ``(out, in)`` int8 weight.

    The timings are :func:`int8_kernel_seconds`'s; a shape only one kernel can run gets it, other
    devices ``"dequantize"``.
    """
    if torch.device(device).type != "cpu":
        return "dequantize"
    seconds = int8_kernel_seconds(in_features, out_features)
    if seconds:
        return min(seconds, key=seconds.__getitem__)
    usable = int8_kernels(in_features)
    return usable[0]
