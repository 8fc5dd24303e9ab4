"""What this machine can do, probed once: the one place that reads the CPU's feature flags.

Everything that depends on the machine asks :func:`capabilities` (a frozen record) and, for a
choice between kernels, :mod:`attnkit.kernels.policy`; no other module names an instruction set.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "KERNEL_TARGET",
    "Capabilities",
    "c_compiler",
    "cache_dir",
    "capabilities",
    "cxx_compiler",
    "last_level_cache_bytes",
]

#: The CPU flags (``/proc/cpuinfo``) the kernels and the policy look at.
_FLAGS_OF_INTEREST = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


#: The compiler flags naming the instruction sets attnkit's C kernels are built for (what
#: :attr:`Capabilities.simd` checks; their wider paths are compiled per function and chosen at
#: run time).
KERNEL_TARGET = ("-mavx2", "-mfma")


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", frozenset()
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or "unknown", flags


def _torch_has(probe: str) -> bool:
    """``torch.cpu.<probe>()``, false where this torch lacks the probe."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


def cache_dir() -> Path:
    """Where compiled kernels and the policy's measurements are cached:
    ``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else ``~/.cache/attnkit``."""
    root = os.environ.get("ATTNKIT_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnkit"


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on the path."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cxx_compiler() -> str | None:
    """The C++ compiler the ``torch.library`` ops are built with: ``$CXX``, else ``c++``/``g++``."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache size from ``/sys`` (Linux), or 32 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = index.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 << 20)


@dataclass(frozen=True)
class Capabilities:
    """What this machine offers attnkit's kernels.

    Attributes:
        cpu: The CPU's model name.
        machine: ``platform.machine()`` (``x86_64``, ``aarch64``, ...).
        system: ``platform.system()``.
        cores: CPUs this process may run on.
        threads: ``torch.get_num_threads()`` when probed.
        flags: The CPU flags of interest found (``/proc/cpuinfo`` names).
        torch_version: ``torch.__version__``.
        mkldnn: Whether torch was built with oneDNN and can use it.
        c_compiler: The C compiler found, or None.
        cxx_compiler: The C++ compiler found, or None.
    """

    cpu: str
    machine: str
    system: str
    cores: int
    threads: int
    flags: frozenset[str] = field(default_factory=frozenset)
    torch_version: str = torch.__version__
    mkldnn: bool = False
    c_compiler: str | None = None
    cxx_compiler: str | None = None

    @property
    def simd(self) -> bool:
        """Whether attnkit's C kernels can run here (x86-64 Linux with AVX2 and FMA)."""
        return (
            self.system == "Linux"
            and self.machine in ("x86_64", "AMD64")
            and {"avx2", "fma"} <= self.flags
        )

    @property
    def wide_vectors(self) -> bool:
        """Whether the CPU has the 512-bit vector subsets the wide float dots use (F, BW, VL)."""
        return {"avx512f", "avx512bw", "avx512vl"} <= self.flags

    @property
    def bf16_dot(self) -> bool:
        """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles)."""
        return "avx512_bf16" in self.flags or self.matrix_tiles

    @property
    def bf16_pairs(self) -> bool:
        """Whether the CPU has 512-bit bf16 pair dot products (AVX512-BF16 with AVX512-BW), which
        ``csrc/bf16_gemm.c`` runs on."""
        return "avx512_bf16" in self.flags and "avx512bw" in self.flags

    @property
    def int8_dot(self) -> bool:
        """Whether the CPU has 512-bit int8 dot products (AVX512-VNNI) for the int8/int4 kernels."""
        return "avx512_vnni" in self.flags and self.wide_vectors

    @property
    def matrix_tiles(self) -> bool:
        """Whether the CPU has AMX tiles (and torch can use them)."""
        return "amx_tile" in self.flags or _torch_has("_is_amx_tile_supported")

    @property
    def key(self) -> str:
        """A short hash naming this machine and torch build, for cached measurements."""
        text = "|".join(
            [
                self.cpu,
                self.machine,
                self.system,
                str(self.cores),
                self.torch_version,
                ",".join(sorted(self.flags)),
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def features(self) -> dict[str, bool]:
        """The derived features the policy reads, by name (for ``attnkit kernels``)."""
        return {
            "simd kernels (AVX2+FMA)": self.simd,
            "wide vectors (AVX512 F/BW/VL)": self.wide_vectors,
            "bf16 dot products (AVX512-BF16 or AMX)": self.bf16_dot,
            "bf16 pair dot products (AVX512-BF16)": self.bf16_pairs,
            "int8 dot products (AVX512-VNNI)": self.int8_dot,
            "matrix tiles (AMX)": self.matrix_tiles,
            "oneDNN": self.mkldnn,
        }


@functools.cache
def capabilities() -> Capabilities:
    """This machine's :class:`Capabilities`, probed once per process."""
    cpu, flags = _cpuinfo()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return Capabilities(
        cpu=cpu,
        machine=platform.machine(),
        system=platform.system(),
        cores=cores,
        threads=torch.get_num_threads(),
        flags=frozenset(flag for flag in _FLAGS_OF_INTEREST if flag in flags),
        torch_version=torch.__version__,
        mkldnn=bool(torch.backends.mkldnn.is_available()),
        c_compiler=c_compiler(),
        cxx_compiler=cxx_compiler(),
    )
