"""Every kernel choice attnkit makes, in one place: rules from the probed capabilities, and
measurements where the better kernel depends on the machine.

A choice is a named :class:`Choice` with a few options. :func:`choose` answers it:

1. an environment variable ``ATTNKIT_KERNEL_<NAME>`` (upper case, ``-`` and ``.`` as ``_``)
   naming one of its options wins (for experiments and for pinning a machine);
2. else, for a *measured* choice, the option that ran fastest in a short timing of its
   candidates on this machine, made once at first use and cached in
   ``<cache dir>/policy/<machine key>.json`` beside the compiled kernels (machine key: the CPU,
   its flags, the core count and the torch version, :attr:`Capabilities.key`);
3. else the choice's rule over :func:`attnkit.kernels.probe.capabilities`.

``attnkit kernels`` prints the capabilities, the kernels built, and every choice with the
timings it was made on; ``attnkit kernels --retune`` measures again. Callers in the rest of the
package ask a named function of this module (``policy.<something>(...)``) and never test CPU
features themselves. Measuring never happens inside ``torch.compile`` tracing: a choice a
compiled graph needs is asked before it traces (or reads its rule).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnkit.kernels import build, linear, timing
from attnkit.kernels.probe import Capabilities, cache_dir, capabilities

__all__ = [
    "INT8_KERNELS",
    "INT8_KERNEL_ALIASES",
    "INT8_KERNEL_ROWS",
    "PROMPT_ROWS",
    "Choice",
    "Decision",
    "LinearPlan",
    "bf16_prompt_upcast",
    "choices",
    "choose",
    "compiled_row_kernel",
    "decision",
    "env_var",
    "fp32_prompt_onednn",
    "int4_kernel",
    "int8_kernel",
    "int8_kernel_name",
    "int8_kernel_rows",
    "int8pack_takes",
    "linear_plan",
    "norm_row_kernel",
    "register",
    "reset",
    "retune",
    "stream_rows",
    "tune_file",
    "weight_layout",
]

#: Version of the tune file's layout; a file of another version is measured again.
_TUNE_FORMAT = 1


@dataclass(frozen=True)
class Choice:
    """A kernel choice: its options, why it exists, and how it is decided.

    Attributes:
        name: Short dotted name (``linear.fp32_row``); ``ATTNKIT_KERNEL_LINEAR_FP32_ROW``
            overrides it.
        options: The options, in order of preference where a rule cannot decide.
        doc: One or two sentences: what is chosen and why it depends on the machine.
        rule: The option from the capabilities alone (always defined: it is the answer where
            measuring is impossible, e.g. while tracing, and the fallback of a failed timing).
        candidates: For a measured choice, a function returning one zero-argument callable per
            option to time (options it leaves out are not eligible on this machine), or None.
        margin: How many times faster another candidate must run than the rule's option to be
            chosen instead (1.0: the fastest wins; more keeps the rule's option where the two
            are close, through timing noise).
    """

    name: str
    options: tuple[str, ...]
    doc: str
    rule: Callable[[Capabilities], str]
    candidates: Callable[[], Mapping[str, Callable[[], Any]]] | None = None
    margin: float = 1.0


@dataclass(frozen=True)
class Decision:
    """How a choice was answered on this machine.

    Attributes:
        name: The choice's name.
        option: The option chosen.
        source: ``"environment"``, ``"measured"``, ``"cached"`` or ``"rule"``; ``"pending"``
            for a measured choice asked with ``measure=False`` before it was measured (the
            option is the rule's until then).
        seconds: For a measured choice, the seconds of each candidate timed (the fastest call).
    """

    name: str
    option: str
    source: str
    seconds: dict[str, float] = field(default_factory=dict)


_CHOICES: dict[str, Choice] = {}
_DECIDED: dict[str, Decision] = {}
_LOCK = threading.RLock()


def register(choice: Choice) -> Choice:
    """Add ``choice`` to the policy (modules of this package call it at import)."""
    if choice.name in _CHOICES:
        raise ValueError(f"kernel choice {choice.name!r} is registered twice")
    if not choice.options:
        raise ValueError(f"kernel choice {choice.name!r} has no options")
    _CHOICES[choice.name] = choice
    return choice


def choices() -> dict[str, Choice]:
    """Every registered choice by name."""
    return dict(_CHOICES)


def env_var(name: str) -> str:
    """The environment variable that overrides the choice ``name``."""
    return "ATTNKIT_KERNEL_" + name.upper().replace(".", "_").replace("-", "_")


def tune_file() -> Path:
    """The file this machine's measured choices are cached in."""
    return cache_dir() / "policy" / f"{capabilities().key}.json"


def _read_tuned() -> dict[str, Any]:
    try:
        data = json.loads(tune_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _TUNE_FORMAT:
        return {}
    tuned = data.get("choices")
    return tuned if isinstance(tuned, dict) else {}


def _write_tuned(tuned: Mapping[str, Any]) -> None:
    """Write the cache atomically (a reader sees the old file or the new one, never half)."""
    caps = capabilities()
    path = tune_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": _TUNE_FORMAT,
            "machine": {
                "cpu": caps.cpu,
                "cores": caps.cores,
                "flags": sorted(caps.flags),
                "torch": caps.torch_version,
            },
            "choices": dict(tuned),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # (a read-only cache: the choice still holds for this process)
        pass


def _time(calls: Mapping[str, Callable[[], Any]], rounds: int = 7) -> dict[str, float]:
    """The fastest of a few timed calls of each candidate, in seconds: one warm-up each, then
    interleaved rounds (neighbours in time share the machine's load). The minimum, not the
    median: another process's work only ever adds time, and on a busy machine a thread pool
    that waits for a descheduled thread can add more than the call itself takes."""
    with torch.no_grad():
        for call in calls.values():
            call()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - start)
    return {name: min(times) for name, times in samples.items()}


def _measure(choice: Choice) -> Decision | None:
    assert choice.candidates is not None
    try:
        calls = dict(choice.candidates())
    except Exception:  # (a candidate that cannot be set up here is not eligible)
        return None
    calls = {name: call for name, call in calls.items() if name in choice.options}
    if len(calls) < 2:
        only = next(iter(calls), None)
        return None if only is None else Decision(choice.name, only, "measured")
    ruled = choice.rule(capabilities())

    def best(seconds: dict[str, float]) -> str:
        fastest = min(seconds, key=seconds.__getitem__)
        if ruled in seconds and seconds[ruled] <= choice.margin * seconds[fastest]:
            return ruled
        return fastest

    try:
        seconds = _time(calls)
        if best(seconds) != ruled:  # (confirmed by a second timing before the rule is left)
            again = _time(calls)
            seconds = {name: min(t, again[name]) for name, t in seconds.items()}
    except Exception:  # (a candidate that fails here is not eligible: the rule stands)
        return None
    return Decision(choice.name, best(seconds), "measured", seconds)


def decision(name: str, *, measure: bool = True) -> Decision:
    """How the choice ``name`` is answered here (deciding it now if it was not yet; with
    ``measure=False`` a measured choice neither measured nor cached is not measured: its
    decision is the rule's, with source ``"pending"``)."""
    try:
        choice = _CHOICES[name]
    except KeyError:
        known = ", ".join(sorted(_CHOICES))
        raise ValueError(f"unknown kernel choice {name!r} (known: {known})") from None
    forced = os.environ.get(env_var(name))
    if forced:
        if forced not in choice.options:
            raise ValueError(
                f"{env_var(name)}={forced!r} is not an option of {name!r} "
                f"(options: {', '.join(choice.options)})"
            )
        return Decision(name, forced, "environment")
    done = _DECIDED.get(name)
    if done is not None:
        return done
    if choice.candidates is None or torch.compiler.is_compiling():
        made = Decision(name, choice.rule(capabilities()), "rule")
        if choice.candidates is None:
            _DECIDED[name] = made
        return made
    with _LOCK:
        done = _DECIDED.get(name)
        if done is not None:
            return done
        cached = _read_tuned().get(name)
        if isinstance(cached, dict) and cached.get("option") in choice.options:
            made = Decision(name, cached["option"], "cached", dict(cached.get("seconds", {})))
        elif not measure:
            return Decision(name, choice.rule(capabilities()), "pending")
        else:
            made = _measure(choice) or Decision(name, choice.rule(capabilities()), "rule")
            if made.source == "measured":
                tuned = _read_tuned()
                tuned[name] = {"option": made.option, "seconds": made.seconds}
                _write_tuned(tuned)
        _DECIDED[name] = made
        return made


def choose(name: str) -> str:
    """The option of the choice ``name`` on this machine (see the module's docstring)."""
    return decision(name).option


def reset() -> None:
    """Forget this process's decisions (the cache file stays): the next question decides again,
    reading the environment and the cache."""
    global _PLAN
    with _LOCK:
        _DECIDED.clear()
        _PLAN = None


def retune(names: list[str] | None = None) -> list[Decision]:
    """Measure the measured choices again (all, or ``names``) and rewrite the cache."""
    global _PLAN
    targets = [n for n in (names or list(_CHOICES)) if _CHOICES[n].candidates is not None]
    with _LOCK:
        _PLAN = None
        tuned = _read_tuned()
        for name in targets:
            _DECIDED.pop(name, None)
            tuned.pop(name, None)
        _write_tuned(tuned)
    return [decision(name) for name in targets]


# Linear products and row kernels
#
# Decoding multiplies a weight by a few rows (one per sequence), so it reads every weight once per
# token: the kernel that streams a weight nearest the memory bandwidth wins. A prompt multiplies it
# by many rows, where a blocked GEMM wins. Which library streams best, which GEMM is faster, and
# whether a compiled graph's single row is better served by attnkit's kernel (an op call) or by
# inductor's own reduction differ from CPU to CPU: those choices are measured on small shapes of
# the kind a small model's decoding step multiplies, the rest follow from the capabilities.

#: Rows from which a product is a prompt's (a blocked GEMM), below which a decoding step's
#: (attnkit's streaming kernel); also where bf16 GEMMs may run in float32
#: (:func:`bf16_prompt_upcast`): a few rows' bf16 products stay bf16 either way.
PROMPT_ROWS = 16
#: Rows up to which an int8 product runs attnkit's kernel with its narrow dots; more rows (a
#: prompt) multiply the dequantized weight by the activations rounded as the kernel rounds them,
#: where the narrow dots fall behind a blocked GEMM. With the wide dots four rows share each
#: block of codes, and the kernel takes every product outside compiled graphs.
INT8_KERNEL_ROWS = 256
#: The int8 kernels :func:`int8_kernel` chooses between (``"dequantize"``: the float product with
#: the dequantized weight, which always runs).
INT8_KERNELS = ("attnkit", "fbgemm", "int8pack", "dequantize")
#: Former names of int8 kernels, still accepted.
INT8_KERNEL_ALIASES = {"avx2": "attnkit"}


def _compiled_row_choice(dtype: torch.dtype) -> str:
    return f"linear.compiled_row.{str(dtype).removeprefix('torch.')}"


register(
    Choice(
        "linear.float_dots",
        ("wide", "narrow"),
        "attnkit's float products: eight rows share each weight vector with the wide dots (where "
        "the CPU has 512-bit vectors), two with the narrow ones.",
        lambda caps: "wide" if caps.wide_vectors else "narrow",
    )
)
register(
    Choice(
        "linear.int8_dots",
        ("wide", "narrow"),
        "attnkit's int8 and int4 products: the wide integer dots take twice the codes per "
        "instruction, with the same bits, where the CPU has them.",
        lambda caps: "wide" if caps.int8_dot else "narrow",
    )
)
register(
    Choice(
        "linear.fp32_row",
        ("stream", "transposed"),
        "An eager float32 product of one row: attnkit's stream over the row-major weight, or "
        "F.linear (MKL) over a column-major one; which reads a weight faster depends on the CPU.",
        lambda caps: "transposed" if caps.matrix_tiles else "stream",
        timing.fp32_row,
        margin=1.05,
    )
)
for _dtype, _rule in ((torch.float32, False), (torch.bfloat16, True)):
    register(
        Choice(
            _compiled_row_choice(_dtype),
            ("kernel", "reduction"),
            f"A compiled step's product of one {_dtype} row: attnkit's kernel as an op, or "
            "inductor's streaming reduction (no op call); measured when compiled decoding "
            "first runs, as it compiles.",
            (lambda caps: "kernel" if caps.wide_vectors else "reduction")
            if _rule
            else (lambda caps: "reduction"),
            lambda dtype=_dtype: timing.compiled_row(dtype),
            margin=1.05,
        )
    )
register(
    Choice(
        "linear.fp32_prompt",
        ("mkl", "onednn"),
        "A prompt's float32 GEMM (eager, no gradients): F.linear's MKL, or oneDNN's GEMM, which "
        "some CPUs run much faster (MKL takes a narrower path on them).",
        lambda caps: "mkl",
        timing.fp32_prompt,
        margin=1.15,
    )
)
register(
    Choice(
        "linear.bf16_prompt",
        ("bf16", "upcast"),
        "A prompt's bf16 GEMM: as it is, or in float32 and rounded back, which wins where the "
        "CPU has no bf16 dot products (torch emulates them).",
        lambda caps: "bf16" if caps.bf16_dot else "upcast",
        timing.bf16_prompt,
    )
)
register(
    Choice(
        "linear.int8",
        INT8_KERNELS[:3],
        "The int8 kernel of quantized linears: attnkit's (streams the codes), fbgemm's dynamic "
        "linear, or torch's int8pack product (bf16 activations).",
        lambda caps: (
            "attnkit"
            if build.kernels_available()
            else "int8pack"
            if caps.matrix_tiles or not linear.fbgemm_engine()
            else "fbgemm"
        ),
        lambda: timing.int8(int8pack_takes),
        margin=1.1,
    )
)
register(
    Choice(
        "linear.int4",
        ("attnkit", "dequantize"),
        "The int4 kernel of quantized linears: attnkit's (packed nibbles, integer dots), or the "
        "float product with the dequantized weight where it cannot run.",
        lambda caps: "attnkit" if build.kernels_available() else "dequantize",
    )
)
register(
    Choice(
        "rows.norm_row",
        ("torch", "kernel"),
        "An eager RMSNorm of one float32 row (a decoding step): three torch calls, or attnkit's "
        "row kernel, whose call can cost more than the row.",
        lambda caps: "torch",
        timing.norm_row,
    )
)


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
    """

    kernels: bool
    int8_wide: bool = False
    fp32_row: str = "stream"
    with_compiled: bool = False
    compiled_row: frozenset[torch.dtype] = frozenset()
    fp32_prompt_onednn: bool = False
    bf16_upcast: bool = False
    norm_row_kernel: bool = False


_PLAN: LinearPlan | None = None
#: The plan while tracing before any was decided: torch's kernels only.
_TRACED = LinearPlan(kernels=False)


def linear_plan(*, compiled: bool = False) -> LinearPlan:
    """The linear and row choices of this process, decided at the first call (measured choices
    at their first use on this machine, then read from the cache), and the kernels' wide dots
    switched as chosen. ``compiled`` also decides the compiled-row choices (compiled decoding
    asks so before it traces). While tracing it returns what was decided before."""
    global _PLAN
    plan = _PLAN
    if plan is not None and (plan.with_compiled or not compiled):
        return plan
    if torch.compiler.is_compiling():
        return _TRACED if plan is None else plan
    with _LOCK:
        compiled = compiled or (plan is not None and plan.with_compiled)
        kernels = build.kernels_available()
        int8_wide = kernels and choose("linear.int8_dots") == "wide"
        if kernels:
            linear.float_wide_dots(choose("linear.float_dots") == "wide")
            linear.int8_wide_dots(int8_wide)
        compiled_row = frozenset(
            dtype
            for dtype in (torch.float32, torch.bfloat16)
            if compiled and kernels and choose(_compiled_row_choice(dtype)) == "kernel"
        )
        plan = LinearPlan(
            kernels=kernels,
            int8_wide=int8_wide,
            fp32_row=choose("linear.fp32_row") if kernels else "transposed",
            with_compiled=compiled,
            compiled_row=compiled_row,
            fp32_prompt_onednn=choose("linear.fp32_prompt") == "onednn",
            bf16_upcast=choose("linear.bf16_prompt") == "upcast",
            norm_row_kernel=kernels and choose("rows.norm_row") == "kernel",
        )
        _PLAN = plan
        return plan


def stream_rows(dtype: torch.dtype, rows: int, *, compiled: bool = False) -> bool:
    """Whether a product of ``rows`` rows (fewer than :data:`PROMPT_ROWS`) with ``dtype``
    weights runs attnkit's streaming kernel: bf16 and float32 where the kernels run, except an
    eager float32 row where ``linear.fp32_row`` chose MKL, and a compiled single row of a dtype
    ``linear.compiled_row.*`` left to inductor's reduction."""
    plan = linear_plan()
    if not plan.kernels or dtype not in (torch.bfloat16, torch.float32) or rows >= PROMPT_ROWS:
        return False
    if rows >= 2:
        return True
    if compiled:
        return dtype in plan.compiled_row
    return not (dtype == torch.float32 and plan.fp32_row == "transposed")


def weight_layout(dtype: torch.dtype, *, cpu: bool, compiled: bool, batch: int) -> str:
    """How a linear's weight is stored for decoding steps of ``batch`` sequences:
    ``"stream"`` (row-major, attnkit's kernel reads it) where CPU steps stream (a compiled step
    of one row may still run inductor's reduction over it), ``"transposed"`` (column-major,
    MKL's one-row product reads it as one stream) for other eager float32 CPU steps, else
    ``"linear"`` (as it is)."""
    rows = max(2, batch) if compiled else batch  # (a compiled single row reads row-major)
    if cpu and stream_rows(dtype, rows):
        return "stream"
    if cpu and not compiled and dtype == torch.float32:
        return "transposed"
    return "linear"


def compiled_row_kernel(dtype: torch.dtype) -> bool:
    """Whether one row of ``dtype`` in a compiled graph runs the kernel's op (else inductor's
    reduction): the ``linear.compiled_row.*`` choices, read from the plan decided before the
    trace."""
    return dtype in linear_plan().compiled_row


def fp32_prompt_onednn() -> bool:
    """Whether a prompt's float32 GEMM runs oneDNN's (choice ``linear.fp32_prompt``)."""
    return linear_plan().fp32_prompt_onednn


def bf16_prompt_upcast() -> bool:
    """Whether a prompt's bf16 GEMM runs in float32 (choice ``linear.bf16_prompt``)."""
    return linear_plan().bf16_upcast


def norm_row_kernel() -> bool:
    """Whether one eager float32 row's RMSNorm runs the row kernel (choice ``rows.norm_row``)."""
    return linear_plan().norm_row_kernel


@torch.compiler.assume_constant_result
def _matrix_tiles() -> bool:
    """The probe's answer, a constant to compiled graphs (which cannot trace the probe)."""
    return capabilities().matrix_tiles


def int8pack_takes(in_features: int) -> bool:
    """Whether ``torch._weight_int8pack_mm`` takes ``in_features`` inputs: multiples of 8 (it
    reads out of bounds otherwise), and of 16 on CPUs with matrix tiles, where its tile kernel
    crashed the process on bf16 activations of several rows otherwise."""
    return in_features % (16 if _matrix_tiles() else 8) == 0


def int8_kernel_name(name: str) -> str:
    """``name`` of an int8 kernel, a former name mapped to today's."""
    return INT8_KERNEL_ALIASES.get(name, name)


def int8_kernel(usable: tuple[str, ...] | list[str]) -> str:
    """The int8 kernel a quantized linear runs, of the ``usable`` ones (those that take its
    shape): the ``linear.int8`` choice where it is usable, else the first usable of the rule's
    order (attnkit, fbgemm where the CPU has no matrix tiles, int8pack), else ``"dequantize"``."""
    chosen = choose("linear.int8")
    if chosen in usable:
        return chosen
    order = ("attnkit",) if capabilities().matrix_tiles else ("attnkit", "fbgemm")
    for kernel in (*order, "int8pack"):
        if kernel in usable:
            return kernel
    return "dequantize"


def int8_kernel_rows(rows: int, *, compiling: bool) -> bool:
    """Whether an int8 product of ``rows`` rows runs attnkit's kernel (else the dequantized
    GEMM): up to :data:`INT8_KERNEL_ROWS` rows, and every row outside compiled graphs where the
    wide dots run."""
    return rows <= INT8_KERNEL_ROWS or (not compiling and linear_plan().int8_wide)


def int4_kernel() -> str:
    """The int4 kernel of quantized linears: ``"attnkit"`` or ``"dequantize"``."""
    return choose("linear.int4")


# Attention: the bf16 flash forward's tile products
#
# A bf16 forward of attnkit's flash kernel multiplies its tiles either in float32 (bf16 blocks
# widened for the BLAS sgemm: the rule where the CPU has no bf16 dot products, which would only
# emulate bf16 products) or in bf16 with float32 sums through MKL's bf16 GEMM, which CPUs with
# bf16 dot products or matrix tiles run at bf16's speed. Whether MKL's bf16 GEMM pays on small
# tiles also depends on the vendor (MKL takes generic paths on some CPUs): measured on a causal
# prefill's shape.

__all__ += ["flash_bf16_products"]


def _flash_bf16_rule(caps: Capabilities) -> str:
    from attnkit.kernels import attention

    usable = attention.flash_bf16_products_available()
    return "bf16" if caps.bf16_dot and usable else "widened"


def _flash_bf16_candidates() -> dict[str, Callable[[], Any]]:
    """One bf16 causal forward of attnkit's flash kernel per product it can run here."""
    from attnkit.kernels import attention

    if not attention.flash_available():
        return {}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    usable = attention.FLASH_PRODUCTS
    if not attention.flash_bf16_products_available():
        usable = tuple(p for p in usable if p != "bf16")
    return {
        p: lambda p=p: attention.flash_attention(q, k, v, scale=0.125, causal=True, products=p)
        for p in usable
    }


register(
    Choice(
        "attention.flash_bf16_products",
        ("bf16", "widened"),
        "A bf16 flash forward's tile products: bf16 operands with float32 sums (MKL's bf16 GEMM), "
        "or widened to float32 for sgemm, which wins where the CPU has no bf16 dot products.",
        _flash_bf16_rule,
        _flash_bf16_candidates,
        margin=1.05,
    )
)


def flash_bf16_products() -> str:
    """How a bf16 flash forward multiplies its tiles (choice ``attention.flash_bf16_products``):
    the ``products`` argument of :func:`attnkit.kernels.attention.flash_attention` and
    :func:`attnkit.kernels.attention.capped_attention`."""
    return choose("attention.flash_bf16_products")
