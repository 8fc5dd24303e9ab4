"""attnkit.blockwise equals float64 attention under the dense mask: values and gradients.

The kernel is called directly (``attend_runs`` on a ``plan_runs`` plan), except where non-finite
inputs are involved: keeping them from the queries that may not attend them is
:mod:`attnkit.functional`'s job, tested through :func:`attnkit.sparse.block_sparse_attention`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.blockwise import TileRun, attend_runs, plan_runs
from attnkit.functional import block_sparse_attention
from attnkit.functional import scaled_dot_product_attention as sdpa
from attnkit.kernels import attention as attention_kernels
from attnkit.kernels import build, policy
from attnkit.kernels.probe import capabilities
from attnkit.masks import Structure
from tests.reference import loop_mask, reference_attention


def call_of(q, *, causal=True, window=None):
    """What the policy reads of a causal/window call on ``q``."""
    eager = build.eager_cpu(q)
    return policy.AttentionCall(
        dtype=q.dtype,
        device=q.device.type,
        L=q.shape[-2],
        S=q.shape[-2],
        causal=causal,
        window=window,
        grads=torch.is_grad_enabled() and q.requires_grad,
        eager=eager,
        ready=eager and attention_kernels.flash_available(),
    )


def native_low_precision(dtype, *, backward=True):
    return policy.torch_low_precision(dtype, backward=backward)


def attnkit_flash(q):
    """The policy's choice between attnkit's flash kernels and torch's for ``q``."""
    return policy.flash_kernel(call_of(q))


def blockwise_attention(q, k, v, *, rows=None, scale=None, dropout_p=0.0, **structure):
    """The kernel on ``(B, H, L, E)`` inputs: plan, then run, on the kernels the policy picks."""
    B, _, L, E = q.shape
    runs = plan_runs(B, L, k.shape[2], Structure(**structure), rows=rows)
    scale = 1 / math.sqrt(E) if scale is None else scale
    kernels = policy.tile_kernels(call_of(q))
    return attend_runs(q, k, v, runs, scale=scale, dropout_p=dropout_p, kernels=kernels)


def documents(B, S, gen, max_docs=4, scramble=False):
    """(B, S) ids of random-length documents; ``scramble`` lets an id occur in pieces."""
    rows = []
    for _ in range(B):
        n = int(torch.randint(0, max_docs, (), generator=gen))
        cuts = torch.randperm(max(S - 1, 0), generator=gen)[:n] + 1
        starts = torch.zeros(S, dtype=torch.long)
        starts[cuts] = 1
        ids = starts.cumsum(0) * 7  # ids need not be 0..n-1
        rows.append(ids % 14 if scramble else ids)
    return torch.stack(rows)


def qkv(B, H, K, L, S, E=8, Ev=None, dtype=torch.float64, layout="bhle"):
    """Inputs that require grad; ``layout="blhe"`` gives the (B, L, H, E) memory of a projection."""

    def make(n, heads, e):
        if layout == "blhe":
            return torch.randn(B, n, heads, e, dtype=dtype).transpose(1, 2).requires_grad_()
        return torch.randn(B, heads, n, e, dtype=dtype, requires_grad=True)

    return make(L, H, E), make(S, K, E), make(S, K, Ev or E)


