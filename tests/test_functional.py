"""The functional core: fused vs explicit vs float64 reference, masks, edge cases, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import attnkit
from attnkit import functional
from attnkit import masks as M
from attnkit.functional import block_sparse_attention
from attnkit.functional import scaled_dot_product_attention as sdpa
from attnkit.kernels import attention as attention_kernels
from attnkit.kernels import build, policy
from attnkit.kernels import one_query as one_query_kernels
from tests.reference import bottom_right_causal, reference_attention


def _qkv(B=2, H=4, K=4, L=5, S=7, E=8, Ev=None, dtype=torch.float32, grad=False):
    Ev = E if Ev is None else Ev
    q = torch.randn(B, H, L, E, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, K, S, E, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, K, S, Ev, dtype=dtype, requires_grad=grad)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("L", "S"), [(5, 5), (3, 7), (1, 9), (6, 6)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_fused_and_explicit_match_float64_reference(causal, L, S, heads):
    H, K = heads
    q, k, v = _qkv(H=H, K=K, L=L, S=S, Ev=6)
    allowed = bottom_right_causal(L, S) if causal else None
    ref, ref_w = reference_attention(q, k, v, allowed)
    fused = sdpa(q, k, v, causal=causal)
    explicit, weights = sdpa(q, k, v, causal=causal, return_weights=True)
    assert_close(fused, ref.float(), atol=1e-5, rtol=1e-5)
    assert_close(explicit, ref.float(), atol=1e-5, rtol=1e-5)
    assert_close(weights, ref_w.float(), atol=1e-6, rtol=1e-5)
    assert weights.shape == (2, H, L, S)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_user_mask_combines_with_causal(kind):
    q, k, v = _qkv(L=6, S=6)
    allowed = torch.rand(2, 1, 6, 6) > 0.3
    mask = allowed if kind == "bool" else M.to_additive(allowed)
    ref, _ = reference_attention(q, k, v, allowed & bottom_right_causal(6, 6))
    assert_close(sdpa(q, k, v, mask, causal=True), ref.float(), atol=1e-5, rtol=1e-5)
    out, _ = sdpa(q, k, v, mask, causal=True, return_weights=True)
    assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)


def test_float_mask_is_additive():
    q, k, v = _qkv(L=4, S=4)
    bias = torch.randn(4, 4)
    ref = (
        torch.softmax(
            (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(8) + bias.double(), dim=-1
        )
        @ v.double()
    )
    assert_close(sdpa(q, k, v, bias), ref.float(), atol=1e-5, rtol=1e-5)
    assert_close(sdpa(q, k, v, bias, return_weights=True)[0], ref.float(), atol=1e-5, rtol=1e-5)


def test_scale_argument():
    q, k, v = _qkv()
    ref, _ = reference_attention(q, k, v, scale=0.05)
    assert_close(sdpa(q, k, v, scale=0.05), ref.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float", "causal_l_gt_s"])
def test_fully_masked_rows_are_zero_with_zero_finite_grads(kind, return_weights):
    q, k, v = _qkv(L=5, S=5 if kind != "causal_l_gt_s" else 3, grad=True)
    mask = None
    causal = kind == "causal_l_gt_s"
    if kind != "causal_l_gt_s":
        allowed = torch.ones(5, 5, dtype=torch.bool)
        allowed[1] = False
        allowed[3] = False
        mask = allowed if kind == "bool" else M.to_additive(allowed)
    res = sdpa(q, k, v, mask, causal=causal, return_weights=return_weights)
    out = res[0] if return_weights else res
    dead = [1, 3] if kind != "causal_l_gt_s" else [0, 1]  # L=5, S=3: queries 0, 1 see nothing
    live = [i for i in range(5) if i not in dead]
    assert torch.isfinite(out).all()
    assert (out[:, :, dead] == 0).all()
    if return_weights:
        assert (res[1][:, :, dead] == 0).all()
        assert_close(res[1][:, :, live].sum(-1), torch.ones(2, 4, len(live)))
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert (q.grad[:, :, dead] == 0).all()
    assert q.grad[:, :, live].abs().sum() > 0


@pytest.mark.parametrize("return_weights", [False, True])
def test_no_keys_gives_zeros(return_weights):
    q, k, v = _qkv(L=3, S=0, grad=True)
    res = sdpa(q, k, v, return_weights=return_weights)
    out = res[0] if return_weights else res
    assert out.shape == (2, 4, 3, 8) and (out == 0).all()
    out.sum().backward()
    assert q.grad is not None and (q.grad == 0).all()


def test_gqa_equals_repeated_heads():
    q, k, v = _qkv(H=6, K=2)
    expected = sdpa(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), causal=True)
    assert_close(sdpa(q, k, v, causal=True), expected)
    assert_close(sdpa(q, k, v, causal=True, return_weights=True)[0], expected)


def test_unbatched_and_extra_leading_dims():
    q, k, v = torch.randn(5, 8), torch.randn(7, 8), torch.randn(7, 3)
    assert_close(sdpa(q, k, v), reference_attention(q, k, v)[0].float(), atol=1e-5, rtol=1e-5)
    q, k, v = (torch.randn(2, 3, 4, 5, 8) for _ in range(3))
    assert_close(
        sdpa(q, k, v, causal=True),
        reference_attention(q, k, v, bottom_right_causal(5, 5))[0].float(),
        atol=1e-5,
        rtol=1e-5,
    )


def test_plain_causal_dispatches_to_is_causal(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(policy, "one_query_kernel", lambda *facts: False)  # (torch's path)
    q, k, v = _qkv(L=6, S=6)
    sdpa(q, k, v, causal=True)
    assert calls[-1] == (None, True)
    q1 = q[:, :, -1:]
    sdpa(q1, k, v, causal=True)  # one query at the end sees every key: no mask at all
    assert calls[-1][0] is None and not calls[-1][1]
    sdpa(q[:, :, :3], k, v, causal=True)  # L != S: bottom-right mask is materialized
    assert calls[-1][0] is not None and calls[-1][1] is False


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 1, 3, 20])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kernel", [True, False])
def test_one_query_matches_float64_reference(heads, window, padded, kernel, monkeypatch):
    """The decoding step (one query) takes its own fast path: grouped heads, the window as a
    slice, attnkit's kernel where it builds (else torch's fused kernel); equal to the float64
    math with every option it takes."""
    if kernel and not build.kernels_available():
        pytest.skip(f"no attnkit kernels: {build.kernels_unavailable()}")
    if not kernel:
        monkeypatch.setattr(policy, "one_query_kernel", lambda *facts: False)
    H, K = heads
    q, k, v = _qkv(B=3, H=H, K=K, L=1, S=9, Ev=6)
    mask = None
    allowed = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    if padded:  # left padding: 0, 2 and 5 slots
        mask = torch.arange(9) >= torch.tensor([0, 2, 5])[:, None]
        mask = mask[:, None, None, :]
        allowed = allowed & mask
    if window is not None:
        allowed = allowed & (torch.arange(9) >= 9 - window)
    shapes = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return real(*args, **kwargs)

    real_kernel = one_query_kernels.one_query_attention

    def spy_kernel(*args, **kwargs):
        shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(one_query_kernels, "one_query_attention", spy_kernel)
    out = sdpa(q, k, v, mask, causal=True, window=window)
    ref, _ = reference_attention(q, k, v, allowed)
    assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    kept = 9 if window is None else min(window, 9)
    # One call saw only the window's keys: the kernel all H query heads, torch's fused kernel
    # H/K query rows per key/value head.
    query = (3, H, 1, 8) if kernel else (3, K, H // K, 8)
    assert shapes == [(query, (3, K, kept, 8))]


@pytest.mark.parametrize("where", ["query", "attended value", "masked key", "no key"])
def test_one_query_non_finite_and_empty_rows_follow_the_general_rules(where):
    """Where the fast path's check fails, the general path decides: the same result as the
    explicit math path (which never takes the fast path)."""
    q, k, v = _qkv(B=2, H=4, K=2, L=1, S=6)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    if where == "query":
        q[0, 1, 0, 3] = float("nan")
    elif where == "attended value":
        v[1, 0, 4, 2] = float("inf")
    elif where == "masked key":
        mask[0, ..., 2] = False
        k[0, 1, 2, 0] = float("nan")
    else:
        mask[1] = False
    out = sdpa(q, k, v, mask, causal=True)
    explicit, _ = sdpa(q, k, v, mask, causal=True, return_weights=True)
    assert_close(out, explicit, atol=1e-6, rtol=1e-5, equal_nan=True)
    nan_rows = out.isnan().any(-1)
    if where == "query":
        assert nan_rows[0, 1] and nan_rows.sum() == 1
    elif where == "attended value":
        assert nan_rows[1, :2].all() and nan_rows.sum() == 2  # heads of key/value head 0
    elif where == "masked key":
        assert not nan_rows.any()
    else:
        assert not nan_rows.any() and (out[1] == 0).all()


@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 6), (1, 6)])
def test_one_query_general_path_reads_each_key_value_head_once(mask_shape, monkeypatch):
    """Where the fast path does not run (compiled steps), a single query per head still reaches
    the fused kernel as H/K rows per key/value head; empty rows stay zero, NaN queries NaN."""
    monkeypatch.setattr(functional, "one_query", lambda *args, **kwargs: None)
    q, k, v = _qkv(B=2, H=6, K=2, L=1, S=6)
    q[1, 4, 0, 2] = float("nan")
    mask = None if mask_shape is None else torch.rand(mask_shape) > 0.3
    if mask_shape == (2, 1, 1, 6):
        mask[0] = False  # a row with no key
    shapes = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        shapes.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = sdpa(q, k, v, mask)
    ref, _ = reference_attention(q, k, v, mask)
    assert shapes == [(2, 2, 3, 8)]
    assert out[1, 4].isnan().all() and out.isnan().sum() == out[1, 4].numel()
    ref[1, 4] = float("nan")
    assert_close(out, ref.float(), atol=1e-5, rtol=1e-5, equal_nan=True)
    if mask_shape == (2, 1, 1, 6):
        assert (out[0] == 0).all()


@pytest.mark.parametrize("return_weights", [False, True])
def test_gradcheck_float64(return_weights):
    q, k, v = _qkv(B=1, H=2, K=1, L=3, S=4, E=3, dtype=torch.float64, grad=True)
    mask = torch.tensor([[True, True, False, True]] * 2 + [[False] * 4])

    def fn(q, k, v):
        res = sdpa(q, k, v, mask, return_weights=return_weights)
        return res[0] if return_weights else res

    assert torch.autograd.gradcheck(fn, (q, k, v))


def _bf16_error_ratio(causal: bool) -> float:
    q, k, v = _qkv(B=2, H=4, L=64, S=64, E=32)
    allowed = bottom_right_causal(64, 64) if causal else None
    ref, _ = reference_attention(q, k, v, allowed)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scores = qb @ kb.transpose(-2, -1) / math.sqrt(32)
    if causal:
        scores = scores.masked_fill(~allowed, float("-inf"))
    plain = torch.softmax(scores, dim=-1) @ vb  # plain PyTorch math in bf16
    plain_err = (plain.double() - ref).abs().max().item()
    ours = max(
        (sdpa(qb, kb, vb, causal=causal).double() - ref).abs().max().item(),
        (sdpa(qb, kb, vb, causal=causal, return_weights=True)[0].double() - ref).abs().max().item(),
    )
    return ours / plain_err


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_error_at_most_twice_plain_torch_math(causal):
    assert _bf16_error_ratio(causal) <= 2.0


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_in_unmasked_inputs_propagates(where):
    q, k, v = _qkv()
    {"q": q, "k": k, "v": v}[where][0, 0, 2, 0] = float("nan")
    row = 2 if where == "q" else 0
    assert torch.isnan(sdpa(q, k, v)[0, 0, row]).any()
    assert torch.isnan(sdpa(q, k, v, return_weights=True)[0][0, 0, row]).any()
    assert torch.isnan(sdpa(q, k, v, causal=True)[0, 0, 2]).any()
    assert torch.isfinite(sdpa(q, k, v)[1]).all()  # other batches are untouched


def test_dropout_scales_kept_weights():
    torch.manual_seed(1)
    q, k, v = _qkv()
    _, w = sdpa(q, k, v, dropout_p=0.5, return_weights=True)
    _, w0 = sdpa(q, k, v, return_weights=True)
    kept = w != 0
    assert 0.3 < kept.float().mean() < 0.7
    assert_close(w[kept], 2 * w0[kept])
    out = sdpa(q, k, v, dropout_p=0.5)
    assert not torch.allclose(out, sdpa(q, k, v))


# ---------------------------------------------------------------- structured masks (dense path)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("L", "S", "window"), [(8, 8, 3), (4, 9, 2), (8, 8, 1)])
def test_window_equals_dense_mask(L, S, window, causal):
    q, k, v = _qkv(L=L, S=S)
    allowed = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        p = i + S - L
        for j in range(S):
            allowed[i, j] = abs(p - j) < window and (j <= p or not causal)
    ref, _ = reference_attention(q, k, v, allowed)
    assert_close(sdpa(q, k, v, causal=causal, window=window), ref.float(), atol=1e-5, rtol=1e-5)
    assert_close(M.sliding_window_mask(L, S, window=window, causal=causal), allowed)
    unbatched = sdpa(q[0, 0], k[0, 0], v[0, 0], causal=causal, window=window)  # (L, E)
    assert_close(unbatched, ref[0, 0].float(), atol=1e-5, rtol=1e-5)


def test_segments_and_key_lengths_equal_dense_masks():
    q, k, v = _qkv(L=6, S=6)
    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    lengths = torch.tensor([6, 4])
    allowed = (seg[:, :, None] == seg[:, None, :])[:, None]
    allowed = allowed & (torch.arange(6) < lengths[:, None])[:, None, None, :]
    allowed = allowed & bottom_right_causal(6, 6)
    ref, _ = reference_attention(q, k, v, allowed)
    out = sdpa(q, k, v, causal=True, segment_ids=seg, key_lengths=lengths)
    assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- property tests


# ---------------------------------------------------------------- errors


def _err(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        sdpa(*args, **kwargs)


def test_error_messages():
    q, k, v = _qkv()
    _err(
        TypeError, r"unknown attention options \['causl'\]; known: \['causal'", q, k, v, causl=True
    )
    _err(TypeError, "q must be a torch.Tensor, got list", [1.0], k, v)
    _err(
        TypeError,
        r"share one floating dtype, got q=torch.float32, k=torch.float64",
        q,
        k.double(),
        v,
    )
    _err(TypeError, "floating dtype", q.long(), k.long(), v.long())
    _err(
        ValueError,
        r"head dims differ: q=\(2, 4, 5, 8\) \(E=8\), k=\(2, 4, 7, 6\)",
        q,
        k[..., :6],
        v,
    )
    _err(ValueError, r"k and v must agree.*k=\(2, 4, 7, 8\), v=\(2, 4, 6, 8\)", q, k, v[:, :, :6])
    _err(
        ValueError,
        r"query heads \(4\) must be a multiple of key/value heads \(3\)",
        q,
        k[:, :3],
        v[:, :3],
    )
    _err(
        ValueError,
        r"mask of shape \(3, 7\) does not broadcast to the scores' shape "
        r"\(2, 4, 5, 7\)",
        q,
        k,
        v,
        torch.ones(3, 7, dtype=torch.bool),
    )
    _err(TypeError, "mask must be bool .* got torch.int64", q, k, v, torch.ones(5, 7).long())
    _err(ValueError, "scale must be a finite number, got nan", q, k, v, scale=float("nan"))
    _err(ValueError, "scale must be a finite number, got inf", q, k, v, scale=math.inf)
    _err(ValueError, r"dropout_p must be in \[0, 1\), got 1.0", q, k, v, dropout_p=1.0)
    _err(ValueError, "window must be a positive int, got 0", q, k, v, window=0)
    _err(ValueError, "same number", q[0], k, v)
    _err(ValueError, r"batch dims differ", q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"key_lengths must be in \[0, S=7\], got \[9, 1\]"):
        sdpa(q, k, v, key_lengths=torch.tensor([9, 1]))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(B, S\) with S=7"):
        sdpa(q, k, v, segment_ids=torch.zeros(2, 5, dtype=torch.long))


def test_top_level_export():
    assert attnkit.scaled_dot_product_attention is sdpa


@pytest.mark.parametrize(("L", "S", "window"), [(100, 100, None), (90, 130, None), (120, 120, 17)])
def test_float32_causal_attention_runs_attnkits_flash_kernel(L, S, window, monkeypatch):
    # Plain causal (bottom-right aligned) and window calls in float32 on the CPU take attnkit's
    # flash kernels (blockwise.attend_positional): equal to the float64 math, gradients too,
    # with grouped-query heads and Ev != E; a non-finite key still poisons exactly the rows that
    # may attend it.
    if not attention_kernels.flash_available():
        pytest.skip("attnkit's flash kernels cannot run here")
    calls = []
    kernel = attention_kernels.flash_attention
    monkeypatch.setattr(
        attention_kernels, "flash_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    )
    q, k, v = _qkv(B=2, H=4, K=2, L=L, S=S, E=16, Ev=12, grad=True)
    out = sdpa(q, k, v, causal=True, window=window)
    allowed = bottom_right_causal(L, S)
    if window is not None:
        allowed = allowed & M.sliding_window_mask(L, S, window=window)
    ref, _ = reference_attention(q, k, v, allowed)
    assert calls
    assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.float())
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        assert_close(a.double(), b.double(), atol=2e-5, rtol=2e-5)
    k_bad = k.detach().clone()
    k_bad[1, 0, S // 2, 3] = float("nan")
    out = sdpa(q.detach(), k_bad, v.detach(), causal=True, window=window)
    poisoned = torch.zeros(2, 4, L, dtype=torch.bool)
    poisoned[1, :2] = allowed[:, S // 2]  # query heads 0-1 read key/value head 0
    assert torch.equal(torch.isnan(out).any(-1), poisoned)


def test_long_window_takes_block_sparse_path_and_matches_dense(monkeypatch):
    from attnkit import sparse

    calls = []
    real = sparse.tiled_attention
    monkeypatch.setattr(
        sparse, "tiled_attention", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw)
    )
    q, k, v = _qkv(B=1, H=2, K=1, L=2100, S=2100, E=16, grad=True)
    out = sdpa(q, k, v, causal=True, window=48)
    assert len(calls) == 1 and calls[0].structure.window == 48 and calls[0].structure.causal
    dense = sdpa(q, k, v, M.sliding_window_mask(2100, window=48))
    assert_close(out, dense, atol=1e-5, rtol=1e-5)
    g_sparse = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_dense = torch.autograd.grad(dense.square().sum(), (q, k, v))
    for a, b in zip(g_sparse, g_dense, strict=True):
        assert_close(a, b, atol=1e-4, rtol=1e-4)
    short = [t[:, :, :100].detach() for t in (q, k, v)]
    sdpa(*(t.double() for t in short), causal=True, window=48)
    assert len(calls) == 1  # short sequences stay on the dense kernel...
    sdpa(*short, causal=True, window=48)  # ... unless attnkit's flash kernels take float32
    assert len(calls) == (2 if attention_kernels.flash_available() else 1)


# ---------------------------------------------------------------- correct on every path


@pytest.mark.parametrize("return_weights", [False, True])
def test_fp16_scores_beyond_the_fp16_range_do_not_overflow(return_weights):
    # q.k = 80 * 256^2 = 5.2e6 overflows fp16; torch's SDPA gives 256 (every value is 256).
    x = torch.full((1, 1, 4, 80), 256.0, dtype=torch.half)
    res = sdpa(x, x, x, return_weights=return_weights)
    out = res[0] if return_weights else res
    assert out.dtype == torch.half
    assert_close(out, torch.full_like(x, 256.0), rtol=0, atol=0)
    if return_weights:
        assert_close(res[1], torch.full((1, 1, 4, 4), 0.25, dtype=torch.half), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spread", [5.0, 300.0])
def test_low_precision_weights_path_is_as_accurate_as_fused(dtype, spread):
    # Against float64 math on the same (rounded) inputs: the weights path must be as accurate as
    # the fused kernel (float32 inside), not low-precision math (0.6 off for bf16).
    g = torch.Generator().manual_seed(3)
    q = (torch.rand(1, 2, 128, 80, generator=g) * spread).to(dtype)
    k = (torch.rand(1, 2, 128, 80, generator=g) * spread).to(dtype)
    v = torch.randn(1, 2, 128, 80, generator=g).to(dtype)
    ref, ref_w = reference_attention(q, k, v, bottom_right_causal(128, 128))
    fused_err = (sdpa(q, k, v, causal=True).double() - ref).abs().max().item()
    out, w = sdpa(q, k, v, causal=True, return_weights=True)
    assert out.dtype == w.dtype == dtype
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding of the result
    assert (out.double() - ref).abs().max().item() <= max(2 * fused_err, 4 * step)
    assert (w.double() - ref_w).abs().max().item() <= 2 * step


def _masked_nan_case(kind: str, dtype: torch.dtype = torch.float32):
    """q, k, v (1, 2, 6, 4), a mask and structure kwargs in which key 4 is masked for some
    queries and attended by others; also the bool allowed mask, for the reference."""
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=dtype) for _ in range(3))
    allowed = torch.ones(6, 6, dtype=torch.bool)
    mask, kw = None, {}
    if kind == "causal":
        kw, allowed = {"causal": True}, bottom_right_causal(6, 6)
    elif kind == "window":
        kw, allowed = {"window": 2}, M.sliding_window_mask(6, window=2, causal=False)
    elif kind == "key_lengths":
        kw, allowed = {"key_lengths": torch.tensor([4])}, allowed & (torch.arange(6) < 4)
    else:
        allowed = torch.rand(6, 6) > 0.5
        allowed[0, 4], allowed[1, 4], allowed[2] = True, False, False  # row 2 sees nothing
        if kind == "bool":
            mask = allowed
        elif kind == "float":
            mask = M.to_additive(allowed, dtype) + torch.randn(6, 6, dtype=dtype)
        else:  # "finfo": masked entries are finfo.min, as in Hugging Face masks
            mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
    return q, k, v, mask, kw, allowed


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("kind", ["bool", "float", "finfo", "key_lengths", "window", "causal"])
def test_nan_at_masked_positions_never_leaks(kind, where, return_weights):
    q, k, v, mask, kw, allowed = _masked_nan_case(kind)
    bias = mask if kind == "float" else None
    clean_k, clean_v = k.clone(), v.clone()
    {"k": k, "v": v}[where][0, 1, 4, 0] = float("nan")  # key 4 of head 1
    {"k": clean_k, "v": clean_v}[where][0, 1, 4, 0] = 0.0
    res = sdpa(q, k, v, mask, return_weights=return_weights, **kw)
    out = res[0] if return_weights else res
    expected = sdpa(q, clean_k, clean_v, mask, **kw)
    sees = allowed.expand(6, 6)[:, 4]  # queries that may attend key 4
    assert_close(out[0, 0], expected[0, 0])  # head 0 never reads the NaN
    assert_close(out[0, 1, ~sees], expected[0, 1, ~sees])  # nor do the queries it is masked for
    assert torch.isnan(out[0, 1, sees]).any(-1).all()  # NaN in an attended input propagates
    if bias is None and kind not in ("bool", "finfo"):
        ref, _ = reference_attention(q, clean_k, clean_v, allowed)
        assert_close(out[0, 1, ~sees], ref[0, 1, ~sees].float(), atol=1e-5, rtol=1e-5)
    if return_weights:
        w = res[1]
        assert torch.isfinite(w[0, 1, ~sees]).all() and torch.isfinite(w[0, 0]).all()
        if where == "k":
            assert torch.isnan(w[0, 1, sees]).all()  # NaN scores: NaN weights
        else:
            assert torch.isfinite(w).all()  # a NaN value leaves the weights alone


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("kind", ["bool", "float", "key_lengths", "window", "causal"])
def test_masked_nan_does_not_reach_the_gradients(kind, where, return_weights):
    # With gradients the backward must not carry 0 * NaN from the masked key either: a loss on
    # the queries that may not attend key 4 has the gradients of the clean inputs.
    q, k, v, mask, kw, allowed = _masked_nan_case(kind)
    sees = allowed.expand(6, 6)[:, 4]
    grads = []
    for value in (float("nan"), 0.0):
        qq, kk, vv = (t.clone() for t in (q, k, v))
        {"k": kk, "v": vv}[where][0, 1, 4, 0] = value
        qq, kk, vv = (t.requires_grad_() for t in (qq, kk, vv))
        res = sdpa(qq, kk, vv, mask, return_weights=return_weights, **kw)
        out = res[0] if return_weights else res
        assert torch.isnan(out[0, 1, sees]).any(-1).all() == (value != 0.0) or not sees.any()
        out[0, :, ~sees].square().sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for got, want in zip(*grads, strict=True):
        assert got is not None and want is not None
        assert_close(got, want)


@pytest.mark.parametrize("return_weights", [False, True])
def test_finite_queries_whose_sum_overflows_stay_finite(return_weights):
    q = torch.full((1, 1, 3, 64), 1e37)  # every entry finite; the row sum is 6.4e38 > f32 max
    k, v = torch.randn(1, 1, 5, 64) * 1e-38, torch.randn(1, 1, 5, 64)
    res = sdpa(q, k, v, return_weights=return_weights)
    out = res[0] if return_weights else res
    ref, _ = reference_attention(q, k, v)
    assert torch.isfinite(out).all()
    assert_close(out, ref.float(), atol=1e-5, rtol=1e-4)
    q64 = torch.full((1, 1, 3, 4), 1e308, dtype=torch.float64)  # the sum overflows float64 too
    k64 = torch.randn(1, 1, 5, 4, dtype=torch.float64) * 1e-300
    v64 = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    assert_close(sdpa(q64, k64, v64), reference_attention(q64, k64, v64)[0])


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_float_masks_at_finfo_min_count_as_masked(dtype, return_weights):
    q, k, v = _qkv(B=1, H=2, K=2, L=4, S=5, dtype=dtype)
    lo = torch.finfo(dtype).min
    mask = torch.zeros(4, 5, dtype=dtype)
    mask[0] = lo  # all finfo.min: no key, zeros like an all -inf row
    mask[1, :3], mask[1, 3:] = lo, float("-inf")
    mask[2, 1] = lo  # one key masked
    wide_min = torch.tensor(torch.finfo(torch.float64).min, dtype=torch.float64)
    mask[3, 0] = wide_min.to(dtype)  # -inf in dtype (or float64's min, in float64)
    res = sdpa(q, k, v, mask, return_weights=return_weights)
    out = res[0] if return_weights else res
    allowed = torch.ones(4, 5, dtype=torch.bool)
    allowed[:2], allowed[2, 1], allowed[3, 0] = False, False, False
    ref, ref_w = reference_attention(q, k, v, allowed)
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype in (torch.float16, torch.bfloat16) else {}
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else tol
    assert (out[:, :, :2] == 0).all()
    assert_close(out.double(), ref, **tol)
    if return_weights:
        assert_close(res[1].double(), ref_w, **tol)
    # a float64 mask at float64's min counts as masked for float32 queries too
    wide = torch.zeros(4, 5, dtype=torch.float64)
    wide[0] = torch.finfo(torch.float64).min
    assert (sdpa(q.float(), k.float(), v.float(), wide)[:, :, 0] == 0).all()


@pytest.mark.parametrize("shape", [(1, 0, 5, 4), (1, 2, 0, 4)])
def test_block_sparse_attention_of_empty_inputs_is_empty(shape):
    # torch's flash kernel divides by the head count (a crash, not an error, at 0 heads)
    q = torch.randn(shape, requires_grad=True)
    k, v = torch.randn(1, shape[1], 5, 4), torch.randn(1, shape[1], 5, 3)
    out = block_sparse_attention(q, k, v, causal=True, block_size=2)
    assert out.shape == (*shape[:-1], 3)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("return_weights", [False, True])
def test_zero_heads_give_an_empty_output_like_torch(return_weights):
    q, k, v = torch.randn(2, 0, 3, 4), torch.randn(2, 0, 5, 4), torch.randn(2, 0, 5, 6)
    res = sdpa(q, k, v, causal=True, return_weights=return_weights)
    out = res[0] if return_weights else res
    assert out.shape == F.scaled_dot_product_attention(q, k, v).shape == (2, 0, 3, 6)
    if return_weights:
        assert res[1].shape == (2, 0, 3, 5)
    with pytest.raises(ValueError, match=r"query heads \(2\) must be a multiple of key/value"):
        sdpa(torch.randn(2, 2, 3, 4), k, v)


@pytest.mark.parametrize("return_weights", [False, True])
def test_zero_head_dim_averages_the_values_like_torch(return_weights):
    q, k, v = torch.randn(2, 2, 3, 0), torch.randn(2, 2, 5, 0), torch.randn(2, 2, 5, 6)
    allowed = torch.tensor([[True, True, False, True, False]])
    for mask in (None, allowed):
        res = sdpa(q, k, v, mask, return_weights=return_weights)
        out = res[0] if return_weights else res
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert_close(out, expected)
        keys = v if mask is None else v[:, :, allowed[0]]
        assert_close(out, keys.mean(-2, keepdim=True).expand_as(out))


@pytest.mark.parametrize("S", [7, 1100])  # dense and block-sparse dispatch
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("arg", ["key_lengths", "segment_ids"])
def test_structure_of_another_batch_size_is_an_error(arg, return_weights, S):
    q, k, v = _qkv(B=1, H=2, K=2, L=S, S=S)
    value = torch.tensor([3, 4]) if arg == "key_lengths" else torch.zeros(2, S, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"{arg} has batch size 2, expected 1"):
        sdpa(q, k, v, window=4, return_weights=return_weights, **{arg: value})
    one = value[:1]  # a batch of 1 broadcasts
    out = sdpa(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), window=4, **{arg: one})
    assert_close(out[0], out[1])


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("return_weights", [False, True])
def test_nan_in_every_attended_key_propagates(return_weights, grad):
    # torch's fused kernel returns zeros for a row whose every score is NaN; attnkit gives NaN.
    q, k, v = _qkv(B=1, H=2, K=2, L=3, S=4)
    k[:, 0] = float("nan")  # head 0: every key
    k[:, 1, :2] = float("nan")  # head 1: the keys that query 0 may attend
    allowed = torch.tensor([[True, True, False, False], [True] * 4, [False, False, True, True]])
    for mask in (None, allowed):
        qq, kk, vv = (t.clone().requires_grad_(grad) for t in (q, k, v))
        res = sdpa(qq, kk, vv, mask, return_weights=return_weights)
        out = res[0] if return_weights else res
        assert torch.isnan(out[0, 0]).all()
        seen = [0, 1, 2] if mask is None else [0, 1]  # query 2 sees only keys 2, 3 (finite)
        assert torch.isnan(out[0, 1, seen]).all()
        if mask is not None:
            ref, _ = reference_attention(q, k, v, allowed)
            assert_close(out[0, 1, 2], ref[0, 1, 2].float(), atol=1e-5, rtol=1e-5)


def _inf_key_case(structure: dict, grad: bool = False):
    """q, k, v (1, 2, 4, 6 keys, E=16) with +inf in one element of key 2: even query rows score
    it +inf, odd rows -inf; and the dense allowed mask of ``structure``."""
    q, k, v = _qkv(B=1, H=2, K=1, L=4, S=6, E=16)
    q[..., 0::2, 5], q[..., 1::2, 5] = 1.0, -1.0
    k[0, 0, 2, 5] = float("inf")
    allowed = M.structured_mask(4, 6, **structure)  # (1, 1, 4, 6)
    return (*(t.requires_grad_(grad) for t in (q, k, v)), allowed)


@pytest.mark.parametrize(
    ("path", "structure"),
    [
        (path, structure)
        for path in ("fused", "weights", "grad", "block_sparse")
        for structure in ({}, {"causal": True}, {"window": 2})
        if path != "block_sparse" or structure  # block-sparse attention needs a structure
    ],
)
def test_inf_in_one_key_element_reaches_only_the_rows_the_math_says(path, structure):
    # As in the math: a +inf score makes its row NaN, a -inf score gives the key weight 0; and
    # (attnkit's rule) rows that may not attend the key never see it.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, allowed = _inf_key_case(structure, grad=path == "grad")
    if not structure:  # torch's fused kernel and its math agree on which rows are NaN
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            math_rows = torch.isnan(F.scaled_dot_product_attention(q, k, v)).any(-1)
        fused_rows = torch.isnan(F.scaled_dot_product_attention(q, k, v)).any(-1)
        assert torch.equal(math_rows, fused_rows)
        assert math_rows[..., 0::2].all() and not math_rows[..., 1::2].any()
    nan_rows = (allowed[..., 2] & (torch.arange(4) % 2 == 0)).expand(1, 2, 4)
    assert 0 < int(nan_rows.sum()) < nan_rows.numel()  # some rows, not all
    # The other rows: the math with key 2 masked wherever its weight is 0 and zeroed.
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        ref_k[0, 0, 2] = 0.0
    mask = allowed.expand(1, 2, 4, 6).clone()
    mask[..., 2] &= nan_rows
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, attn_mask=mask)
    if path == "block_sparse":
        out = block_sparse_attention(q, k, v, block_size=2, **structure)
    else:
        res = sdpa(q, k, v, return_weights=path == "weights", **structure)
        out = res[0] if path == "weights" else res
    assert torch.equal(torch.isnan(out).any(-1), nan_rows)
    assert torch.isnan(out[nan_rows]).all()
    assert_close(out[~nan_rows], want[~nan_rows])
    if path == "weights":
        assert torch.equal(torch.isnan(res[1]).any(-1), nan_rows)
        assert (res[1][~nan_rows][..., 2] == 0).all()
    if path == "grad":  # the finite rows' gradients are those of the same math
        want[~nan_rows].square().sum().backward()
        out[~nan_rows].square().sum().backward()
        for got, exp in ((q.grad, ref_q.grad), (k.grad, ref_k.grad), (v.grad, ref_v.grad)):
            assert_close(got, exp)


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("structure", [{}, {"causal": True}, {"causal": True, "window": 3}])
def test_softcap_caps_scores_on_every_path(return_weights, structure):
    """Gemma 2's soft-capping: tanh(s / c) * c before the mask, outputs and gradients."""
    q = (3 * torch.randn(2, 4, 7, 8, dtype=torch.float64)).requires_grad_()
    k = (3 * torch.randn(2, 2, 7, 8, dtype=torch.float64)).requires_grad_()
    v = torch.randn(2, 2, 7, 8, dtype=torch.float64, requires_grad=True)
    allowed = M.structured_mask(7, 7, **structure) if structure else None
    ref_out, ref_w = reference_attention(q, k, v, allowed, softcap=2.0)
    got = sdpa(q, k, v, softcap=2.0, return_weights=return_weights, **structure)
    out = got[0] if return_weights else got
    assert_close(out, ref_out)
    if return_weights:
        assert_close(got[1], ref_w)
    plain = sdpa(q, k, v, **structure)
    assert not torch.allclose(out, plain)  # the cap changes large scores
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref_out.sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r)
    with pytest.raises(ValueError, match=r"softcap must be a positive finite number.*-1"):
        sdpa(q, k, v, softcap=-1.0)


