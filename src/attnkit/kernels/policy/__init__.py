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
from attnkit.kernels.policy.attention import (
    CAPPED_CHUNK_SCORES,
    CAPPED_MAX_ROWS,
    CAPPED_MIN_ROWS,
    FLASH_MIN_SCORES,
    FLEX_CHUNK_SCORES,
    SPARSE_LONG_BACKWARD_MAX_DENSITY,
    SPARSE_LONG_KEYS,
    SPARSE_LONG_MAX_DENSITY,
    SPARSE_MAX_DENSITY,
    SPARSE_MIN_KEYS,
    alibi_kernel,
    attention_path,
    attention_plan,
    bf16_backward_products,
    bf16_structured,
    block_sparse,
    capped_chunk_rows,
    capped_flash_rows,
    capped_kernel,
    flash_bf16_products,
    flash_kernel,
    flex_block_rows,
    flex_chunk_keys,
    one_query_kernel,
    ring_block_kernel,
    tile_kernels,
    tile_rows,
    torch_low_precision,
)
from attnkit.kernels.policy.linear import (
    BLOCK_KERNEL_ROWS,
    COMPILED_STEP_BATCH,
    INT8_KERNEL_ALIASES,
    INT8_KERNEL_ROWS,
    INT8_KERNELS,
    PROMPT_ROWS,
    bf16_prompt_upcast,
    block_kernel_rows,
    block_tile_rows,
    compiled_row_kernel,
    compiled_step_fuses,
    fp32_prompt_onednn,
    int4_kernel,
    int8_kernel,
    int8_kernel_name,
    int8_kernel_rows,
    int8pack_takes,
    linear_plan,
    most_stream_rows,
    norm_row_kernel,
    stream_rows,
    weight_layout,
)
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
    "BLOCK_KERNEL_ROWS",
    "CAPPED_CHUNK_SCORES",
    "CAPPED_MAX_ROWS",
    "CAPPED_MIN_ROWS",
    "COMPILED_STEP_BATCH",
    "FLASH_MIN_SCORES",
    "FLEX_CHUNK_SCORES",
    "INT8_KERNELS",
    "INT8_KERNEL_ALIASES",
    "INT8_KERNEL_ROWS",
    "PROMPT_ROWS",
    "SPARSE_LONG_BACKWARD_MAX_DENSITY",
    "SPARSE_LONG_KEYS",
    "SPARSE_LONG_MAX_DENSITY",
    "SPARSE_MAX_DENSITY",
    "SPARSE_MIN_KEYS",
    "AttentionCall",
    "AttentionPlan",
    "Choice",
    "Decision",
    "LinearPlan",
    "TileKernels",
    "alibi_kernel",
    "attention_path",
    "attention_plan",
    "bf16_backward_products",
    "bf16_prompt_upcast",
    "bf16_structured",
    "block_kernel_rows",
    "block_sparse",
    "block_tile_rows",
    "capped_chunk_rows",
    "capped_flash_rows",
    "capped_kernel",
    "choices",
    "choose",
    "compiled_row_kernel",
    "compiled_step_fuses",
    "decision",
    "env_var",
    "flash_bf16_products",
    "flash_kernel",
    "flex_block_rows",
    "flex_chunk_keys",
    "fp32_prompt_onednn",
    "int4_kernel",
    "int8_kernel",
    "int8_kernel_name",
    "int8_kernel_rows",
    "int8pack_takes",
    "linear_plan",
    "most_stream_rows",
    "norm_row_kernel",
    "one_query_kernel",
    "provide_attention_kernel",
    "provide_decoding_steps",
    "register",
    "reset",
    "retune",
    "ring_block_kernel",
    "stream_rows",
    "tile_kernels",
    "tile_rows",
    "torch_low_precision",
    "tune_file",
    "weight_layout",
]