def check(q, k, v, allowed, *, atol=1e-10, rtol=1e-7, **kw):
    """Values and all three gradients against the float64 reference; returns them."""
    out = blockwise_attention(q, k, v, **kw)
    ref, _ = reference_attention(q, k, v, allowed, scale=kw.get("scale"))
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w.double(), atol=atol, rtol=rtol)
    return out, got


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2),
    heads=st.sampled_from([(1, 1), (4, 2), (4, 1)]),
    S=st.integers(1, 48),
    dL=st.integers(-8, 40),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 60)),
    docs=st.sampled_from(["none", "contiguous", "scrambled"]),
    pad=st.booleans(),
    rows=st.integers(1, 20),
    Ev=st.sampled_from([None, 5]),  # Ev != E takes the torch-SDPA executor
    seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(B, heads, S, dL, causal, window, docs, pad, rows, Ev, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    seg = None if docs == "none" else documents(B, S, gen, scramble=docs == "scrambled")
    L = max(1, S - dL) if seg is None else max(1, min(S, S - dL))  # documents need L <= S
    lengths = torch.randint(0, S + 1, (B,), generator=gen) if pad else None
    kw = dict(causal=causal, window=window, segment_ids=seg, key_lengths=lengths)
    H, K = heads
    check(*qkv(B, H, K, L, S, Ev=Ev), loop_mask(L, S, **kw), rows=rows, **kw)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2),
    heads=st.sampled_from([(1, 1), (4, 2), (4, 1)]),
    S=st.integers(1, 150),
    dL=st.integers(-8, 40),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 60)),
    docs=st.sampled_from(["none", "contiguous", "scrambled"]),
    pad=st.booleans(),
    rows=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_float32_on_attnkits_flash_kernels_matches_float64(
    B, heads, S, dL, causal, window, docs, pad, rows, seed
):
    # float32 runs attnkit's flash kernels where they apply: a whole causal/window sequence
    # (attend_positional), and the unmasked runs (documents' causal squares) of the tile plan.
    gen = torch.Generator().manual_seed(seed)
    seg = None if docs == "none" else documents(B, S, gen, scramble=docs == "scrambled")
    L = max(1, S - dL) if seg is None else max(1, min(S, S - dL))
    lengths = torch.randint(0, S + 1, (B,), generator=gen) if pad else None
    kw = dict(causal=causal, window=window, segment_ids=seg, key_lengths=lengths)
    q, k, v = (t.detach().float().requires_grad_() for t in qkv(B, *heads, L, S))
    out = block_sparse_attention(q, k, v, block_size=rows, **kw)
    ref, _ = reference_attention(q, k, v, loop_mask(L, S, **kw))
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.float())
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=0)


def test_positional_structures_in_float32_are_one_call_of_attnkits_kernel(monkeypatch):
    if not attention_kernels.flash_available():
        pytest.skip("attnkit's flash kernels cannot run here")
    calls = []
    kernel = attention_kernels.flash_attention
    monkeypatch.setattr(
        attention_kernels, "flash_attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw)
    )
    q, k, v = (t.detach().float() for t in qkv(2, 4, 2, 300, 300, E=16))
    out = block_sparse_attention(q, k, v, causal=True, window=20)
    ref, _ = reference_attention(q, k, v, loop_mask(300, 300, causal=True, window=20))
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    assert [(c["causal"], c["window"]) for c in calls] == [(True, 20)]
    # float64, dropout and documents keep the tile runs on torch's kernel (documents' causal
    # squares: attnkit's kernel per run, no window)
    assert not attnkit_flash(q.double())
    whole = call_of(q, window=20)
    assert policy.attention_path(whole) == "flash"
    assert policy.attention_path(dataclasses.replace(whole, dropout=True)) != "flash"
    assert policy.attention_path(dataclasses.replace(whole, batched=True)) != "flash"
    seg = (torch.arange(300) // 100).expand(2, 300)
    calls.clear()
    block_sparse_attention(q, k, v, causal=True, segment_ids=seg)
    assert calls and all(c["first"] == 0 and c.get("window") is None for c in calls)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True, window=16),
        dict(causal=True, segment_ids=torch.tensor([[0] * 30 + [1] * 41 + [2] * 29])),
        dict(window=9, key_lengths=torch.tensor([77])),
    ],
)
def test_low_precision_matches_float64(dtype, atol, kw):
    # L = 100 is no multiple of the 64-row tiles; the layout is that of a projection.
    q, k, v = qkv(1, 4, 2, 100, 100, E=16, dtype=dtype, layout="blhe")
    out, grads = check(q, k, v, loop_mask(100, 100, **kw), atol=atol, rtol=atol, rows=64, **kw)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)


