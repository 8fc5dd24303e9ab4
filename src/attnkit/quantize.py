"""Weight-only int8 and int4 quantization of a model's linears, as a module swap.

Decoding one token reads every weight once, so on a CPU it runs at the read bandwidth divided by
the weight bytes: int8 weights read a quarter of fp32's bytes, int4 an eighth. :func:`quantize`
replaces each plain linear of a model (``nn.Linear`` or :class:`attnkit.decoding.PreparedLinear`)
by a quantized linear of :mod:`attnkit.quantized`; the model's own forward runs them, so
generation, ``return_weights`` and the explorer work unchanged (attention weights, norms and
embeddings are not quantized). A tied output head gets a quantized copy of the embedding
(``lm_head``) while the lookup keeps the full-precision table.

Layouts (``layout=``):

* ``"channel"`` (int8): :class:`Int8Linear`, one scale per output channel; its kernels
  (``int8_kernel=``) are described in :mod:`attnkit.quantized.int8`.
* ``"q8_0"`` (int8), ``"q4_1"`` and ``"q4_0"`` (int4): :class:`BlockLinear`, GGUF's block layouts,
  one f16 scale (``q4_1``: and minimum) per group of 32 inputs (int4: ``group_size``), float32
  activations: the layer computes the float product of its dequantized weight.
* ``"grouped"`` (int4): :class:`Int4Linear`, an asymmetric bf16 scale and offset per group,
  activations rounded to int8 per block of 32 for integer dots: faster where integer dots
  outrun float ones, less exact (an explicit choice of speed over exactness).
* ``"auto"`` (the default): int8 takes ``"channel"`` for a layer whose per-channel weight gives
  a relative output error on a probe input (:func:`layer_error`) of at most
  :data:`CHANNEL_TOLERANCE`, else ``"q8_0"`` where that is more exact (one scale per channel
  loses precision where a row holds outliers); int4 takes
  :data:`INT4_DEFAULT_LAYOUT`.

A layer whose inputs no block or group divides falls back to ``"channel"`` int8.
``attnkit bench`` and ``python -m attnkit.bench.quantization`` measure each layout's quality and
speed.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from attnkit.decoding import PreparedLinear
from attnkit.kernels.probe import last_level_cache_bytes  # (re-exported)
from attnkit.profiling import time_calls  # (re-exported: quantize.time_calls)
from attnkit.quantized import (
    BLOCK_LAYOUTS,
    INT8_KERNELS,
    BlockLinear,
    Int4Linear,
    Int8Kernel,
    Int8Linear,
    choose_int8_kernel,
    default_int8_kernel,
    int8_kernel_seconds,
    int8_kernels,
)
from attnkit.quantized.base import GROUP_SIZES

__all__ = [
    "BLOCK_LAYOUTS",
    "CHANNEL_TOLERANCE",
    "INT4_DEFAULT_LAYOUT",
    "INT8_KERNELS",
    "LAYOUTS",
    "MODES",
    "BlockLinear",
    "Int4Linear",
    "Int8Linear",
    "Layout",
    "Mode",
    "choose_int8_kernel",
    "default_int8_kernel",
    "int8_kernel_seconds",
    "int8_kernels",
    "last_level_cache_bytes",
    "layer_error",
    "quantize",
    "quantize_linear",
    "time_calls",
]

Mode = Literal["int8", "int4"]
MODES: tuple[Mode, ...] = ("int8", "int4")
Layout = Literal["auto", "channel", "q8_0", "q4_0", "q4_1", "grouped"]
#: The layouts each mode takes (see the module's docstring).
LAYOUTS: dict[str, tuple[str, ...]] = {
    "int8": ("auto", "channel", "q8_0"),
    "int4": ("auto", "q4_1", "q4_0", "grouped"),
}
#: Largest relative output error (Frobenius norm, on :func:`layer_error`'s probe) at which
#: ``layout="auto"`` keeps an int8 layer per channel rather than in 32-input blocks.
CHANNEL_TOLERANCE = 0.01
#: The int4 layout ``layout="auto"`` takes.
INT4_DEFAULT_LAYOUT = "grouped"
#: Rows of the probe input :func:`layer_error` multiplies.
PROBE_ROWS = 32


@torch.no_grad()
def layer_error(weight: Tensor, dequantized: Tensor, *, rows: int = PROBE_ROWS) -> float:
    """Relative output error of a linear whose float ``weight`` ``(out, in)`` is held as
    ``dequantized`` on a probe input: ``|| x (D - W)^T || / || x W^T ||`` for ``rows`` rows of
    standard normal ``x`` (a fixed seed: every call gives the same number). It measures the
    layout alone, not a kernel's rounding of the activations."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.device)
    w = weight.detach().float()
    want = x @ w.T
    return float((x @ (dequantized.float() - w).T).norm() / want.norm().clamp(min=1e-30))


def _channel_weight(weight: Tensor) -> Tensor:
    """``weight`` rounded to int8 per output channel and back (what :class:`Int8Linear` holds)."""
    w = weight.detach().float()
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).round().clamp(-127, 127) * scale


def _group_for(in_features: int, group_size: int) -> int | None:
    """``group_size`` if it divides ``in_features``, else the largest smaller one that does."""
    for size in GROUP_SIZES:
        if size <= group_size and in_features % size == 0:
            return size
    return None


