"""Building attnkit's C kernels and the C++ ops, caching the builds, loading them.

The C sources (``csrc/*.c``) are built by the system's C compiler into one shared library cached
under :func:`attnkit.kernels.probe.cache_dir` (``kernels/kernels-<hash>.so``), named by a hash of
the sources, the flags and the compiler, written atomically; it runs on the OpenMP runtime torch
loaded (one thread pool: ``torch.set_num_threads`` applies) and is called through ``ctypes``
(:mod:`attnkit.kernels.binding` declares its functions). Where anything is missing (not Linux on
x86-64 with the vector units the kernels need, no compiler, a build that fails),
:func:`kernels_available` is false, :func:`kernels_unavailable` says why, and callers use torch's
kernels.

Compiled graphs call the decoding kernels as ops (:mod:`attnkit.kernels.ops`). Their CPU
implementations are C++ (``csrc/ops.cpp``, built with the system's C++ compiler against torch's
headers and linked to the kernels' library), so the dispatcher calls the kernels without
entering Python. :func:`load_ops` builds and loads them; until then, and where they cannot be
built (:func:`ops_unavailable` says why), the ops run the Python functions of this package.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from attnkit.kernels import binding
from attnkit.kernels.probe import KERNEL_TARGET, c_compiler, cache_dir, capabilities, cxx_compiler

__all__ = [
    "CSRC",
    "eager_cpu",
    "kernels_available",
    "kernels_loaded",
    "kernels_path",
    "kernels_unavailable",
    "library",
    "load_library",
    "load_ops",
    "openmp_runtime",
    "ops_path",
    "ops_unavailable",
    "require_cpu",
]

#: The folder of the kernels' sources.
CSRC = Path(__file__).with_name("csrc")
_SOURCES = tuple(
    CSRC / name
    for name in (
        "int8_dot.c",
        "int4_dot.c",
        "block_dot.c",
        "float_dot.c",
        "capped_softmax.c",
        "one_query.c",
        "flash.c",
        "bf16_gemm.c",
        "rows.c",
        "step.c",
    )
)
#: Headers the sources include (hashed into the build's name with them).
_HEADERS = (CSRC / "simd.h",)
_FLAGS = ("-O3", *KERNEL_TARGET, "-fPIC", "-Wall")
_OPS_SOURCE = CSRC / "ops.cpp"


def openmp_runtime() -> Path | None:
    """The OpenMP runtime (``libgomp``) this process loaded with torch, if any."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1]
        if "libgomp" in Path(path).name and Path(path).is_file():
            return Path(path)
    return None


def _version(compiler: list[str]) -> str:
    """The compiler's ``--version`` text (hashed into a build's name)."""
    done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout


def _run(command: list[str], timeout: int) -> None:
    """Run a compiler command; a RuntimeError with the end of its errors where it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")


def _build(compiler: str, runtime: Path | None) -> Path:
    """Compile the sources (cached by a hash of everything that goes into the build)."""
    sources = [path.read_bytes() for path in (*_SOURCES, *_HEADERS)]
    cc = shlex.split(compiler)  # (CC may carry a launcher or flags: "ccache gcc")
    version = _version(cc)
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(_FLAGS).encode(), version.encode(), str(runtime).encode()])
    ).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    target = folder / f"kernels-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        objects = [str(Path(work) / f"{path.stem}.o") for path in _SOURCES]
        lib = Path(work) / target.name
        compile_flags = [*_FLAGS, "-fopenmp"] if runtime else [*_FLAGS, "-Wno-unknown-pragmas"]
        # Linked to torch's own OpenMP runtime by path, not the compiler's: one thread pool.
        link = [str(runtime), f"-Wl,-rpath,{runtime.parent}"] if runtime else []
        commands = [
            [*cc, *compile_flags, "-c", str(path), "-o", obj]
            for path, obj in zip(_SOURCES, objects, strict=True)
        ]
        for command in [*commands, [*cc, "-shared", *objects, "-o", str(lib), *link]]:
            _run(command, timeout=300)
        os.replace(lib, target)  # (atomic: a reader sees a whole library or none)
    return target


def _build_ops(compiler: str, kernels: Path) -> Path:
    """Compile the ops' C++ implementations against torch's headers, linked to ``kernels`` (cached
    by a hash of everything that goes into the build)."""
    cxx = shlex.split(compiler)
    version = _version(cxx)
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-fPIC", "-shared", "-std=c++17", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    parts = [_OPS_SOURCE.read_bytes(), *(str(x).encode() for x in (flags, version, kernels))]
    key = hashlib.sha256(b"\0".join([*parts, torch.__version__.encode()])).hexdigest()[:16]
    target = kernels.parent / f"ops-{key}.so"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=kernels.parent) as work:
        lib = Path(work) / target.name
        libs = torch_dir / "lib"
        command = [*cxx, *flags, "-I", str(torch_dir / "include"), str(_OPS_SOURCE), str(kernels)]
        command += ["-L", str(libs), "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{libs}", "-o", str(lib)]
        _run(command, timeout=600)
        os.replace(lib, target)  # (atomic, as the kernels')
    return target


_kernels_path: Path | None = None  # the library load_library() loaded (None: none yet)
_ops_path: Path | None = None  # the ops' library loaded (None: none yet)
_ops_why: str | None = None  # why the C++ ops are not loaded ("" loaded; None: not tried)


@functools.cache
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The kernels' library, built the first time (then cached on disk) and loaded once a
    process, or ``None`` and why not."""
    caps = capabilities()
    if not caps.simd:
        if caps.system != "Linux" or caps.machine not in ("x86_64", "AMD64"):
            return None, f"needs Linux on x86-64 (this is {caps.system} on {caps.machine})"
        return None, "the CPU lacks the vector units the kernels need (see attnkit kernels)"
    compiler = c_compiler()
    if compiler is None:
        return None, "no C compiler (set CC, or install gcc)"
    try:
        path = _build(compiler, openmp_runtime())
        lib = ctypes.CDLL(str(path))
        binding.declare(lib)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as error:
        return None, f"the build failed: {error}"
    global _kernels_path
    _kernels_path = path
    return lib, ""


