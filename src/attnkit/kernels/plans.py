"""The records the dispatch policy (:mod:`attnkit.kernels.policy`) reads and answers with: what
it reads of an attention call, and the plans it hands back (the attention modules and the
compiled decoding step read these, and never decide a kernel themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionCall", "AttentionPlan", "LinearPlan", "TileKernels"]


@dataclass(frozen=True)
class AttentionCall:
    """What the attention policy reads of a checked call.

    Attributes:
        dtype: The inputs' dtype.
        device: The inputs' device type (``"cpu"``, ``"cuda"``, ``"meta"``, ...).
        L: Query length.
        S: Key length.
        causal: Causal masking.
        window: The sliding window, or None.
        batched: Documents (``segment_ids``) or ``key_lengths`` are given.
        masked: An explicit mask is given.
        weights: The weights are requested.
        dropout: Dropout is on.
        softcap: The scores are soft-capped.
        grads: Gradients will flow.
        eager: attnkit's kernels may compute here: CPU tensors, torch running eagerly
            (not compiling or tracing, outside torch dispatch modes and ``torch.func``).
        ready: attnkit's flash kernels are built and checked on this machine.
        dispatch_mode: Under a torch dispatch mode (FLOP counters, fake tensors), which sees
            torch's operations and not what a kernel of attnkit's computes.
    """

    dtype: torch.dtype
    device: str
    L: int
    S: int
    causal: bool = False
    window: int | None = None
    batched: bool = False
    masked: bool = False
    weights: bool = False
    dropout: bool = False
    softcap: bool = False
    grads: bool = False
    eager: bool = False
    ready: bool = False
    dispatch_mode: bool = False

    @property
    def structured(self) -> bool:
        """Whether a structure narrows the keys a query may attend."""
        return self.causal or self.window is not None or self.batched


@dataclass(frozen=True)
class TileKernels:
    """The kernels of the block-sparse tiles (:func:`tile_kernels`).

    Attributes:
        flash: attnkit's flash kernels compute causal/window structures whole, and the runs
            without a mask of the others; torch's flash kernel the rest.
        widen: bfloat16/float16 inputs are computed on float32 copies and the result rounded
            (unless every run takes attnkit's kernel, which widens blocks itself).
        flash_wide: ``flash`` for those float32 copies.
        products: How attnkit's bf16 flash kernels multiply their tiles, forward and backward
            (the ``products`` argument of :func:`attnkit.kernels.attention.flash_attention`).
    """

    flash: bool
    widen: bool = False
    flash_wide: bool = False
    products: str = "widened"


@dataclass(frozen=True)
class AttentionPlan:
    """Every attention choice for one call (:func:`attention_plan`).

    Attributes:
        call: What the policy read of the call.
        path: :func:`attention_path`.
        capped: :func:`capped_kernel` on the ``capped`` path.
        tiles: :func:`tile_kernels` on the ``flash`` and ``tiles`` paths.
        rows: :func:`tile_rows` on the ``tiles`` path, else None.
    """

    call: AttentionCall
    path: str
    capped: str
    tiles: TileKernels
    rows: int | None


@dataclass(frozen=True)
class LinearPlan:
    """The linear and row choices, decided together once (:func:`linear_plan`): compiled graphs
    read this record, which they cannot decide themselves.

    Attributes:
        kernels: attnkit's C kernels run here.
        int8_wide: Their int8 and int4 products run the wide dots (``linear.int8_dots``).
        fp32_row: ``"stream"`` or ``"transposed"`` (choice ``linear.fp32_row``).
        with_compiled: The compiled-row choices were decided (``linear_plan(compiled=True)``).
        compiled_row: Weight dtypes whose single row in a compiled step runs the kernel's op
            (choices ``linear.compiled_row.*``).
        fp32_prompt_onednn: Prompts' float32 GEMMs run oneDNN's (``linear.fp32_prompt``).
        bf16_upcast: Prompts' bf16 GEMMs run in float32 (``linear.bf16_prompt``).
        norm_row_kernel: One float32 row's RMSNorm runs the kernel (``rows.norm_row``).
        fp32_batch_stream: An eager float32 product of ``PROMPT_ROWS`` rows (a full batch's
            decoding step) streams rather than running the prompts' GEMM
            (``linear.fp32_batch``).
    """

    kernels: bool
    int8_wide: bool = False
    fp32_row: str = "stream"
    with_compiled: bool = False
    compiled_row: frozenset[torch.dtype] = frozenset()
    fp32_prompt_onednn: bool = False
    bf16_upcast: bool = False
    norm_row_kernel: bool = False
    fp32_batch_stream: bool = False
