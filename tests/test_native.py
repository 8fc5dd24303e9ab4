"""attnkit's own kernels (``attnkit.native``): the int8 dot products exact against integer sums,
the bf16/float32 streaming products against float64, their errors, their build and where they
must be available."""

from __future__ import annotations

import platform
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from attnkit import native
from attnkit.quantize import AVX2_MAX_ROWS, Int8Linear
from tests.helpers import int8_dot_reference

needs_kernel = pytest.mark.skipif(
    not native.kernels_available(), reason=f"no attnkit kernels: {native.kernels_unavailable()}"
)


def _slack(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """float32 rounding of the block sums and of the products with the scales."""
    return 1e-5 * (x.double().abs() @ (codes.double().abs() * scale.double()[:, None]).T) + 1e-30


def test_the_kernel_builds_on_every_linux_x86_machine_with_avx2_and_a_compiler() -> None:
    """The rule CI holds the kernel to: where it can be built, it is (the other tests of this
    module skip only elsewhere)."""
    can = (
        sys.platform.startswith("linux")
        and platform.machine().lower() in ("x86_64", "amd64")
        and {"avx2", "fma"} <= native._cpu_flags()
        and native._compiler() is not None
    )
    if not can:
        pytest.skip("not Linux on x86-64 with AVX2, FMA and a C compiler")
    assert native.kernels_available(), native.kernels_unavailable()
    assert native.kernels_unavailable() == ""


@needs_kernel
@pytest.mark.parametrize(
    ("rows", "out", "n"), [(2, 4, 32), (1, 130, 576), (3, 7, 96), (17, 64, 64)]
)
def test_products_are_the_integer_sums_of_the_rounded_rows(rows: int, out: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * out + n)
    codes = torch.randint(-128, 128, (out, n), dtype=torch.int8, generator=gen)
    scale = torch.rand(out, generator=gen) / 100
    x = torch.randn(rows, n, generator=gen)
    x[0, :32] *= 1000  # blocks of very different sizes: each keeps its own scale
    x[-1, -32:] = 0  # an all-zero block
    got = native.int8_dot_linear(x, native.group_codes(codes), scale).double()
    want = int8_dot_reference(x, codes, scale)
    assert got.shape == (rows, out)
    assert ((got - want).abs() <= _slack(x, codes, scale)).all(), (got - want).abs().max()
    # Not vacuous: the activations' rounding is far above the slack.
    exact = x.double() @ (codes.double() * scale.double()[:, None]).T
    assert ((got - exact).abs() > _slack(x, codes, scale)).any()


@needs_kernel
def test_the_largest_codes_do_not_saturate_the_pair_sums() -> None:
    """AVX2 multiplies unsigned by signed bytes and sums pairs into 16 bits: |w| = 128 (code
    -128) times an activation of 127 in every lane is the largest pair sum, 2 * 128 * 127."""
    n = 64
    for code in (-128, -127, 127):
        codes = torch.full((5, n), code, dtype=torch.int8)
        for sign in (1.0, -1.0):
            x = torch.full((1, n), sign * 3.0)
            got = native.int8_dot_linear(x, codes, torch.ones(5))
            assert torch.equal(got, torch.full((1, 5), sign * 3.0 * code * n))


@needs_kernel
def test_non_finite_activations_give_non_finite_rows_and_tiny_ones_keep_their_precision() -> None:
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=gen)
    grouped, scale = native.group_codes(codes), torch.rand(8, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    x[3] *= 1e-40  # subnormal: 127 / max would overflow
    got = native.int8_dot_linear(x, grouped, scale)
    assert got[1].isnan().all() and not got[2].isfinite().any()
    clean = torch.stack([x[0], x[3]])
    want = int8_dot_reference(clean, codes, scale)
    slack = _slack(clean, codes, scale).clamp(min=1e-50)
    assert ((got[[0, 3]].double() - want).abs() <= slack).all()
    assert got[3].abs().max() > 0


@needs_kernel
def test_activation_codes_round_half_to_even() -> None:
    # one-hot codes read each rounded activation back: x / top * 127 lands on .5 ties here
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] + [0.25] * 24])
    codes = torch.eye(32, dtype=torch.int8)
    got = native.int8_dot_linear(x, native.group_codes(codes), torch.ones(32))
    assert torch.equal(got[0, :8], torch.tensor([127.0, 0, 2, 2, 0, -2, -2, 126]))


@needs_kernel
def test_the_vnni_and_avx2_dots_give_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (70, 192), dtype=torch.int8, generator=gen)
    grouped, scale = native.group_codes(codes), torch.rand(70, generator=gen)
    # 7 rows: four, two and one a pass with VNNI (each row's sums in the same order)
    x = torch.randn(7, 192, generator=gen) * torch.logspace(-3, 3, 192)
    flags = Path("/proc/cpuinfo").read_text().split()
    able = "avx512_vnni" in flags and "avx512bw" in flags
    before = native.int8_vnni()
    try:
        assert native.int8_vnni(False) is False
        avx2 = native.int8_dot_linear(x, grouped, scale)
        assert native.int8_vnni(True) is able  # (on only where the CPU has it)
        assert torch.equal(native.int8_dot_linear(x, grouped, scale), avx2)
    finally:
        native.int8_vnni(before)
    want = int8_dot_reference(x, codes, scale)
    assert ((avx2.double() - want).abs() <= _slack(x, codes, scale)).all()


@needs_kernel
def test_threads_and_strides_do_not_change_the_product() -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (70, 128), dtype=torch.int8, generator=gen)
    scale = torch.rand(70, generator=gen)
    x = torch.randn(128, 4, generator=gen).T  # (4, 128), not contiguous
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.int8_dot_linear(x, native.group_codes(codes), scale)
        torch.set_num_threads(2)
        two = native.int8_dot_linear(x.contiguous(), native.group_codes(codes), scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_a_compiled_graph_calls_the_same_kernel() -> None:
    torch.manual_seed(2)
    layer = Int8Linear.from_weight(torch.randn(48, 96), torch.randn(48), kernel="avx2")
    x = torch.randn(1, 96)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))