def library() -> ctypes.CDLL:
    """The kernels' library; a RuntimeError saying why where it is not available."""
    lib, why = load_library()
    if lib is None:
        raise RuntimeError(f"attnkit's kernels are not available: {why}")
    return lib


def kernels_available() -> bool:
    """Whether attnkit's C kernels run here (the first call builds them)."""
    return load_library()[0] is not None


def kernels_unavailable() -> str:
    """Why attnkit's kernels cannot run here (empty where they can)."""
    return load_library()[1]


def kernels_loaded() -> bool:
    """Whether the kernels are built and loaded already (never builds them: safe to ask while
    ``torch.compile`` traces, where a build cannot run)."""
    return _kernels_path is not None


def kernels_path() -> Path | None:
    """The kernels' library loaded in this process (None: not loaded)."""
    return _kernels_path


def _load_ops(kernels: Path) -> None:
    """Load the ops' C++ implementations, once a process (a library's registrations stay)."""
    global _ops_why, _ops_path
    if _ops_why is not None:
        return
    compiler = cxx_compiler()
    if compiler is None:
        _ops_why = "no C++ compiler (set CXX, or install g++)"
        return
    try:
        path = _build_ops(compiler, kernels)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _ops_why = f"the build failed: {error}"
        return
    _ops_why, _ops_path = "", path


def load_ops() -> bool:
    """Build (the first time, then cached) and load the ops' C++ implementations, after the
    kernels they call; whether they are loaded. :func:`attnkit.decoding.compiled_step` calls
    this before it traces (a graph compiled before keeps calling the Python functions)."""
    load_library()
    if _kernels_path is None:
        return False
    _load_ops(_kernels_path)
    return _ops_why == ""


def ops_unavailable() -> str:
    """Why the ops compiled graphs call run this package's Python functions rather than their
    C++ implementations ("" where the C++ ones are loaded; :func:`load_ops` first)."""
    if not kernels_available():
        return f"attnkit's kernels are not available: {kernels_unavailable()}"
    load_ops()
    return _ops_why or ""


def ops_path() -> Path | None:
    """The ops' C++ library loaded in this process (None: not loaded)."""
    return _ops_path


def eager_cpu(t: Tensor) -> bool:
    """Whether attnkit's kernels may compute on ``t`` now: it lives on the CPU and torch runs
    eagerly (not compiling or tracing, outside torch dispatch modes: a graph, a trace, a FLOP
    counter or fake tensors see torch's ops, not a kernel's writes; and outside ``torch.func``'s
    transforms, whose batched or differentiated tensors have no memory of their own to read)."""
    return (
        t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not is_in_torch_dispatch_mode()
        and not torch._C._are_functorch_transforms_active()
    )


def require_cpu(name: str, *tensors: Tensor) -> None:
    """Raise a ValueError naming the devices where one of a kernel's tensors is not on the CPU."""
    if any(t.device.type != "cpu" for t in tensors):
        devices = ", ".join(str(t.device) for t in tensors)
        raise ValueError(f"{name} runs on CPU tensors, got {devices}")
