"""Kernels attnkit compiles itself, on first use, with the system's C compiler.

Products for decoding (a weight times a few rows), each reading the weight as one sequential
stream per thread, prefetched ahead:

* int8 weights through AVX2's integer dot products (``csrc/int8_dot.c``). On CPUs with AVX2 but
  neither AVX512-BF16 nor AMX, torch's int8 kernels (fbgemm's dynamic linear,
  ``torch._weight_int8pack_mm``) stream one-row products at about a third of the read bandwidth;
  this one streams the codes at about the bandwidth, as llama.cpp's ``q8_0`` dot does
  (``benchmarks/RESULTS.md``). Its activations are rounded to int8 per block of 32 inputs, so it
  is more exact than fbgemm's (one 7-bit scale per row).
* int4 weights (a bf16 scale and offset per group of inputs) through the same integer dots
  (``csrc/int4_dot.c``): the codes packed two to a byte, unpacked by a shift and two masks,
  multiplied by the activations rounded as for int8. torch's CPU int4 kernel
  (``torch._weight_int4pack_mm_for_cpu``) converts its codes to floats, and decoded the 135M
  Llama shape at 0.83x attnkit's int8 on an AVX512 EPYC (``benchmarks/RESULTS.md``).
* bf16 and float32 weights through AVX2 FMAs (``csrc/float_dot.c``): torch's bf16 ``F.linear``
  reads a one-row product's weight at about 0.6x this kernel's bandwidth on such CPUs, and at
  0.5x on an AMD EPYC with AVX512-BF16 (fp32 ``F.linear`` at 0.4x). Where the CPU has AVX512
  (:func:`float_wide`), eight rows share each weight vector: on an Intel Xeon with AMX a step's
  products of 8 rows through the 100M Llama shape ran 1.4x faster than with the AVX2 dots' two,
  and 8 prompts decoded 1.2x faster (compiled).

and for attention:

* a decoding step's attention, one query per head over a key/value cache
  (``csrc/one_query.c``, :func:`one_query_attention`, in compiled graphs the op
  ``attnkit::one_query_attention``): the query heads sharing a key/value head computed together,
  masked slots of a static cache never read; torch's fused kernel spends most of such a call on
  set-up, and reads every slot.
* FlashAttention's loop for float32 attention (``csrc/flash.c``): :func:`flash_attention` and
  :func:`flash_attention_backward` (FlashAttention-2's order), tiles of scores from the BLAS
  ``sgemm`` torch links, folded into an online softmax while they sit in L2, each block of
  queries computing only the keys its causal/window rules let it reach (torch's CPU kernel
  computes whole 256 x 512 blocks): :mod:`attnkit.blockwise` runs them for structured
  attention. :func:`capped_attention` is the forward with Gemma 2's soft cap, which torch's
  fused kernels cannot apply.
* the soft-capped softmax of rows of scores (``csrc/capped_softmax.c``,
  :func:`capped_softmax_`): the cap, the causal/window masks and the softmax in one pass from
  memory, where torch makes five (for torch builds whose BLAS cannot be found).

and for a forward pass's row-wise steps (``csrc/rows.c``), which torch runs as several passes
through fresh tensors, and fresh memory is what an eager prefill pays most for on a CPU (page
faults):

* RMSNorm (:func:`rms_norm`): a row's sum of squares, then its scaled product, in float32 for
  bf16 rows too, where torch's composite makes a float32 copy, its square, the mean, the scale and
  the cast back;
* rotary positions (:func:`rotate`): queries or keys rotated in float32 and rounded once, where
  torch's form (:func:`attnkit.positional.apply_rope`) makes a float32 copy, the product with the
  cosines, the partner's product with the sines, and the cast back.

The AVX2 helpers they share (``exp``, bf16 conversions, lane sums) are in ``csrc/simd.h``.

The sources are built by ``cc -O3 -mavx2 -mfma`` into one shared library cached under
``$ATTNKIT_CACHE_DIR`` (default ``~/.cache/attnkit``), named by a hash of the sources, the flags
and the compiler, written atomically; it runs on the OpenMP runtime torch loaded (one thread
pool; ``torch.set_num_threads`` applies) and is called through ``ctypes``. Where anything is
missing (not Linux on x86-64 with AVX2 and FMA, no compiler, a build that fails),
:func:`kernels_available` is false, :func:`kernels_unavailable` says why, and callers use
torch's kernels.

Compiled graphs call the decoding kernels as ops (``attnkit::int8_dot_linear``,
``attnkit::int4_dot_linear``, ``attnkit::float_dot_linear``, ``attnkit::one_query_attention``).
Their CPU implementations are C++ (``csrc/ops.cpp``, built with the system's C++ compiler
against torch's headers and linked to the kernels' library), so the dispatcher calls the kernels
without entering Python: 15-25 us a call less, over a hundred calls a decoding step with int8 or
int4 weights (``benchmarks/RESULTS.md``).
:func:`load_ops` builds and loads them (:func:`attnkit.decoding.compiled_step` does, before it
traces); until then, and where they cannot be built (:func:`ops_unavailable` says why), the ops
run this module's Python functions (registered for every backend, so a C++ CPU kernel takes
precedence).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

__all__ = [
    "INT8_DOT_BLOCK",
    "capped_attention",
    "capped_softmax_",
    "eager_cpu",
    "flash_attention",
    "flash_attention_backward",
    "flash_available",
    "float_dot_linear",
    "float_wide",
    "group_codes",
    "int4_dot_linear",
    "int8_dot_linear",
    "int8_vnni",
    "kernels_available",
    "kernels_loaded",
    "kernels_unavailable",
    "load_ops",
    "one_query_attention",
    "ops_unavailable",
    "pack_int4",
    "pack_int4_scales",
    "rms_norm",
    "rotate",
    "round_activations",
    "ungroup_codes",
    "unpack_int4",
    "unpack_int4_scales",
    "wide_cpu",
]

#: Inputs per activation scale; the weight's input count must be a multiple of it.
INT8_DOT_BLOCK = 32
#: Output rows whose codes :func:`group_codes` lays side by side.
_GROUP = 4
_SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "int8_dot.c",
        "int4_dot.c",
        "float_dot.c",
        "capped_softmax.c",
        "one_query.c",
        "flash.c",
        "rows.c",
    )
)
#: Headers the sources include (hashed into the build's name with them).
_HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("simd.h",))
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-Wall")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _cpu_has(probe: str) -> bool:
    """``torch.cpu.<probe>()``, false where this torch lacks the probe."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


