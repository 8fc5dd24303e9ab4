"""The chunked kernel for soft-capped scores (:mod:`attnkit.softcap`) against float64 math.

The property test draws the same random problems as ``tests/test_properties.py`` (shapes with
``L != S``, grouped-query heads, empty dims, bool and float masks, every structure option) and
runs them in chunks of 1-3 queries, so that chunk boundaries, skipped chunks, cut spans and rows
without keys all occur; outputs, weights and gradients must equal the textbook math in float64.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnkit import masks as M
from attnkit.functional import attend
from attnkit.functional import scaled_dot_product_attention as sdpa
from attnkit.kernels import attention as attention_kernels
from attnkit.kernels import build, policy
from attnkit.kernels.policy import CAPPED_CHUNK_SCORES, CAPPED_MAX_ROWS
from attnkit.kernels.policy import capped_chunk_rows as chunk_rows
from attnkit.softcap import capped_attention
from tests.reference import loop_mask, reference_attention
from tests.test_properties import PROFILE, TOL, Case, cases


def capped(q, k, v, mask, rules, **kw):
    """capped_attention on the kernel the policy picks for these inputs."""
    eager = build.eager_cpu(q)
    call = policy.AttentionCall(
        dtype=q.dtype,
        device=q.device.type,
        L=q.shape[-2],
        S=k.shape[-2],
        causal=rules.causal,
        window=rules.window,
        batched=rules.batched,
        masked=mask is not None,
        weights=kw.get("return_weights", False),
        dropout=kw.get("dropout_p", 0.0) > 0.0,
        softcap=True,
        grads=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        eager=eager,
        ready=eager and attention_kernels.flash_available(),
    )
    return capped_attention(q, k, v, mask, rules, kernel=policy.capped_kernel(call), **kw)


@pytest.fixture(params=["kernel", "chunks"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int] | None:
    """Without gradients: attnkit's whole-attention kernel (returns the list its calls append
    to), or the chunked torch path that runs where it cannot (returns None)."""
    if request.param == "chunks":
        monkeypatch.setattr(attention_kernels, "flash_available", lambda: False)
        return None
    if not attention_kernels.flash_available():
        pytest.skip("capped_attention cannot run here")
    calls: list[int] = []
    kernel = attention_kernels.capped_attention
    monkeypatch.setattr(
        attention_kernels, "capped_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    )
    return calls


@settings(PROFILE, max_examples=150)
@given(
    case=cases(dtypes=(torch.float32, torch.float64), grad=True),
    rows=st.integers(1, 3),
    cap=st.sampled_from([0.5, 2.0, 30.0]),
    grad=st.booleans(),
)
def test_chunks_equal_the_float64_reference(case: Case, rows: int, cap: float, grad: bool) -> None:
    atol, rtol = TOL[case.q.dtype]
    q, k, v = case.inputs()
    B, L, S = q.shape[0], q.shape[-2], k.shape[-2]
    rules = M.Structure(**case.structure)
    rules.check(L, S, batch=B)
    scale = 1 / math.sqrt(q.shape[-1])
    with torch.set_grad_enabled(grad):  # without: the in-place path on one buffer
        out, weights = capped(
            q, k, v, case.mask, rules, softcap=cap, scale=scale, return_weights=True, rows=rows
        )
    ref, ref_w = reference_attention(q, k, v, case.allowed, bias=case.bias, softcap=cap)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert_close(out.double(), ref, atol=atol, rtol=rtol)
    assert weights is not None
    assert_close(weights.double(), ref_w.expand_as(weights), atol=atol, rtol=rtol)
    seen = case.allowed.any(-1, keepdim=True)  # rows that attend anything; the others are 0
    assert torch.where(seen, 0.0, out.detach()).eq(0).all()
    if not grad:
        return
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g.to(out.dtype), allow_unused=True)
    want = torch.autograd.grad(ref, (q, k, v), g, allow_unused=True)
    for name, a, b, t in zip("qkv", got, want, (q, k, v), strict=True):
        a = torch.zeros_like(t) if a is None else a
        b = torch.zeros_like(t) if b is None else b
        assert torch.isfinite(a).all(), name
        assert_close(a.double(), b.double(), atol=10 * atol, rtol=10 * rtol, msg=name)


@pytest.mark.parametrize(
    ("L", "S", "heads", "structure"),
    [
        (300, 300, (4, 4), {"causal": True}),  # several chunks, diagonal cut in each
        (150, 300, (4, 2), {"causal": True}),  # bottom-right aligned queries, grouped heads
        (300, 300, (2, 1), {"causal": True, "window": 37}),  # spans cut on both sides
        (200, 260, (2, 2), {"window": 25}),  # a two-sided window
        (1, 300, (4, 1), {"causal": True}),  # a decoding step with grouped heads
        (1, 300, (2, 2), {"causal": True}),  # a decoding step, one query per key head
    ],
)
def test_attend_with_softcap_equals_the_reference_at_several_chunks(L, S, heads, structure, path):
    H, K = heads
    g = torch.Generator().manual_seed(L + S)
    q = (4 * torch.randn(2, H, L, 16, generator=g)).requires_grad_()
    k = (4 * torch.randn(2, K, S, 16, generator=g)).requires_grad_()
    v = torch.randn(2, K, S, 16, generator=g).requires_grad_()
    allowed = loop_mask(L, S, **structure)
    ref, ref_w = reference_attention(q, k, v, allowed, softcap=5.0)
    out, weights = sdpa(q, k, v, softcap=5.0, return_weights=True, **structure)
    assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    assert_close(weights.double(), ref_w, atol=2e-5, rtol=1e-4)
    with torch.no_grad():  # attnkit's kernel, or the in-place chunks
        assert_close(sdpa(q, k, v, softcap=5.0, **structure).double(), ref, atol=2e-5, rtol=1e-4)
    assert path is None or bool(path) == (L > 1)  # (a decoding step has its own path)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, exp in zip(grads, want, strict=True):
        assert_close(got.double(), exp.double(), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("shape", [(2, 1, 1, 40), (1, 1, 40, 1)])
@pytest.mark.parametrize("grad", [False, True])
def test_masks_broadcast_over_queries_or_keys_cover_every_chunk(shape, grad):
    # A key-padding mask (one row for all queries) or a per-query mask (one column for all keys),
    # over several chunks of a sliding window: each chunk takes its rows and keys of the mask.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=g).requires_grad_(grad) for _ in range(3))
    mask = torch.rand(shape, generator=g) > 0.3
    mask[..., :1, :1] = True
    rules = M.Structure(causal=True, window=6)
    out, _ = capped(q, k, v, mask, rules, softcap=2.0, scale=8**-0.5, rows=16)
    allowed = loop_mask(40, 40, causal=True, window=6) & mask
    ref, _ = reference_attention(q, k, v, allowed, softcap=2.0)
    assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 90, 8, generator=g).to(dtype) for _ in range(3))
    out = attend(q, k, v, causal=True, window=20, softcap=1.5)[0]
    ref, _ = reference_attention(q, k, v, loop_mask(90, 90, causal=True, window=20), softcap=1.5)
    assert out.dtype == dtype
    assert_close(out.double(), ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("kernel", [True, False])
def test_a_window_never_reads_the_keys_outside_its_span(kernel, monkeypatch):
    # Cost follows the allowed pairs: a chunk (the kernel's block of queries) reads only the keys
    # its queries may attend. NaN keys and values far outside every window would poison any
    # chunk that read them (the kernel itself does not guard against non-finite inputs;
    # functional does).
    if not kernel:
        monkeypatch.setattr(attention_kernels, "flash_available", lambda: False)
    g = torch.Generator().manual_seed(0)
    L, window = 384, 16
    rows = chunk_rows(2, 2 * window + 16, L, window)  # the chunked path's default here
    assert L % rows == 0
    q, k, v = (torch.randn(1, 2, L, 8, generator=g) for _ in range(3))
    late = torch.arange(L) >= L - rows  # the last chunk's queries...
    far = slice(0, L - rows - window + 1)  # ...and the keys before its span
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[..., far, :] = float("nan")
    v_bad[..., far, :] = float("nan")
    rules = M.Structure(causal=True, window=window)
    call = functools.partial(capped_attention, softcap=3.0, scale=0.3, rows=rows)
    with torch.no_grad():
        out, _ = call(q, k_bad, v_bad, None, rules)
        clean, _ = call(q, k, v, None, rules)
    assert torch.isfinite(out[..., late, :]).all()
    assert torch.equal(out[..., late, :], clean[..., late, :])
    # ... and with a NaN inside the last chunk's span, that chunk is poisoned: the test can fail.
    k_bad[..., L - 2, :] = float("nan")
    with torch.no_grad():
        out, _ = call(q, k_bad, v_bad, None, rules)
    assert torch.isnan(out[..., L - 1, :]).all()


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("grad", [False, True])
def test_non_finite_keys_follow_the_rules_of_functional(value, grad):
    # attend keeps its NaN/inf rules with a cap: a non-finite key poisons exactly the rows that
    # may attend it (a capped infinite score is finite, so the zeroed key cannot stand in for
    # it), with or without gradients.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 8, generator=g) for _ in range(3))
    k[0, 1, 150, 3] = value
    q.requires_grad_(grad)
    out = attend(q, k, v, causal=True, window=30, softcap=2.0)[0]
    reach = torch.zeros(1, 2, 200, dtype=torch.bool)
    reach[0, 1, 150:180] = True  # head 1, queries 150 .. 150 + window - 1
    assert torch.equal(torch.isnan(out).any(-1), reach)


def test_chunk_rows_bounds_the_buffer():
    assert chunk_rows(8, 1024, 4096) == CAPPED_MAX_ROWS
    assert chunk_rows(8, 32768, 4096) == 16  # 8 * 16 * 32768 scores: the floor
    assert chunk_rows(1, 10, 5) == 5  # never more than the queries
    assert chunk_rows(64, 2048, 4096) * 64 * 2048 <= CAPPED_CHUNK_SCORES
    assert chunk_rows(8, 512, 4096, window=256) == 64  # a quarter of the window
    assert chunk_rows(8, 512, 4096, window=16) == 16  # never below the floor


@pytest.mark.parametrize("window", [None, 10])
@pytest.mark.parametrize(("at", "value"), [(None, 0.0), (45, float("nan")), (5, float("inf"))])
def test_a_decoding_step_keeps_the_rules(window, at, value):
    # L = 1 without gradients takes the few-call step; a non-finite key it reads sends it back to
    # the general path (its head's rows NaN), one outside the window is never read.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 50, 8, generator=g, dtype=torch.float64) for _ in range(2))
    clean = k.clone()
    if at is not None:
        k[1, 0, at, 2] = value
    with torch.no_grad():
        out = attend(q, k, v, causal=True, window=window, softcap=2.0)[0]
    allowed = loop_mask(1, 50, causal=True, window=window)
    ref, _ = reference_attention(q, clean, v, allowed, softcap=2.0)
    reached = at is not None and bool(allowed[..., at].any())
    nan_rows = torch.zeros(2, 4, 1, dtype=torch.bool)
    nan_rows[1, :2] = reached  # query heads 0 and 1 read key/value head 0
    assert torch.equal(torch.isnan(out).any(-1), nan_rows)
    assert_close(out[~nan_rows], ref[~nan_rows], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("structure", [{"causal": True}, {"causal": True, "window": 24}, {}])
def test_known_finite_inputs_skip_only_the_nan_pass(structure, path):
    # finite=True drops the pass that turns an infinite raw score into NaN: finite inputs give
    # the same numbers as the float64 math, and a raw score that overflows is capped to c (as
    # tanh does) instead of poisoning its row.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 150, 16, generator=g) for _ in range(3))
    rules = M.Structure(**structure)
    allowed = loop_mask(150, 150, **structure)
    ref, _ = reference_attention(q, k, v, allowed, softcap=3.0)
    with torch.no_grad():
        for finite in (False, True):
            out, _ = capped(q, k, v, None, rules, softcap=3.0, scale=0.25, finite=finite)
            assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        assert path is None or path
        big = q.clone()
        big[1, 2, 100] = 3e38  # finite, but most of its scores overflow float32
        out, _ = capped(big, k, v, None, rules, softcap=3.0, scale=1.0, finite=True)
        guarded, _ = capped(big, k, v, None, rules, softcap=3.0, scale=1.0)
    assert torch.isnan(guarded[1, 2, 100]).all()
    # The overflowing row is a finite average of the values (which scores saturate depends on
    # float32 partial sums, so no float64 reference); every other row is the math's.
    assert torch.isfinite(out).all()
    assert (out[1, 2, 100].abs() <= v[1, 2].abs().amax(0)).all()
    want, _ = reference_attention(big, k, v, allowed, scale=1.0, softcap=3.0)
    other = torch.ones(2, 4, 150, dtype=torch.bool)
    other[1, 2, 100] = False
    assert_close(out[other].double(), want[other], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("L", [200, 3])
@pytest.mark.parametrize("grad", [False, True])
def test_a_non_finite_query_poisons_its_own_row(value, L, grad, path):
    # With many queries (or gradients) attend searches k and v first and, for a finite q, skips
    # the kernel's inf -> NaN pass; a non-finite query keeps it (an infinite score capped to c
    # would hide the query); with few queries the output check finds it.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, L, 8, generator=g)
    k, v = (torch.randn(1, 2, 200, 8, generator=g) for _ in range(2))
    clean = attend(q.clone().requires_grad_(grad), k, v, causal=True, softcap=2.0)[0].detach()
    q[0, 1, L - 2, 5] = value
    out = attend(q.requires_grad_(grad), k, v, causal=True, softcap=2.0)[0].detach()
    bad = torch.zeros(1, 2, L, dtype=torch.bool)
    bad[0, 1, L - 2] = True
    assert torch.equal(torch.isnan(out).any(-1), bad)
    assert torch.equal(out[~bad], clean[~bad])
    assert path is None or bool(path) == (L > 1 and not grad)
