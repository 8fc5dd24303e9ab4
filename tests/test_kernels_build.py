"""attnkit's kernel builds (``attnkit.kernels.build``): built wherever they can be, once, with the
reason where not; the C++ ops and the package data."""

from __future__ import annotations

import dataclasses
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attnkit.kernels import build, linear, one_query, probe

needs_kernel = pytest.mark.skipif(
    not build.kernels_available(), reason=f"no attnkit kernels: {build.kernels_unavailable()}"
)


def test_the_kernel_builds_on_every_machine_the_probe_accepts_with_a_compiler() -> None:
    """The rule CI holds the kernel to: where it can be built, it is (the other tests of this
    module skip only elsewhere)."""
    can = (
        sys.platform.startswith("linux")
        and platform.machine().lower() in ("x86_64", "amd64")
        and probe.capabilities().simd
        and probe.c_compiler() is not None
    )
    if not can:
        pytest.skip("not Linux on x86-64 with the kernels' vector units and a C compiler")
    assert build.kernels_available(), build.kernels_unavailable()
    assert build.kernels_unavailable() == ""


@pytest.fixture
def fresh_build(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Builds and loads of the kernels happen anew (into a temporary cache) and are forgotten
    afterwards."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    build.load_library.cache_clear()
    yield
    build.load_library.cache_clear()


def _flags(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str]) -> None:
    """The build sees a CPU with these ``flags``."""
    caps = dataclasses.replace(probe.capabilities(), flags=flags)
    monkeypatch.setattr(build, "capabilities", lambda: caps)


