"""Block-sparse attention equals dense masked attention (values and gradients), and the bench."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.functional import block_sparse_attention
from attnkit.kernels import policy
from attnkit.sparse import should_use_block_sparse, structured_mask
from tests.reference import loop_mask, reference_attention


def random_segments(B, S, gen):
    """(B, S) ids of contiguous documents with random lengths."""
    rows = []
    for _ in range(B):
        cuts = torch.randperm(S - 1, generator=gen)[: torch.randint(0, 4, (), generator=gen)] + 1
        starts = torch.zeros(S, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0) * 7)  # ids need not be 0..n-1
    return torch.stack(rows)


def check_against_reference(q, k, v, allowed, **kw):
    out = block_sparse_attention(q, k, v, **kw)
    ref, _ = reference_attention(q, k, v, allowed)
    torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w.float(), atol=5e-5, rtol=1e-4)
    return out, got


def qkv(B, H, K, L, S, E=8, Ev=None):
    q = torch.randn(B, H, L, E, requires_grad=True)
    k = torch.randn(B, K, S, E, requires_grad=True)
    v = torch.randn(B, K, S, Ev or E, requires_grad=True)
    return q, k, v


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2),
    heads=st.sampled_from([(1, 1), (4, 2), (4, 1)]),
    S=st.integers(1, 40),
    dL=st.integers(0, 40),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 12)),
    docs=st.booleans(),
    pad=st.booleans(),
    block=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_reference(B, heads, S, dL, causal, window, docs, pad, block, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    L = max(1, S - dL)  # L <= S (bottom-right aligned queries)
    H, K = heads
    seg = random_segments(B, S, gen) if docs else None
    lengths = torch.randint(0, S + 1, (B,), generator=gen) if pad else None
    kw = dict(causal=causal, window=window, segment_ids=seg, key_lengths=lengths)
    allowed = loop_mask(L, S, **kw)
    torch.testing.assert_close(structured_mask(L, S, **kw), allowed, rtol=0, atol=0)
    check_against_reference(*qkv(B, H, K, L, S), allowed, block_size=block, **kw)


@pytest.mark.parametrize("L, S", [(5, 9), (9, 5), (13, 13)])
def test_bottom_right_causal_window_and_longer_queries(L, S):
    # L > S: the first L - S queries sit before every key and see nothing.
    q, k, v = qkv(1, 2, 2, L, S)
    kw = dict(causal=True, window=3)
    out, _ = check_against_reference(q, k, v, loop_mask(L, S, **kw), block_size=4, **kw)
    if L > S:
        assert (out[..., : L - S, :] == 0).all()


def test_fully_masked_rows_are_zero_with_zero_grads():
    q, k, v = qkv(2, 4, 2, 10, 10)
    lengths = torch.tensor([0, 6])  # batch 0 has no keys at all
    out, (gq, gk, gv) = check_against_reference(
        q, k, v, loop_mask(10, 10, key_lengths=lengths), key_lengths=lengths, block_size=4
    )
    assert (out[0] == 0).all() and (gq[0] == 0).all()
    assert (gk[0] == 0).all() and (gv[0] == 0).all() and (gk[1, :, 6:] == 0).all()


def test_no_allowed_key_anywhere_still_gives_zero_grads():
    q, k, v = qkv(1, 2, 2, 6, 6)
    out = block_sparse_attention(q, k, v, key_lengths=torch.tensor([0]))
    assert (out == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and (t.grad == 0).all()


def test_non_contiguous_documents_and_value_dim():
    seg = torch.tensor([[0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1, 0]])
    q, k, v = qkv(1, 2, 1, 8, 12, E=4, Ev=6)
    kw = dict(segment_ids=seg, causal=True)
    check_against_reference(q, k, v, loop_mask(8, 12, **kw), block_size=3, **kw)


def test_leading_dims_and_no_head_dim():
    q, k, v = torch.randn(2, 3, 4, 9, 8), torch.randn(2, 3, 2, 9, 8), torch.randn(2, 3, 2, 9, 8)
    out = block_sparse_attention(q, k, v, window=2, block_size=4)
    ref, _ = reference_attention(q, k, v, loop_mask(9, 9, window=2)[0, 0])
    torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-4)
    out2 = block_sparse_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], window=2)
    torch.testing.assert_close(out2, out[0, 0, 0], atol=1e-6, rtol=1e-5)


def test_long_window_uses_few_keys_and_matches_sdpa():
    # Big enough that tiles skip most keys; the fused kernel with the dense mask is the reference.
    L = S = 1024
    q, k, v = torch.randn(1, 2, L, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    mask = structured_mask(L, S, causal=True, window=64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = block_sparse_attention(q, k, v, causal=True, window=64)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_dropout_keeps_masked_rows_zero():
    q, k, v = qkv(1, 2, 2, 8, 8)
    out = block_sparse_attention(q, k, v, key_lengths=torch.tensor([0]), dropout_p=0.5)
    assert (out == 0).all()
    out = block_sparse_attention(q, k, v, window=2, dropout_p=0.5)
    assert torch.isfinite(out).all() and out.shape == (1, 2, 8, 8)


def test_fallback_decision():
    seg = torch.arange(8192).div(1024, rounding_mode="floor")[None]  # 8 documents
    assert should_use_block_sparse(8192, 8192, causal=True, window=256)
    assert should_use_block_sparse(8192, 8192, causal=True, segment_ids=seg)
    assert not should_use_block_sparse(256, 256, causal=True, window=16)  # too short
    assert not should_use_block_sparse(8192, 8192, window=8192)  # nothing to skip
    assert not should_use_block_sparse(8192, 8192)  # no structure
    assert not should_use_block_sparse(8192, 8192, key_lengths=torch.tensor([8000]))
    assert should_use_block_sparse(8192, 8192, key_lengths=torch.tensor([1000]))
    assert should_use_block_sparse(8192, 8192, key_lengths=torch.tensor([4096]))  # long: half
    assert not should_use_block_sparse(2048, 2048, key_lengths=torch.tensor([1024]))  # short: no
    assert policy.SPARSE_MIN_KEYS > 256


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(window=0), r"window must be a positive int, got 0"),
        (dict(window=2.5), r"window must be a positive int, got 2.5"),
        (dict(segment_ids=torch.zeros(2, 5, dtype=torch.long)), r"shape \(B, S\) with S=6"),
        (dict(segment_ids=torch.zeros(3, 6, dtype=torch.long)), r"batch size 3, expected 2"),
        (dict(segment_ids=torch.zeros(2, 6)), r"segment_ids must be an integer tensor"),
        (dict(key_lengths=torch.tensor([7, 1])), r"key_lengths must be in \[0, S=6\].*\[7, 1\]"),
        (dict(key_lengths=torch.tensor([[1, 1]])), r"key_lengths must have shape \(B,\)"),
        (dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\), got 1.0"),
        (dict(block_size=0), r"block_size must be a positive int, got 0"),
    ],
)
def test_errors_name_the_values(kw, match):
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(q, k, v, **kw)


def test_shape_errors():
    q, k = torch.randn(1, 3, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(
        ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"
    ):
        block_sparse_attention(q, k, k, window=2)
    with pytest.raises(ValueError, match=r"need L <= S"):
        block_sparse_attention(
            torch.randn(1, 2, 7, 8), k, k, segment_ids=torch.zeros(1, 6, dtype=torch.long)
        )
    with pytest.raises(TypeError, match="floating dtype"):
        block_sparse_attention(q.long(), k, k)


@pytest.mark.slow
def test_bench_quick_writes_json(tmp_path, capsys):
    from attnkit.cli import main

    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--out", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["config"]["seq_lens"] == [256]
    seen = {(r["case"], r["mode"], r["impl"]) for r in report["results"]}
    for case in ("causal", "padding", "window", "documents"):
        for mode in ("fwd", "fwd+bwd"):
            for impl in ("block_sparse", "torch_sdpa", "textbook"):
                assert (case, mode, impl) in seen
    for r in report["results"]:
        assert r["max_abs_err_vs_sdpa"] < 1e-4 and 0 < r["density"] <= 1
    assert "block_sparse" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA path")
def test_bench_cuda_without_cuda_skips(tmp_path, capsys):
    from attnkit.cli import main

    path = tmp_path / "gpu.json"
    assert main(["bench", "--quick", "--device", "cuda", "--out", str(path)]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
    assert json.loads(path.read_text())["skipped"] == "CUDA not available"


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("kind", ["window", "key_lengths", "documents"])
def test_nan_at_masked_positions_never_leaks(kind, where, grad):
    # Key 8 holds a NaN; the queries that may not attend it must not see it, those that may must.
    kw = {
        "window": dict(causal=True, window=5),
        "key_lengths": dict(key_lengths=torch.tensor([8, 12])),  # batch 0: nobody sees key 8
        "documents": dict(segment_ids=torch.tensor([[0] * 6 + [1] * 6, [0] * 9 + [1] * 3])),
    }[kind]
    q, k, v = (t.detach().requires_grad_(grad) for t in qkv(2, 2, 1, 12, 12))
    bad = {"k": k, "v": v}[where].detach().clone()
    bad[:, 0, 8, 0] = float("nan")
    clean = bad.nan_to_num(0.0)
    kv_bad, kv_clean = ((bad, v), (clean, v)) if where == "k" else ((k, bad), (k, clean))
    out = block_sparse_attention(q, *kv_bad, block_size=4, **kw)
    want = block_sparse_attention(q, *kv_clean, block_size=4, **kw)
    sees = loop_mask(12, 12, **kw).expand(2, 1, 12, 12)[:, 0, :, 8]  # (B, L): may attend key 8
    for b in range(2):
        assert torch.isnan(out[b][:, sees[b]]).any(-1).all()
        torch.testing.assert_close(out[b][:, ~sees[b]], want[b][:, ~sees[b]])
    if grad:  # nor into the gradients through the queries that may not attend it
        rows = ~sees[:, None, :, None]
        g_out = torch.autograd.grad(out.where(rows, 0.0).sum(), q)[0]
        g_want = torch.autograd.grad(want.where(rows, 0.0).sum(), q)[0]
        torch.testing.assert_close(g_out, g_want)


def test_nan_in_masked_keys_on_the_long_dispatch_path():
    # functional dispatches this to the block-sparse kernel (long, windowed).
    from attnkit.functional import scaled_dot_product_attention as sdpa

    L = 1100
    q, k, v = torch.randn(1, 2, L, 8), torch.randn(1, 2, L, 8), torch.randn(1, 2, L, 8)
    k[0, :, 700] = float("nan")
    v[0, :, 701] = float("nan")
    out = sdpa(q, k, v, causal=True, window=16)
    sees = (torch.arange(L) >= 700) & (torch.arange(L) < 701 + 16)
    assert torch.isnan(out[0, :, sees]).all(-1).all()
    assert torch.isfinite(out[0, :, ~sees]).all()
    want = sdpa(q, k.nan_to_num(0.0), v.nan_to_num(0.0), causal=True, window=16)
    torch.testing.assert_close(out[0, :, ~sees], want[0, :, ~sees])


def test_nan_query_propagates_and_fully_masked_rows_stay_zero():
    q, k, v = (t.detach() for t in qkv(1, 2, 1, 12, 12))
    q[0, 1, 5, 0] = float("nan")
    out = block_sparse_attention(q, k, v, causal=True, window=3, block_size=4)
    assert torch.isnan(out[0, 1, 5]).all()
    out[0, 1, 5] = 0.0
    assert torch.isfinite(out).all()
    q[0, 0, 0, 0] = float("nan")  # batch 0 with key_lengths 0: no key, so zero
    out = block_sparse_attention(q, k, v, key_lengths=torch.tensor([0]), block_size=4)
    assert (out == 0).all()