@needs_kernel
@pytest.mark.parametrize("vnni", [False, True])
def test_a_rows_product_does_not_depend_on_how_many_rows_came_with_it(vnni: bool) -> None:
    """Past AVX2_MAX_ROWS rows a layer multiplies the dequantized weight by the activations
    rounded as the kernel rounds them (the kernel's VNNI dots, where they run, take every row):
    the same products up to float32 summation order."""
    torch.manual_seed(5)
    layer = Int8Linear.from_weight(torch.randn(40, 96), torch.randn(40), kernel="avx2")
    x = torch.randn(AVX2_MAX_ROWS + 1, 96)
    x[7, 5] = float("nan")
    before = native.int8_vnni()
    try:
        native.int8_vnni(vnni)
        many, few = layer(x), layer(x[:3])
    finally:
        native.int8_vnni(before)
    assert few.isfinite().all() and many[7].isnan().all()
    assert_close(many[:3], few, rtol=1e-5, atol=1e-5)
    codes, deq = layer.codes(), layer.dequantize().double()
    want = int8_dot_reference(x[8:], codes, layer.scale) + layer.bias.double()
    slack = 1e-5 * (x[8:].double().abs() @ deq.abs().T) + 1e-6
    assert ((many[8:].double() - want).abs() <= slack).all()


