"""attnkit's attention kernels (``attnkit.kernels.attention``): the soft-capped softmax and
attention, the flash forward and backward, and the one-query attention against float64, with their
errors."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from attnkit.kernels import attention, build, one_query, policy, probe

needs_kernel = pytest.mark.skipif(
    not build.kernels_available(), reason=f"no attnkit kernels: {build.kernels_unavailable()}"
)


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
    got = attention.capped_softmax_(
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
    got = attention.capped_softmax_(t.clone(), 5.0)
    assert torch.isnan(got[:3]).all()  # NaN, and inf unless `finite`
    assert torch.isfinite(got[3:]).all()
    assert_close(
        got[3:].double(), _capped_reference(t[3:], 5.0, 0, 3, False, None), atol=2e-6, rtol=2e-5
    )
    # With `finite` the caller vouches for the inputs: an overflowed score is capped like tanh.
    capped = attention.capped_softmax_(t[1:3].clone(), 5.0, finite=True)
    assert_close(
        capped.double(),
        _capped_reference(t[1:3].clamp(-1e30, 1e30), 5.0, 0, 2, False, None),
        atol=2e-6,
        rtol=2e-5,
    )
    # A NaN the masks leave out is never read.
    masked = torch.zeros(2, 8)
    masked[:, 5] = torch.nan
    out = attention.capped_softmax_(masked, 5.0, causal=True, period=2)  # rows at positions 0, 1
    assert torch.isfinite(out).all()
    assert_close(out[1, :2], torch.full((2,), 0.5))


@needs_kernel
def test_capped_softmax_ignores_threads_and_gets_clear_errors() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(64, 1500, generator=gen)  # over the threading threshold
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention.capped_softmax_(t.clone(), 50.0, causal=True, first=700)
        torch.set_num_threads(2)
        two = attention.capped_softmax_(t.clone(), 50.0, causal=True, first=700)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert attention.capped_softmax_(torch.empty(0, 5), 1.0).shape == (0, 5)
    with pytest.raises(TypeError, match="float32"):
        attention.capped_softmax_(t.double(), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        attention.capped_softmax_(t.t(), 1.0)
    with pytest.raises(ValueError, match="softcap=0"):
        attention.capped_softmax_(t.clone(), 0.0)
    with pytest.raises(ValueError, match="window=0"):
        attention.capped_softmax_(t.clone(), 1.0, window=0)


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
    not attention.flash_available(),
    reason=f"capped_attention cannot run here: {build.kernels_unavailable() or 'no sgemm'}",
)


def test_capped_attention_runs_wherever_the_kernels_build() -> None:
    """torch's x86 builds link a BLAS whose ``sgemm_`` the kernel finds (CI holds it to that)."""
    if not build.kernels_available():
        pytest.skip(f"no attnkit kernels: {build.kernels_unavailable()}")
    assert attention.flash_available()


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
        got = attention.capped_attention(
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
                attention.capped_attention(
                    q, k, v, softcap=2.0, scale=0.4, causal=True, key_block=9
                )
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
    got = attention.capped_attention(q, k, v, softcap=3.0, scale=0.3, causal=True, key_block=8)
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
    assert attention.capped_attention(q[:, :, :0], k, v, softcap=1.0, scale=1.0).shape == (
        1, 2, 0, 8,
    )  # fmt: skip
    with pytest.raises(TypeError, match="float32"):
        attention.capped_attention(q.double(), k, v, softcap=1.0, scale=1.0)
    with pytest.raises(ValueError, match=r"H % K"):
        attention.capped_attention(q, k[:, :, :, :4], v, softcap=1.0, scale=1.0)
    with pytest.raises(ValueError, match="softcap=0"):
        attention.capped_attention(q, k, v, softcap=0.0, scale=1.0)
    with pytest.raises(ValueError, match="window=0"):
        attention.capped_attention(q, k, v, softcap=1.0, scale=1.0, window=0)


def test_flash_options_are_checked() -> None:
    """The options the flash functions take by keyword: an unknown one, or no ``scale``, is a
    TypeError naming the function (``first`` belongs to the flash pair only)."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="capped_attention takes scale"):
        attention.capped_attention(q, q, q, softcap=1.0, scale=1.0, first=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="flash_attention takes scale"):
        attention.flash_attention(q, q, q, causal=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="flash_attention_backward takes scale"):
        attention.flash_attention_backward(q, q, q, q, q, q[..., 0], scale=1.0, cap=2.0)  # type: ignore[call-arg]


def _flash_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    window: int | None,
    first: int | None,
    slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The float64 attention (scale 0.3, two query heads per key/value head) of ``q, k, v`` under
    the causal/window rules with queries at ``first`` (None: aligned to the keys' end), with
    ALiBi's ``slopes`` times the key's offset from the query added to the scores: the output,
    the masked scores and which pairs may attend."""
    L, S = q.shape[-2], k.shape[-2]
    at = torch.arange(L)[:, None] + (S - L if first is None else first)
    j = torch.arange(S)[None, :]
    ok = torch.ones(L, S, dtype=torch.bool)
    if causal:
        ok &= j <= at
    if window is not None:
        ok &= (at - j).abs() < window
    kk, vv = (t.double().repeat_interleave(2, 1) for t in (k, v))
    scores = q.double() @ kk.transpose(-1, -2) * 0.3
    if slopes is not None:
        scores = scores + slopes.double().view(1, -1, 1, 1) * (j - at)
    scores = scores.masked_fill(~ok, -torch.inf)
    want = torch.softmax(scores, -1).nan_to_num(nan=0.0) @ vv
    return want, scores, ok


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
    want, scores, ok = _flash_reference(q, k, v, causal, window, first)
    grads = torch.autograd.grad((want * grad_out.double()).sum(), (q, k, v))
    rows = ok.any(-1)
    want_lse = torch.logsumexp(scores, -1)
    for blocks in ((8, 16), (5, 7), (64, 512)):
        options = {"scale": 0.3, "causal": causal, "window": window, "first": first}
        with torch.no_grad():
            out, lse = attention.flash_attention(q, k, v, blocks=blocks, **options)
            got = attention.flash_attention_backward(grad_out, q, k, v, out, lse, **options)
        assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
        assert_close(lse[..., rows].double(), want_lse[..., rows], atol=2e-6, rtol=2e-5)
        assert (lse[..., ~rows] == -torch.inf).all()
        for name, g, w in zip("qkv", got, grads, strict=True):
            assert_close(g.double(), w.double(), atol=2e-5, rtol=2e-5, msg=name)
    if not rows.all():  # rows without keys: exact zeros
        assert torch.equal(out[:, :, ~rows], torch.zeros_like(out[:, :, ~rows]))
        assert torch.equal(got[0][:, :, ~rows], torch.zeros_like(got[0][:, :, ~rows]))


@needs_capped
@pytest.mark.parametrize(
    ("dtype", "products"),
    [(torch.float32, "widened")] + [(torch.bfloat16, p) for p in attention.FLASH_PRODUCTS],
)
@pytest.mark.parametrize(
    ("L", "S", "causal", "window", "first"),
    [
        (37, 37, True, None, 0),
        (20, 45, True, None, None),
        (50, 60, True, 6, 10),
        (33, 41, False, None, 0),
    ],
)
def test_flash_alibi_slopes_follow_float64(
    dtype: torch.dtype,
    products: str,
    L: int,
    S: int,
    causal: bool,
    window: int | None,
    first: int | None,
) -> None:
    """ALiBi's bias, ``slope * (j - p)`` per query head, added in the kernel: the output, the
    log-sum-exp and the three gradients follow the float64 math with the bias in the scores
    (bf16: its tolerance, the gradients relative to each one's largest element)."""
    gen = torch.Generator().manual_seed(L + S)
    q = (2 * torch.randn(2, 4, L, 16, generator=gen)).to(dtype).requires_grad_()
    k = (2 * torch.randn(2, 2, S, 16, generator=gen)).to(dtype).requires_grad_()
    v = torch.randn(2, 2, S, 12, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(2, 4, L, 12, generator=gen).to(dtype)
    slopes = torch.tensor([0.5, 0.25, 0.125, 1.0])
    want, scores, ok = _flash_reference(q, k, v, causal, window, first, slopes)
    grads = torch.autograd.grad((want * grad_out.double()).sum(), (q, k, v))
    rows = ok.any(-1)
    bf16 = dtype == torch.bfloat16
    tol = {"atol": 3e-2, "rtol": 2e-2} if bf16 else {"atol": 2e-5, "rtol": 2e-5}
    options = {"scale": 0.3, "causal": causal, "window": window, "first": first}
    options["products"] = products
    with torch.no_grad():
        out, lse = attention.flash_attention(
            q, k, v, blocks=(8, 16), alibi_slopes=slopes, **options
        )
        got = attention.flash_attention_backward(
            grad_out, q, k, v, out, lse, blocks=(8, 16), alibi_slopes=slopes, **options
        )
        plain, _ = attention.flash_attention(q, k, v, blocks=(8, 16), **options)
    assert_close(out.double(), want, **tol)
    assert_close(lse[..., rows].double(), torch.logsumexp(scores, -1)[..., rows], **tol)
    for name, g, w in zip("qkv", got, grads, strict=True):
        atol = 1e-2 * w.abs().max().item() if bf16 else tol["atol"]
        assert_close(g.double(), w.double(), atol=atol, rtol=tol["rtol"], msg=name)
    assert (out - plain).abs().max() > 0.1  # (the bias moved the answer)


@needs_capped
def test_flash_alibi_slopes_are_checked() -> None:
    q = torch.randn(1, 2, 4, 8)
    for slopes, error, match in [
        (
            torch.ones(3),
            ValueError,
            r"alibi_slopes of shape \(2,\) \(one per query head\), got \(3,\)",
        ),
        (torch.tensor([1.0, float("nan")]), ValueError, "finite alibi_slopes"),
        (torch.ones(2, dtype=torch.int64), TypeError, "alibi_slopes as a float tensor"),
        ([0.5, 0.25], TypeError, "alibi_slopes as a float tensor"),
    ]:
        with pytest.raises(error, match=match):
            attention.flash_attention(q, q, q, scale=1.0, alibi_slopes=slopes)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="capped_attention takes scale"):
        attention.capped_attention(q, q, q, softcap=1.0, scale=1.0, alibi_slopes=torch.ones(2))  # type: ignore[call-arg]


@needs_capped
def test_flash_attention_widens_bf16_blocks() -> None:
    # bf16 inputs (for CPUs without bf16 units): the float32 math on the widened values, the
    # output rounded once; gradients in bf16 from float32 sums.
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad_out = (torch.randn(2, 4, 70, 16, generator=gen).bfloat16() for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    out, lse = attention.flash_attention(q, k, v, scale=0.25, causal=True, window=30)
    wide = [t.float() for t in (q, k, v)]
    out32, lse32 = attention.flash_attention(*wide, scale=0.25, causal=True, window=30)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(out, out32.bfloat16(), atol=8e-3, rtol=8e-3)
    assert_close(lse, lse32, atol=1e-6, rtol=1e-6)
    got = attention.flash_attention_backward(
        grad_out, q, k, v, out, lse, scale=0.25, causal=True, window=30
    )
    want = attention.flash_attention_backward(
        grad_out.float(), *wide, out.float(), lse, scale=0.25, causal=True, window=30
    )
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert_close(g, w.bfloat16(), atol=8e-3, rtol=8e-3)
    # ... and with Gemma 2's cap
    capped = attention.capped_attention(q, k, v, softcap=2.0, scale=0.25, causal=True)
    capped32 = attention.capped_attention(*wide, softcap=2.0, scale=0.25, causal=True)
    assert capped.dtype == torch.bfloat16
    assert_close(capped, capped32.bfloat16(), atol=8e-3, rtol=8e-3)


def _bf16_case(
    L: int, S: int, E: int, Ev: int, causal: bool, window: int | None, first: int | None, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """bf16 ``q, k, v`` (grouped-query heads), the float64 attention of their values and its
    log-sum-exp, and which queries have keys."""
    gen = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(2, 4, L, E, generator=gen)).bfloat16()
    k = (2 * torch.randn(2, 2, S, E, generator=gen)).bfloat16()
    v = torch.randn(2, 2, S, Ev, generator=gen).bfloat16()
    want, scores, ok = _flash_reference(q, k, v, causal, window, first)
    return q, k, v, want, torch.logsumexp(scores, -1), ok.any(-1)


def test_flash_bf16_products_are_found_where_torch_links_them() -> None:
    """Where torch links MKL's bf16 GEMM, the kernel's check of it passes (its calling
    convention and semantics are what csrc/flash.c assumes)."""
    if not attention.flash_available():
        pytest.skip("the flash kernels cannot run here")
    found = attention._gemm_bf16_address() is not None
    assert attention.flash_bf16_products_available() is found
    assert attention._gemm_bf16_address("attnkit_no_such_symbol") is None


@needs_capped
@pytest.mark.parametrize("products", attention.FLASH_PRODUCTS)
@pytest.mark.parametrize(
    ("L", "S", "E", "Ev", "causal", "window", "first"),
    [
        (37, 37, 24, 20, True, None, 0),  # blocks and tiles with tails
        (20, 45, 64, 64, True, None, None),  # bottom-right aligned queries, a model's head size
        (45, 20, 16, 12, True, None, None),  # the first queries attend no key: zero rows
        (130, 150, 24, 20, True, 40, 20),  # a causal window: key tiles skipped on both sides
        (70, 70, 16, 12, False, 9, None),  # a two-sided window
        (70, 70, 16, 12, False, None, None),
    ],
)
def test_flash_attention_bf16_follows_float64(
    products: str,
    L: int,
    S: int,
    E: int,
    Ev: int,
    causal: bool,
    window: int | None,
    first: int | None,
) -> None:
    # Either product: the scores and their softmax in float32, the output rounded to bf16 once
    # (with bf16 products the probabilities are rounded to bf16 too): bf16's tolerance.
    q, k, v, want, want_lse, rows = _bf16_case(L, S, E, Ev, causal, window, first, L * S + E)
    options = {"scale": 0.3, "causal": causal, "window": window, "first": first}
    for blocks in ((8, 16), (5, 7), (128, 512)):
        out, lse = attention.flash_attention(q, k, v, blocks=blocks, products=products, **options)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert_close(out.double(), want, atol=8e-3, rtol=8e-3)
        assert_close(lse[..., rows].double(), want_lse[..., rows], atol=2e-5, rtol=2e-5)
        assert (lse[..., ~rows] == -torch.inf).all()
        if not rows.all():  # rows without keys: exact zeros
            assert torch.equal(out[:, :, ~rows], torch.zeros_like(out[:, :, ~rows]))
    # Not vacuous: the masks change the output far beyond the tolerance.
    if not rows.all() or window is not None or causal:
        full = attention.flash_attention(q, k, v, scale=0.3, products=products)[0]
        assert (full.double() - want).abs().max() > 5e-2


@needs_capped
@pytest.mark.parametrize("products", attention.FLASH_PRODUCTS)
@pytest.mark.parametrize(
    ("L", "S", "causal", "window", "first"),
    [
        (37, 37, True, None, 0),  # blocks and tiles with tails
        (45, 20, True, None, None),  # the first queries attend no key: zero gradients
        (130, 150, True, 40, 20),  # a causal window: key blocks skipped on both sides
        (70, 70, False, None, None),
    ],
)
def test_flash_backward_bf16_follows_float64(
    products: str, L: int, S: int, causal: bool, window: int | None, first: int | None
) -> None:
    # Either product: float32 sums; with bf16 products the probabilities and score gradients
    # are rounded to bf16 for theirs. The gradients come back in bf16: bf16's tolerance of the
    # float64 gradients, relative to each one's largest element.
    q, k, v, _, _, rows = _bf16_case(L, S, 24, 20, causal, window, first, L + S)
    grad_out = torch.randn(2, 4, L, 20, generator=torch.Generator().manual_seed(L)).bfloat16()
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    want = _flash_reference(*wide, causal, window, first)[0]
    grads = torch.autograd.grad((want * grad_out.double()).sum(), wide)
    options = {"scale": 0.3, "causal": causal, "window": window, "first": first}
    for blocks in ((8, 16), (64, 512)):
        out, lse = attention.flash_attention(q, k, v, blocks=blocks, products=products, **options)
        got = attention.flash_attention_backward(
            grad_out, q, k, v, out, lse, blocks=blocks, products=products, **options
        )
        for name, g, w in zip("qkv", got, grads, strict=True):
            assert g.dtype == torch.bfloat16
            assert_close(g.double(), w, atol=1e-2 * w.abs().max().item(), rtol=2e-2, msg=name)
        if not rows.all():
            assert torch.equal(got[0][:, :, ~rows], torch.zeros_like(got[0][:, :, ~rows]))


@pytest.fixture(params=["bf16", "bf16-attnkit"])
def bf16_products(request: pytest.FixtureRequest) -> str:
    """Each bf16 tile product of the flash kernels (skipped where it does not run here)."""
    if request.param not in attention.flash_products():
        pytest.skip(f"products={request.param!r} do not run here")
    return str(request.param)


@needs_capped
def test_flash_backward_bf16_products_are_another_path(bf16_products: str) -> None:
    # Where they run, the backward's bf16 products round the probabilities and score gradients
    # (the widened path does not): the gradients differ, each within bf16's tolerance.
    q, k, v, _, _, _ = _bf16_case(300, 300, 64, 64, True, None, None, 9)
    grad_out = torch.randn(2, 4, 300, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    out, lse = attention.flash_attention(q, k, v, scale=0.3, causal=True)
    bf16, widened = (
        attention.flash_attention_backward(
            grad_out, q, k, v, out, lse, scale=0.3, causal=True, products=products
        )
        for products in (bf16_products, "widened")
    )
    for a, b in zip(bf16, widened, strict=True):
        assert not torch.equal(a, b)
        assert_close(a.double(), b.double(), atol=1e-2 * b.abs().max().item(), rtol=2e-2)


@needs_capped
def test_flash_attention_bf16_products_are_another_path(bf16_products: str) -> None:
    # Where they run, bf16 products round the probabilities (the widened path does not): some
    # outputs differ from the widened ones, within bf16's tolerance of float64.
    products = bf16_products
    q, k, v, want, _, _ = _bf16_case(300, 300, 64, 64, True, None, None, 7)
    bf16 = attention.flash_attention(q, k, v, scale=0.3, causal=True, products=products)[0]
    widened = attention.flash_attention(q, k, v, scale=0.3, causal=True, products="widened")[0]
    assert not torch.equal(bf16, widened)
    assert_close(bf16.double(), want, atol=8e-3, rtol=8e-3)
    # ... and with Gemma 2's cap, any thread count, a NaN query's row NaN and no other
    want_capped = _capped_attention_reference(q, k, v, 2.0, 0.3, True, None)
    q[0, 1, 100, 3] = torch.nan
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(
                attention.capped_attention(
                    q, k, v, softcap=2.0, scale=0.3, causal=True, products=products
                )
            )
    finally:
        torch.set_num_threads(before)
    bad = torch.zeros(2, 4, 300, dtype=torch.bool)
    bad[0, 1, 100] = True
    for got in outs:
        assert torch.equal(torch.isnan(got).any(-1), bad) and torch.isnan(got[bad]).all()
        assert_close(got[~bad].double(), want_capped[~bad], atol=8e-3, rtol=8e-3)
        assert_close(got, outs[0], atol=0, rtol=0, equal_nan=True)  # (one thread per block)


@needs_capped
@pytest.mark.parametrize("products", ["bf16", "bf16-attnkit"])
def test_flash_bf16_products_fall_back_where_they_cannot_run(
    monkeypatch: pytest.MonkeyPatch, products: str
) -> None:
    # MKL's products where torch links no bf16 GEMM, attnkit's on a CPU without bf16 pair dot
    # products: the widened path, bit for bit, and the policy neither picks nor times them.

    q, k, v, want, _, _ = _bf16_case(70, 90, 16, 12, True, 30, None, 11)
    widened, _ = attention.flash_attention(q, k, v, scale=0.3, causal=True, window=30)
    if products == "bf16":
        monkeypatch.setattr(attention, "_gemm_bf16_address", lambda name="": None)
    else:
        caps = dataclasses.replace(probe.capabilities(), flags=frozenset({"avx2", "fma"}))
        monkeypatch.setattr(attention, "capabilities", lambda: caps)
    attention._flash_gemm_bf16.cache_clear()
    attention._own_gemm_bf16.cache_clear()
    try:
        assert products not in attention.flash_products()
        out, _ = attention.flash_attention(
            q, k, v, scale=0.3, causal=True, window=30, products=products
        )
        assert torch.equal(out, widened)  # the widened path, bit for bit
        choice = policy.choices()["attention.flash_bf16_products"]
        assert choice.rule(probe.capabilities()) != products
        candidates = set(choice.candidates())  # type: ignore[misc]
        assert candidates == set(attention.flash_products()) and products not in candidates
    finally:
        monkeypatch.undo()
        attention._flash_gemm_bf16.cache_clear()
        attention._own_gemm_bf16.cache_clear()
    assert_close(widened.double(), want, atol=8e-3, rtol=8e-3)


def _own_gemm() -> Callable[..., None]:
    """attnkit's bf16 GEMM (csrc/bf16_gemm.c) as a ctypes function, or a skip where the CPU lacks
    its instructions."""
    address = attention._own_gemm_bf16()
    if address is None:
        pytest.skip("no bf16 pair dot products here")
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    kind = ctypes.CFUNCTYPE(
        None, i64, i64, i64, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64
    )
    return kind(address)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 1, 1), (7, 33, 5), (6, 32, 2), (13, 70, 63), (128, 96, 64), (5, 17, 0)]
)
def test_attnkits_bf16_gemm_follows_float64(
    trans_a: bool, trans_b: bool, m: int, n: int, k: int
) -> None:
    # C = alpha op(A) op(B) + beta C in row-major storage with padded rows, every transpose,
    # sizes off the register blocks and an odd or empty k: float32 sums of exact bf16 products,
    # so within float32 rounding of the float64 product; the padding columns stay untouched.
    gemm = _own_gemm()
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    a = torch.randn(*((k, m) if trans_a else (m, k)), generator=gen).bfloat16()
    b = torch.randn(*((n, k) if trans_b else (k, n)), generator=gen).bfloat16()
    a = torch.nn.functional.pad(a, (0, 3))  # (leading dimensions wider than the rows)
    b = torch.nn.functional.pad(b, (0, 5))
    op_a = (a[:, :m].T if trans_a else a[:, :k]).double()
    op_b = (b[:, :k].T if trans_b else b[:, :n]).double()
    for alpha, beta in ((1.0, 0.0), (0.125, 1.0), (2.0, -0.5)):
        c = torch.randn(m, n + 2, generator=gen)
        if beta == 0.0:
            c[:, :n] = torch.nan  # (beta 0 never reads C)
        before = c.clone()
        want = alpha * op_a @ op_b + (beta * before[:, :n].double() if beta else 0.0)
        gemm(
            101, 112 if trans_a else 111, 112 if trans_b else 111, m, n, k, alpha,
            a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), beta, c.data_ptr(), c.stride(0),
        )  # fmt: skip
        assert_close(c[:, :n].double(), want, atol=1e-5 * max(k, 1), rtol=1e-5)
        assert torch.equal(c[:, n:], before[:, n:])