@pytest.mark.parametrize("layout", ["bhle", "blhe"])
@pytest.mark.parametrize(
    "B, kw",
    [
        (1, dict(causal=True, segment_ids=(torch.arange(64) // 16).view(1, 64))),
        (1, dict(segment_ids=(torch.arange(64) // 32).view(1, 64))),
        (3, dict(causal=True)),  # one tile per batch element
        (1, dict(key_lengths=torch.tensor([50]))),  # queries in order, keys cut short
    ],
)
def test_single_ordered_run_returns_the_kernel_results_as_views(layout, B, kw):
    # One run whose tiles cover the queries in order: no output buffer, copies or additions.
    runs = plan_runs(B, 64, 64, Structure(**kw), rows=64 if "segment_ids" not in kw else None)
    assert len(runs) == 1
    for dtype, atol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        q, k, v = qkv(B, 4, 2, 64, 64, dtype=dtype, layout=layout)
        check(q, k, v, loop_mask(64, 64, **kw), atol=atol, rtol=atol, rows=runs[0].rows, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_without_native_units_is_float32_rounded(dtype):
    kw = dict(causal=True, segment_ids=torch.tensor([[0] * 40 + [1] * 60]))
    q, k, v = qkv(1, 4, 2, 100, 100, E=16, dtype=dtype, layout="blhe")
    out = blockwise_attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = blockwise_attention(*wide, **kw)
    ref_grads = torch.autograd.grad(ref, wide, torch.ones_like(ref))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    if native_low_precision(dtype):  # the kernel's own low-precision path: close, not equal
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    elif dtype == torch.bfloat16 and attention_kernels.flash_available():
        # attnkit's kernels widen bf16 blocks in place of the float32 copies: the same float32
        # math (its products may round differently), rounded once: within one bf16 step. The
        # backward reads the bf16 output (the forward's result), not a float32 one.
        torch.testing.assert_close(out.float(), ref, atol=1e-3, rtol=8e-3)
        for g, w in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g.float(), w, atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(out, ref.to(dtype))
        for g, w in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, w.to(dtype))


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True, window=40),
        dict(causal=True, segment_ids=torch.tensor([[0] * 90 + [1] * 150 + [2] * 60])),
        dict(segment_ids=torch.tensor([[0] * 90 + [1] * 150 + [2] * 60]), window=70),
    ],
)
def test_bf16_forward_error_within_twice_torchs_fused_kernel(kw):
    # Without gradients bf16 runs torch's bf16 kernel on every CPU; its error against float64
    # is held to twice that of torch's fused kernel on the dense mask (same inputs).
    q, k, v = (t.detach() for t in qkv(2, 4, 4, 300, 300, E=32, layout="blhe"))
    allowed = loop_mask(300, 300, **kw)
    ref, _ = reference_attention(q, k, v, allowed)
    low = [t.bfloat16() for t in (q, k, v)]
    with torch.no_grad():
        out = blockwise_attention(*low, **kw)
        fused = torch.nn.functional.scaled_dot_product_attention(*low, attn_mask=allowed)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs().max().item()
    fused_err = (fused.double() - ref).abs().max().item()
    assert 0 < err <= 2 * fused_err


def test_bf16_forward_of_equal_documents_is_one_kernel_call():
    # Equal causal documents are one kernel call: bit for bit attnkit's kernel on the bf16
    # inputs (its float32 result rounded, its products the measured choice) where the rule picks
    # it (a forward alone: every CPU without AMX), else torch's bf16 causal SDPA per document.
    q, k, v = (t.detach().bfloat16() for t in qkv(1, 4, 4, 256, 256, E=32, layout="blhe"))
    seg = (torch.arange(256) // 64).view(1, 256)
    with torch.no_grad():
        out = blockwise_attention(q, k, v, causal=True, segment_ids=seg)
        docs = [tuple(t[:, :, i : i + 64] for t in (q, k, v)) for i in range(0, 256, 64)]
        if not attnkit_flash(q):
            per_doc = [F.scaled_dot_product_attention(*doc, is_causal=True) for doc in docs]
        else:
            per_doc = [
                attention_kernels.flash_attention(
                    *(t.contiguous() for t in doc),
                    scale=32**-0.5,
                    causal=True,
                    products=policy.flash_bf16_products(),
                )[0]
                for doc in docs
            ]
    assert torch.equal(out, torch.cat(per_doc, dim=2))


@pytest.mark.parametrize("L, S", [(37, 37), (13, 50), (50, 13), (64, 200)])
@pytest.mark.parametrize("window", [1, 5, 64, 400])
def test_odd_sizes_and_windows(L, S, window):
    # Bottom-right alignment for L != S; window 1 (only itself) and windows >= S (no cut).
    kw = dict(causal=True, window=window)
    q, k, v = qkv(2, 2, 1, L, S, layout="blhe")
    out, _ = check(q, k, v, loop_mask(L, S, **kw), rows=16, **kw)
    if L > S:  # queries before every key see nothing
        assert (out[:, :, : L - S] == 0).all()


def test_default_tiles_on_long_inputs_match_float64():
    # The tile heights the dispatch uses (64 for windows, 1024 otherwise), with a ragged end.
    L = S = 1100
    seg = torch.tensor([[0] * 300 + [1] * 700 + [2] * 100])
    for kw in (dict(causal=True, window=100), dict(causal=True, segment_ids=seg)):
        q, k, v = qkv(1, 2, 2, L, S, E=4, dtype=torch.float32, layout="blhe")
        check(q, k, v, loop_mask(L, S, **kw), atol=2e-5, rtol=1e-4, **kw)


def test_fully_masked_rows_and_batches_are_zero_with_zero_grads():
    q, k, v = qkv(2, 4, 2, 10, 10)
    lengths = torch.tensor([0, 6])  # batch 0 has no key at all
    seg = torch.tensor([[0] * 10, [0] * 4 + [1] * 6])
    kw = dict(key_lengths=lengths, segment_ids=seg, causal=True)
    out, (gq, gk, gv) = check(q, k, v, loop_mask(10, 10, **kw), rows=3, **kw)
    assert (out[0] == 0).all() and (gq[0] == 0).all() and (gk[0] == 0).all()
    assert (gv[0] == 0).all() and (gk[1, :, 6:] == 0).all() and (gv[1, :, 6:] == 0).all()


@pytest.mark.parametrize("Ev", [8, 5])
def test_nothing_allowed_anywhere_gives_zeros_and_zero_grads(Ev):
    q, k, v = qkv(1, 2, 2, 6, 6, Ev=Ev)
    out = blockwise_attention(q, k, v, key_lengths=torch.tensor([0]))
    assert out.shape == (1, 2, 6, Ev) and (out == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and (t.grad == 0).all()


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("Ev", [8, 5])
def test_nan_in_masked_out_keys_does_not_leak(where, Ev):
    # Document 0 is keys 0-9, document 1 keys 10-19; padding from key 18 on. A NaN in
    # document 0 or in padding must not reach document 1, nor the padded key the others.
    seg = torch.tensor([[0] * 10 + [1] * 10])
    kw = dict(segment_ids=seg, key_lengths=torch.tensor([18]), causal=True)
    q, k, v = qkv(1, 2, 1, 20, 20, Ev=Ev)
    with torch.no_grad():
        t = {"k": k, "v": v}[where]
        t[0, 0, 4, 0] = float("nan")  # attended by queries 4-9 only
        t[0, 0, 19, 0] = float("nan")  # padding: attended by nobody
    out = block_sparse_attention(q, k, v, block_size=16, **kw)  # one tile spans both documents
    reached = torch.isnan(out[0, :, 4:10])
    ref, _ = reference_attention(q, k.nan_to_num(), v.nan_to_num(), loop_mask(20, 20, **kw))
    if where == "k":  # a NaN score: the whole row
        assert reached.all()
    else:  # a NaN value: its own column only
        assert reached[..., 0].all() and not reached[..., 1:].any()
        torch.testing.assert_close(out[0, :, 4:10, 1:], ref[0, :, 4:10, 1:], atol=1e-10, rtol=1e-7)
    clean = torch.ones(20, dtype=torch.bool)
    clean[4:10] = False
    torch.testing.assert_close(out[0, :, clean], ref[0, :, clean], atol=1e-10, rtol=1e-7)
    grads = torch.autograd.grad(out[0, :, clean].sum(), (q, k, v))  # nor reach the gradients
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():  # inference takes another guard
        torch.testing.assert_close(block_sparse_attention(q, k, v, block_size=16, **kw), out,
                                   equal_nan=True)  # fmt: skip


def test_nan_in_window_key_reaches_exactly_the_window():
    q, k, v = qkv(1, 1, 1, 40, 40)
    with torch.no_grad():
        v[0, 0, 10, 3] = float("nan")
    out = block_sparse_attention(q, k, v, causal=True, window=4, block_size=8)
    nan_rows = torch.isnan(out[0, 0]).any(-1)
    assert nan_rows.nonzero().flatten().tolist() == [10, 11, 12, 13]


def test_nan_query_propagates_unless_its_row_has_no_key():
    q, k, v = qkv(1, 2, 2, 12, 12)
    with torch.no_grad():
        q[0, 1, 5, 0] = float("nan")
        q[0, 0, 11, 0] = float("nan")  # its window (keys 9-11) is all padding: stays zero
    kw = dict(causal=True, key_lengths=torch.tensor([8]), window=3)
    out = block_sparse_attention(q, k, v, **kw)
    nan = torch.isnan(out).any(-1)[0]
    assert nan[1, 5] and nan.sum() == 1
    assert (out[0, 0, 11] == 0).all()
    with torch.no_grad():
        again = block_sparse_attention(q, k, v, **kw)
    torch.testing.assert_close(again, out, equal_nan=True)


def test_expanded_and_sliced_inputs():
    # Views with zero or odd strides, as from a fused qkv projection or a broadcast batch.
    qkv_ = torch.randn(2, 30, 3 * 4 * 8, dtype=torch.float64)
    q, k, v = (t.view(2, 30, 4, 8).transpose(1, 2) for t in qkv_.split(32, dim=-1))
    k = k[:1].expand(2, -1, -1, -1)
    kw = dict(causal=True, window=7)
    out = blockwise_attention(q, k, v, rows=8, **kw)
    ref, _ = reference_attention(q, k, v, loop_mask(30, 30, **kw))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-7)


def test_scale_is_used():
    q, k, v = qkv(1, 2, 2, 20, 20)
    kw = dict(causal=True, window=6)
    check(q, k, v, loop_mask(20, 20, **kw), scale=0.3, rows=8, **kw)


def test_dropout_path_keeps_masked_rows_zero_and_is_random():
    q, k, v = qkv(1, 2, 2, 16, 16, dtype=torch.float32)
    kw = dict(key_lengths=torch.tensor([9]), causal=True, window=4)
    a = blockwise_attention(q, k, v, dropout_p=0.5, **kw)
    b = blockwise_attention(q, k, v, dropout_p=0.5, **kw)
    full = blockwise_attention(q, k, v, **kw)
    assert torch.isfinite(a).all() and not torch.equal(a, b) and not torch.equal(a, full)
    a.sum().backward()
    assert torch.isfinite(q.grad).all() and (k.grad[:, :, 9:] == 0).all()
    # Zero dropout through the same path gives the exact result.
    torch.testing.assert_close(blockwise_attention(q, k, v, dropout_p=0.0, **kw), full)


# ---------------------------------------------------------------------------------- the plan


def test_window_plan_is_one_strided_run_with_a_shared_mask():
    runs = plan_runs(1, 8192, 8192, Structure(causal=True, window=256))
    interior = max(runs, key=lambda r: r.count)
    assert (interior.rows, interior.width, interior.di, interior.dj) == (64, 319, 64, 64)
    assert interior.count == 8192 // 64 - 4 and interior.allowed is not None
    assert interior.allowed.shape == (1, 64, 319)  # one mask for all 124 tiles
    assert len(runs) == 5 and sum(r.count * r.rows for r in runs) == 8192


def test_equal_documents_plan_is_one_causal_run_without_mask():
    seg = (torch.arange(8192) // 1024).view(1, -1)
    (run,) = plan_runs(1, 8192, 8192, Structure(causal=True, segment_ids=seg))
    assert (run.count, run.rows, run.width, run.di, run.dj) == (8, 1024, 1024, 1024, 1024)
    assert run.causal  # the kernel's is_causal, no mask tensor
    (run,) = plan_runs(
        1, 8192, 8192, Structure(segment_ids=seg)
    )  # bidirectional: every pair allowed
    assert run.allowed is None


def test_padding_only_needs_no_mask_and_skips_padded_keys():
    runs = plan_runs(3, 100, 100, Structure(key_lengths=torch.tensor([40, 0, 100])), rows=32)
    assert all(r.allowed is None for r in runs)
    assert {(r.b, r.width) for r in runs} == {(0, 40), (2, 100)}  # batch 1: nothing to do


def test_tiles_never_straddle_documents():
    seg = torch.tensor([[0] * 5 + [1] * 20 + [2] * 3])
    runs = plan_runs(1, 28, 28, Structure(causal=True, segment_ids=seg), rows=8)
    tiles = sorted((r.i + u * r.di, r.rows) for r in runs for u in range(r.count))
    assert tiles == [(0, 5), (5, 8), (13, 8), (21, 4), (25, 3)]  # the grid restarts per doc


def test_tile_rows_rule():
    assert policy.tile_rows(8192, 256) == 64 and policy.tile_rows(8192, 4096) == 128
    assert policy.tile_rows(8192, None) == 1024 and policy.tile_rows(10, None) == 10
    assert isinstance(plan_runs(1, 5, 5, Structure(causal=True))[0], TileRun)


@pytest.mark.parametrize("option", ["flash", "tiles-64", "tiles-128", "tiles-256"])
def test_bf16_forward_takes_the_policys_kernel(monkeypatch, option):
    # The bf16 structured choice is measured per machine; an environment override pins it.
    if not attention_kernels.flash_available():
        pytest.skip(f"attnkit's flash kernel does not run here: {build.kernels_unavailable()}")
    monkeypatch.setenv("ATTNKIT_KERNEL_ATTENTION_BF16_STRUCTURED", option)
    q = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16)
    windowed = call_of(q, window=32)
    assert policy.flash_kernel(windowed) is (option == "flash")  # no gradients: the measured choice
    rows = 64 if option == "flash" else int(option.split("-")[1])
    assert policy.tile_rows(4096, 256, torch.bfloat16) == rows
    wants = q.clone().requires_grad_()  # gradients: the measured attention.bf16_backward
    assert attnkit_flash(wants) is (policy.choose("attention.bf16_backward") != "torch")
    assert attnkit_flash(q.float())


@pytest.mark.parametrize("option", ["flash", "torch"])
def test_a_bf16_causal_forward_takes_the_policys_kernel(monkeypatch, option):
    # Plain causal bf16 has its own measured choice (no band to skip); an override pins it.
    if not attention_kernels.flash_available():
        pytest.skip(f"attnkit's flash kernel does not run here: {build.kernels_unavailable()}")
    monkeypatch.setenv("ATTNKIT_KERNEL_ATTENTION_BF16_CAUSAL", option)
    monkeypatch.setenv("ATTNKIT_KERNEL_ATTENTION_BF16_STRUCTURED", "tiles-64")
    q = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16)
    assert attnkit_flash(q) is (option == "flash")
    assert not policy.flash_kernel(call_of(q, window=32))  # (windows ask the other choice)
    k, v = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16), torch.randn(1, 2, 64, 16).bfloat16()
    out = sdpa(q, k, v, causal=True)
    want, _ = reference_attention(q, k, v, loop_mask(64, 64, causal=True))
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_bf16_causal_candidates_compute_the_causal_forward():
    calls = policy.choices()["attention.bf16_causal"].candidates()
    g = torch.Generator().manual_seed(0)  # (the candidates' inputs)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    ref, _ = reference_attention(q, k, v, loop_mask(1024, 1024, causal=True))
    assert "torch" in calls
    for call in calls.values():
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_bf16_backward_candidates_compute_the_windows_gradients():
    choice = policy.choices()["attention.bf16_backward"]
    caps = capabilities()
    # Before a measurement it follows the forward's products: torch's kernel where MKL's bf16
    # GEMM leads, attnkit's flash kernels on their own bf16 products, else by the bf16 units.
    forward = policy.choices()["attention.flash_bf16_products"].rule(caps)
    fallback = "torch" if caps.bf16_dot else "flash"
    want = {"bf16": "torch", "bf16-attnkit": "flash-bf16-attnkit"}.get(forward, fallback)
    assert choice.rule(caps) == want
    # With matrix tiles: torch's kernel, unless MKL's bf16 GEMM is missing and attnkit's runs.
    usable = attention_kernels.flash_products()
    tiles = dataclasses.replace(caps, flags=caps.flags | {"amx_tile"})
    own = "bf16" not in usable and caps.bf16_pairs and "bf16-attnkit" in usable
    assert choice.rule(tiles) == ("flash-bf16-attnkit" if own else "torch")
    calls = choice.candidates()
    g = torch.Generator().manual_seed(0)  # (the candidates' inputs)
    q, k, v, grad = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(4))
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*wide, loop_mask(1024, 1024, causal=True, window=256))
    want = torch.autograd.grad(ref, wide, grad.double())
    expected = {"torch"}
    if attention_kernels.flash_available():
        expected.add("flash")
    expected |= {f"flash-{p}" for p in attention_kernels.flash_products() if p != "widened"}
    assert set(calls) == expected
    for call in calls.values():
        with torch.no_grad():  # (as the timings run them)
            grads = call()
        for got, expected in zip(grads, want, strict=True):
            torch.testing.assert_close(got.double(), expected, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("option", ["flash", "flash-bf16", "flash-bf16-attnkit", "torch"])
def test_bf16_gradients_and_documents_take_the_policys_kernel(monkeypatch, option):
    # With gradients the bf16_backward choice decides; documents without a window are causal
    # prefixes and follow bf16_causal, not the windows' choice.
    if not attention_kernels.flash_available():
        pytest.skip(f"attnkit's flash kernel does not run here: {build.kernels_unavailable()}")
    monkeypatch.setenv("ATTNKIT_KERNEL_ATTENTION_BF16_BACKWARD", option)
    monkeypatch.setenv("ATTNKIT_KERNEL_ATTENTION_BF16_CAUSAL", option.split("-")[0])
    monkeypatch.setenv("ATTNKIT_KERNEL_ATTENTION_BF16_STRUCTURED", "flash")
    q = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16)
    wants = q.clone().requires_grad_()
    flash = option != "torch"
    windowed = call_of(wants, window=32)
    assert policy.flash_kernel(windowed) is flash
    # (the forward with gradients and its backward multiply as the choice says)
    products = {"flash-bf16": "bf16", "flash-bf16-attnkit": "bf16-attnkit"}.get(option, "widened")
    assert not flash or policy.tile_kernels(windowed).products == products
    documents = dataclasses.replace(call_of(q), batched=True)
    assert policy.flash_kernel(documents) is flash
    assert policy.flash_kernel(call_of(q, window=32))  # (windows ask bf16_structured)


def test_bf16_structured_rule_and_candidates():
    choice = policy.choices()["attention.bf16_structured"]
    caps = capabilities()
    tiles = dataclasses.replace(caps, flags=caps.flags | {"amx_tile"})
    assert choice.rule(tiles) == "tiles-64"
    assert choice.candidates is not None
    calls = choice.candidates()
    if attention_kernels.flash_available():
        assert set(calls) == set(choice.options)
    for call in calls.values():  # each candidate computes the window it is timed on
        out = call()
        assert out[0].shape if isinstance(out, tuple) else out.shape
    g = torch.Generator().manual_seed(0)  # (the candidates' inputs)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        ref, _ = reference_attention(q, k, v, loop_mask(1024, 1024, causal=True, window=256))
        out = calls["tiles-128"]()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
