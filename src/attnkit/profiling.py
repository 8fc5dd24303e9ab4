"""Timing and peak-memory measurement shared by ``attnkit bench``, ``attnkit complexity
--measure`` and the benchmark scripts.

Timing: :func:`time_call` times one call (waiting for CUDA work before and after),
:func:`time_interleaved` times several implementations in interleaved rounds (so that the noise
of a shared machine hits them alike; compare medians), :func:`best_time` keeps the fastest of
repeated calls, and :func:`matmul_flops_per_second` measures the dense matmul rate, the roofline
attention kernels chase.

Memory: on CUDA :func:`peak_memory` is ``torch.cuda.max_memory_allocated``. On Linux CPUs it is
the growth of the resident high-water mark: glibc first returns freed blocks to the OS
(``malloc_trim``; otherwise a warm call would reuse them and show no growth), then writing ``5``
to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current RSS, and the peak is ``VmHWM`` after
the call minus the RSS before it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "best_time",
    "matmul_flops_per_second",
    "peak_memory",
    "time_call",
    "time_calls",
    "time_interleaved",
]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds one call of ``fn`` takes, including the CUDA work it queues.

    Args:
        fn: The work to time.
        device: On a ``"cuda"`` device the clock starts and stops after synchronizing it.

    Returns:
        Wall-clock seconds of the call.
    """
    device = torch.device(device)
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    device: torch.device | str = "cpu",
) -> dict[str, list[float]]:
    """Time several implementations side by side: ``repeats`` rounds, each calls every one once.

    Interleaving spreads the load changes of a shared machine over all implementations alike,
    so ratios of their medians are meaningful even when absolute times are not. Warm each
    function up before (first calls pay for allocation and kernel selection).

    Args:
        fns: Name -> the work to time.
        repeats: Rounds (samples per implementation).
        device: Device whose queued work each timing waits for.

    Returns:
        Name -> the ``repeats`` timings in seconds, in round order.

    Raises:
        ValueError: If ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_call(fn, device))
    return samples


def time_calls(calls: Mapping[str, Callable[[], Any]], *, rounds: int = 7) -> dict[str, float]:
    """Median seconds per call of each of ``calls``: one warm-up call each, then ``rounds``
    interleaved rounds (:func:`time_interleaved`)."""
    for call in calls.values():
        call()
    samples = time_interleaved(calls, repeats=rounds)
    return {name: statistics.median(t) for name, t in samples.items()}


def best_time(
    fn: Callable[[], object],
    device: torch.device | str = "cpu",
    *,
    min_runs: int = 3,
    max_runs: int = 50,
    budget_s: float = 1.0,
) -> float:
    """Fastest of repeated calls of ``fn`` after one warm-up call.

    It runs at least ``min_runs`` times, then more while ``budget_s`` seconds have not passed,
    up to ``max_runs``. On a shared machine the fastest run is the least disturbed one.

    Args:
        fn: The work to time.
        device: Device whose queued work each timing waits for.
        min_runs: Timed runs at the least.
        max_runs: Timed runs at the most.
        budget_s: Seconds after which no run beyond ``min_runs`` starts.

    Returns:
        The smallest time in seconds.

    Raises:
        ValueError: If ``min_runs < 1`` or ``max_runs < min_runs``.
    """
    if min_runs < 1 or max_runs < min_runs:
        raise ValueError(f"need 1 <= min_runs <= max_runs, got {min_runs} and {max_runs}")
    time_call(fn, device)  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (
        time.perf_counter() - start < budget_s and len(times) < max_runs
    ):
        times.append(time_call(fn, device))
    return min(times)


def matmul_flops_per_second(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    size: int | None = None,
    budget_s: float = 0.5,
) -> float:
    """Measured rate of a dense square matmul in FLOP/s (``2 * n**3`` FLOPs per product).

    Args:
        dtype: Element type of the operands.
        device: Where to run it.
        size: ``n``; defaults to 8192 on CUDA and 1024 elsewhere.
        budget_s: Time budget of :func:`best_time`.

    Returns:
        FLOP/s of the fastest run.

    Raises:
        ValueError: If ``size < 1``.
    """
    device = torch.device(device)
    n = size if size is not None else (8192 if device.type == "cuda" else 1024)
    if n < 1:
        raise ValueError(f"size must be >= 1, got {n}")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = best_time(lambda: a @ b, device, budget_s=budget_s)
    return 2 * n**3 / seconds


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> int | None:
    """Extra peak memory of one call of ``fn`` in bytes, or ``None`` where it can't be measured.

    Args:
        fn: The work to measure (call it once before, so one-time allocations are not counted).
        device: ``"cuda"`` devices use the CUDA allocator's statistics, others the process RSS.

    Returns:
        Bytes above the memory in use before the call, or ``None`` without ``/proc`` access.
    """
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with contextlib.suppress(OSError, AttributeError):  # not glibc: measure as is
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        base = _status_kib("VmRSS")
        fn()
        return max(0, _status_kib("VmHWM") - base) * 1024
    except OSError:  # not Linux, or /proc not writable
        return None