def test_flash_bf16_products_choice_rule_and_override(monkeypatch: pytest.MonkeyPatch) -> None:

    name = "attention.flash_bf16_products"
    choice = policy.choices()[name]
    caps = probe.capabilities()
    assert choice.doc and set(choice.options) == set(attention.FLASH_PRODUCTS)
    # Before a measurement: MKL's on matrix tiles, attnkit's on pair dot products, MKL's on other
    # bf16 units, else widened; each only where it runs here.
    usable = attention.flash_products()
    if caps.matrix_tiles and "bf16" in usable:
        want = "bf16"
    elif caps.bf16_pairs and "bf16-attnkit" in usable:
        want = "bf16-attnkit"
    else:
        want = "bf16" if caps.bf16_dot and "bf16" in usable else "widened"
    assert choice.rule(caps) == want
    for option in choice.options:
        monkeypatch.setenv(policy.env_var(name), option)
        assert policy.flash_bf16_products() == option
    monkeypatch.setenv(policy.env_var(name), "fp8")
    with pytest.raises(ValueError, match="fp8"):
        policy.flash_bf16_products()


@needs_capped
def test_flash_attention_takes_strided_views_and_gets_clear_errors() -> None:
    gen = torch.Generator().manual_seed(4)
    # (documents, L, H, E) storage seen as (documents, H, L, E), as attnkit.blockwise's tiles
    q, k, v, grad_out = (torch.randn(3, 40, 2, 8, generator=gen).transpose(1, 2) for _ in range(4))
    out, lse = attention.flash_attention(q, k, v, scale=0.5, causal=True, blocks=(16, 16))
    got = attention.flash_attention_backward(grad_out, q, k, v, out, lse, scale=0.5, causal=True)
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
    back = attention.flash_attention_backward(
        grad_out, q, k, v, out, lse, scale=0.5, causal=True, into=tuple(sums)
    )
    assert all(a is b for a, b in zip(back, sums, strict=True))
    for total, start, g in zip(sums, before, got, strict=True):
        assert_close(total, start + g, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="into"):
        attention.flash_attention_backward(
            grad_out, q, k, v, out, lse, scale=0.5, into=(sums[0].double(), *sums[1:])
        )
    with pytest.raises(TypeError, match="float32"):
        attention.flash_attention(q.double(), k, v, scale=1.0)
    with pytest.raises(ValueError, match=r"H % K"):
        attention.flash_attention(q, k[:, :, :, :4], v, scale=1.0)
    with pytest.raises(ValueError, match="lse"):
        attention.flash_attention_backward(grad_out, q, k, v, out, lse[:, :1], scale=0.5)
    with pytest.raises(ValueError, match="products='fp16'"):
        attention.flash_attention(q, k, v, scale=0.5, products="fp16")


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
            out, flags = one_query.one_query_attention(q, k, v, mask, E**-0.5, softcap=cap)
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
    out, flags = one_query.one_query_attention(q, k, v, mask, 8**-0.5)
    assert flags == one_query.NO_KEY and torch.equal(out[1], torch.zeros(4, 1, 8))
    assert_close(out[0].double(), _one_query_reference(q, k, v, mask)[0], atol=1e-5, rtol=1e-5)
    # A NaN key the mask leaves out is never read; one it allows makes its head's rows NaN.
    mask[1] = True
    mask[:, ..., 3] = False
    k[0, 1, 3, 0] = torch.nan
    out, flags = one_query.one_query_attention(q, k, v, mask, 8**-0.5)
    assert flags == 0 and torch.isfinite(out).all()
    k[0, 1, 4, 0] = torch.nan
    out, flags = one_query.one_query_attention(q, k, v, mask, 8**-0.5)
    assert flags == one_query.NON_FINITE
    assert torch.isnan(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    assert torch.isfinite(out[1]).all()
    # With a cap an infinite score is flagged too (capped it would look finite).
    k[0, 1, 4, 0] = 0.0
    k[1, 0, 2, 0] = -torch.inf
    out, flags = one_query.one_query_attention(q, k, v, mask, 8**-0.5, softcap=3.0)
    assert flags == one_query.NON_FINITE
    assert torch.isnan(out[1, :2]).all() and torch.isfinite(out[0]).all()


@needs_kernel
def test_one_query_attention_ignores_threads_and_gets_clear_errors() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 8, 1, 64, generator=gen), *torch.randn(2, 4, 2, 700, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = one_query.one_query_attention(q, k, v, None, 0.125)[0]
        torch.set_num_threads(2)
        two = one_query.one_query_attention(q, k, v, None, 0.125)[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    with pytest.raises(TypeError, match="bfloat16 or all float32"):
        one_query.one_query_attention(q.double(), k, v, None, 1.0)
    with pytest.raises(TypeError, match="bool mask"):
        one_query.one_query_attention(q, k, v, torch.zeros(4, 1, 1, 700), 1.0)
    with pytest.raises(ValueError, match="H % K == 0"):
        one_query.one_query_attention(q[:, :3], k, v, None, 1.0)
    with pytest.raises(ValueError, match="mask"):
        one_query.one_query_attention(q, k, v, torch.ones(4, 1, 1, 5, dtype=torch.bool), 1.0)