def _quantized(
    weight: Tensor,
    bias: Tensor | None,
    mode: Mode,
    group_size: int,
    kernel: Int8Kernel = "default",
    layout: str = "auto",
) -> nn.Module:
    n = weight.shape[1]
    if mode == "int4":
        group = _group_for(n, group_size)
        chosen = INT4_DEFAULT_LAYOUT if layout == "auto" else layout
        if group is not None and chosen == "grouped" and weight.device.type == "cpu":
            return Int4Linear.from_weight(weight, bias, group_size=group)
        if group is not None and chosen != "grouped":
            return BlockLinear.from_weight(weight, bias, layout=chosen, group_size=group)  # type: ignore[arg-type]
    # int4 weights no group divides (and int4 "grouped" on other devices) fall back to int8.
    if kernel not in ("default", "auto", *int8_kernels(n, weight.device)):
        kernel = "default"  # (a named kernel that cannot run this weight: the default's rule)
    blocks = n % GROUP_SIZES[-1] == 0
    if layout == "q8_0" and blocks:
        return BlockLinear.from_weight(weight, bias, layout="q8_0")
    if layout == "auto" and mode == "int8" and blocks:
        error = layer_error(weight, _channel_weight(weight))
        if error > CHANNEL_TOLERANCE:
            block = BlockLinear.from_weight(weight, bias, layout="q8_0")
            if layer_error(weight, block.dequantize()) < error:
                return block
    return Int8Linear.from_weight(weight, bias, kernel=kernel)


def _check_options(
    mode: str, group_size: int, int8_kernel: str = "default", layout: str = "auto"
) -> None:
    """Raise a ValueError naming an unknown ``mode``, ``group_size``, ``int8_kernel`` or a
    ``layout`` the mode does not take."""
    if int8_kernel not in ("default", "auto") and int8_kernel not in INT8_KERNELS:
        raise ValueError(
            f"int8_kernel must be 'default', 'auto' or one of {INT8_KERNELS}, got {int8_kernel!r}"
        )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if layout not in LAYOUTS[mode]:
        raise ValueError(f"layout for {mode} must be one of {LAYOUTS[mode]}, got {layout!r}")


def quantize_linear(
    linear: nn.Linear,
    mode: Mode,
    *,
    group_size: int = 32,
    int8_kernel: Int8Kernel = "default",
    layout: Layout = "auto",
) -> nn.Module:
    """``linear`` as a quantized linear (the rule of :func:`quantize`).

    Loading with ``quantize=`` calls this on each linear as soon as its weight is streamed in.

    Raises:
        ValueError: Unknown ``mode``, ``group_size``, ``int8_kernel`` or ``layout``.
    """
    _check_options(mode, group_size, int8_kernel, layout)
    with torch.no_grad():
        return _quantized(linear.weight, linear.bias, mode, group_size, int8_kernel, layout)


@torch.no_grad()
def quantize(
    model: nn.Module,
    mode: Mode,
    *,
    group_size: int = 32,
    head: bool = True,
    int8_kernel: Int8Kernel = "default",
    layout: Layout = "auto",
) -> nn.Module:
    """Quantize ``model``'s linear weights in place (weight-only) and return it.

    Args:
        model: Any module. Its plain linears (``nn.Linear`` and
            :class:`attnkit.decoding.PreparedLinear`, exactly those types) are swapped;
            subclasses (a LoRA wrapper, a user's own) and already quantized modules stay.
        mode: ``"int8"`` or ``"int4"``.
        group_size: int4 group size: 32 (GGUF's), 64, 128 or 256; a linear whose input size no
            group size of at most ``group_size`` divides gets int8.
        head: Also quantize a tied output head: a model with an ``embedding`` and an
            ``lm_head`` of ``None`` (a tied :class:`attnkit.TransformerLM`) gets an ``lm_head``
            holding the quantized embedding; the embedding itself stays for the lookup.
        int8_kernel: The CPU kernel of per-channel int8 linears: ``"default"`` (the rule of
            :func:`default_int8_kernel`), ``"attnkit"``, ``"fbgemm"``, ``"int8pack"``,
            ``"dequantize"``, or ``"auto"`` (the fastest measured per shape).
        layout: ``"auto"`` (per layer for int8, :data:`INT4_DEFAULT_LAYOUT` for int4), or one of
            :data:`LAYOUTS` for the mode (see the module's docstring).

    Returns:
        ``model``.

    Raises:
        ValueError: Unknown ``mode``, ``group_size``, ``int8_kernel`` or ``layout``.
    """
    _check_options(mode, group_size, int8_kernel, layout)
    swaps = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, PreparedLinear)
    ]
    for parent, name in swaps:  # (no list of the old linears: each goes once it is swapped)
        child = getattr(parent, name)
        new = _quantized(child.weight, child.bias, mode, group_size, int8_kernel, layout)
        setattr(parent, name, new)
        del child
    embedding = getattr(model, "embedding", None)
    if head and isinstance(embedding, nn.Embedding) and getattr(model, "lm_head", 0) is None:
        model.lm_head = _quantized(embedding.weight, None, mode, group_size, int8_kernel, layout)
    # A compiled step traced before the swap would run the old modules.
    model.__dict__.pop("_attnkit_step", None)
    return model
