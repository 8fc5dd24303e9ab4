"""Every kernel choice attnkit makes, in one place: rules from the probed capabilities, and
measurements where the better kernel depends on the machine.

Each choice is a named :class:`~attnkit.kernels.tuning.Choice` registered here, answered by
:func:`choose` (an ``ATTNKIT_KERNEL_<NAME>`` environment variable, else a measurement cached per
machine, else the rule over :func:`attnkit.kernels.probe.capabilities`; see
:mod:`attnkit.kernels.tuning`). The rest of attnkit asks the named functions gathered here
(which path serves an attention call, which kernel multiplies a linear) and never tests CPU
features itself.
``attnkit kernels`` prints the capabilities, the kernels built, and every choice with the
timings it was made on; ``attnkit kernels --retune`` measures again. Measuring never happens
inside ``torch.compile`` tracing: a choice a compiled graph needs is asked before it traces (or
reads its rule).

The choices live in two modules by topic, their names gathered here:
:mod:`attnkit.kernels.policy.attention` (which path serves an attention call; docs/guide/core.md,
"How a call finds its kernel") and :mod:`attnkit.kernels.policy.linear` (linear products, row
kernels and compiled decoding steps; docs/guide/kernels.md).
"""

from __future__ import annotations

from attnkit.kernels.plans import AttentionCall, AttentionPlan, LinearPlan, TileKernels
from attnkit.kernels.policy import attention, linear
from attnkit.kernels.policy.attention import *  # noqa: F403  (its __all__: the attention choices)
from attnkit.kernels.policy.linear import *  # noqa: F403  (its __all__: the linear choices)
from attnkit.kernels.timing import provide_attention_kernel, provide_decoding_steps
from attnkit.kernels.tuning import (
    Choice,
    Decision,
    choices,
    choose,
    decision,
    env_var,
    register,
    reset,
    retune,
    tune_file,
)

__all__ = [
    "AttentionCall",
    "AttentionPlan",
    "Choice",
    "Decision",
    "LinearPlan",
    "TileKernels",
    "choices",
    "choose",
    "decision",
    "env_var",
    "provide_attention_kernel",
    "provide_decoding_steps",
    "register",
    "reset",
    "retune",
    "tune_file",
]
__all__ += attention.__all__
__all__ += linear.__all__