@needs_kernel
def test_gradients_flow_through_the_float_product() -> None:
    torch.manual_seed(3)
    layer = Int8Linear.from_weight(torch.randn(8, 64), kernel="avx2")
    x = torch.randn(2, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert x.grad is not None
    assert torch.allclose(x.grad, layer.dequantize().sum(0).expand(2, 64))
    # The values are the kernel's (the activations rounded), the gradient the float product's.
    with torch.no_grad():
        assert_close(y, layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out", [1, 4, 7, 12])
def test_grouped_codes_are_the_same_bytes_in_the_kernels_order(out: int) -> None:
    codes = torch.arange(out * 64, dtype=torch.int32).remainder(251).sub(125).to(torch.int8)
    codes = codes.view(out, 64)
    grouped = native.group_codes(codes)
    assert grouped.shape == codes.shape and torch.equal(native.ungroup_codes(grouped), codes)
    assert torch.equal(grouped.flatten().sort().values, codes.flatten().sort().values)
    whole = out // 4 * 4
    if whole:  # the first group's first block: its four rows' first 32 codes, side by side
        assert torch.equal(grouped.flatten()[:128], codes[:4, :32].flatten())
        assert not torch.equal(grouped, codes)
    assert torch.equal(grouped[whole:], codes[whole:])  # the rows after the last group
    with pytest.raises(ValueError, match="multiple of 32 inputs, got 40"):
        native.group_codes(torch.zeros(4, 40, dtype=torch.int8))


def test_bad_inputs_get_clear_errors() -> None:
    codes, scale = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4)
    with pytest.raises(TypeError, match="float32 x"):
        native.int8_dot_linear(torch.zeros(1, 64, dtype=torch.float64), codes, scale)
    with pytest.raises(TypeError, match="int8 codes"):
        native.int8_dot_linear(torch.zeros(1, 64), codes.float(), scale)
    with pytest.raises(ValueError, match=r"\(1, 32\), \(4, 64\)"):
        native.int8_dot_linear(torch.zeros(1, 32), codes, scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.int8_dot_linear(torch.zeros(1, 40), codes[:, :40], scale)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        native.int8_dot_linear(torch.zeros(1, 64), codes, scale[:3])
    with pytest.raises(ValueError, match="meta"):
        native.int8_dot_linear(torch.zeros(1, 64, device="meta"), codes, scale)


@pytest.fixture
def fresh_build(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Builds and loads of the kernels happen anew (into a temporary cache) and are forgotten
    afterwards."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    native._load.cache_clear()
    yield
    native._load.cache_clear()


def test_without_a_compiler_the_reason_is_given(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    if native.kernels_unavailable().startswith("needs Linux"):
        pytest.skip(native.kernels_unavailable())
    scale = torch.ones(1)
    assert not native.kernels_available()
    assert "no C compiler" in native.kernels_unavailable()
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.int8_dot_linear(torch.zeros(1, 32), torch.ones(1, 32, dtype=torch.int8), scale)
    native._load.cache_clear()
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"sse2"})
    assert native.kernels_unavailable() == "the CPU lacks AVX2 or FMA"


def test_a_failing_build_is_reported_and_leaves_no_library(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(native, "_compiler", lambda: "false")  # (exits 1, prints nothing)
    if native.kernels_unavailable().startswith("needs Linux"):
        pytest.skip(native.kernels_unavailable())
    assert native.kernels_unavailable().startswith("the build failed: false ")
    assert not list((native._cache_dir() / "kernels").glob("*.so"))


@needs_kernel
def test_the_library_is_built_once_and_reused(fresh_build: None) -> None:
    assert native.kernels_available()
    (built,) = (native._cache_dir() / "kernels").glob("kernels-*.so")
    stamp = built.stat().st_mtime_ns
    native._load.cache_clear()
    assert native.kernels_available()
    assert built.stat().st_mtime_ns == stamp
    assert [p.name for p in (native._cache_dir() / "kernels").iterdir()] == [built.name]


def _bf16_ulp(t: Tensor) -> Tensor:
    """The spacing of bf16 values at ``t`` (float64): 2^(exponent - 7)."""
    return torch.ldexp(torch.ones_like(t), torch.frexp(t)[1] - 8).abs()


@pytest.fixture(params=[False, True], ids=["avx2", "avx512"])
def float_dots(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The float products' AVX2 dots, or their AVX512 ones (where the CPU has them: the AVX2 ones
    elsewhere); yields whether the AVX512 ones run."""
    before = native.float_wide()
    try:
        wide = native.float_wide(request.param)
        assert wide == (request.param and native.wide_cpu())  # (the kernel's probe and ours)
        yield wide
    finally:
        native.float_wide(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "out", "n", "bias"),
    [
        (1, 1536, 576, False),
        (3, 77, 100, True),
        (15, 9, 64, True),
        (2, 5, 7, False),
        (9, 20, 1536, True),  # eight rows' inputs in chunks (AVX512), then one row at once
        (8, 11, 1100, False),  # chunks of 512, 512 and 76 (two steps of 32 and 12 masked)
    ],
)
def test_float_products_follow_float64(
    dtype: torch.dtype, rows: int, out: int, n: int, bias: bool, float_dots: bool
) -> None:
    """Summed in float32 (n not a multiple of the vector width too), then rounded to the dtype."""
    gen = torch.Generator().manual_seed(rows * out + n)
    x = torch.randn(rows, n, generator=gen).to(dtype)
    w = torch.randn(out, n, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    got = native.float_dot_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, out)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    slack = 1e-6 * (x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs()))
    if dtype == torch.bfloat16:
        slack = slack + _bf16_ulp(want)  # the float32 sum's rounding to bf16: within one step
    assert ((got.double() - want).abs() <= slack).all(), (got.double() - want).abs().max()


@needs_kernel
def test_float_products_keep_non_finite_values_and_ignore_threads_and_strides(
    float_dots: bool,
) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 3, generator=gen).T  # (3, 64), not contiguous
    w = torch.randn(64, 40, generator=gen).T  # (40, 64), not contiguous
    x[1, 5] = float("nan")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.float_dot_linear(x, w)
        torch.set_num_threads(2)
        two = native.float_dot_linear(x.contiguous(), w.contiguous())
    finally:
        torch.set_num_threads(threads)
    assert_close(one, two, rtol=0, atol=0, equal_nan=True)  # each output row: one thread, one order
    assert one[1].isnan().all() and one[[0, 2]].isfinite().all()
    half = native.float_dot_linear(x.bfloat16(), w.bfloat16())
    assert half[1].isnan().all() and half[[0, 2]].isfinite().all()
    big = torch.full((1, 64), 3e38).bfloat16()
    assert native.float_dot_linear(big, torch.ones(2, 64).bfloat16()).isposinf().all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_rows_product_does_not_depend_on_the_rows_beside_it(
    dtype: torch.dtype, float_dots: bool
) -> None:
    """Rows go through the kernel a few at a time (AVX2: two, and an odd one alone; AVX512: up to
    eight, whose inputs go in chunks where they would not stay in L1): each row's result is the
    same bits as the row's product by itself (a sequence decodes the same alone or batched)."""
    gen = torch.Generator().manual_seed(11)
    for n in (1100, 576, 100, 7):
        x = torch.randn(11, n, generator=gen).to(dtype)
        w = torch.randn(70, n, generator=gen).to(dtype)
        b = torch.randn(70, generator=gen).to(dtype)
        together = native.float_dot_linear(x, w, b)
        for r in range(11):
            alone = native.float_dot_linear(x[r : r + 1], w, b)
            assert torch.equal(together[r : r + 1], alone), (n, r)
        for part in (slice(1, 3), slice(2, 10), slice(3, 6)):  # (other counts and offsets)
            assert torch.equal(native.float_dot_linear(x[part], w, b), together[part]), part


@needs_kernel
def test_the_avx512_and_avx2_float_dots_agree_within_their_roundings() -> None:
    """The two sum in different orders: the same products up to float32 summation order."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 1100, generator=gen), torch.randn(33, 1100, generator=gen)
    before = native.float_wide()
    try:
        native.float_wide(False)
        avx2 = native.float_dot_linear(x, w)
        native.float_wide(True)
        wide = native.float_dot_linear(x, w)
    finally:
        native.float_wide(before)
    assert_close(wide, avx2, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_compiled_graph_calls_the_float_kernel() -> None:
    x, w = torch.randn(1, 1, 96).bfloat16(), torch.randn(48, 96).bfloat16()
    compiled = torch.compile(
        lambda x, w: torch.ops.attnkit.float_dot_linear(x, w, None) * 2, fullgraph=True
    )
    assert torch.equal(compiled(x, w), native.float_dot_linear(x, w) * 2)


def test_float_products_get_clear_errors() -> None:
    w = torch.zeros(4, 64)
    with pytest.raises(TypeError, match=r"torch\.float64, torch\.float32"):
        native.float_dot_linear(torch.zeros(1, 64, dtype=torch.float64), w)
    with pytest.raises(TypeError, match=r"torch\.bfloat16, torch\.bfloat16, torch\.float32"):
        native.float_dot_linear(torch.zeros(1, 64).bfloat16(), w.bfloat16(), torch.zeros(4))
    with pytest.raises(ValueError, match=r"\(1, 32\), \(4, 64\) and None"):
        native.float_dot_linear(torch.zeros(1, 32), w)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        native.float_dot_linear(torch.zeros(1, 64), w, torch.zeros(3))
    with pytest.raises(ValueError, match="meta"):
        native.float_dot_linear(torch.zeros(1, 64, device="meta"), w)


@needs_kernel
def test_float_products_of_empty_sizes_and_strided_bias() -> None:
    """No inputs: the bias alone; no rows: an empty result; a strided bias is read correctly."""
    bias = torch.arange(10.0)[::2]  # (5,), not contiguous
    got = native.float_dot_linear(torch.zeros(3, 0), torch.zeros(5, 0), bias)
    assert torch.equal(got, bias.expand(3, 5))
    assert native.float_dot_linear(torch.zeros(0, 4), torch.ones(5, 4), bias).shape == (0, 5)
    x, w = torch.randn(2, 4), torch.randn(5, 4)
    assert_close(native.float_dot_linear(x, w, bias), x @ w.T + bias)


def _capped_reference(
    t: Tensor, cap: float, first: int, period: int, causal: bool, window: int | None
) -> Tensor:
    """float64 softmax of ``cap * tanh(x / cap)`` with ``t = 2 x / cap``, masked by position."""
    rows, width = t.shape
    x = t.double() * cap / 2
    at = first + torch.arange(rows) % period  # each row's query position
    j = torch.arange(width)
    ok = torch.ones(rows, width, dtype=torch.bool)
    if causal:
        ok &= j[None, :] <= at[:, None]
    if window is not None:
        ok &= (at[:, None] - j[None, :]).abs() < window
    p = torch.softmax((cap * torch.tanh(x / cap)).masked_fill(~ok, -torch.inf), dim=-1)
    return p.nan_to_num(nan=0.0)  # (a row without keys: all zero)


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 5, 300])
@pytest.mark.parametrize("first", [-12, 0, 7, 40])
def test_capped_softmax_follows_float64(causal: bool, window: int | None, first: int) -> None:
    gen = torch.Generator().manual_seed(first + 3 * (window or 0) + causal)
    rows, width, period, cap = 3 * 13, 37, 13, 3.0  # widths off the vector length, tails
    t = 2 / cap * 8 * torch.randn(rows, width, generator=gen)  # raw scores of size ~8
    got = native.capped_softmax_(
        t.clone().view(3, period, width),
        cap,
        first=first,
        period=period,
        causal=causal,
        window=window,
        finite=True,
    )
    want = _capped_reference(t, cap, first, period, causal, window)
    assert_close(got.view(rows, width).double(), want, atol=2e-6, rtol=2e-5)
    # Not vacuous: the cap changes the weights far beyond the tolerance.
    plain = torch.softmax(t.double() * cap / 2, -1)
    assert (plain - want).abs().max() > 1e-2
    if causal and first < 0:  # rows before the first key attend nothing: exact zeros
        assert torch.equal(got.view(rows, width)[:-first], torch.zeros(-first, width))


@needs_kernel
def test_capped_softmax_keeps_non_finite_values_in_their_row_only() -> None:
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 40, generator=gen)
    t[0, 3], t[1, 39], t[2, 17] = torch.nan, torch.inf, -torch.inf
    got = native.capped_softmax_(t.clone(), 5.0)
    assert torch.isnan(got[:3]).all()  # NaN, and inf unless `finite`
    assert torch.isfinite(got[3:]).all()
    assert_close(
        got[3:].double(), _capped_reference(t[3:], 5.0, 0, 3, False, None), atol=2e-6, rtol=2e-5
    )
    # With `finite` the caller vouches for the inputs: an overflowed score is capped like tanh.
    capped = native.capped_softmax_(t[1:3].clone(), 5.0, finite=True)
    assert_close(
        capped.double(),
        _capped_reference(t[1:3].clamp(-1e30, 1e30), 5.0, 0, 2, False, None),
        atol=2e-6,
        rtol=2e-5,
    )
    # A NaN the masks leave out is never read.
    masked = torch.zeros(2, 8)
    masked[:, 5] = torch.nan
    out = native.capped_softmax_(masked, 5.0, causal=True, period=2)  # rows at positions 0, 1
    assert torch.isfinite(out).all()
    assert_close(out[1, :2], torch.full((2,), 0.5))


@needs_kernel
def test_capped_softmax_ignores_threads_and_gets_clear_errors() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(64, 1500, generator=gen)  # over the threading threshold
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.capped_softmax_(t.clone(), 50.0, causal=True, first=700)
        torch.set_num_threads(2)
        two = native.capped_softmax_(t.clone(), 50.0, causal=True, first=700)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert native.capped_softmax_(torch.empty(0, 5), 1.0).shape == (0, 5)
    with pytest.raises(TypeError, match="float32"):
        native.capped_softmax_(t.double(), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        native.capped_softmax_(t.t(), 1.0)
    with pytest.raises(ValueError, match="softcap=0"):
        native.capped_softmax_(t.clone(), 0.0)
    with pytest.raises(ValueError, match="window=0"):
        native.capped_softmax_(t.clone(), 1.0, window=0)


def _capped_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, cap: float, scale: float, causal: bool, window: int | None
) -> Tensor:
    """float64 soft-capped attention, bottom-right aligned queries; rows without keys zero."""
    L, S = q.shape[-2], k.shape[-2]
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    scores = cap * torch.tanh(q.double() @ kk.transpose(-1, -2) * scale / cap)
    at, j = torch.arange(L)[:, None] + S - L, torch.arange(S)[None, :]
    ok = torch.ones(L, S, dtype=torch.bool)
    if causal:
        ok &= j <= at
    if window is not None:
        ok &= (at - j).abs() < window
    return torch.softmax(scores.masked_fill(~ok, -torch.inf), -1).nan_to_num(nan=0.0) @ vv


needs_capped = pytest.mark.skipif(
    not native.flash_available(),
    reason=f"capped_attention cannot run here: {native.kernels_unavailable() or 'no sgemm'}",
)


def test_capped_attention_runs_wherever_the_kernels_build() -> None:
    """torch's x86 builds link a BLAS whose ``sgemm_`` the kernel finds (CI holds it to that)."""
    if not native.kernels_available():
        pytest.skip(f"no attnkit kernels: {native.kernels_unavailable()}")
    assert native.flash_available()


@needs_capped
@pytest.mark.parametrize(
    ("L", "S", "causal", "window"),
    [
        (37, 37, True, None),  # blocks and tiles with tails
        (37, 37, False, None),
        (20, 45, True, None),  # queries bottom-right aligned
        (45, 20, True, None),  # the first queries attend no key: zero rows
        (50, 50, True, 6),  # key tiles skipped on both sides
        (33, 41, False, 9),  # a two-sided window
        (1, 40, True, None),  # one query
    ],
)
def test_capped_attention_follows_float64(L: int, S: int, causal: bool, window: int | None) -> None:
    gen = torch.Generator().manual_seed(L * S + (window or 0))
    q = 3 * torch.randn(2, 4, L, 16, generator=gen)  # scores of size ~10: the cap matters
    k = 3 * torch.randn(2, 2, S, 16, generator=gen)  # grouped-query heads
    v = torch.randn(2, 2, S, 12, generator=gen)
    want = _capped_attention_reference(q, k, v, 4.0, 0.25, causal, window)
    for blocks in ((8, 16), (5, 7), (64, 512)):  # key tiles of one query's reach and more
        got = native.capped_attention(
            q, k, v, softcap=4.0, scale=0.25, causal=causal, window=window,
            query_block=blocks[0], key_block=blocks[1], finite=True,
        )  # fmt: skip
        assert got.shape == (2, 4, L, 12)
        assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
    # Not vacuous: the cap changes the output far beyond the tolerance.
    plain = _capped_attention_reference(q, k, v, 1e9, 0.25, causal, window)
    assert (plain - want).abs().max() > 1e-2
    if L > S and causal:  # rows before the first key: exact zeros
        assert torch.equal(got[:, :, : L - S], torch.zeros(2, 4, L - S, 12))


@needs_capped
def test_capped_attention_takes_strided_inputs_and_any_thread_count() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 70, 4, 8, generator=gen).transpose(1, 2)  # (B, L, H, E) storage
    k = torch.randn(3, 70, 2, 8, generator=gen).transpose(1, 2)
    v = torch.randn(3, 2, 70, 16, generator=gen)[..., ::2]  # a strided last dim: copied
    want = _capped_attention_reference(q, k, v, 2.0, 0.4, True, None)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(
                native.capped_attention(q, k, v, softcap=2.0, scale=0.4, causal=True, key_block=9)
            )
    finally:
        torch.set_num_threads(before)
    for got in outs:
        assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
        assert torch.equal(got, outs[0])  # (each block is computed by one thread, in order)


@needs_capped
def test_capped_attention_keeps_non_finite_scores_in_their_row_and_gets_clear_errors() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=gen) for _ in range(3))
    q[0, 0, 4, 1], q[0, 1, 9, 2], k[0, 1, 25, 0] = torch.nan, torch.inf, torch.inf
    got = native.capped_attention(q, k, v, softcap=3.0, scale=0.3, causal=True, key_block=8)
    bad = torch.zeros(1, 2, 30, dtype=torch.bool)
    bad[0, 0, 4] = bad[0, 1, 9] = True  # a NaN query, an infinite one
    bad[0, 1, 25:] = True  # the queries that may attend the infinite key (causal)
    assert torch.equal(torch.isnan(got).any(-1), bad)
    assert torch.isnan(got[bad]).all()
    clean = q.clone()
    clean[bad] = 0.0
    ks = k.clone()
    ks[0, 1, 25] = 0.0
    want = _capped_attention_reference(clean, ks, v, 3.0, 0.3, True, None)
    assert_close(got[~bad].double(), want[~bad], atol=2e-6, rtol=2e-5)
    assert native.capped_attention(q[:, :, :0], k, v, softcap=1.0, scale=1.0).shape == (
        1, 2, 0, 8,
    )  # fmt: skip
    with pytest.raises(TypeError, match="float32"):
        native.capped_attention(q.double(), k, v, softcap=1.0, scale=1.0)
    with pytest.raises(ValueError, match=r"H % K"):
        native.capped_attention(q, k[:, :, :, :4], v, softcap=1.0, scale=1.0)
    with pytest.raises(ValueError, match="softcap=0"):
        native.capped_attention(q, k, v, softcap=0.0, scale=1.0)
    with pytest.raises(ValueError, match="window=0"):
        native.capped_attention(q, k, v, softcap=1.0, scale=1.0, window=0)


