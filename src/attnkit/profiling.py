"""Peak-memory measurement shared by ``attnkit bench``, ``attnkit complexity --measure`` and the
benchmark scripts.

On CUDA this is ``torch.cuda.max_memory_allocated``. On Linux CPUs it is the growth of the resident
high-water mark: glibc first returns freed blocks to the OS (``malloc_trim``; otherwise a warm call
would reuse them and show no growth), then writing ``5`` to ``/proc/self/clear_refs`` resets
``VmHWM`` to the current RSS, and the peak is ``VmHWM`` after the call minus the RSS before it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["peak_memory"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int | None:
    """Extra peak memory of one call of ``fn`` in bytes, or ``None`` where it can't be measured.

    Args:
        fn: The work to measure (call it once before, so one-time allocations are not counted).
        device: ``"cuda"`` devices use the CUDA allocator's statistics, others the process RSS.
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