@pytest.mark.skipif(not build.kernels_available(), reason="attnkit's kernels do not build here")
def test_a_compiled_decoding_step_calls_the_one_query_kernel() -> None:
    """Inside a compiled graph one query per head over a padded (static) cache is the op
    ``attnkit::one_query_attention``, equal to the float64 math (and to torch's fused kernel)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 8, generator=g)
    k, v = (torch.randn(2, 3, 10, 8, generator=g) for _ in range(2))
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[1, ..., :4] = False  # left padding
    mask[..., 7:] = False  # empty slots of the cache
    step = torch.compile(sdpa, fullgraph=True)
    with torch.no_grad(), torch.profiler.profile() as prof:
        got = step(q, k, v, mask)
    assert any(event.name == "attnkit::one_query_attention" for event in prof.events())
    want, _ = reference_attention(q, k, v, mask)
    assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "L, kw",
    [
        (4, {}),  # torch's fused kernel
        (4, {"causal": True}),
        (4, {"return_weights": True}),  # the explicit math
        (4, {"softcap": 5.0}),
        (1, {}),  # a decoding step
        (128, {"causal": True, "window": 16}),  # attnkit's flash kernels (float32)
        (128, {"causal": True, "segment_ids": torch.tensor([[0] * 50 + [1] * 78])}),
    ],
)
def test_a_non_finite_value_reaches_only_its_column(L, kw, value):
    # As in the math (and torch's kernels where every key may be attended): v[j, c] reaches
    # output column c of the rows that may attend key j, and nothing else.
    g = torch.Generator().manual_seed(0)
    S, j, c = max(L, 16), 1, 5
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (L, S, S))
    v[0, 1, j, c] = value
    got = sdpa(q, k, v, **kw)
    out = got[0] if kw.get("return_weights") else got
    structure = {n: kw[n] for n in ("causal", "window", "segment_ids") if n in kw}
    allowed = M.structured_mask(L, S, **structure)  # (1, 1, L, S)
    want = torch.zeros(out.shape, dtype=torch.bool)
    want[0, 1, :, c] = allowed[0, 0, :, j]
    assert want.any()
    assert torch.equal(torch.isnan(out), want)
    if not structure:  # torch's own kernel: non-finite exactly there (inf stays inf there)
        plain = F.scaled_dot_product_attention(q, k, v)
        assert torch.equal(~torch.isfinite(plain), want)
    clean = v.clone()
    clean[0, 1, j, c] = 0.0
    ref, _ = reference_attention(q, k, clean, allowed, softcap=kw.get("softcap"))
    assert_close(out[~want].double(), ref[~want], atol=1e-5, rtol=1e-5)
    if kw.get("return_weights"):
        assert torch.isfinite(got[1]).all()  # a value leaves the weights finite


# The layers of the attention path, top-down (as in pyproject.toml's layers contract).
_RANK = {"functional": 0, "sparse": 1, "softcap": 1, "blockwise": 2, "masks": 3, "native": 3}


def _calls_between_modules(fn):
    """``(caller module, called module, function)`` of every call from one attnkit module into
    another while ``fn`` runs."""
    import sys

    seen = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if callee.startswith("attnkit.") and caller.startswith("attnkit.") and callee != caller:
            seen.append((caller[8:], callee[8:], frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True, "window": 32},
        {"causal": True, "softcap": 20.0},
        {"causal": True, "segment_ids": torch.tensor([[0] * 100 + [1] * 156])},
        {"causal": True, "return_weights": True},
        {},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_goes_down_once(kw, dtype):
    # API -> checks -> policy -> kernel: the policy answers once, from the API, and no module of
    # the path calls a module above it (no callbacks up).
    q, k, v = (torch.randn(1, 4, 256, 16, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        sdpa(q, k, v, **kw)  # (builds the kernels, decides measured choices)
        calls = _calls_between_modules(lambda: sdpa(q, k, v, **kw))
    asked = [
        (a, f) for a, b, f in calls if b.startswith("kernels.policy") and f == "attention_plan"
    ]
    assert asked == [("functional", "attention_plan")]
    up = [(a, b, f) for a, b, f in calls if _RANK.get(b, 9) < _RANK.get(a, 9)]
    assert not up, up
    assert all(b != "functional" for _, b, _ in calls)