@needs_capped
@pytest.mark.parametrize(
    ("L", "S", "causal", "window", "first"),
    [
        (37, 37, True, None, 0),  # a document's causal square, blocks with tails
        (37, 37, False, None, 0),
        (20, 45, True, None, None),  # bottom-right aligned queries
        (45, 20, True, None, None),  # the first queries attend no key: zero rows and gradients
        (50, 60, True, 6, 10),  # a window: key blocks skipped on both sides
        (33, 41, False, 9, None),  # a two-sided window
    ],
)
def test_flash_attention_and_its_backward_follow_float64(
    L: int, S: int, causal: bool, window: int | None, first: int | None
) -> None:
    gen = torch.Generator().manual_seed(L * S + (window or 0))
    q = (2 * torch.randn(2, 4, L, 16, generator=gen)).requires_grad_()
    k = (2 * torch.randn(2, 2, S, 16, generator=gen)).requires_grad_()  # grouped-query heads
    v = torch.randn(2, 2, S, 12, generator=gen).requires_grad_()
    grad_out = torch.randn(2, 4, L, 12, generator=gen)
    at = torch.arange(L)[:, None] + (S - L if first is None else first)
    j = torch.arange(S)[None, :]
    ok = torch.ones(L, S, dtype=torch.bool)
    if causal:
        ok &= j <= at
    if window is not None:
        ok &= (at - j).abs() < window
    kk, vv = (t.double().repeat_interleave(2, 1) for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2) * 0.3).masked_fill(~ok, -torch.inf)
    want = torch.softmax(scores, -1).nan_to_num(nan=0.0) @ vv
    grads = torch.autograd.grad((want * grad_out.double()).sum(), (q, k, v))
    rows = ok.any(-1)
    want_lse = torch.logsumexp(scores, -1)
    for blocks in ((8, 16), (5, 7), (64, 512)):
        options = {"scale": 0.3, "causal": causal, "window": window, "first": first}
        with torch.no_grad():
            out, lse = native.flash_attention(q, k, v, blocks=blocks, **options)
            got = native.flash_attention_backward(grad_out, q, k, v, out, lse, **options)
        assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
        assert_close(lse[..., rows].double(), want_lse[..., rows], atol=2e-6, rtol=2e-5)
        assert (lse[..., ~rows] == -torch.inf).all()
        for name, g, w in zip("qkv", got, grads, strict=True):
            assert_close(g.double(), w.double(), atol=2e-5, rtol=2e-5, msg=name)
    if not rows.all():  # rows without keys: exact zeros
        assert torch.equal(out[:, :, ~rows], torch.zeros_like(out[:, :, ~rows]))
        assert torch.equal(got[0][:, :, ~rows], torch.zeros_like(got[0][:, :, ~rows]))


