"""attnkit's own kernels under their former home: the public names of :mod:`attnkit.kernels`.

The kernels live in :mod:`attnkit.kernels` (building and loading in
:mod:`attnkit.kernels.build`, one module per family: :mod:`attnkit.kernels.attention`,
:mod:`attnkit.kernels.one_query`, :mod:`attnkit.kernels.linear`, :mod:`attnkit.kernels.rows`,
the ops in :mod:`attnkit.kernels.ops`), and the choice of kernel in
:mod:`attnkit.kernels.policy`. This module keeps the names code has imported from
``attnkit.native``.
"""

from __future__ import annotations

from attnkit import kernels as _kernels  # noqa: F401  (registers the ops)
from attnkit.kernels.attention import (
    capped_attention,
    capped_softmax_,
    flash_attention,
    flash_attention_backward,
    flash_available,
)
from attnkit.kernels.build import (
    eager_cpu,
    kernels_available,
    kernels_loaded,
    kernels_unavailable,
    load_ops,
    ops_unavailable,
)
from attnkit.kernels.linear import (
    INT8_DOT_BLOCK,
    float_dot_linear,
    float_wide_dots,
    group_codes,
    int4_dot_linear,
    int8_dot_linear,
    int8_wide_dots,
    pack_int4,
    pack_int4_scales,
    round_activations,
    ungroup_codes,
    unpack_int4,
    unpack_int4_scales,
)
from attnkit.kernels.one_query import NO_KEY, NON_FINITE, one_query_attention
from attnkit.kernels.probe import capabilities
from attnkit.kernels.rows import rms_norm, rotate

__all__ = [
    "INT8_DOT_BLOCK",
    "NON_FINITE",
    "NO_KEY",
    "capped_attention",
    "capped_softmax_",
    "eager_cpu",
    "flash_attention",
    "flash_attention_backward",
    "flash_available",
    "float_dot_linear",
    "float_wide",
    "float_wide_dots",
    "group_codes",
    "int4_dot_linear",
    "int8_dot_linear",
    "int8_wide_dots",
    "kernels_available",
    "kernels_loaded",
    "kernels_unavailable",
    "load_ops",
    "one_query_attention",
    "ops_unavailable",
    "pack_int4",
    "pack_int4_scales",
    "rms_norm",
    "rotate",
    "round_activations",
    "ungroup_codes",
    "unpack_int4",
    "unpack_int4_scales",
    "wide_cpu",
]

#: :func:`attnkit.kernels.linear.float_wide_dots` under its former name.
float_wide = float_wide_dots


def wide_cpu() -> bool:
    """Whether this CPU has the 512-bit vector units the wide float dots need
    (:attr:`attnkit.kernels.probe.Capabilities.wide_vectors`; without building the kernels)."""
    return capabilities().wide_vectors
