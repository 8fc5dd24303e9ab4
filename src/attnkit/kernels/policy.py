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

import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from attnkit.kernels.probe import Capabilities, cache_dir, capabilities

__all__ = [
    "Choice",
    "Decision",
    "choices",
    "choose",
    "decision",
    "register",
    "retune",
    "tune_file",
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
    """

    name: str
    options: tuple[str, ...]
    doc: str
    rule: Callable[[Capabilities], str]
    candidates: Callable[[], Mapping[str, Callable[[], Any]]] | None = None


@dataclass(frozen=True)
class Decision:
    """How a choice was answered on this machine.

    Attributes:
        name: The choice's name.
        option: The option chosen.
        source: ``"environment"``, ``"measured"``, ``"cached"`` or ``"rule"``.
        seconds: For a measured choice, the median seconds of each candidate timed.
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


def _env_name(name: str) -> str:
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


def _time(calls: Mapping[str, Callable[[], Any]], rounds: int = 5) -> dict[str, float]:
    """Median seconds per call of each candidate: one warm-up each, then interleaved rounds
    (neighbours in time share the machine's load, so their ratio is fair on a busy machine)."""
    with torch.no_grad():
        for call in calls.values():
            call()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


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
    try:
        seconds = _time(calls)
    except Exception:
        return None
    best = min(seconds, key=seconds.__getitem__)
    return Decision(choice.name, best, "measured", seconds)


def decision(name: str) -> Decision:
    """How the choice ``name`` is answered here (deciding it now if it was not yet)."""
    try:
        choice = _CHOICES[name]
    except KeyError:
        known = ", ".join(sorted(_CHOICES))
        raise ValueError(f"unknown kernel choice {name!r} (known: {known})") from None
    forced = os.environ.get(_env_name(name))
    if forced:
        if forced not in choice.options:
            raise ValueError(
                f"{_env_name(name)}={forced!r} is not an option of {name!r} "
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


def retune(names: list[str] | None = None) -> list[Decision]:
    """Measure the measured choices again (all, or ``names``) and rewrite the cache."""
    targets = [n for n in (names or list(_CHOICES)) if _CHOICES[n].candidates is not None]
    with _LOCK:
        tuned = _read_tuned()
        for name in targets:
            _DECIDED.pop(name, None)
            tuned.pop(name, None)
        _write_tuned(tuned)
    return [decision(name) for name in targets]


# Attention
#
# Which path serves an attention call (docs/guide/core.md, "How a call finds its kernel"). The
# callers hand over what they know of a checked call; nothing here reads tensor values. attnkit's
# compiled kernels sit above this module, so the attention modules hand their entry points over
# at import (:func:`provide_attention_kernel`) for the measured choices to time.

#: Scores per head below which causal/window attention stays on torch's fused kernel: there the
#: BLAS calls' set-up outweighs the keys attnkit's flash kernels skip.
FLASH_MIN_SCORES = 64 * 64
#: Below this many keys the dense fused kernel beats the block-sparse tiles: planning and
#: per-call overhead outweigh the skipped work.
SPARSE_MIN_KEYS = 2048
#: The tiles run when they compute at most this fraction of the dense scores ...
SPARSE_MAX_DENSITY = 0.25
#: ... or, from this many keys on, ...
SPARSE_LONG_KEYS = 4096
#: ... this fraction without a backward ...
SPARSE_LONG_MAX_DENSITY = 0.5
#: ... and this one with a backward (the flash backward costs a larger multiple of its forward
#: than the dense one does).
SPARSE_LONG_BACKWARD_MAX_DENSITY = 0.35
#: Most scores a soft-capped chunk computes (all heads of the batch together): the buffer stays
#: bounded for long keys.
CAPPED_CHUNK_SCORES = 2**21
#: Most queries per soft-capped chunk: taller products run faster, but a causal chunk computes
#: ``rows**2 / 2`` masked scores on its diagonal.
CAPPED_MAX_ROWS = 128
#: Fewest queries per soft-capped chunk (below it the per-call overhead dominates).
CAPPED_MIN_ROWS = 16

_ATTENTION_KERNELS: dict[str, Callable[..., Any]] = {}


def provide_attention_kernel(name: str, kernel: Callable[..., Any]) -> None:
    """Hand the policy an attention kernel to time (``"flash"``: attnkit's flash forward, the
    signature of :func:`attnkit.native.flash_attention`; ``"tiles"``: a causal window forward on
    torch's flash kernel in tiles, :func:`attnkit.sparse.window_tiles`)."""
    _ATTENTION_KERNELS[name] = kernel


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


def attention_plan(
    *,
    dtype: torch.dtype,
    device: str,
    L: int,
    S: int,
    causal: bool = False,
    window: int | None = None,
    batched: bool = False,
    masked: bool = False,
    weights: bool = False,
    dropout: bool = False,
    softcap: bool = False,
    grads: bool = False,
    eager: bool = False,
    ready: bool = False,
) -> AttentionPlan:
    """Every choice for a checked attention call with more than one query, in one answer (the
    arguments are the fields of :class:`AttentionCall`)."""
    call = AttentionCall(
        dtype, device, L, S, causal, window, batched, masked, weights, dropout, softcap, grads,
        eager, eager and ready, is_in_torch_dispatch_mode(),
    )  # fmt: skip
    path = attention_path(call)
    tiled = path in ("flash", "tiles")  # (only these ask the measured choices)
    return AttentionPlan(
        call,
        path,
        capped_kernel(call) if path == "capped" else "chunks",
        tile_kernels(call) if tiled else TileKernels(False),
        tile_rows(L, window, dtype) if path == "tiles" else None,
    )


def attention_path(call: AttentionCall) -> str:
    """The path of a checked attention call with more than one query.

    * ``"capped"``: soft-capped scores, which torch's fused kernels cannot compute
      (:func:`capped_kernel` says which capped kernel; it returns weights too).
    * ``"explicit"``: the weights are requested, or there is no key: the textbook math (the
      tests' reference).
    * ``"flash"``: causal or sliding-window attention on attnkit's flash kernels over the whole
      sequence (:func:`flash_kernel`), from :data:`FLASH_MIN_SCORES` scores per head: each block
      of queries computes only the keys it may reach.
    * ``"tiles"``: structured attention on long sequences: the block-sparse tiles, when
      :func:`block_sparse` finds that they skip enough of the scores, else ``"fused"``.
    * ``"fused"``: torch's fused ``scaled_dot_product_attention``.
    """
    if call.softcap:
        return "capped"
    if call.weights or call.S == 0:
        return "explicit"
    if (
        call.structured
        and not (call.batched or call.masked or call.dropout)
        and call.L * call.S >= FLASH_MIN_SCORES
        and flash_kernel(call)
    ):
        return "flash"
    if (call.window is not None or call.batched) and not call.masked and call.S >= SPARSE_MIN_KEYS:
        return "tiles"
    return "fused"


def flash_kernel(call: AttentionCall) -> bool:
    """Whether attnkit's flash kernels (forward and backward) should compute ``call`` rather than
    torch's flash kernel: where they may run (:attr:`AttentionCall.eager` and
    :attr:`AttentionCall.ready`), in float32 always (they skip finer blocks of a causal or
    windowed structure than torch's kernel), in bfloat16 by :func:`bf16_structured` (they widen
    bf16 blocks to float32 and multiply in float32, which wins where the CPU has no bf16 units
    and loses where torch's kernel runs on them)."""
    if not (call.eager and call.ready):
        return False
    if call.dtype == torch.float32:
        return True
    if call.dtype != torch.bfloat16:
        return False
    if call.grads:
        return not torch_low_precision(torch.bfloat16, backward=True)
    return bf16_structured(call.window)[0] == "flash"


def torch_low_precision(dtype: torch.dtype, *, backward: bool) -> bool:
    """Whether torch's CPU flash kernel should compute ``dtype`` (bfloat16 or float16) itself
    rather than on float32 copies of the inputs.

    A bfloat16 forward alone: always (it is torch's own bf16 path; float32 copies cost fresh
    allocations on every call). With a backward, only where the CPU multiplies ``dtype``
    natively (AVX512-BF16 or AMX tiles for bfloat16, AMX-FP16 for float16): elsewhere torch's
    kernel converts every block it multiplies, which costs more than one float32 pass and a
    rounding at the end. float16 forward likewise needs AMX-FP16.
    """
    if dtype == torch.bfloat16:
        return not backward or capabilities().bf16_dot
    return dtype == torch.float16 and _torch_has_amx_fp16()


def _torch_has_amx_fp16() -> bool:
    probe = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    return bool(probe()) if probe is not None else False


@dataclass(frozen=True)
class TileKernels:
    """The kernels of the block-sparse tiles (:func:`tile_kernels`).

    Attributes:
        flash: attnkit's flash kernels compute causal/window structures whole, and the runs
            without a mask of the others; torch's flash kernel the rest.
        widen: bfloat16/float16 inputs are computed on float32 copies and the result rounded
            (unless every run takes attnkit's kernel, which widens blocks itself).
        flash_wide: ``flash`` for those float32 copies.
    """

    flash: bool
    widen: bool = False
    flash_wide: bool = False


def tile_kernels(call: AttentionCall) -> TileKernels:
    """The kernels of the block-sparse tiles for ``call``: :func:`flash_kernel`, and float32
    copies for half precision where :func:`torch_low_precision` says torch's kernel should not
    take it."""
    low = call.dtype in (torch.bfloat16, torch.float16)
    widen = low and not torch_low_precision(call.dtype, backward=call.grads)
    wide = dataclasses.replace(call, dtype=torch.float32)
    return TileKernels(flash_kernel(call), widen, widen and flash_kernel(wide))


def block_sparse(
    L: int, S: int, *, covered: int, batch: int, backward: bool, structured: bool = True
) -> bool:
    """Whether the block-sparse tiles should replace the dense fused kernel: at least
    :data:`SPARSE_MIN_KEYS` keys and tiles that compute at most :data:`SPARSE_MAX_DENSITY` of the
    ``batch * L * S`` scores (from :data:`SPARSE_LONG_KEYS` keys on
    :data:`SPARSE_LONG_MAX_DENSITY`, or :data:`SPARSE_LONG_BACKWARD_MAX_DENSITY` when a backward
    follows). ``covered`` is the number of scores the tiles compute."""
    if S < SPARSE_MIN_KEYS or L < 1 or not structured:
        return False
    density = SPARSE_MAX_DENSITY
    if S >= SPARSE_LONG_KEYS:
        density = SPARSE_LONG_BACKWARD_MAX_DENSITY if backward else SPARSE_LONG_MAX_DENSITY
    return covered <= density * batch * L * S


def tile_rows(L: int, window: int | None, dtype: torch.dtype = torch.float32) -> int:
    """Queries per block-sparse tile.

    With a window the band computed per query is ``rows + window`` keys wide, so tiles stay
    small: 64 rows, 128 past a window of 2048 (half the calls and overlapping key gradients for
    a few percent more scores); a bfloat16 window forward on torch's kernel takes the measured
    height of :func:`bf16_structured`. Without one (documents, padding, plain causal) a span is
    a whole document or prefix, and large tiles mean fewer, larger kernel calls: 1024 rows.
    """
    if window is None:
        return max(1, min(1024, L))
    rows = 128 if window > 2048 else 64
    if dtype == torch.bfloat16:
        kernel, measured = bf16_structured(window)
        if kernel == "tiles" and window <= 2048:
            rows = measured
    return max(1, min(rows, L))


def _bf16_structured_candidates() -> dict[str, Callable[[], Any]]:
    """A bfloat16 sliding-window forward (window 256 over 1024 queries, 4 heads of 64) on
    attnkit's flash kernel and on torch's kernel in tiles of 64, 128 and 256 queries."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    calls: dict[str, Callable[[], Any]] = {}
    flash, tiles = _ATTENTION_KERNELS.get("flash"), _ATTENTION_KERNELS.get("tiles")
    if tiles is None:  # (not measured, nor cached, before attnkit.sparse is imported)
        raise LookupError("the attention kernels are not imported: import attnkit.functional")
    if flash is not None:
        calls["flash"] = lambda: flash(q, k, v, scale=0.125, causal=True, window=256)
    if tiles is not None:
        for rows in (64, 128, 256):
            calls[f"tiles-{rows}"] = lambda rows=rows: tiles(q, k, v, rows=rows, window=256)
    return calls


register(
    Choice(
        "attention.bf16_structured",
        ("flash", "tiles-64", "tiles-128", "tiles-256"),
        "A bfloat16 causal/sliding-window forward: attnkit's flash kernel (bf16 widened to "
        "float32 blocks) or torch's flash kernel on tiles of that many queries (bf16 products "
        "where the CPU has bf16 units). Which wins depends on those units and on the tile size.",
        lambda caps: "tiles-64" if caps.matrix_tiles else "flash",
        _bf16_structured_candidates,
    )
)


def bf16_structured(window: int | None = None) -> tuple[str, int]:
    """``(kernel, rows)`` for a bfloat16 causal/window forward: ``"flash"`` (attnkit's) or
    ``"tiles"`` (torch's kernel in tiles of ``rows`` queries), from the measured
    ``attention.bf16_structured`` choice. Without a window a tile is a whole prefix, so only
    the kernel is taken from the measurement."""
    option = choose("attention.bf16_structured")
    if option == "flash":
        return "flash", 0
    return "tiles", int(option.split("-")[1])


def capped_kernel(call: AttentionCall) -> str:
    """Which kernel computes soft-capped attention.

    * ``"flash"``: attnkit's flash loop with the cap, where it may run, without gradients,
      masks, documents, lengths, weights or dropout, in float32 or bfloat16 (widened): the
      scores never leave the caches.
    * ``"one-pass"``: chunks of queries over their key spans, with the cap, the causal/window
      masks and the softmax as one in-place pass of attnkit's row kernel (no gradients, masks,
      documents or lengths; float32 or widened bf16/fp16 in float32).
    * ``"chunks"``: the same chunks with torch's operations (anything else).
    """
    simple = (
        not call.grads
        and not call.masked
        and not call.batched
        and not call.weights
        and not call.dropout
    )
    wide = torch.promote_types(call.dtype, torch.float32) == torch.float32
    if simple and wide and call.eager and call.ready:
        return "flash"
    if (
        not call.grads
        and not call.masked
        and not call.batched
        and wide
        and call.device == "cpu"
        and call.ready
    ):
        return "one-pass"
    return "chunks"


def capped_flash_rows(window: int | None) -> int:
    """Queries per block of the capped flash kernel: 64 for a window (a block computes
    ``rows + window`` keys per query), else 128 (taller products run faster)."""
    return 64 if window is not None else 128


def capped_chunk_rows(heads: int, width: int, L: int, window: int | None = None) -> int:
    """Queries per soft-capped chunk: :data:`CAPPED_MAX_ROWS` (a quarter of a ``window``, if
    that is less), fewer when ``heads * rows * width`` would pass :data:`CAPPED_CHUNK_SCORES`
    (but at least :data:`CAPPED_MIN_ROWS`), never more than ``L``.

    A window's chunk computes ``rows * (window + rows)`` scores for ``rows * window`` allowed
    pairs, so its rows stay small beside the window.

    Args:
        heads: Batch times query heads.
        width: Keys a chunk attends at most (``S``, or ``window + rows`` for a window).
        L: Query length.
        window: The sliding window, if any.
    """
    most = CAPPED_MAX_ROWS
    if window is not None:
        most = min(CAPPED_MAX_ROWS, window // 4 // CAPPED_MIN_ROWS * CAPPED_MIN_ROWS)
    rows = CAPPED_CHUNK_SCORES // max(1, heads * width)
    rows = max(CAPPED_MIN_ROWS, min(most, rows // CAPPED_MIN_ROWS * CAPPED_MIN_ROWS))
    return max(1, min(rows, L))


def one_query_kernel(dtype: torch.dtype, device: str, grads: bool) -> bool:
    """Whether attnkit's one-query kernel computes a decoding step (one query per sequence over
    a cache) rather than torch's fused kernel: float32 or bfloat16 on the CPU, no gradients,
    outside torch dispatch modes (the caller checks that the kernels load; under
    ``torch.compile`` it is one operation of the graph). It reads each key/value row once for the
    query heads that share it, and skips the slots a static cache's mask leaves out, which
    torch's kernel reads."""
    return (
        dtype in (torch.float32, torch.bfloat16)
        and device == "cpu"
        and not grads
        and not is_in_torch_dispatch_mode()
    )


def ring_block_kernel(call: AttentionCall) -> str:
    """The kernel of one block of ring attention (:mod:`attnkit.distributed`): ``"flash"``
    (attnkit's flash kernels, where :func:`flash_kernel` says), ``"torch-flash"`` (torch's CPU
    flash kernel: CPU tensors of a dtype it takes) or ``"explicit"`` (the math, any device)."""
    if flash_kernel(call):
        return "flash"
    if call.device == "cpu" and call.dtype in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
    ):
        return "torch-flash"
    return "explicit"