def wide_cpu() -> bool:
    """Whether this CPU has the AVX512 subsets :func:`float_wide`'s dots need (F, BW and VL;
    from the CPU's flags, without building the kernels)."""
    return {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags()


def _amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon from Sapphire Rapids on)."""
    return _cpu_has("_is_amx_tile_supported")


def _openmp_runtime() -> Path | None:
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


def _cache_dir() -> Path:
    root = os.environ.get("ATTNKIT_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnkit"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


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
    folder = _cache_dir() / "kernels"
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


_OPS_SOURCE = Path(__file__).with_name("csrc") / "ops.cpp"


def _cxx_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


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


_ops_why: str | None = None  # why the C++ ops are not loaded ("" loaded; None: not tried)


def _load_ops(kernels: Path) -> None:
    """Load the ops' C++ implementations, once a process (a library's registrations stay)."""
    global _ops_why
    if _ops_why is not None:
        return
    compiler = _cxx_compiler()
    if compiler is None:
        _ops_why = "no C++ compiler (set CXX, or install g++)"
        return
    try:
        torch.ops.load_library(str(_build_ops(compiler, kernels)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _ops_why = f"the build failed: {error}"
        return
    _ops_why = ""


def load_ops() -> bool:
    """Build (the first time: 8-13 s, then cached) and load the ops' C++ implementations, after
    the kernels they call; whether they are loaded. :func:`attnkit.decoding.compiled_step` calls
    this before it traces (a graph compiled before keeps calling the Python functions)."""
    _load()  # (sets _kernels_path where the kernels load)
    if _kernels_path is None:
        return False
    _load_ops(_kernels_path)
    return _ops_why == ""


def ops_unavailable() -> str:
    """Why the ops compiled graphs call run the Python functions of this module rather than their
    C++ implementations ("" where the C++ ones are loaded; :func:`load_ops` first)."""
    if not kernels_available():
        return f"attnkit's kernels are not available: {kernels_unavailable()}"
    load_ops()
    return _ops_why or ""


_kernels_path: Path | None = None  # the library _load() loaded (None: none yet)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library, or ``None`` and why not."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in (
        "x86_64",
        "amd64",
    ):
        return None, f"needs Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
    if not {"avx2", "fma"} <= _cpu_flags():
        return None, "the CPU lacks AVX2 or FMA"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (set CC, or install gcc)"
    try:
        path = _build(compiler, _openmp_runtime())
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return None, f"the build failed: {error}"
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    for call in (lib.attnkit_int8_linear, lib.attnkit_bf16_linear, lib.attnkit_float_linear):
        call.argtypes = [pointer, int64, int64, pointer, pointer, int64, pointer, ctypes.c_int]
        call.restype = ctypes.c_int
    for call in (lib.attnkit_int8_vnni, lib.attnkit_float_wide):
        call.argtypes, call.restype = [ctypes.c_int], ctypes.c_int
    call = lib.attnkit_int4_linear
    call.argtypes = [pointer, int64, int64, pointer, pointer, int64, int64, pointer, ctypes.c_int]
    call.restype = ctypes.c_int
    lib.attnkit_capped_softmax.argtypes = [pointer, *[int64] * 5, ctypes.c_int, int64]
    lib.attnkit_capped_softmax.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.attnkit_capped_softmax.restype = ctypes.c_int
    view, floats = _View, ctypes.c_float
    call = lib.attnkit_flash_forward
    call.argtypes = [view] * 4 + [pointer, int64, int64, pointer, int64, ctypes.c_int, int64]
    call.argtypes += [floats, floats, ctypes.c_int, int64, int64, ctypes.c_int, pointer]
    call.argtypes += [ctypes.c_int]
    call.restype = ctypes.c_int
    call = lib.attnkit_flash_backward
    call.argtypes = [view, view, view, view, view, pointer, int64, int64, view, view, view]
    call.argtypes += [pointer, int64, ctypes.c_int, int64, floats, int64, int64, ctypes.c_int]
    call.argtypes += [ctypes.c_int, pointer, ctypes.c_int]
    call.restype = ctypes.c_int
    call = lib.attnkit_one_query_attention
    call.argtypes = [pointer, *[int64] * 4, pointer, *[int64] * 3, pointer, *[int64] * 5]
    call.argtypes += [pointer, int64, int64, ctypes.c_float, ctypes.c_float, pointer]
    call.argtypes += [ctypes.c_int, ctypes.c_int]
    call.restype = ctypes.c_int
    call = lib.attnkit_rms_norm
    call.argtypes = [pointer, int64, int64, int64, pointer, pointer, floats, ctypes.c_int]
    call.argtypes += [ctypes.c_int]
    call.restype = ctypes.c_int
    call = lib.attnkit_rotate
    call.argtypes = [pointer, *[int64] * 7, pointer, pointer, int64, pointer, ctypes.c_int]
    call.argtypes += [ctypes.c_int, ctypes.c_int]
    call.restype = ctypes.c_int
    global _kernels_path
    _kernels_path = path
    return lib, ""


def kernels_available() -> bool:
    """Whether attnkit's kernels (:func:`int8_dot_linear`, :func:`float_dot_linear`,
    :func:`capped_softmax_`, :func:`one_query_attention`) run here (the first call builds them)."""
    return _load()[0] is not None


def kernels_loaded() -> bool:
    """Whether the kernels are built and loaded already (never builds them: safe to ask while
    ``torch.compile`` traces, where a build cannot run)."""
    return _kernels_path is not None


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


def _sgemm_address() -> int | None:
    """The address of the Fortran BLAS ``sgemm_`` torch links (MKL in torch's x86 wheels)."""
    torch_cpu = Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"
    for path in (str(torch_cpu), None):  # (then anything loaded globally)
        if path is not None and not torch_cpu.is_file():
            continue
        try:
            address = ctypes.cast(ctypes.CDLL(path).sgemm_, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if address:
            return address
    return None


#: Input dtypes of the flash kernels (bfloat16 widened to float32 block by block).
_FLASH_DTYPES = (torch.float32, torch.bfloat16)


class _View(ctypes.Structure):
    """csrc/flash.c's ``view``: a ``(count, heads, rows, dim)`` tensor's data and strides."""

    _fields_ = (
        ("data", ctypes.c_void_p),
        ("item", ctypes.c_int64),
        ("head", ctypes.c_int64),
        ("row", ctypes.c_int64),
    )


def _view(t: Tensor) -> _View:
    """``t`` ``(count, heads, rows, dim)`` with a contiguous last dim (see :func:`_rows`)."""
    rows, dim = t.shape[2], t.shape[3]
    row = t.stride(2) if rows > 1 else max(dim, 1)
    return _View(t.data_ptr(), t.stride(0), t.stride(1), row)


def _rows(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy where its rows are not contiguous vectors BLAS can take."""
    rows, dim = t.shape[2], t.shape[3]
    if (t.stride(3) == 1 or dim <= 1) and (rows <= 1 or t.stride(2) >= max(dim, 1)):
        return t
    return t.contiguous()


@functools.cache
def _flash_sgemm() -> int | None:
    """``sgemm_``'s address for the flash kernels, once a small call through it equals torch's
    math (which also proves its calling convention), or None."""
    if _load()[0] is None:
        return None
    address = _sgemm_address()
    if address is None:
        return None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 5, 3, generator=g) for n in (2, 1, 1))
    got, _ = _forward(q, k, v, 0.5, 2.0, True, None, 0, False, (4, 3), address, 1, False)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    capped = 2.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 2.0)
    want = torch.softmax(capped.masked_fill(~allowed, -math.inf), dim=-1) @ v
    return address if torch.allclose(got, want, atol=1e-5) else None


def flash_available() -> bool:
    """Whether :func:`flash_attention`, :func:`flash_attention_backward` and
    :func:`capped_attention` run here: the kernels build and torch's BLAS ``sgemm`` is found
    (and checked)."""
    return _flash_sgemm() is not None


def _check_flash(
    name: str, q: Tensor, k: Tensor, v: Tensor, window: int | None, dtypes: tuple[torch.dtype, ...]
) -> None:
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{name} takes q, k and v all of one dtype of {[str(d) for d in dtypes]}, got "
            f"{q.dtype}, {k.dtype} and {v.dtype}"
        )
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (
        q.dim() == k.dim() == v.dim() == 4
        and q.is_cpu
        and k.is_cpu
        and v.is_cpu
        and ks[1] > 0
        and qs[1] % ks[1] == 0
        and qs[0] == ks[0] == vs[0]
        and qs[3] == ks[3]
        and ks[1:3] == vs[1:3]
    ):
        raise ValueError(
            f"{name} needs CPU q (B, H, L, E), k (B, K, S, E) and v (B, K, S, Ev) with "
            f"H % K == 0, got {tuple(qs)}, {tuple(ks)} and {tuple(vs)} on {q.device}, "
            f"{k.device} and {v.device}"
        )
    if window is not None and window < 1:
        raise ValueError(f"{name} needs window >= 1 or None, got window={window}")
    if _flash_sgemm() is None:
        why = _load()[1] or "torch's BLAS sgemm was not found"
        raise RuntimeError(f"{name} cannot run here: {why}")


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    cap: float,
    causal: bool,
    window: int | None,
    first: int,
    finite: bool,
    blocks: tuple[int, int],
    sgemm: int,
    threads: int,
    with_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """csrc/flash.c's forward on checked inputs: ``(out, lse or None)``, ``out`` laid out
    ``(B, L, H, Ev)`` in memory (as torch's flash kernel lays out its output)."""
    lib = _load()[0]
    assert lib is not None
    B, H, L, _ = q.shape
    K, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    out = q.new_empty(B, L, H, Ev).transpose(1, 2)
    lse = q.new_empty(B, H, L, dtype=torch.float32) if with_lse else None
    if out.numel() == 0:
        return out, lse
    q, k, v = _rows(q), _rows(k), _rows(v)
    dims = (ctypes.c_int64 * 7)(B, H, K, L, S, q.shape[3], Ev)
    failed = lib.attnkit_flash_forward(
        _view(q), _view(k), _view(v), _view(out),
        None if lse is None else lse.data_ptr(), H * L, L,
        dims, first, int(causal), window or 0, scale, cap, int(finite), *blocks,
        q.dtype == torch.bfloat16, sgemm, threads,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the flash forward could not allocate its buffers ({threads} threads)")
    return out, lse


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    first: int | None = None,
    blocks: tuple[int, int] = (128, 512),
) -> tuple[Tensor, Tensor]:
    """Attention in FlashAttention's loop on the CPU, with the log-sum-exp the backward needs.

    Each thread takes ``blocks[0]`` queries of one head at a time and walks the blocks of at most
    ``blocks[1]`` keys they may attend, each tile only as wide as the block's reach (a causal
    block of queries computes the keys up to its last query): a tile of scores from torch's BLAS
    ``sgemm``, folded into a running maximum and sum per query, multiplied with the block's
    values, all while it stays in the CPU's caches. Query ``i`` sits at key position
    ``first + i`` (default ``S - L``: bottom-right aligned, as :class:`attnkit.masks.Structure`);
    a query that may attend no key gets a zero row and log-sum-exp ``-inf``. Inputs must be
    finite (a NaN score makes its row NaN).

    Args:
        q: Queries ``(B, H, L, E)``, float32 or bfloat16 (widened to float32 a block at a
            time, for CPUs without bf16 units; each thread keeps a float32 copy of the keys
            and values of the head it works on) on the CPU, any strides (rows are copied where
            their last dim is not contiguous).
        k: Keys ``(B, K, S, E)`` with ``H % K == 0`` (grouped-query attention).
        v: Values ``(B, K, S, Ev)``.
        scale: Multiplier of the scores.
        causal: Keys after a query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        first: Key position of the first query.
        blocks: Queries per block and most keys per tile.

    Returns:
        ``(out, lse)``: ``out`` ``(B, H, L, Ev)`` in ``q``'s dtype (laid out ``(B, L, H, Ev)``
        in memory), ``lse`` ``(B, H, L)`` float32, the log-sum-exp of each query's scaled
        scores.

    Raises:
        TypeError: For other or mixed dtypes.
        ValueError: For shapes that do not fit, tensors not on the CPU, or a bad argument.
        RuntimeError: Where it cannot run here (:func:`flash_available`).
    """
    _check_flash("flash_attention", q, k, v, window, _FLASH_DTYPES)
    first = k.shape[2] - q.shape[2] if first is None else first
    sgemm = _flash_sgemm()
    assert sgemm is not None
    out, lse = _forward(
        q, k, v, scale, 0.0, causal, window, first, True, blocks, sgemm, torch.get_num_threads(),
        True,
    )  # fmt: skip
    assert lse is not None
    return out, lse


def flash_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    first: int | None = None,
    blocks: tuple[int, int] = (64, 512),
    into: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`flash_attention` in FlashAttention-2's loop order.

    Each thread takes one key/value head and the query heads that share it; for each block of
    ``blocks[1]`` keys, every block of ``blocks[0]`` queries that reaches it recomputes its
    scores (only as wide as its reach), takes the probabilities from ``lse`` and makes the five
    products of the backward; the key and value gradients of the block accumulate in cache and
    are written once, the query gradients accumulate over the key blocks.

    Args:
        grad_out: The gradient of ``out``, ``(B, H, L, Ev)``.
        q: Queries, as given to :func:`flash_attention` (with ``k``, ``v`` and the options).
        k: Keys.
        v: Values.
        out: :func:`flash_attention`'s output.
        lse: :func:`flash_attention`'s log-sum-exp.
        scale: Multiplier of the scores.
        causal: Keys after a query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        first: Key position of the first query (default ``S - L``).
        blocks: Queries per block and keys per block.
        into: float32 ``(dq, dk, dv)`` to add the gradients to (views are fine, with contiguous
            rows), instead of new tensors: ring attention sums its blocks' gradients without a
            buffer per block.

    Returns:
        ``(dq, dk, dv)`` in ``q``'s dtype (accumulated in float32), laid out
        ``(B, L or S, heads, dim)`` in memory; or ``into``.

    Raises:
        TypeError: For other or mixed dtypes.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where it cannot run here (:func:`flash_available`).
    """
    _check_flash("flash_attention_backward", q, k, v, window, _FLASH_DTYPES)
    B, H, L, E = q.shape
    K, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    if grad_out.shape != (B, H, L, Ev) or out.shape != (B, H, L, Ev) or lse.shape != (B, H, L):
        raise ValueError(
            f"flash_attention_backward needs grad_out and out {(B, H, L, Ev)} and lse "
            f"{(B, H, L)}, got {tuple(grad_out.shape)}, {tuple(out.shape)} and "
            f"{tuple(lse.shape)}"
        )
    lib, sgemm = _load()[0], _flash_sgemm()
    assert lib is not None and sgemm is not None
    first = S - L if first is None else first
    dtype = q.dtype
    if into is not None:
        dq, dk, dv = into
        shapes = ((B, H, L, E), (B, K, S, E), (B, K, S, Ev))
        if any(
            t.dtype != torch.float32 or t.shape != shape or not t.is_cpu or _rows(t) is not t
            for t, shape in zip(into, shapes, strict=True)
        ):
            raise ValueError(
                f"flash_attention_backward's into needs float32 CPU tensors {shapes} with "
                f"contiguous rows, got {[(t.dtype, tuple(t.shape), t.stride()) for t in into]}"
            )
    else:
        dq = q.new_empty(B, L, H, E, dtype=torch.float32).transpose(1, 2)
        dk = k.new_empty(B, S, K, E, dtype=torch.float32).transpose(1, 2)
        dv = v.new_empty(B, S, K, Ev, dtype=torch.float32).transpose(1, 2)
    if min(B * H, L, S) == 0:  # no (query, key) pair: nothing to add, or zero gradients
        if into is not None:
            return into
        return dq.zero_().to(dtype), dk.zero_().to(dtype), dv.zero_().to(dtype)
    q, k, v = _rows(q), _rows(k), _rows(v)
    grad_out, out = _rows(grad_out.to(dtype)), _rows(out.to(dtype))
    lse = lse.float().contiguous()
    dims = (ctypes.c_int64 * 7)(B, H, K, L, S, E, Ev)
    threads = torch.get_num_threads()
    failed = lib.attnkit_flash_backward(
        _view(q), _view(k), _view(v), _view(out), _view(grad_out), lse.data_ptr(), H * L, L,
        _view(dq), _view(dk), _view(dv), dims, first, int(causal), window or 0, scale, *blocks,
        dtype == torch.bfloat16, into is not None, sgemm, threads,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the flash backward could not allocate its buffers ({threads} threads)")
    if into is not None:
        return into
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def capped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softcap: float,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    finite: bool = False,
    query_block: int = 64,
    key_block: int = 512,
) -> Tensor:
    """Soft-capped attention without gradients, ``softmax(c * tanh(q k^T * scale / c)) v`` over
    the keys each query may attend: :func:`flash_attention`'s loop with the cap applied to each
    tile of scores (Gemma 2's attention-logit soft-capping, which torch's fused kernels cannot
    do).

    Query ``i`` sits at key position ``S - L + i``; a query that may attend no key gets a zero
    row. A NaN score makes its row NaN; unless ``finite``, so does an infinite one (capped it
    would look finite).

    Args:
        q: Queries ``(B, H, L, E)``, float32 or bfloat16 (widened as in
            :func:`flash_attention`) on the CPU.
        k: Keys ``(B, K, S, E)`` with ``H % K == 0`` (grouped-query attention).
        v: Values ``(B, K, S, Ev)``.
        softcap: The cap ``c > 0``.
        scale: Multiplier of the scores.
        causal: Keys after a query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        finite: ``q`` and ``k`` are known to be finite (skips turning infinite scores into NaN).
        query_block: Queries a thread works on at a time (64 suits a window: a block computes
            ``query_block + window`` keys per query; without one 128 measured faster).
        key_block: Most keys of a tile of scores.

    Returns:
        ``out`` ``(B, H, L, Ev)`` in ``q``'s dtype.

    Raises:
        TypeError: For other or mixed dtypes.
        ValueError: For shapes that do not fit, tensors not on the CPU, or a bad argument.
        RuntimeError: Where it cannot run here (:func:`flash_available`).
    """
    if not (softcap > 0 and math.isfinite(softcap)) or query_block < 1 or key_block < 1:
        raise ValueError(
            f"capped_attention needs a finite softcap > 0 and blocks >= 1, got "
            f"softcap={softcap}, query_block={query_block}, key_block={key_block}"
        )
    _check_flash("capped_attention", q, k, v, window, _FLASH_DTYPES)
    sgemm = _flash_sgemm()
    assert sgemm is not None
    first = k.shape[2] - q.shape[2]
    out, _ = _forward(
        q, k, v, scale, softcap, causal, window, first, finite, (query_block, key_block), sgemm,
        torch.get_num_threads(), False,
    )  # fmt: skip
    return out


def _library() -> ctypes.CDLL:
    """The kernels' library; a RuntimeError saying why where it is not available."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"attnkit's kernels are not available: {why}")
    return lib


def kernels_unavailable() -> str:
    """Why attnkit's kernels cannot run here (empty where they can)."""
    return _load()[1]


def group_codes(codes: Tensor) -> Tensor:
    """Int8 ``codes`` ``(out, n)`` in the order :func:`int8_dot_linear` reads them: one
    sequential stream for a one-row product.

    Output rows in groups of four, each group's codes block by block, the four rows' 32 codes of
    a block side by side (``(out // 4, n // 32, 4, 32)``), then the ``out % 4`` last rows as they
    are. The same shape and bytes, another order (a new tensor); :func:`ungroup_codes` undoes it.
    """
    out, n = codes.shape
    if n % INT8_DOT_BLOCK:
        raise ValueError(f"group_codes needs a multiple of {INT8_DOT_BLOCK} inputs, got {n}")
    whole = out // _GROUP * _GROUP
    grouped = torch.empty_like(codes, memory_format=torch.contiguous_format)
    blocks = n // INT8_DOT_BLOCK
    head = codes[:whole].reshape(-1, _GROUP, blocks, INT8_DOT_BLOCK)
    grouped[:whole].view(-1, blocks, _GROUP, INT8_DOT_BLOCK).copy_(head.transpose(1, 2))
    grouped[whole:] = codes[whole:]
    return grouped


def ungroup_codes(grouped: Tensor, dtype: torch.dtype = torch.int8) -> Tensor:
    """The row-major codes ``(out, n)`` of :func:`group_codes`' order (a new tensor), converted
    to ``dtype`` in the same pass."""
    out, n = grouped.shape
    whole = out // _GROUP * _GROUP
    rows = torch.empty(out, n, dtype=dtype, device=grouped.device)
    head = grouped[:whole].view(-1, n // INT8_DOT_BLOCK, _GROUP, INT8_DOT_BLOCK)
    rows[:whole].view(-1, _GROUP, n // INT8_DOT_BLOCK, INT8_DOT_BLOCK).copy_(head.transpose(1, 2))
    rows[whole:] = grouped[whole:]
    return rows


def round_activations(x: Tensor) -> Tensor:
    """``x`` ``(..., n)`` rounded as :func:`int8_dot_linear` rounds its activations, in float32:
    per block of 32 inputs to ``q * max|block| / 127`` with ``q`` an integer in -127..127 (a block
    holding a NaN or an infinity becomes NaN). ``F.linear`` of it with the dequantized weight is
    the kernel's product up to float32 summation order: how layers multiply many rows at once."""
    blocks = x.float().unflatten(-1, (-1, INT8_DOT_BLOCK))
    top = blocks.abs().amax(-1, keepdim=True)
    nonzero = torch.where(top > 0, top, torch.ones_like(top))  # (0 / 0: an all-zero block)
    codes = (blocks / nonzero * 127).round_()
    return (codes * (top / 127)).flatten(-2)


def _check(x: Tensor, codes: Tensor, scale: Tensor) -> None:
    if x.dtype != torch.float32 or codes.dtype != torch.int8 or scale.dtype != torch.float32:
        raise TypeError(
            f"int8_dot_linear takes float32 x, int8 codes and float32 scale, got {x.dtype}, "
            f"{codes.dtype} and {scale.dtype}"
        )
    if (
        x.dim() != 2
        or codes.dim() != 2
        or x.shape[1] != codes.shape[1]
        or scale.shape != codes.shape[:1]
        or codes.shape[1] % INT8_DOT_BLOCK
    ):
        raise ValueError(
            f"int8_dot_linear needs x (rows, n), codes (out, n) and scale (out,) with n a "
            f"multiple of {INT8_DOT_BLOCK}, got {tuple(x.shape)}, {tuple(codes.shape)} and "
            f"{tuple(scale.shape)}"
        )
    _require_cpu("int8_dot_linear", x, codes, scale)


def _require_cpu(name: str, *tensors: Tensor) -> None:
    """Raise a ValueError naming the devices where one of a kernel's tensors is not on the CPU."""
    if any(t.device.type != "cpu" for t in tensors):
        devices = ", ".join(str(t.device) for t in tensors)
        raise ValueError(f"{name} runs on CPU tensors, got {devices}")


def int8_vnni(use: bool | None = None) -> bool:
    """Whether :func:`int8_dot_linear` runs its AVX512-VNNI dots: twice the codes per instruction
    of its AVX2 ones, with the same bits. ``use`` switches them on or off (on only where the
    CPU has AVX512-VNNI); by default they run where they can.

    Raises:
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    lib = _library()
    return bool(lib.attnkit_int8_vnni(-1 if use is None else int(use)))


def float_wide(use: bool | None = None) -> bool:
    """Whether :func:`float_dot_linear` runs its AVX512 dots: eight activation rows share each
    weight vector (against two with AVX2), so a few rows' product reads the weight near the
    bandwidth. The two sum in different orders, so their results differ in the last bits; a row's
    result does not depend on the rows beside it with either. ``use`` switches them on or off (on
    only where the CPU has AVX512F, BW and VL); by default they run where they can.

    Raises:
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    lib = _library()
    return bool(lib.attnkit_float_wide(-1 if use is None else int(use)))


def int8_dot_linear(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """``x @ (ungroup_codes(codes) * scale[:, None]).T`` with ``x``'s rows rounded to int8 per
    block of 32 inputs.

    Compiled graphs call it as one op, ``torch.ops.attnkit.int8_dot_linear`` (an op call costs
    several times a small product in eager mode, so eager code calls this function).

    Args:
        x: Float32 activations ``(rows, n)``, ``n`` a multiple of :data:`INT8_DOT_BLOCK`.
        codes: Int8 weight codes ``(out, n)`` in :func:`group_codes`' order.
        scale: Float32 scale per output row ``(out,)``.

    Returns:
        ``(rows, out)``, float32.

    Raises:
        TypeError: For other dtypes.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where the kernel is not available (:func:`kernels_unavailable`).
    """
    _check(x, codes, scale)
    _library()
    return _int8_product(x.contiguous(), codes.contiguous(), scale.contiguous())


def _int8_product(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """:func:`int8_dot_linear` without its checks, for callers that hold the invariants (an
    :class:`attnkit.quantize.Int8Linear` in eager mode, as :func:`_int4_product`)."""
    lib = _load()[0]
    y = x.new_empty(x.shape[0], codes.shape[0])
    failed = lib.attnkit_int8_linear(  # type: ignore[union-attr]
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        codes.data_ptr(),
        scale.data_ptr(),
        codes.shape[0],
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"int8_dot_linear could not allocate {x.shape[0]} quantized rows")
    return y


# The ops compiled graphs call (see the module's docstring). Where the C++ implementations are
# not loaded they run these Python functions, registered through torch.library's plain
# registration rather than ``torch.library.custom_op``, whose Python wrapper costs about 30 us a
# call here against about 15 us.
_OPS = torch.library.Library("attnkit", "FRAGMENT")
_OPS.define("int8_dot_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_OPS.impl("int8_dot_linear", int8_dot_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("attnkit::int8_dot_linear", lib=_OPS)
def _(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


def _int4_rows(out: int) -> int:
    """Rows of an int4 weight as :func:`pack_int4` stores it: ``out`` rounded up to groups."""
    return -(-out // _GROUP) * _GROUP


def pack_int4(codes: Tensor) -> Tensor:
    """Int4 ``codes`` ``(out, n)`` (integers 0..15, any integer dtype) packed two to a byte in
    the order :func:`int4_dot_linear` reads them: ``(out4, n // 2)`` uint8 with ``out4`` the
    rows rounded up to a multiple of four (the added rows' codes are 0).

    Rows in groups of four, each group's codes block by block, the four rows' 16 bytes of a
    block of 32 inputs side by side; byte ``j`` of a row's block holds input ``j`` in its low
    nibble and input ``16 + j`` in its high one. :func:`unpack_int4` undoes it.
    """
    out, n = codes.shape
    if n % INT8_DOT_BLOCK:
        raise ValueError(f"pack_int4 needs a multiple of {INT8_DOT_BLOCK} inputs, got {n}")
    padded = codes.new_zeros(_int4_rows(out), n, dtype=torch.uint8)
    padded[:out] = codes
    blocks = padded.view(-1, _GROUP, n // INT8_DOT_BLOCK, 2, INT8_DOT_BLOCK // 2).transpose(1, 2)
    return (blocks[:, :, :, 0] | blocks[:, :, :, 1] << 4).reshape(len(padded), n // 2)


def unpack_int4(packed: Tensor, out: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """The codes ``(out, n)`` of :func:`pack_int4`'s ``packed`` (a new tensor), in ``dtype``."""
    rows, half = packed.shape
    blocks = packed.view(-1, half * 2 // INT8_DOT_BLOCK, _GROUP, INT8_DOT_BLOCK // 2)
    nibbles = torch.stack([blocks & 15, blocks >> 4], dim=3)  # (groups, blocks, 4, 2, 16)
    codes = nibbles.transpose(1, 2).reshape(rows, half * 2)[:out]
    return codes.to(dtype)


def pack_int4_scales(scale: Tensor, offset: Tensor) -> Tensor:
    """Per-group ``scale`` and ``offset`` ``(out, n // group)`` as :func:`int4_dot_linear` reads
    them: bf16, ``(out4 // 4, groups * 8)``: for each group of four rows and each input group,
    the four rows' scales, then their offsets (rows added to fill a group get 0)."""
    out, groups = scale.shape
    both = scale.new_zeros(_int4_rows(out), groups, 2, dtype=torch.bfloat16)
    both[:out, :, 0], both[:out, :, 1] = scale, offset
    return both.view(-1, _GROUP, groups, 2).permute(0, 2, 3, 1).reshape(-1, groups * 2 * _GROUP)


def unpack_int4_scales(packed: Tensor, out: int) -> tuple[Tensor, Tensor]:
    """``(scale, offset)``, each ``(out, groups)`` float32, of :func:`pack_int4_scales`."""
    groups = packed.shape[1] // (2 * _GROUP)
    both = packed.view(-1, groups, 2, _GROUP).permute(0, 3, 1, 2).reshape(-1, groups, 2)[:out]
    return both[..., 0].float(), both[..., 1].float()


def _check_int4(x: Tensor, codes: Tensor, scales: Tensor, out: int) -> None:
    """Raise for inputs :func:`int4_dot_linear` does not take, naming them (as :func:`_check`)."""
    if x.dtype != torch.float32 or codes.dtype != torch.uint8 or scales.dtype != torch.bfloat16:
        raise TypeError(
            f"int4_dot_linear takes float32 x, uint8 codes and bfloat16 scales, got {x.dtype}, "
            f"{codes.dtype} and {scales.dtype}"
        )
    n = codes.shape[1] * 2 if codes.dim() == 2 else -1
    groups = scales.shape[1] // (2 * _GROUP) if scales.dim() == 2 else 0
    if (
        x.dim() != 2
        or x.shape[1] != n
        or n % INT8_DOT_BLOCK
        or codes.shape[0] != _int4_rows(out)
        or out < 0
        or scales.shape != (codes.shape[0] // _GROUP, groups * 2 * _GROUP)
        or groups == 0
        or n % groups
        or (n // groups) % INT8_DOT_BLOCK
    ):
        raise ValueError(
            f"int4_dot_linear needs x (rows, n), codes (ceil(out / 4) * 4, n / 2) and scales "
            f"(ceil(out / 4), groups * 8) with n a multiple of groups * {INT8_DOT_BLOCK}, got "
            f"{tuple(x.shape)}, {tuple(codes.shape)} and {tuple(scales.shape)} for out={out}"
        )
    _require_cpu("int4_dot_linear", x, codes, scales)


def int4_dot_linear(x: Tensor, codes: Tensor, scales: Tensor, out: int) -> Tensor:
    """``x @ W.T`` for the int4 weight ``W[o, i] = q[o, i] * scale[o, g] + offset[o, g]``
    (``g`` the input group of ``i``), with ``x``'s rows rounded to int8 per block of 32 inputs
    as :func:`int8_dot_linear` rounds them (:func:`round_activations`).

    The weight is read once as packed nibbles (half a byte a weight, plus 4 bytes a group), the
    products summed in integers a block at a time (AVX512-VNNI where :func:`int8_vnni` runs,
    else AVX2; the same bits). Compiled graphs call it as one op,
    ``torch.ops.attnkit.int4_dot_linear``.

    Args:
        x: Float32 activations ``(rows, n)``.
        codes: :func:`pack_int4`'s codes, ``(ceil(out / 4) * 4, n / 2)`` uint8.
        scales: :func:`pack_int4_scales`' scales and offsets (bf16); the group size is ``n``
            over their groups, a multiple of 32.
        out: The weight's output rows.

    Returns:
        ``(rows, out)``, float32.

    Raises:
        TypeError: For other dtypes.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where the kernel is not available (:func:`kernels_unavailable`).
    """
    _check_int4(x, codes, scales, out)
    _library()
    return _int4_product(x.contiguous(), codes.contiguous(), scales.contiguous(), out)


def _int4_product(x: Tensor, codes: Tensor, scales: Tensor, out: int) -> Tensor:
    """:func:`int4_dot_linear` without its checks, for callers that hold the invariants (an
    :class:`attnkit.quantize.Int4Linear` in eager mode: the checks cost about 5 us a call, over
    a hundred calls a decoding step): contiguous CPU tensors of the right dtypes and shapes, the
    kernels loaded."""
    lib = _load()[0]
    n = x.shape[1]
    y = x.new_empty(x.shape[0], out)
    failed = lib.attnkit_int4_linear(  # type: ignore[union-attr]
        x.data_ptr(),
        x.shape[0],
        n,
        codes.data_ptr(),
        scales.data_ptr(),
        out,
        n // (scales.shape[1] // (2 * _GROUP)),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"int4_dot_linear could not allocate {x.shape[0]} quantized rows")
    return y


_OPS.define("int4_dot_linear(Tensor x, Tensor codes, Tensor scales, int out) -> Tensor")
_OPS.impl("int4_dot_linear", int4_dot_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("attnkit::int4_dot_linear", lib=_OPS)
def _(x: Tensor, codes: Tensor, scales: Tensor, out: int) -> Tensor:
    return x.new_empty(x.shape[0], out)


def _float_mismatch(x: Tensor, weight: Tensor, bias: Tensor | None) -> Exception:
    """The error for inputs :func:`float_dot_linear` does not take."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    if weight.dtype not in (torch.bfloat16, torch.float32) or any(
        t.dtype != weight.dtype for t in tensors
    ):
        got = ", ".join(str(t.dtype) for t in tensors)
        return TypeError(
            f"float_dot_linear takes x, weight and bias all bfloat16 or all float32, got {got}"
        )
    if any(t.device.type != "cpu" for t in tensors):
        return ValueError(
            f"float_dot_linear runs on CPU tensors, got {', '.join(str(t.device) for t in tensors)}"
        )
    return ValueError(
        f"float_dot_linear needs x (..., n), weight (out, n) and bias (out,) or None, got "
        f"{tuple(x.shape)}, {tuple(weight.shape)} and "
        f"{None if bias is None else tuple(bias.shape)}"
    )


def float_dot_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a few rows, summed in float32 with the weight read as one
    stream per thread (bf16 results are rounded to nearest even).

    Meant for decoding's one-row products: every row is dotted with each weight row while it is in
    cache, so many rows (a prompt) are better served by ``F.linear``'s blocked GEMM. Compiled
    graphs call it as one op, ``torch.ops.attnkit.float_dot_linear``. A call costs about ten
    microseconds beside the product (decoding makes over a hundred a token), so the checks are
    few and cheap.

    Args:
        x: Activations ``(..., n)``.
        weight: ``(out, n)``, row-major or not (a copy is made if not).
        bias: ``(out,)`` or ``None``. All three bfloat16, or all float32.

    Returns:
        ``(..., out)``, in the inputs' dtype.

    Raises:
        TypeError: For other dtypes or mixed ones.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where the kernel is not available (:func:`kernels_unavailable`).
    """
    dtype = weight.dtype
    out, n = weight.shape if weight.dim() == 2 else (-1, -1)
    if (
        x.dtype != dtype
        or dtype not in _FLOAT_CALLS
        or x.dim() < 1
        or x.shape[-1] != n
        or not x.is_cpu
        or not weight.is_cpu
        or (bias is not None and (bias.dtype != dtype or bias.shape != (out,) or not bias.is_cpu))
    ):
        raise _float_mismatch(x, weight, bias)
    lib = _library()
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()  # (held: the kernel reads its memory)
    rows = math.prod(x.shape[:-1])
    y = x.new_empty((*x.shape[:-1], out))  # (x.dtype is dtype; new_empty costs half of empty)
    failed = getattr(lib, _FLOAT_CALLS[dtype])(
        x.data_ptr(),
        rows,
        n,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"float_dot_linear could not allocate {rows} float32 rows")
    return y


_FLOAT_CALLS = {torch.bfloat16: "attnkit_bf16_linear", torch.float32: "attnkit_float_linear"}


_OPS.define("float_dot_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_OPS.impl("float_dot_linear", float_dot_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("attnkit::float_dot_linear", lib=_OPS)
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def capped_softmax_(
    scores: Tensor,
    softcap: float,
    *,
    first: int = 0,
    period: int | None = None,
    causal: bool = False,
    window: int | None = None,
    finite: bool = False,
) -> Tensor:
    """The softmax of soft-capped scores along the last dim, in place, in one pass from memory.

    ``scores`` holds ``t = 2 x / c`` for raw scores ``x`` and cap ``c = softcap`` (fold the
    factor into the product that makes them); each row becomes
    ``softmax(c * tanh(x / c))`` over the keys it may attend, and 0 elsewhere (a row that may
    attend no key is all 0). Row ``k`` (over all leading dims) is the query at position
    ``first + k % period`` counted from the row's first key: ``causal`` keeps the keys at or
    before it, ``window`` the keys less than ``window`` away (:class:`attnkit.masks.Structure`'s
    rules). A NaN makes its row NaN; unless ``finite``, so does an infinite ``t``.

    Args:
        scores: Float32, contiguous, on the CPU, at least one dim.
        softcap: The cap ``c > 0``.
        first: Position of the first row's query, relative to the first key.
        period: Rows per run of query positions (default: all rows, one position each).
        causal: Keys after the query are masked.
        window: Keys ``window`` or more positions away are masked (None: no window).
        finite: The raw scores are known to be finite (skips a pass that turns inf into NaN).

    Returns:
        ``scores``.

    Raises:
        TypeError: For a dtype other than float32.
        ValueError: For a tensor that is not contiguous or not on the CPU, or a bad argument.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    if scores.dtype != torch.float32:
        raise TypeError(f"capped_softmax_ takes float32 scores, got {scores.dtype}")
    if scores.device.type != "cpu" or not scores.is_contiguous() or scores.dim() < 1:
        raise ValueError(
            f"capped_softmax_ needs contiguous CPU scores with at least one dim, got shape "
            f"{tuple(scores.shape)} strides {scores.stride()} on {scores.device}"
        )
    rows = math.prod(scores.shape[:-1])
    period = max(rows, 1) if period is None else period
    if not softcap > 0 or period < 1 or (window is not None and window < 1):
        raise ValueError(
            f"capped_softmax_ needs softcap > 0, period >= 1 and window >= 1 or None, got "
            f"softcap={softcap}, period={period}, window={window}"
        )
    lib = _library()
    width = scores.shape[-1]
    if rows and width:
        lib.attnkit_capped_softmax(
            scores.data_ptr(),
            rows,
            width,
            width,
            period,
            first,
            int(causal),
            window or 0,
            softcap,
            int(finite),
            torch.get_num_threads(),
        )
    return scores


def _row_dtype(name: str, *tensors: Tensor) -> bool:
    """Whether the tensors are bf16 (else float32); a TypeError for other or mixed dtypes."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16}:
        raise TypeError(
            f"{name} takes float32 or bfloat16 tensors of one dtype, got "
            f"{[str(t.dtype) for t in tensors]}"
        )
    return tensors[0].dtype == torch.bfloat16


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` along the last dim, in float32 (bf16 rows are
    widened, and the result rounded once), as a new contiguous tensor.

    The same function as ``F.rms_norm(x, (D,), weight, eps)``, up to the rounding of another
    summation order: torch's CPU composite makes about ten passes through fresh tensors, this
    reads each row twice from cache and writes it once. For eager inference (no gradient).

    Args:
        x: ``(..., D)`` float32 or bfloat16 on the CPU, rows contiguous.
        weight: ``(D,)`` of ``x``'s dtype, or ``None``.
        eps: Added to the mean square.

    Raises:
        TypeError: For other dtypes or mixed ones.
        ValueError: For a weight of another size, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    D = x.shape[-1] if x.dim() else 0
    bf16 = _row_dtype("rms_norm", *(x,) if weight is None else (x, weight))
    if x.dim() < 1 or (weight is not None and weight.shape != (D,)):
        raise ValueError(
            f"rms_norm needs x (..., D) and a weight (D,), got x {tuple(x.shape)} and weight "
            f"{None if weight is None else tuple(weight.shape)}"
        )
    _require_cpu("rms_norm", x, *(() if weight is None else (weight,)))
    lib = _library()
    x = x if x.stride(-1) == 1 or D <= 1 else x.contiguous()
    flat = x.reshape(-1, D) if x.numel() else x.new_empty(0, D)  # (a view for strided rows)
    weight = None if weight is None else weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if flat.numel():
        lib.attnkit_rms_norm(
            flat.data_ptr(),
            flat.shape[0],
            D,
            flat.stride(0) if flat.shape[0] > 1 else D,
            None if weight is None else weight.data_ptr(),
            out.data_ptr(),
            float(eps),
            int(bf16),
            torch.get_num_threads(),
        )
    return out


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor, *, interleaved: bool) -> Tensor:
    """Rotary positions: ``x * cos + partner(x) * signed_sin`` (see
    :func:`attnkit.positional.apply_rope`) in float32, each product and the sum rounded (as
    torch's vector kernels round them), then once to ``x``'s dtype, as a new contiguous tensor.
    For eager inference (no gradient).

    Args:
        x: ``(B, H, L, E)``, ``(H, L, E)`` or ``(L, E)`` float32 or bfloat16 on the CPU, any
            strides with a contiguous last dim (heads split out of a fused projection are a view).
        cos: Float32 full-width rows ``(L, E)`` shared by every sequence, or ``(B, 1, L, E)``.
        signed_sin: Like ``cos``.
        interleaved: Pairs are adjacent channels (else the two halves).

    Raises:
        TypeError: For dtypes other than these.
        ValueError: For shapes that do not fit, an odd ``E``, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    if x.dtype not in (torch.float32, torch.bfloat16) or {cos.dtype, signed_sin.dtype} != {
        torch.float32
    }:
        raise TypeError(
            f"rotate takes float32 or bfloat16 x and float32 tables, got x {x.dtype}, "
            f"cos {cos.dtype}, signed_sin {signed_sin.dtype}"
        )
    if not 2 <= x.dim() <= 4:
        raise ValueError(f"rotate takes x (B, H, L, E), (H, L, E) or (L, E), got {tuple(x.shape)}")
    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x
    B, H, L, E = x4.shape
    shared = cos.shape == (L, E)
    if (
        E % 2
        or cos.shape != signed_sin.shape
        or not (shared or cos.shape == (B, 1, L, E))
        or x4.stride(-1) != 1
    ):
        raise ValueError(
            f"rotate needs x (B, H, L, E) with an even, contiguous last dim and tables (L, E) or "
            f"(B, 1, L, E), got x {tuple(x.shape)} strides {x.stride()}, cos {tuple(cos.shape)}, "
            f"signed_sin {tuple(signed_sin.shape)}"
        )
    _require_cpu("rotate", x, cos, signed_sin)
    lib = _library()
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if out.numel():
        lib.attnkit_rotate(
            x4.data_ptr(),
            B,
            H,
            L,
            E,
            *x4.stride()[:3],
            cos.data_ptr(),
            signed_sin.data_ptr(),
            0 if shared else L * E,
            out.data_ptr(),
            int(interleaved),
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
    return out


#: Flags of :func:`one_query_attention` (or-ed).
NO_KEY = 1  #: some query may attend no key: its row is zero
NON_FINITE = 2  #: some output value is NaN or infinite
_NO_MEMORY = 4  # a buffer could not be allocated: nothing was written (csrc/one_query.c)


def one_query_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
) -> tuple[Tensor, int]:
    """Attention of one query per sequence and head over a key/value cache: a decoding step.

    The ``H / K`` query heads sharing a key/value head are computed together, each key and value
    row read once; keys the mask leaves out are never read. Over the keys a query may attend the
    result is the textbook softmax (a NaN or ``+inf`` score makes the row NaN, a ``-inf`` score
    weighs 0); a query with no allowed key gets a zero row. The flags say where either happened,
    so that a caller with stricter rules can recompute those steps. With a ``softcap`` ``c`` the
    scores are capped to ``c * tanh(s / c)`` first (Gemma 2), and an infinite score makes its row
    NaN.

    Args:
        q: Queries ``(B, H, 1, E)``.
        k: Keys ``(B, K, S, E)`` with ``H % K == 0`` (rows may be strided: a cache's slice).
        v: Values ``(B, K, S, Ev)``.
        mask: Bool ``(B or 1, 1, 1, S)``, ``True`` where a key may be attended, or None.
        scale: Multiplier of the scores.
        softcap: The scores' soft cap ``c > 0``, or None.

    Returns:
        ``(out, flags)``: ``out`` ``(B, H, 1, Ev)`` in the inputs' dtype (all bfloat16 or all
        float32), ``flags`` an or of :data:`NO_KEY` and :data:`NON_FINITE` (0: neither).

    Raises:
        TypeError: For other or mixed dtypes, or a mask that is not bool.
        ValueError: For shapes that do not fit, or tensors not on the CPU.
        RuntimeError: Where the kernels are not available (:func:`kernels_unavailable`).
    """
    # (Checks written for speed: a decoding step calls this once a layer, and each microsecond
    # here is a few percent of a small model's step.)
    dtype = q.dtype
    if dtype not in _FLOAT_CALLS or k.dtype != dtype or v.dtype != dtype:
        raise TypeError(
            f"one_query_attention takes q, k and v all bfloat16 or all float32, got {q.dtype}, "
            f"{k.dtype} and {v.dtype}"
        )
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"one_query_attention takes a bool mask, got {mask.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape
    fits = len(qs) == len(ks) == len(vs) == 4 and q.is_cpu and k.is_cpu and v.is_cpu
    if fits:
        B, H, L, E = qs
        K, S, Ev = ks[1], ks[2], vs[3]
        fits = (
            L == 1
            and K > 0
            and H % K == 0
            and ks[0] == vs[0] == B
            and ks[3] == E
            and vs[1] == K
            and vs[2] == S
            and (
                mask is None
                or (
                    mask.dim() == 4
                    and mask.is_cpu
                    and mask.shape[1] == mask.shape[2] == 1
                    and mask.shape[3] == S
                    and mask.shape[0] in (1, B)
                )
            )
        )
    if not fits:
        raise ValueError(
            f"one_query_attention needs CPU q (B, H, 1, E), k (B, K, S, E), v (B, K, S, Ev) "
            f"with H % K == 0 and a mask (B or 1, 1, 1, S) or None, got {tuple(qs)}, "
            f"{tuple(ks)}, {tuple(vs)} and {None if mask is None else tuple(mask.shape)} on "
            f"{q.device}, {k.device}, {v.device}"
        )
    lib = _library()
    q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = q.new_empty(B, H, 1, Ev)
    if out.numel() == 0:
        return out, 0
    k0, k1, k2, _ = k.stride()
    v0, v1, v2, _ = v.stride()
    m0, _, _, m3 = (0, 0, 0, 0) if mask is None else mask.stride()
    flags = lib.attnkit_one_query_attention(
        q.data_ptr(),
        B,
        K,
        H // K,
        E,
        k.data_ptr(),
        k0,
        k1,
        k2,
        v.data_ptr(),
        v0,
        v1,
        v2,
        Ev,
        S,
        None if mask is None else mask.data_ptr(),
        m0 if mask is not None and mask.shape[0] > 1 else 0,  # (0: one mask row for all)
        m3,
        scale,
        softcap or 0.0,
        out.data_ptr(),
        dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
    if flags & _NO_MEMORY:
        raise MemoryError(f"one_query_attention could not allocate its buffers ({S} keys)")
    return out, flags


def _one_query_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    return one_query_attention(q, k, v, mask, scale)[0]


_OPS.define(
    "one_query_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor"
)
_OPS.impl("one_query_attention", _one_query_op, "CompositeExplicitAutograd")


@torch.library.register_fake("attnkit::one_query_attention", lib=_OPS)
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])
