"""attnkit's linear kernels (``attnkit.kernels.linear``): the int8 and int4 dot products exact
against integer sums, the bf16/float32 streaming products against float64, their narrow and wide
dots, their errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from attnkit.kernels import build, linear, policy, probe
from attnkit.quantize import Int8Linear
from tests.helpers import int8_dot_reference

needs_kernel = pytest.mark.skipif(
    not build.kernels_available(), reason=f"no attnkit kernels: {build.kernels_unavailable()}"
)


def _slack(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """float32 rounding of the block sums and of the products with the scales."""
    return 1e-5 * (x.double().abs() @ (codes.double().abs() * scale.double()[:, None]).T) + 1e-30


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
    got = linear.int8_dot_linear(x, linear.group_codes(codes), scale).double()
    want = int8_dot_reference(x, codes, scale)
    assert got.shape == (rows, out)
    assert ((got - want).abs() <= _slack(x, codes, scale)).all(), (got - want).abs().max()
    # Not vacuous: the activations' rounding is far above the slack.
    exact = x.double() @ (codes.double() * scale.double()[:, None]).T
    assert ((got - exact).abs() > _slack(x, codes, scale)).any()


@needs_kernel
def test_the_largest_codes_do_not_saturate_the_pair_sums() -> None:
    """The narrow dots multiply unsigned by signed bytes and sum pairs into 16 bits: |w| = 128
    (code -128) times an activation of 127 in every lane is the largest pair sum, 2 * 128 * 127."""
    n = 64
    for code in (-128, -127, 127):
        codes = torch.full((5, n), code, dtype=torch.int8)
        for sign in (1.0, -1.0):
            x = torch.full((1, n), sign * 3.0)
            got = linear.int8_dot_linear(x, codes, torch.ones(5))
            assert torch.equal(got, torch.full((1, 5), sign * 3.0 * code * n))


@needs_kernel
def test_non_finite_activations_give_non_finite_rows_and_tiny_ones_keep_their_precision() -> None:
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=gen)
    grouped, scale = linear.group_codes(codes), torch.rand(8, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    x[3] *= 1e-40  # subnormal: 127 / max would overflow
    got = linear.int8_dot_linear(x, grouped, scale)
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
    got = linear.int8_dot_linear(x, linear.group_codes(codes), torch.ones(32))
    assert torch.equal(got[0, :8], torch.tensor([127.0, 0, 2, 2, 0, -2, -2, 126]))


@needs_kernel
def test_the_wide_and_narrow_int8_dots_give_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (70, 192), dtype=torch.int8, generator=gen)
    grouped, scale = linear.group_codes(codes), torch.rand(70, generator=gen)
    # 7 rows: four, two and one a pass with the wide dots (each row's sums in the same order)
    x = torch.randn(7, 192, generator=gen) * torch.logspace(-3, 3, 192)
    able = probe.capabilities().int8_dot
    before = linear.int8_wide_dots()
    try:
        assert linear.int8_wide_dots(False) is False
        narrow = linear.int8_dot_linear(x, grouped, scale)
        assert linear.int8_wide_dots(True) is able  # (on only where the CPU has it)
        assert torch.equal(linear.int8_dot_linear(x, grouped, scale), narrow)
    finally:
        linear.int8_wide_dots(before)
    want = int8_dot_reference(x, codes, scale)
    assert ((narrow.double() - want).abs() <= _slack(x, codes, scale)).all()


@needs_kernel
def test_threads_and_strides_do_not_change_the_product() -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (70, 128), dtype=torch.int8, generator=gen)
    scale = torch.rand(70, generator=gen)
    x = torch.randn(128, 4, generator=gen).T  # (4, 128), not contiguous
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear.int8_dot_linear(x, linear.group_codes(codes), scale)
        torch.set_num_threads(2)
        two = linear.int8_dot_linear(x.contiguous(), linear.group_codes(codes), scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_a_compiled_graph_calls_the_same_kernel() -> None:
    torch.manual_seed(2)
    layer = Int8Linear.from_weight(torch.randn(48, 96), torch.randn(48), kernel="attnkit")
    x = torch.randn(1, 96)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))


@needs_kernel
@pytest.mark.parametrize("wide", [False, True])
def test_a_rows_product_does_not_depend_on_how_many_rows_came_with_it(wide: bool) -> None:
    """Past policy.INT8_KERNEL_ROWS rows a layer multiplies the dequantized weight by the
    activations rounded as the kernel rounds them (the kernel's wide dots, where they run, take
    every row):
    the same products up to float32 summation order."""
    torch.manual_seed(5)
    layer = Int8Linear.from_weight(torch.randn(40, 96), torch.randn(40), kernel="attnkit")
    x = torch.randn(policy.INT8_KERNEL_ROWS + 1, 96)
    x[7, 5] = float("nan")
    before = linear.int8_wide_dots()
    try:
        linear.int8_wide_dots(wide)
        many, few = layer(x), layer(x[:3])
    finally:
        linear.int8_wide_dots(before)
    assert few.isfinite().all() and many[7].isnan().all()
    assert_close(many[:3], few, rtol=1e-5, atol=1e-5)
    codes, deq = layer.codes(), layer.dequantize().double()
    want = int8_dot_reference(x[8:], codes, layer.scale) + layer.bias.double()
    slack = 1e-5 * (x[8:].double().abs() @ deq.abs().T) + 1e-6
    assert ((many[8:].double() - want).abs() <= slack).all()


@needs_kernel
def test_gradients_flow_through_the_float_product() -> None:
    torch.manual_seed(3)
    layer = Int8Linear.from_weight(torch.randn(8, 64), kernel="attnkit")
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
    grouped = linear.group_codes(codes)
    assert grouped.shape == codes.shape and torch.equal(linear.ungroup_codes(grouped), codes)
    assert torch.equal(grouped.flatten().sort().values, codes.flatten().sort().values)
    whole = out // 4 * 4
    if whole:  # the first group's first block: its four rows' first 32 codes, side by side
        assert torch.equal(grouped.flatten()[:128], codes[:4, :32].flatten())
        assert not torch.equal(grouped, codes)
    assert torch.equal(grouped[whole:], codes[whole:])  # the rows after the last group
    with pytest.raises(ValueError, match="multiple of 32 inputs, got 40"):
        linear.group_codes(torch.zeros(4, 40, dtype=torch.int8))


def test_bad_inputs_get_clear_errors() -> None:
    codes, scale = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4)
    with pytest.raises(TypeError, match="float32 x"):
        linear.int8_dot_linear(torch.zeros(1, 64, dtype=torch.float64), codes, scale)
    with pytest.raises(TypeError, match="int8 codes"):
        linear.int8_dot_linear(torch.zeros(1, 64), codes.float(), scale)
    with pytest.raises(ValueError, match=r"\(1, 32\), \(4, 64\)"):
        linear.int8_dot_linear(torch.zeros(1, 32), codes, scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        linear.int8_dot_linear(torch.zeros(1, 40), codes[:, :40], scale)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        linear.int8_dot_linear(torch.zeros(1, 64), codes, scale[:3])
    with pytest.raises(ValueError, match="meta"):
        linear.int8_dot_linear(torch.zeros(1, 64, device="meta"), codes, scale)


def _bf16_ulp(t: Tensor) -> Tensor:
    """The spacing of bf16 values at ``t`` (float64): 2^(exponent - 7)."""
    return torch.ldexp(torch.ones_like(t), torch.frexp(t)[1] - 8).abs()


@pytest.fixture(params=[False, True], ids=["narrow", "wide"])
def float_dots(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The float products' narrow dots, or their wide ones (where the CPU has them: the narrow
    ones elsewhere); yields whether the wide ones run."""
    before = linear.float_wide_dots()
    try:
        wide = linear.float_wide_dots(request.param)
        assert wide == (
            request.param and probe.capabilities().wide_vectors
        )  # (the kernel's probe and ours)
        yield wide
    finally:
        linear.float_wide_dots(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "out", "n", "bias"),
    [
        (1, 1536, 576, False),
        (3, 77, 100, True),
        (15, 9, 64, True),
        (2, 5, 7, False),
        (9, 20, 1536, True),  # eight rows' inputs in chunks (wide dots), then one row at once
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
    got = linear.float_dot_linear(x, w, b)
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
        one = linear.float_dot_linear(x, w)
        torch.set_num_threads(2)
        two = linear.float_dot_linear(x.contiguous(), w.contiguous())
    finally:
        torch.set_num_threads(threads)
    assert_close(one, two, rtol=0, atol=0, equal_nan=True)  # each output row: one thread, one order
    assert one[1].isnan().all() and one[[0, 2]].isfinite().all()
    half = linear.float_dot_linear(x.bfloat16(), w.bfloat16())
    assert half[1].isnan().all() and half[[0, 2]].isfinite().all()
    big = torch.full((1, 64), 3e38).bfloat16()
    assert linear.float_dot_linear(big, torch.ones(2, 64).bfloat16()).isposinf().all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_rows_product_does_not_depend_on_the_rows_beside_it(
    dtype: torch.dtype, float_dots: bool
) -> None:
    """Rows go through the kernel a few at a time (narrow dots: up to four against three outputs,
    a lone row against eight; wide dots: up to eight, whose inputs go in chunks where they would
    not stay in L1), and 70 outputs leave partial tiles: each row's
    result is the same bits as the row's product by itself (a sequence decodes the same alone or
    batched)."""
    gen = torch.Generator().manual_seed(11)
    for n in (1100, 576, 100, 7):
        x = torch.randn(11, n, generator=gen).to(dtype)
        w = torch.randn(70, n, generator=gen).to(dtype)
        b = torch.randn(70, generator=gen).to(dtype)
        together = linear.float_dot_linear(x, w, b)
        for r in range(11):
            alone = linear.float_dot_linear(x[r : r + 1], w, b)
            assert torch.equal(together[r : r + 1], alone), (n, r)
        for part in (slice(1, 3), slice(2, 10), slice(3, 6)):  # (other counts and offsets)
            assert torch.equal(linear.float_dot_linear(x[part], w, b), together[part]), part


@needs_kernel
def test_the_wide_and_narrow_float_dots_agree_within_their_roundings() -> None:
    """The two sum in different orders: the same products up to float32 summation order."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 1100, generator=gen), torch.randn(33, 1100, generator=gen)
    before = linear.float_wide_dots()
    try:
        linear.float_wide_dots(False)
        narrow = linear.float_dot_linear(x, w)
        linear.float_wide_dots(True)
        wide = linear.float_dot_linear(x, w)
    finally:
        linear.float_wide_dots(before)
    assert_close(wide, narrow, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_compiled_graph_calls_the_float_kernel() -> None:
    x, w = torch.randn(1, 1, 96).bfloat16(), torch.randn(48, 96).bfloat16()
    compiled = torch.compile(
        lambda x, w: torch.ops.attnkit.float_dot_linear(x, w, None) * 2, fullgraph=True
    )
    assert torch.equal(compiled(x, w), linear.float_dot_linear(x, w) * 2)


def test_float_products_get_clear_errors() -> None:
    w = torch.zeros(4, 64)
    with pytest.raises(TypeError, match=r"torch\.float64, torch\.float32"):
        linear.float_dot_linear(torch.zeros(1, 64, dtype=torch.float64), w)
    with pytest.raises(TypeError, match=r"torch\.bfloat16, torch\.bfloat16, torch\.float32"):
        linear.float_dot_linear(torch.zeros(1, 64).bfloat16(), w.bfloat16(), torch.zeros(4))
    with pytest.raises(ValueError, match=r"\(1, 32\), \(4, 64\) and None"):
        linear.float_dot_linear(torch.zeros(1, 32), w)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        linear.float_dot_linear(torch.zeros(1, 64), w, torch.zeros(3))
    with pytest.raises(ValueError, match="meta"):
        linear.float_dot_linear(torch.zeros(1, 64, device="meta"), w)


@needs_kernel
def test_float_products_of_empty_sizes_and_strided_bias() -> None:
    """No inputs: the bias alone; no rows: an empty result; a strided bias is read correctly."""
    bias = torch.arange(10.0)[::2]  # (5,), not contiguous
    got = linear.float_dot_linear(torch.zeros(3, 0), torch.zeros(5, 0), bias)
    assert torch.equal(got, bias.expand(3, 5))
    assert linear.float_dot_linear(torch.zeros(0, 4), torch.ones(5, 4), bias).shape == (0, 5)
    x, w = torch.randn(2, 4), torch.randn(5, 4)
    assert_close(linear.float_dot_linear(x, w, bias), x @ w.T + bias)


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
    packed = linear.pack_int4(codes)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(linear.unpack_int4(packed, 7), codes)
    # Row 0's first block: input j in the low nibble of byte j, input 16 + j in its high one.
    assert torch.equal(packed[0, :16], codes[0, :16] | codes[0, 16:32] << 4)
    # The next 16 bytes are row 1's first block (four rows side by side, block by block).
    assert torch.equal(packed[0, 16:32], codes[1, :16] | codes[1, 16:32] << 4)
    assert not packed[-1].any() or torch.equal(linear.unpack_int4(packed, 8)[7], torch.zeros(64))
    scale, offset = torch.rand(7, 2).bfloat16().float(), torch.randn(7, 2).bfloat16().float()
    both = linear.pack_int4_scales(scale, offset)
    assert both.shape == (2, 16) and both.dtype == torch.bfloat16
    got = linear.unpack_int4_scales(both, 7)
    assert torch.equal(got[0], scale) and torch.equal(got[1], offset)
    with pytest.raises(ValueError, match="40"):
        linear.pack_int4(torch.zeros(4, 40, dtype=torch.uint8))


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
    packed, scales = linear.pack_int4(codes), linear.pack_int4_scales(scale, offset)
    got = linear.int4_dot_linear(x, packed, scales, out).double()
    want = _int4_reference(x, codes, scale, offset)
    assert got.shape == (rows, out)
    slack = _int4_slack(x, codes, scale, offset)
    assert ((got - want).abs() <= slack).all(), (got - want).abs().max()


@needs_kernel
def test_int4_wide_and_narrow_dots_give_the_same_bits_and_rows_stay_apart() -> None:
    # 5 rows: four and one a pass with the wide dots, two, two and one with the narrow ones
    x, codes, scale, offset = _int4_case(5, 70, 192, 64, seed=5)
    x = x * torch.logspace(-3, 3, 192)
    x[1, 40] = float("nan")  # (its row only)
    packed, scales = linear.pack_int4(codes), linear.pack_int4_scales(scale, offset)
    before = linear.int8_wide_dots()
    try:
        linear.int8_wide_dots(False)
        narrow = linear.int4_dot_linear(x, packed, scales, 70)
        linear.int8_wide_dots(True)
        wide = linear.int4_dot_linear(x, packed, scales, 70)
        assert_close(wide, narrow, rtol=0, atol=0, equal_nan=True)  # (the same bits)
    finally:
        linear.int8_wide_dots(before)
    keep = [0, 2, 3, 4]
    assert narrow[1].isnan().all() and not narrow[keep].isnan().any()
    for r in keep:  # (a row's product does not depend on the rows beside it)
        assert torch.equal(linear.int4_dot_linear(x[r : r + 1], packed, scales, 70)[0], narrow[r])
    want = _int4_reference(x[keep], codes, scale, offset)
    slack = _int4_slack(x[keep], codes, scale, offset)
    assert ((narrow[keep].double() - want).abs() <= slack).all()


@needs_kernel
def test_int4_dot_linear_names_what_it_does_not_take() -> None:
    codes = linear.pack_int4(torch.zeros(5, 64, dtype=torch.uint8))
    scales = linear.pack_int4_scales(torch.ones(5, 2), torch.zeros(5, 2))
    x = torch.zeros(1, 64)
    with pytest.raises(TypeError, match="float32 x, uint8 codes and bfloat16 scales"):
        linear.int4_dot_linear(x.double(), codes, scales, 5)
    with pytest.raises(ValueError, match=r"\(1, 96\)"):
        linear.int4_dot_linear(torch.zeros(1, 96), codes, scales, 5)
    with pytest.raises(ValueError, match="out=9"):
        linear.int4_dot_linear(x, codes, scales, 9)
    with pytest.raises(ValueError, match="CPU"):
        linear.int4_dot_linear(x.to("meta"), codes, scales, 5)