@needs_capped
def test_flash_attention_widens_bf16_blocks() -> None:
    # bf16 inputs (for CPUs without bf16 units): the float32 math on the widened values, the
    # output rounded once; gradients in bf16 from float32 sums.
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad_out = (torch.randn(2, 4, 70, 16, generator=gen).bfloat16() for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    out, lse = native.flash_attention(q, k, v, scale=0.25, causal=True, window=30)
    wide = [t.float() for t in (q, k, v)]
    out32, lse32 = native.flash_attention(*wide, scale=0.25, causal=True, window=30)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(out, out32.bfloat16(), atol=8e-3, rtol=8e-3)
    assert_close(lse, lse32, atol=1e-6, rtol=1e-6)
    got = native.flash_attention_backward(
        grad_out, q, k, v, out, lse, scale=0.25, causal=True, window=30
    )
    want = native.flash_attention_backward(
        grad_out.float(), *wide, out.float(), lse, scale=0.25, causal=True, window=30
    )
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert_close(g, w.bfloat16(), atol=8e-3, rtol=8e-3)
    # ... and with Gemma 2's cap
    capped = native.capped_attention(q, k, v, softcap=2.0, scale=0.25, causal=True)
    capped32 = native.capped_attention(*wide, softcap=2.0, scale=0.25, causal=True)
    assert capped.dtype == torch.bfloat16
    assert_close(capped, capped32.bfloat16(), atol=8e-3, rtol=8e-3)


@needs_capped
def test_flash_attention_takes_strided_views_and_gets_clear_errors() -> None:
    gen = torch.Generator().manual_seed(4)
    # (documents, L, H, E) storage seen as (documents, H, L, E), as attnkit.blockwise's tiles
    q, k, v, grad_out = (torch.randn(3, 40, 2, 8, generator=gen).transpose(1, 2) for _ in range(4))
    out, lse = native.flash_attention(q, k, v, scale=0.5, causal=True, blocks=(16, 16))
    got = native.flash_attention_backward(grad_out, q, k, v, out, lse, scale=0.5, causal=True)
    qc, kc, vc = (t.contiguous().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=0.5)
    assert_close(out, ref, atol=2e-6, rtol=2e-5)
    want = torch.autograd.grad((ref * grad_out).sum(), (qc, kc, vc))
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, atol=2e-5, rtol=2e-5)
    # into=: the gradients added to running sums (views with contiguous rows), as ring
    # attention's blocks add theirs.
    sums = [torch.randn(3, 40, 2, 8, generator=gen).transpose(1, 2) for _ in range(3)]
    before = [t.clone() for t in sums]
    back = native.flash_attention_backward(
        grad_out, q, k, v, out, lse, scale=0.5, causal=True, into=tuple(sums)
    )
    assert all(a is b for a, b in zip(back, sums, strict=True))
    for total, start, g in zip(sums, before, got, strict=True):
        assert_close(total, start + g, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="into"):
        native.flash_attention_backward(
            grad_out, q, k, v, out, lse, scale=0.5, into=(sums[0].double(), *sums[1:])
        )
    with pytest.raises(TypeError, match="float32"):
        native.flash_attention(q.double(), k, v, scale=1.0)
    with pytest.raises(ValueError, match=r"H % K"):
        native.flash_attention(q, k[:, :, :, :4], v, scale=1.0)
    with pytest.raises(ValueError, match="lse"):
        native.flash_attention_backward(grad_out, q, k, v, out, lse[:, :1], scale=0.5)