def test_without_a_compiler_the_reason_is_given(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not probe.capabilities().simd:
        pytest.skip("the kernels' vector units are missing here")
    monkeypatch.setattr(build, "c_compiler", lambda: None)
    if build.kernels_unavailable().startswith("needs Linux"):
        pytest.skip(build.kernels_unavailable())
    scale = torch.ones(1)
    assert not build.kernels_available()
    assert "no C compiler" in build.kernels_unavailable()
    with pytest.raises(RuntimeError, match="no C compiler"):
        linear.int8_dot_linear(torch.zeros(1, 32), torch.ones(1, 32, dtype=torch.int8), scale)
    build.load_library.cache_clear()
    _flags(monkeypatch, frozenset())
    assert build.kernels_unavailable().startswith("the CPU lacks the vector units")


def test_a_failing_build_is_reported_and_leaves_no_library(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    if not probe.capabilities().simd:
        pytest.skip("the kernels' vector units are missing here")
    monkeypatch.setattr(build, "c_compiler", lambda: "false")  # (exits 1, prints nothing)
    if build.kernels_unavailable().startswith("needs Linux"):
        pytest.skip(build.kernels_unavailable())
    assert build.kernels_unavailable().startswith("the build failed: false ")
    assert not list((probe.cache_dir() / "kernels").glob("*.so"))


@needs_kernel
def test_the_library_is_built_once_and_reused(fresh_build: None) -> None:
    assert build.kernels_available()
    (built,) = (probe.cache_dir() / "kernels").glob("kernels-*.so")
    stamp = built.stat().st_mtime_ns
    build.load_library.cache_clear()
    assert build.kernels_available()
    assert built.stat().st_mtime_ns == stamp
    assert [p.name for p in (probe.cache_dir() / "kernels").iterdir()] == [built.name]


# The ops compiled graphs call: C++ implementations where a C++ compiler builds them.


def _op_cases() -> list[tuple[str, tuple[object, ...], object]]:
    """(op, arguments, the Python function's result) for each op, with strided inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=gen)
    codes = linear.group_codes(torch.randint(-127, 128, (40, 96), dtype=torch.int8, generator=gen))
    scale = torch.rand(40, generator=gen)
    w, b = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    q = torch.randn(2, 6, 1, 32, generator=gen)
    k, v = torch.randn(2, 2, 2, 50, 32, generator=gen)[:, :, :, ::2]  # (rows strided in S)
    mask = torch.rand(2, 1, 1, 25, generator=gen) > 0.3
    codes4 = linear.pack_int4(torch.randint(0, 16, (41, 96), dtype=torch.uint8, generator=gen))
    scales4 = linear.pack_int4_scales(torch.rand(41, 3), torch.randn(41, 3))
    int4 = (x[:, ::1], codes4, scales4, 41)
    cases: list[tuple[str, tuple[object, ...], object]] = [
        ("int8_dot_linear", (x, codes, scale), linear.int8_dot_linear(x, codes, scale)),
        ("int4_dot_linear", int4, linear.int4_dot_linear(*int4)),
        (
            "one_query_attention",
            (q, k, v, mask, 0.2),
            one_query.one_query_attention(q, k, v, mask, 0.2)[0],
        ),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        xs, ws, bs = x[:, None].to(dtype), w.to(dtype), b.to(dtype)
        cases.append(("float_dot_linear", (xs, ws, bs), linear.float_dot_linear(xs, ws, bs)))
        cases.append(("float_dot_linear", (xs, ws, None), linear.float_dot_linear(xs, ws)))
        empty = xs[..., :0], ws[:, :0], bs  # (no inputs: the outputs are the bias)
        cases.append(("float_dot_linear", empty, linear.float_dot_linear(*empty)))
    return cases


@needs_kernel
def test_the_ops_run_their_cpp_implementations_wherever_a_cpp_compiler_builds_them() -> None:
    """The rule CI holds them to, and what the dispatcher then calls for CPU tensors."""
    if probe.cxx_compiler() is None:
        pytest.skip("no C++ compiler")
    assert build.load_ops() and build.ops_unavailable() == ""
    for name in ("int8_dot_linear", "int4_dot_linear", "float_dot_linear", "one_query_attention"):
        table = torch._C._dispatch_dump(f"attnkit::{name}")
        cpu = [line for line in table.splitlines() if line.startswith("CPU:")]
        assert len(cpu) == 1 and "ops.cpp" in cpu[0], table


@needs_kernel
def test_the_ops_equal_the_python_functions_and_check_their_inputs() -> None:
    """Whichever implementation runs (C++ where it builds): the same kernels, the same bytes."""
    build.load_ops()
    for name, args, want in _op_cases():
        got = getattr(torch.ops.attnkit, name).default(*args)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        if name == "float_dot_linear" and args[0].shape[-1] == 0:
            assert torch.equal(got, args[2].expand_as(got)), "no inputs: the bias"
    ops = torch.ops.attnkit
    x, codes, scale = torch.zeros(1, 64), torch.ones(3, 64, dtype=torch.int8), torch.ones(3)
    with pytest.raises(TypeError, match="float32 x, int8 codes"):
        ops.int8_dot_linear(x.double(), codes, scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.int8_dot_linear(x[:, :40], codes[:, :40], scale)
    codes4, scales4 = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="uint8 codes"):
        ops.int4_dot_linear(x, codes4.to(torch.int8), scales4, 3)
    with pytest.raises(ValueError, match="out=5"):
        ops.int4_dot_linear(x, codes4, scales4, 5)
    w = torch.zeros(3, 64)
    with pytest.raises(TypeError, match="all bfloat16 or all float32"):
        ops.float_dot_linear(x, w.bfloat16(), None)
    with pytest.raises(ValueError, match="bias"):
        ops.float_dot_linear(x, w, torch.zeros(4))
    q, k = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(TypeError, match="bool mask"):
        ops.one_query_attention(q, k, k, torch.zeros(1, 1, 1, 5), 1.0)
    with pytest.raises(ValueError, match="H % K == 0"):
        ops.one_query_attention(q[:, :3], k, k, None, 1.0)


def test_without_a_cpp_compiler_the_ops_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason is kept (the ops then run the Python functions); a failing build likewise."""
    if not build.kernels_available():
        assert build.ops_unavailable().startswith("attnkit's kernels are not available")
        return
    kernels = build.kernels_path()
    assert kernels is not None
    monkeypatch.setattr(build, "_ops_why", None)
    monkeypatch.setattr(build, "cxx_compiler", lambda: None)
    build._load_ops(kernels)
    assert build.ops_unavailable() == "no C++ compiler (set CXX, or install g++)"
    monkeypatch.setattr(build, "_ops_why", None)
    monkeypatch.setattr(build, "cxx_compiler", lambda: "false")
    build._load_ops(kernels)
    assert build.ops_unavailable().startswith("the build failed: false ")


def test_every_kernel_source_ships_with_the_package() -> None:
    """A non-editable install builds from the package data: each file of csrc/ must be in it."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["attnkit"]
    sources = sorted((root / "src" / "attnkit" / "kernels" / "csrc").iterdir())
    assert {p.suffix for p in sources} >= {".c", ".cpp", ".h"}
    for path in sources:
        name = f"kernels/csrc/{path.name}"
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
