"""The ``ctypes`` signatures of the kernels' C functions (``csrc/*.c``), declared once when the
library loads (:func:`attnkit.kernels.build.load_library`)."""

from __future__ import annotations

import ctypes

from torch import Tensor

__all__ = ["StepCache", "StepLayer", "StepLinear", "StepShape", "View", "declare", "view"]


class View(ctypes.Structure):
    """csrc/flash.c's ``view``: a ``(count, heads, rows, dim)`` tensor's data and strides."""

    _fields_ = (
        ("data", ctypes.c_void_p),
        ("item", ctypes.c_int64),
        ("head", ctypes.c_int64),
        ("row", ctypes.c_int64),
    )


class StepLinear(ctypes.Structure):
    """csrc/step.c's ``step_linear``: one product's weight kind, sizes and pointers."""

    _fields_ = (
        ("kind", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("out", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("bits", ctypes.c_int64),
        ("tile", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    )


class StepLayer(ctypes.Structure):
    """csrc/step.c's ``step_layer``: a layer's norm weights and epsilons, its attention's
    window, soft cap and query/key norms, its output norms, its rotary tables, its products."""

    _fields_ = (
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("cap", ctypes.c_float),
        ("q_eps", ctypes.c_float),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("k_eps", ctypes.c_float),
        ("post_eps1", ctypes.c_float),
        ("post1", ctypes.c_void_p),
        ("post2", ctypes.c_void_p),
        ("post_eps2", ctypes.c_float),
        ("local", ctypes.c_int64),
        ("qkv", StepLinear),
        ("out", StepLinear),
        ("gate_up", StepLinear),
        ("down", StepLinear),
    )


class StepCache(ctypes.Structure):
    """csrc/step.c's ``step_cache``: where a step's keys and values go and which it attends."""

    _fields_ = (
        ("storage", ctypes.POINTER(ctypes.c_void_p)),
        ("head", ctypes.c_int64),
        ("row", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("capacity", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("keys", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("first", ctypes.c_void_p),
        ("count", ctypes.c_void_p),
        ("batched", ctypes.c_int64),
        ("batch", ctypes.c_int64),
        ("padding", ctypes.c_void_p),
        ("padding_row", ctypes.c_int64),
        ("padding_key", ctypes.c_int64),
    )


class StepShape(ctypes.Structure):
    """csrc/step.c's ``step_shape``: the stack's sizes, attention scale, rotary layout,
    whether its activations are bf16, its kind of RMSNorm and its gate's activation."""

    _fields_ = (
        ("dim", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("interleaved", ctypes.c_int64),
        ("bf16", ctypes.c_int64),
        ("plus_one", ctypes.c_int64),
        ("gate", ctypes.c_int64),
    )


def view(t: Tensor) -> View:
    """``t`` ``(count, heads, rows, dim)`` with a contiguous last dim as a :class:`View`."""
    rows, dim = t.shape[2], t.shape[3]
    row = t.stride(2) if rows > 1 else max(dim, 1)
    return View(t.data_ptr(), t.stride(0), t.stride(1), row)


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument and result types of every function of the kernels' library ``lib``."""
    int64, pointer, floats, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    for call in (lib.attnkit_int8_linear, lib.attnkit_bf16_linear, lib.attnkit_float_linear):
        call.argtypes = [pointer, int64, int64, pointer, pointer, int64, pointer, flag]
        call.restype = flag
    # The switches between each product's narrow and wide dots (-1 asks, 0/1 sets).
    for call in (lib.attnkit_int8_wide, lib.attnkit_float_wide):
        call.argtypes, call.restype = [flag], flag
    call = lib.attnkit_int4_linear
    call.argtypes = [pointer, int64, int64, pointer, pointer, int64, int64, pointer, flag]
    call.restype = flag
    for call in (lib.attnkit_block_linear, lib.attnkit_block_linear_rounded):
        call.argtypes = [pointer, int64, int64, pointer, pointer, pointer, int64, flag, int64]
        call.argtypes += [pointer, flag, flag]
        call.restype = flag
    call = lib.attnkit_capped_softmax
    call.argtypes = [pointer, *[int64] * 5, flag, int64, floats, flag, flag]
    call.restype = flag
    call = lib.attnkit_flash_forward
    call.argtypes = [View] * 4 + [pointer, int64, int64, pointer, int64, flag, int64]
    call.argtypes += [floats, floats, flag, pointer, int64, int64, flag, pointer, pointer, flag]
    call.restype = flag
    call = lib.attnkit_bf16_gemm_native
    call.argtypes = []
    call.restype = flag
    call = lib.attnkit_flash_backward
    call.argtypes = [View, View, View, View, View, pointer, int64, int64, View, View, View]
    call.argtypes += [pointer, int64, flag, int64, floats, pointer, int64, int64, flag, flag]
    call.argtypes += [pointer, pointer, flag]
    call.restype = flag
    call = lib.attnkit_one_query_attention
    call.argtypes = [pointer, *[int64] * 4, pointer, *[int64] * 3, pointer, *[int64] * 5]
    call.argtypes += [pointer, int64, int64, floats, floats, pointer, flag, flag]
    call.restype = flag
    call = lib.attnkit_paged_one_query_attention
    call.argtypes = [pointer, *[int64] * 4, pointer, int64, int64, pointer, int64, int64, int64]
    call.argtypes += [pointer, int64, pointer, pointer, int64, floats, floats, pointer, flag, flag]
    call.restype = flag
    call = lib.attnkit_rms_norm
    call.argtypes = [pointer, int64, int64, int64, pointer, pointer, floats, flag, flag]
    call.restype = flag
    call = lib.attnkit_rotate
    call.argtypes = [pointer, *[int64] * 7, pointer, pointer, int64, pointer, flag, flag, flag]
    call.restype = flag
    call = lib.attnkit_decoder_step
    call.argtypes = [ctypes.POINTER(StepLayer), int64, ctypes.POINTER(StepShape), pointer, int64]
    call.argtypes += [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(StepCache), flag]
    call.restype = flag
