"""Every ``torch.library`` op of attnkit, in one place: the kernels compiled graphs call.

* ``attnkit::int8_dot_linear``, ``attnkit::int4_dot_linear``, ``attnkit::float_dot_linear``:
  :mod:`attnkit.kernels.linear`'s products;
* ``attnkit::block_dot_linear``: :mod:`attnkit.kernels.block_linear`'s product;
* ``attnkit::int8_fbgemm_linear``: fbgemm's product over a layer's prepacked weight (by handle);
* ``attnkit::one_query_attention``: :func:`attnkit.kernels.one_query.one_query_attention`.

Each is defined here with its fake (shape) function and a Python implementation, registered
through torch.library's plain registration rather than ``torch.library.custom_op``, whose Python
wrapper costs more per call. The kernels' ops have C++ implementations as well
(``csrc/ops.cpp``, :func:`attnkit.kernels.build.load_ops`): loaded, they take precedence over the
Python ones (those are registered for every backend, the C++ ones for the CPU), and the
dispatcher calls the kernels without entering Python.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels.block_linear import block_dot_linear
from attnkit.kernels.linear import (
    fbgemm_linear,
    float_dot_linear,
    int4_dot_linear,
    int8_dot_linear,
)
from attnkit.kernels.one_query import one_query_attention

__all__: list[str] = []

_OPS = torch.library.Library("attnkit", "FRAGMENT")

_OPS.define("int8_dot_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_OPS.impl("int8_dot_linear", int8_dot_linear, "CompositeExplicitAutograd")


def _rows_by_codes(x: Tensor, codes: Tensor, *rest: object, **named: object) -> Tensor:
    """The fake of a product with a weight of one row of codes per output: ``(rows, out)``."""
    return x.new_empty(x.shape[0], codes.shape[0])


torch.library.register_fake("attnkit::int8_dot_linear", _rows_by_codes, lib=_OPS)


_OPS.define("int4_dot_linear(Tensor x, Tensor codes, Tensor scales, int out) -> Tensor")
_OPS.impl("int4_dot_linear", int4_dot_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("attnkit::int4_dot_linear", lib=_OPS)
def _(x: Tensor, codes: Tensor, scales: Tensor, out: int) -> Tensor:
    return x.new_empty(x.shape[0], out)


_OPS.define(
    "block_dot_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int bits, "
    "bool rounded=False) -> Tensor"
)
_OPS.impl("block_dot_linear", block_dot_linear, "CompositeExplicitAutograd")


torch.library.register_fake("attnkit::block_dot_linear", _rows_by_codes, lib=_OPS)


_OPS.define("float_dot_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_OPS.impl("float_dot_linear", float_dot_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("attnkit::float_dot_linear", lib=_OPS)
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _one_query_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    return one_query_attention(q, k, v, mask, scale)[0]


_OPS.define(
    "one_query_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor"
)
_OPS.impl("one_query_attention", _one_query_op, "CompositeExplicitAutograd")


@torch.library.register_fake("attnkit::one_query_attention", lib=_OPS)
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])


# (an opaque call in a graph: dynamo cannot trace fbgemm's prepacked weight)
_OPS.define(
    "int8_fbgemm_linear(Tensor x, Tensor handle, Tensor tail, Tensor scale, Tensor scale_bf16)"
    " -> Tensor"
)
_OPS.impl("int8_fbgemm_linear", fbgemm_linear, "CPU")


@torch.library.register_fake("attnkit::int8_fbgemm_linear", lib=_OPS)
def _(x: Tensor, handle: Tensor, tail: Tensor, scale: Tensor, scale_bf16: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], scale_bf16.shape[0])
