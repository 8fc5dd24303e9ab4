"""Fast cached decoding of a model's own forward: prepare its linears, then optionally compile.

Decoding one token at a time costs per-token overhead on small models (dozens of tiny ops per
layer) and weight-read bandwidth on large ones (every weight is read once per token). Nothing here
re-implements the model: :func:`prepare` swaps the model's plain ``nn.Linear`` modules for
:class:`PreparedLinear` (the same parameters, stored in the layout a single row reads fastest), and
:func:`compiled_step` compiles the model's own one-token forward with a static
:class:`attnkit.KVCache` (``cache_position`` as a tensor, so one graph serves every step).
:func:`attnkit.generation.generate` (``compile=True``) uses it.

What stays fast because the model itself is written for it: the query/key/value projections are one
fused ``qkv_proj`` and the SwiGLU gate/up projections one ``gate_up`` (one matrix read per step
each), and rotary tables are computed once per length.

Modules that are not plain ``nn.Linear`` (a subclass: torchao's quantized linears, a LoRA wrapper,
a user's own) are left as they are and run as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from attnkit.kernels import build, policy, rows
from attnkit.kernels.linear import float_dot_linear

__all__ = [
    "UPCAST_ROWS",
    "Layout",
    "PreparedLinear",
    "PreparedRMSNorm",
    "compile_for_steps",
    "compiled_step",
    "differentiating_guards_only",
    "layout_for",
    "linear",
    "prepare",
]

# How a product reads its weight is the policy's choice (:mod:`attnkit.kernels.policy`, section
# "Linear products and row kernels"; ``attnkit kernels`` shows the choices made here):
#   * a few rows (a decoding step) of fp32 and bf16 weights: attnkit's own streaming kernel over
#     the row-major weight (``"stream"``), except where the policy gives one eager fp32 row to
#     MKL over a column-major weight (``"transposed"``), or a compiled single row to inductor's
#     streaming reduction;
#   * other eager fp32 steps: a column-major weight, as MKL streams it;
#   * prompts: a blocked GEMM (oneDNN's or MKL's, bf16 or upcast to fp32, as the policy chose);
#   * everything else: ``F.linear`` as is.
Layout = Literal["linear", "transposed", "stream"]
ModuleT = TypeVar("ModuleT", bound=nn.Module)

#: Weight dtypes attnkit's streaming kernel multiplies
#: (:func:`attnkit.kernels.linear.float_dot_linear`).
KERNEL_DTYPES: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float32})
#: From this many rows on a product is a prompt's (:data:`attnkit.kernels.policy.PROMPT_ROWS`).
UPCAST_ROWS = policy.PROMPT_ROWS


def _needs_grad(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def layout_for(weight: Tensor, *, compiled: bool = False, batch: int = 1) -> Layout:
    """The storage layout :func:`prepare` gives ``weight`` for steps of ``batch`` sequences
    (:func:`attnkit.kernels.policy.weight_layout`): ``"stream"`` where CPU steps run attnkit's
    kernel, ``"transposed"`` (column-major) for other eager fp32 CPU steps, else ``"linear"``.
    """
    cpu = weight.device.type == "cpu"
    layout = policy.weight_layout(weight.dtype, cpu=cpu, compiled=compiled, batch=batch)
    return layout  # type: ignore[return-value]


class PreparedLinear(nn.Linear):
    """An ``nn.Linear`` prepared for decoding: same parameters, faster single-row products.

    Built by :meth:`from_linear`, which shares the original's ``weight``/``bias`` parameters
    (no copy of the values is kept elsewhere): with the ``"transposed"`` layout the weight's
    storage is made column-major (shape and values unchanged, so ``state_dict()`` and training
    still work). Its forward is :func:`linear`.
    """

    layout: Layout = "linear"
    #: The most rows an eager ``"stream"`` product streams (:func:`policy.most_stream_rows`).
    stream_rows: int = UPCAST_ROWS - 1

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls, linear: nn.Linear, *, compiled: bool = False, batch: int = 1
    ) -> PreparedLinear:
        """A prepared linear over ``linear``'s parameters, laid out for compiled or eager
        steps of ``batch`` sequences (see :func:`layout_for`)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.layout = layout_for(linear.weight, compiled=compiled, batch=batch)
        new.stream_rows = policy.most_stream_rows(linear.weight.dtype)
        if new.layout == "transposed" and linear.weight.stride() != (1, linear.out_features):
            # Column-major storage of the same (out, in) values.
            new.weight.data = linear.weight.data.t().contiguous().t()
        if new.layout == "stream" and not linear.weight.is_contiguous():
            new.weight.data = linear.weight.data.contiguous()
        return new

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(*, in) -> (*, out)``."""
        if (
            self.layout == "stream"
            and x.numel() <= self.stream_rows * self.in_features
            and self.weight.dtype in KERNEL_DTYPES  # (not after a cast, e.g. .double())
            and not (torch.is_grad_enabled() and _needs_grad(x, self.weight, self.bias))
            and not torch.compiler.is_compiling()
            and not is_in_torch_dispatch_mode()  # (FLOP counters, fake tensors: torch's ops)
        ):
            # A few rows without gradients (a decoding step), eager: the kernel directly (the
            # checks of `linear` cost more than a small product).
            return float_dot_linear(x, self.weight, self.bias)
        if self.layout == "transposed" and not _onednn_prompt(x, self.weight, self.bias):
            # fp32 on CPU: F.linear multiplies by the column-major weight's contiguous transpose
            # in one BLAS call (its transpose is a C++ view, not a Python op per call).
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout}"


class PreparedRMSNorm(nn.RMSNorm):
    """An ``nn.RMSNorm`` prepared for decoding and prefill: same parameters, a shorter forward.

    Built by :meth:`from_norm`, which shares the original's ``weight``. Eager float32 or bf16
    CPU rows without gradients run :func:`attnkit.kernels.rows.rms_norm` where attnkit's kernels
    are built: one pass through the rows instead of torch's composite ``rms_norm`` (about ten
    kernels, each writing a fresh tensor). A single float32 row (a one-token decoding step) runs
    the kernel too, unless the policy measured three torch calls faster (``rows.norm_row``: the
    kernel's call can cost more than the row): the row's norm read once and the scale
    ``1 / sqrt(||x||^2 / D + eps)`` applied in one multiply with the weight. Every other input
    runs ``nn.RMSNorm``'s own forward; they all differ by float rounding only.
    """

    _zero: Tensor

    @classmethod
    def from_norm(cls, norm: nn.RMSNorm) -> PreparedRMSNorm:
        """A prepared norm over ``norm``'s parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps = norm.normalized_shape, norm.eps
        new.elementwise_affine = norm.elementwise_affine
        new.weight = norm.weight
        new._zero = torch.zeros(())  # addcmul's (broadcast) addend
        return new

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(..., dim) -> (..., dim)``."""
        weight = self.weight
        D = x.shape[-1] if x.dim() else 0
        if (
            len(self.normalized_shape) != 1
            or (
                torch.is_grad_enabled()
                and (x.requires_grad or (weight is not None and weight.requires_grad))
            )
            or x.device.type != "cpu"
            or torch.compiler.is_compiling()
        ):
            return super().forward(x)
        # (torch's default: the epsilon of the dtype it computes in, float32 for half precision)
        wide = torch.promote_types(x.dtype, torch.float32)
        eps = torch.finfo(wide).eps if self.eps is None else self.eps
        plan = policy.linear_plan()
        if x.numel() == D and x.dtype == torch.float32 and not plan.norm_row_kernel:
            norm = float(torch.linalg.vector_norm(x))
            scale = 1.0 / math.sqrt(norm * norm / D + eps)
            if weight is None:
                return x * scale
            return torch.addcmul(self._zero, x, weight, value=scale)
        if (
            x.dtype in (torch.float32, torch.bfloat16)
            and (weight is None or weight.dtype == x.dtype)
            and self.normalized_shape[0] == D
            and plan.kernels
            and build.eager_cpu(x)
        ):
            return rows.rms_norm(x, weight, eps)
        return super().forward(x)


def _onednn_prompt(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``F.linear(x, weight, bias)`` is a float32 CPU prompt product (at least
    :data:`UPCAST_ROWS` rows, no gradients, eager) and the policy gives prompts to oneDNN's GEMM
    (choice ``linear.fp32_prompt``)."""
    return (
        x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.device.type == weight.device.type == "cpu"
        and weight.dim() == 2
        and x.dim() >= 2
        and x.numel() >= UPCAST_ROWS * x.shape[-1] > 0
        and not (torch.is_grad_enabled() and _needs_grad(x, weight, bias))
        and not torch.compiler.is_compiling()
        and not is_in_torch_dispatch_mode()  # (FLOP counters, fake tensors: torch's ops)
        and policy.fp32_prompt_onednn()
    )


def _streams(x: Tensor, weight: Tensor, bias: Tensor | None, compiling: bool) -> bool:
    """Whether ``F.linear(x, weight, bias)`` runs attnkit's streaming kernel
    (:func:`attnkit.kernels.policy.stream_rows`)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        policy.stream_rows(weight.dtype, rows, compiled=compiling)
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.numel() > 0
        and not (torch.is_grad_enabled() and _needs_grad(x, weight, bias))
        and not is_in_torch_dispatch_mode()  # (FLOP counters, fake tensors: torch's ops)
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through the kernel the policy chooses
    (:mod:`attnkit.kernels.policy`, ``attnkit kernels`` shows the choices):

    * the rows of a decoding step (:func:`attnkit.kernels.policy.most_stream_rows`) of a
      :data:`KERNEL_DTYPES` weight without gradients:
      :func:`attnkit.kernels.linear.float_dot_linear` where the policy streams them (in compiled
      graphs as the op ``attnkit::float_dot_linear``; a single row there only where the policy
      measured the op faster than inductor's reduction);
    * a single row otherwise inside a compiled graph: ``(W * x).sum(-1)`` in float32, which
      inductor streams at the memory bandwidth;
    * float32 prompts without gradients: oneDNN's GEMM where the policy measured it faster than
      ``F.linear``'s MKL;
    * bf16 prompts: in float32, rounded back to bf16, where the policy found bf16 GEMMs slower
      (CPUs that emulate them);
    * everything else: ``F.linear``.

    Shape: x ``(*, in)``, weight ``(out, in)`` -> ``(*, out)``.
    """
    compiling = torch.compiler.is_compiling()
    if _streams(x, weight, bias, compiling):  # (before the GEMM: a full batch's step may stream)
        if not compiling:
            return float_dot_linear(x, weight, bias)
        return torch.ops.attnkit.float_dot_linear(x, weight, bias)
    if _onednn_prompt(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if (
        weight.dtype == torch.bfloat16
        and not compiling
        and x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.numel() >= UPCAST_ROWS * x.shape[-1] > 0
        and policy.bf16_prompt_upcast()
    ):
        wide = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide).to(torch.bfloat16)
    one_row = x.dim() >= 2 and x.numel() == x.shape[-1]
    if (
        one_row
        and compiling
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
    ):
        return _row(x, weight, bias)
    return F.linear(x, weight, bias)


def _row(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One row's product as a streaming reduction over the weight (compiled graphs only).

    The row is stored before the reduction (an identity view makes inductor store it: otherwise
    it inlines the producer, a norm or SwiGLU's silu, into the reduction and recomputes it for
    every output row), widened to float32 first, so the loop widens only the weight (faster than
    widening the row in the loop, or partial sums over vector lanes first).
    """
    shape, out_features = x.shape, weight.shape[0]
    row = x.reshape(1, -1).float()
    row = torch.as_strided(row, row.shape, row.stride())
    y = (row.unsqueeze(1) * weight).sum(-1, dtype=torch.float32)  # (1, out)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*shape[:-1], out_features)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _huge_page_empty(numel: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised 1-D tensor whose memory asks Linux for transparent huge pages.

    Streaming hundreds of MB of weights per token through 4 KiB pages costs TLB misses.
    ``madvise`` must come before the pages are first touched; it is a no-op where unsupported.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    slack = _HUGE_PAGE // itemsize
    buf = torch.empty(numel + slack, dtype=dtype)
    start = (-buf.data_ptr() % _HUGE_PAGE) // itemsize
    out = buf[start : start + numel]  # 2 MiB aligned; keeps `buf` alive
    length = numel * itemsize // _HUGE_PAGE * _HUGE_PAGE
    if sys.platform.startswith("linux") and length:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc symbol: ordinary pages
            pass
    return out


@torch.no_grad()
def _gather_on_huge_pages(weights: list[Tensor]) -> None:
    """Move the CPU ``weights`` (parameters) into one huge-page block per dtype, in place."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for w in weights:
        if w.device.type == "cpu":
            groups.setdefault(w.dtype, []).append(w)
    for dtype, members in groups.items():
        block = _huge_page_empty(sum(w.numel() for w in members), dtype)
        offset = 0
        for w in members:
            n = w.numel()
            # Keep each weight's layout: copy its storage order (column-major stays so).
            column_major = w.dim() == 2 and w.stride() == (1, w.shape[0])
            shape = w.shape[::-1] if column_major else w.shape
            view = block[offset : offset + n].view(shape)
            view.copy_(w.t() if column_major else w)
            w.data = view.t() if column_major else view
            offset += n


@torch.no_grad()
def prepare(model: ModuleT, *, compiled: bool = False, batch: int = 1) -> ModuleT:
    """Prepare ``model`` for decoding, in place, and return it.

    Args:
        model: Any module; its plain ``nn.Linear`` children are swapped.
        compiled: Lay the weights out for compiled steps (``generate(..., compile=True)``)
            rather than eager ones.
        batch: The number of sequences its steps will decode together. It only changes eager
            fp32 layouts where the policy gives one row to MKL (:func:`layout_for`): for one
            sequence MKL's product over a column-major weight, for several attnkit's kernel (any
            batch decodes with either, at those speeds).

    Every plain ``nn.Linear`` (exactly that type) is replaced by a :class:`PreparedLinear` over
    the same parameters; subclasses (quantized or LoRA linears, a user's own) are kept as they
    are; every plain ``nn.RMSNorm`` likewise by a :class:`PreparedRMSNorm`. Plain
    ``nn.Embedding`` tables get the same layout (a tied output head reads them as a
    matrix; looking up a few rows does not mind). The prepared weights of CPU models are
    gathered into huge-page blocks. Outputs are
    unchanged up to the rounding of another summation order. Tied weights stay tied.

    Returns:
        ``model``.

    Raises:
        ValueError: If ``batch`` is not a positive int.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, nn.RMSNorm)
    ]
    for parent, name, child in swaps:
        if isinstance(child, nn.Linear):
            prepared = PreparedLinear.from_linear(child, compiled=compiled, batch=batch)
            setattr(parent, name, prepared)
        elif isinstance(child, nn.RMSNorm):
            setattr(parent, name, PreparedRMSNorm.from_norm(child))
    if not compiled:  # a tied output head reads the embedding table as a matrix
        for m in model.modules():
            if type(m) is nn.Embedding and layout_for(m.weight, batch=batch) == "transposed":
                m.weight.data = m.weight.data.t().contiguous().t()
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, PreparedLinear)}
    weights |= {id(m.weight): m.weight for m in model.modules() if type(m) is nn.Embedding}
    _gather_on_huge_pages(list(weights.values()))
    return model


def compiled_step(model: Any) -> Callable[..., Any]:
    """The model's forward compiled for one-token steps (:func:`compile_for_steps`).

    Call it as ``step(input_ids, mask, positions=..., kv_caches=..., cache_position=...,
    logits_to_keep=1)``: the caches' storage is static and ``cache_position`` a tensor, so the
    graph compiles once per batch size and cache capacity. The compiled function is kept on the
    model (``model._attnkit_step``) and reused.
    """
    step = model.__dict__.get("_attnkit_step")
    if step is None:
        step = compile_for_steps(model.forward)
        model.__dict__["_attnkit_step"] = step
    return step


def compile_for_steps(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a model's forward, or a function calling one) compiled as decoding steps are:
    ``fullgraph``, static shapes, after deciding what the trace reads.

    Decided (and built) before the trace, which reads the answers: the policy's linear plan,
    with its compiled-row choices, and the kernels the graph's ops call, with their C++
    implementations. Without inductor's checks of every input's size and strides at each call
    (one Python call per weight): dynamo's guards check the same before a call, the first step
    of each generate call included. torch keeps at most a few graphs per code object in a
    process (``torch._dynamo.config.recompile_limit``), so a function that is not a model's
    forward keeps its graphs apart from those of the models.
    """
    policy.linear_plan(compiled=True)
    build.load_ops()
    options: dict[str, Any] = {"size_asserts": False}
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


@contextlib.contextmanager
def differentiating_guards_only() -> Iterator[None]:
    """A context in which compiled steps check only the guards that tell their graphs apart.

    Before each call of a compiled function, dynamo checks its guards (every parameter's
    dtype, shape and strides, grad mode, ...), a share of a small model's compiled step worth
    saving. :func:`attnkit.generation.generate` enters this for the steps
    after a call's first compiled step, which checked them all: between its steps nothing but
    its own loop runs (``stream`` gives control to the caller between steps, so it does not).
    torch's ``set_stance(skip_guard_eval_unsafe=True)`` for the duration; where the stance is
    not torch's plain default (the user set another), nothing changes.
    """
    stance = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "_stance", None)
    plain = (
        getattr(stance, "stance", None) == "default"
        and getattr(stance, "backend", None) is None
        and getattr(stance, "skip_guard_eval_unsafe", None) is False
    )
    if not plain:
        yield
        return
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        yield