def _one_query_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cap: float | None = None
) -> Tensor:
    """float64 attention of each query head over its key/value head (scores soft-capped to
    ``cap``, if given); rows without keys zero."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    scores = q.double() @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    return torch.softmax(scores, -1).nan_to_num(nan=0.0) @ vv


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("B", "H", "K", "S", "E", "Ev"),
    [(1, 9, 3, 136, 64, 64), (2, 8, 2, 37, 33, 17), (3, 4, 4, 1, 8, 8), (2, 2, 1, 300, 128, 96)],
)
def test_one_query_attention_follows_float64(dtype, B, H, K, S, E, Ev) -> None:
    gen = torch.Generator().manual_seed(S + E)
    q = torch.randn(B, H, 1, E, generator=gen).to(dtype)
    cache = torch.randn(B, K, S + 5, E, generator=gen).to(dtype)  # a cache's slice: strided
    k, v = cache[:, :, :S], torch.randn(B, K, S, Ev, generator=gen).to(dtype)
    padded = torch.rand(B, 1, 1, S, generator=gen) > 0.3
    padded[..., 0] = True
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for mask in (None, padded, padded[:1]):
        for cap in (None, 2.0):  # (and soft-capped scores, Gemma 2's)
            out, flags = native.one_query_attention(q, k, v, mask, E**-0.5, softcap=cap)
            assert flags == 0 and out.dtype == dtype and out.shape == (B, H, 1, Ev)
            assert_close(out.double(), _one_query_reference(q, k, v, mask, cap), **tol)
    if S > 1:  # not vacuous: the cap changes the output beyond the tolerance
        plain, capped = (
            _one_query_reference(q, k, v, None),
            _one_query_reference(q, k, v, None, 2.0),
        )
        assert (plain - capped).abs().max() > 0.05


@needs_kernel
def test_one_query_attention_flags_empty_and_non_finite_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=gen)
    k, v = (torch.randn(2, 2, 10, 8, generator=gen) for _ in range(2))  # two key/value heads
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[1] = False  # the second sequence may attend nothing: zero rows
    out, flags = native.one_query_attention(q, k, v, mask, 8**-0.5)
    assert flags == native.NO_KEY and torch.equal(out[1], torch.zeros(4, 1, 8))
    assert_close(out[0].double(), _one_query_reference(q, k, v, mask)[0], atol=1e-5, rtol=1e-5)
    # A NaN key the mask leaves out is never read; one it allows makes its head's rows NaN.
    mask[1] = True
    mask[:, ..., 3] = False
    k[0, 1, 3, 0] = torch.nan
    out, flags = native.one_query_attention(q, k, v, mask, 8**-0.5)
    assert flags == 0 and torch.isfinite(out).all()
    k[0, 1, 4, 0] = torch.nan
    out, flags = native.one_query_attention(q, k, v, mask, 8**-0.5)
    assert flags == native.NON_FINITE
    assert torch.isnan(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    assert torch.isfinite(out[1]).all()
    # With a cap an infinite score is flagged too (capped it would look finite).
    k[0, 1, 4, 0] = 0.0
    k[1, 0, 2, 0] = -torch.inf
    out, flags = native.one_query_attention(q, k, v, mask, 8**-0.5, softcap=3.0)
    assert flags == native.NON_FINITE
    assert torch.isnan(out[1, :2]).all() and torch.isfinite(out[0]).all()


@needs_kernel
def test_one_query_attention_ignores_threads_and_gets_clear_errors() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 8, 1, 64, generator=gen), *torch.randn(2, 4, 2, 700, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.one_query_attention(q, k, v, None, 0.125)[0]
        torch.set_num_threads(2)
        two = native.one_query_attention(q, k, v, None, 0.125)[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    with pytest.raises(TypeError, match="bfloat16 or all float32"):
        native.one_query_attention(q.double(), k, v, None, 1.0)
    with pytest.raises(TypeError, match="bool mask"):
        native.one_query_attention(q, k, v, torch.zeros(4, 1, 1, 700), 1.0)
    with pytest.raises(ValueError, match="H % K == 0"):
        native.one_query_attention(q[:, :3], k, v, None, 1.0)
    with pytest.raises(ValueError, match="mask"):
        native.one_query_attention(q, k, v, torch.ones(4, 1, 1, 5, dtype=torch.bool), 1.0)


def _int4_case(
    rows: int, out: int, n: int, group: int, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Activations, codes (0..15), scales and offsets of an int4 product; the scales and offsets
    are bf16 values (what the kernel reads)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, n), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(out, n // group, generator=gen) / 10).bfloat16().float()
    offset = (torch.randn(out, n // group, generator=gen) / 10).bfloat16().float()
    return torch.randn(rows, n, generator=gen), codes, scale, offset


def _int4_reference(x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """The float64 product of the rows rounded as the int8 kernel rounds them and the weight
    ``codes * scale + offset`` (per group)."""
    out, n = codes.shape
    groups = codes.double().view(out, scale.shape[1], -1)
    weight = (groups * scale.double()[..., None] + offset.double()[..., None]).view(out, n)
    return int8_dot_reference(x, weight, torch.ones(out))


def _int4_slack(x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """float32 rounding of the block sums, of the products with the scales and of the sums."""
    out, n = codes.shape
    groups = codes.double().view(out, scale.shape[1], -1)
    size = (groups * scale.double().abs()[..., None] + offset.double().abs()[..., None]).view(
        out, n
    )
    return 1e-5 * (x.double().abs() @ size.T) + 1e-30


def test_int4_packing_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=gen)
    packed = native.pack_int4(codes)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(native.unpack_int4(packed, 7), codes)
    # Row 0's first block: input j in the low nibble of byte j, input 16 + j in its high one.
    assert torch.equal(packed[0, :16], codes[0, :16] | codes[0, 16:32] << 4)
    # The next 16 bytes are row 1's first block (four rows side by side, block by block).
    assert torch.equal(packed[0, 16:32], codes[1, :16] | codes[1, 16:32] << 4)
    assert not packed[-1].any() or torch.equal(native.unpack_int4(packed, 8)[7], torch.zeros(64))
    scale, offset = torch.rand(7, 2).bfloat16().float(), torch.randn(7, 2).bfloat16().float()
    both = native.pack_int4_scales(scale, offset)
    assert both.shape == (2, 16) and both.dtype == torch.bfloat16
    got = native.unpack_int4_scales(both, 7)
    assert torch.equal(got[0], scale) and torch.equal(got[1], offset)
    with pytest.raises(ValueError, match="40"):
        native.pack_int4(torch.zeros(4, 40, dtype=torch.uint8))


@needs_kernel
@pytest.mark.parametrize(
    ("rows", "out", "n", "group"),
    [(1, 4, 32, 32), (1, 130, 576, 64), (3, 7, 96, 32), (9, 64, 256, 128), (2, 13, 512, 256)],
)
def test_int4_products_are_the_integer_sums_of_the_rounded_rows(
    rows: int, out: int, n: int, group: int
) -> None:
    x, codes, scale, offset = _int4_case(rows, out, n, group, seed=rows * out + n)
    x[0, :32] *= 1000  # blocks of very different sizes: each keeps its own scale
    x[-1, -32:] = 0  # an all-zero block
    packed, scales = native.pack_int4(codes), native.pack_int4_scales(scale, offset)
    got = native.int4_dot_linear(x, packed, scales, out).double()
    want = _int4_reference(x, codes, scale, offset)
    assert got.shape == (rows, out)
    slack = _int4_slack(x, codes, scale, offset)
    assert ((got - want).abs() <= slack).all(), (got - want).abs().max()


@needs_kernel
def test_int4_vnni_and_avx2_dots_give_the_same_bits_and_rows_stay_apart() -> None:
    # 5 rows: four and one a pass with VNNI, two, two and one with AVX2
    x, codes, scale, offset = _int4_case(5, 70, 192, 64, seed=5)
    x = x * torch.logspace(-3, 3, 192)
    x[1, 40] = float("nan")  # (its row only)
    packed, scales = native.pack_int4(codes), native.pack_int4_scales(scale, offset)
    before = native.int8_vnni()
    try:
        native.int8_vnni(False)
        avx2 = native.int4_dot_linear(x, packed, scales, 70)
        native.int8_vnni(True)
        wide = native.int4_dot_linear(x, packed, scales, 70)
        assert_close(wide, avx2, rtol=0, atol=0, equal_nan=True)  # (the same bits)
    finally:
        native.int8_vnni(before)
    keep = [0, 2, 3, 4]
    assert avx2[1].isnan().all() and not avx2[keep].isnan().any()
    for r in keep:  # (a row's product does not depend on the rows beside it)
        assert torch.equal(native.int4_dot_linear(x[r : r + 1], packed, scales, 70)[0], avx2[r])
    want = _int4_reference(x[keep], codes, scale, offset)
    assert ((avx2[keep].double() - want).abs() <= _int4_slack(x[keep], codes, scale, offset)).all()


@needs_kernel
def test_int4_dot_linear_names_what_it_does_not_take() -> None:
    codes = native.pack_int4(torch.zeros(5, 64, dtype=torch.uint8))
    scales = native.pack_int4_scales(torch.ones(5, 2), torch.zeros(5, 2))
    x = torch.zeros(1, 64)
    with pytest.raises(TypeError, match="float32 x, uint8 codes and bfloat16 scales"):
        native.int4_dot_linear(x.double(), codes, scales, 5)
    with pytest.raises(ValueError, match=r"\(1, 96\)"):
        native.int4_dot_linear(torch.zeros(1, 96), codes, scales, 5)
    with pytest.raises(ValueError, match="out=9"):
        native.int4_dot_linear(x, codes, scales, 9)
    with pytest.raises(ValueError, match="CPU"):
        native.int4_dot_linear(x.to("meta"), codes, scales, 5)


# The ops compiled graphs call: C++ implementations where a C++ compiler builds them.


def _op_cases() -> list[tuple[str, tuple[object, ...], object]]:
    """(op, arguments, the Python function's result) for each op, with strided inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=gen)
    codes = native.group_codes(torch.randint(-127, 128, (40, 96), dtype=torch.int8, generator=gen))
    scale = torch.rand(40, generator=gen)
    w, b = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    q = torch.randn(2, 6, 1, 32, generator=gen)
    k, v = torch.randn(2, 2, 2, 50, 32, generator=gen)[:, :, :, ::2]  # (rows strided in S)
    mask = torch.rand(2, 1, 1, 25, generator=gen) > 0.3
    codes4 = native.pack_int4(torch.randint(0, 16, (41, 96), dtype=torch.uint8, generator=gen))
    scales4 = native.pack_int4_scales(torch.rand(41, 3), torch.randn(41, 3))
    int4 = (x[:, ::1], codes4, scales4, 41)
    cases: list[tuple[str, tuple[object, ...], object]] = [
        ("int8_dot_linear", (x, codes, scale), native.int8_dot_linear(x, codes, scale)),
        ("int4_dot_linear", int4, native.int4_dot_linear(*int4)),
        (
            "one_query_attention",
            (q, k, v, mask, 0.2),
            native.one_query_attention(q, k, v, mask, 0.2)[0],
        ),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        xs, ws, bs = x[:, None].to(dtype), w.to(dtype), b.to(dtype)
        cases.append(("float_dot_linear", (xs, ws, bs), native.float_dot_linear(xs, ws, bs)))
        cases.append(("float_dot_linear", (xs, ws, None), native.float_dot_linear(xs, ws)))
        empty = xs[..., :0], ws[:, :0], bs  # (no inputs: the outputs are the bias)
        cases.append(("float_dot_linear", empty, native.float_dot_linear(*empty)))
    return cases


@needs_kernel
def test_the_ops_run_their_cpp_implementations_wherever_a_cpp_compiler_builds_them() -> None:
    """The rule CI holds them to, and what the dispatcher then calls for CPU tensors."""
    if native._cxx_compiler() is None:
        pytest.skip("no C++ compiler")
    assert native.load_ops() and native.ops_unavailable() == ""
    for name in ("int8_dot_linear", "int4_dot_linear", "float_dot_linear", "one_query_attention"):
        table = torch._C._dispatch_dump(f"attnkit::{name}")
        cpu = [line for line in table.splitlines() if line.startswith("CPU:")]
        assert len(cpu) == 1 and "ops.cpp" in cpu[0], table


@needs_kernel
def test_the_ops_equal_the_python_functions_and_check_their_inputs() -> None:
    """Whichever implementation runs (C++ where it builds): the same kernels, the same bytes."""
    native.load_ops()
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
    if not native.kernels_available():
        assert native.ops_unavailable().startswith("attnkit's kernels are not available")
        return
    kernels = native._kernels_path
    assert kernels is not None
    monkeypatch.setattr(native, "_ops_why", None)
    monkeypatch.setattr(native, "_cxx_compiler", lambda: None)
    native._load_ops(kernels)
    assert native.ops_unavailable() == "no C++ compiler (set CXX, or install g++)"
    monkeypatch.setattr(native, "_ops_why", None)
    monkeypatch.setattr(native, "_cxx_compiler", lambda: "false")
    native._load_ops(kernels)
    assert native.ops_unavailable().startswith("the build failed: false ")


def test_every_kernel_source_ships_with_the_package() -> None:
    """A non-editable install builds from the package data: each file of csrc/ must be in it."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["attnkit"]
    sources = sorted((root / "src" / "attnkit" / "csrc").iterdir())
    assert {p.suffix for p in sources} >= {".c", ".cpp", ".h"}
    for path in sources:
        name = f"csrc/{path.name}"
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("E", [64, 18, 2])
def test_rotate_equals_torchs_rotation(dtype: torch.dtype, interleaved: bool, E: int) -> None:
    from attnkit.positional import _full_width, apply_rope

    gen = torch.Generator().manual_seed(E)
    qkv = torch.randn(2, 33, 5 * E, generator=gen).to(dtype)
    x = qkv.unflatten(-1, (-1, E)).transpose(1, 2)[:, :4]  # heads of a fused projection: a view
    angles = torch.rand(33, E // 2, generator=gen, dtype=torch.float64) * 100
    cos, sin = angles.cos().float(), angles.sin().float()
    full = _full_width(cos, sin, interleaved)
    got = native.rotate(x, *full, interleaved=interleaved)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == x.shape
    # float64 math: each output channel x_i cos_i -/+ x_j sin_i of its pair
    wide = x.double()
    if interleaved:
        a, b = wide[..., 0::2], wide[..., 1::2]
        ref = torch.stack(
            (a * cos.double() - b * sin.double(), b * cos.double() + a * sin.double()), -1
        )
        ref = ref.flatten(-2)
    else:
        a, b = wide[..., : E // 2], wide[..., E // 2 :]
        c, s = cos.double(), sin.double()
        ref = torch.cat((a * c - b * s, b * c + a * s), -1)
    if dtype == torch.float32:
        assert_close(got.double(), ref, atol=1e-6, rtol=1e-6)
    else:  # rounded once from float32: at most one bf16 step from the exact value
        assert_close(got.double(), ref, atol=1e-2, rtol=8e-3)
    with torch.enable_grad():  # torch's form (a gradient is wanted): the same float32 steps
        torch_form = apply_rope(x.clone().requires_grad_(), cos, sin, interleaved=interleaved)
    same = {"atol": 0, "rtol": 0} if E % 16 == 0 else {}  # (torch's scalar tails may fuse)
    assert_close(got, torch_form.detach(), **same)
    # per-sequence rows (B, 1, L, E) and a 3-D x (H, L, E)
    per_row = tuple(t.expand(2, 1, 33, E).contiguous() for t in full)
    assert_close(native.rotate(x, *per_row, interleaved=interleaved), got, atol=0, rtol=0)
    assert_close(native.rotate(x[1], *full, interleaved=interleaved), got[1], atol=0, rtol=0)


@needs_kernel
def test_rotary_inference_runs_the_kernel_and_training_torchs_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from attnkit.positional import RotaryEmbedding

    rotary = RotaryEmbedding(16, interleaved=False)
    x = torch.randn(2, 3, 7, 16)
    calls: list[torch.Size] = []
    kernel = native.rotate
    monkeypatch.setattr(
        native, "rotate", lambda x, *a, **k: calls.append(x.shape) or kernel(x, *a, **k)
    )
    with torch.no_grad():
        want = rotary(x)
    assert calls == [x.shape]
    xg = x.clone().requires_grad_()
    out = rotary(xg)
    assert calls == [x.shape] and out.requires_grad  # torch's ops, which autograd follows
    assert_close(out.detach(), want, atol=1e-6, rtol=1e-6)
    out.sum().backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0
    # under torch.func's transforms the batched tensors have no memory to read: torch's form
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's note on an in-place op without a batch rule)
        batched = torch.func.vmap(rotary)(x)
    assert calls == [x.shape]
    assert_close(batched, want, atol=1e-6, rtol=1e-6)


def test_rotate_names_what_does_not_fit() -> None:
    x, table = torch.zeros(1, 2, 3, 8), torch.zeros(3, 8)
    with pytest.raises(TypeError, match="float32 or bfloat16 x and float32 tables"):
        native.rotate(x.double(), table, table, interleaved=True)
    with pytest.raises(TypeError, match=r"cos torch\.bfloat16"):
        native.rotate(x, table.bfloat16(), table, interleaved=True)
    with pytest.raises(
        ValueError, match=r"tables \(L, E\) or \(B, 1, L, E\), got x \(1, 2, 3, 8\)"
    ):
        native.rotate(x, torch.zeros(4, 8), torch.zeros(4, 8), interleaved=True)
    with pytest.raises(ValueError, match=r"\(B, H, L, E\), \(H, L, E\) or \(L, E\)"):
        native.rotate(x[0, 0, 0], table[0], table[0], interleaved=True)
