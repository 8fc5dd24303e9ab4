"""The paged KV cache: the block pool's bookkeeping and the attention through block tables
against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from attnkit.cache import AttendingCache
from attnkit.kernels.build import kernels_available
from attnkit.kernels.one_query import paged_one_query_attention
from attnkit.serving import paged
from attnkit.serving.paged import (
    BlockPool,
    PagedKVCache,
    SequenceSlice,
    block_hash,
)
from tests.reference import bottom_right_causal, reference_attention


def test_pool_allocates_lowest_first_and_counts() -> None:
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.allocate() is None and pool.num_used == 4 and pool.num_free == 0
    pool.release(2)
    pool.release(0)
    assert pool.num_free == 2 and pool.allocate() == 0
    with pytest.raises(ValueError, match="block 2 is not held"):
        pool.release(2)
    with pytest.raises(ValueError, match="block 7 is not held"):
        pool.release(7)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_prefix_cache_refcounts_and_lru_eviction() -> None:
    pool = BlockPool(3)
    a, b = block_hash(None, [1, 2]), block_hash(None, [3, 4])
    assert block_hash(a, [5, 6]) != block_hash(b, [5, 6])  # chained: same block, other prefix
    x, y = pool.allocate(), pool.allocate()
    assert x is not None and y is not None
    pool.register(x, a)
    pool.register(y, b)
    assert pool.lookup(a) == x and pool.refs[x] == 2  # shared while held
    pool.release(x)
    pool.release(x)  # nobody holds it: free, still cached
    pool.release(y)  # released later: evicted later
    assert pool.num_free == 3 and pool.num_used == 0
    assert pool.lookup(b) == y and pool.refs[y] == 1  # reused from the cache
    pool.release(y)
    z = pool.allocate()  # the never-used block first
    assert z not in (x, y)
    assert pool.allocate() == x  # then the least recently released cached one, evicted
    assert pool.lookup(a) is None and pool.lookup(b) == y


def test_register_keeps_the_first_block_of_a_prefix() -> None:
    pool = BlockPool(2)
    key = block_hash(None, [9])
    first, second = pool.allocate(), pool.allocate()
    assert first is not None and second is not None
    pool.register(first, key)
    pool.register(second, key)
    assert pool.lookup(key) == first
    pool.release(second)
    assert pool.num_free == 1 and pool.allocate() == second


def make_cache(dtype: torch.dtype, K: int = 2, E: int = 8) -> PagedKVCache:
    return PagedKVCache(
        num_layers=1, num_blocks=12, block_size=4, num_kv_heads=K, head_dim=E, dtype=dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "K"), [(6, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (None, 5.0)])
@pytest.mark.parametrize("in_place", [True, False])
def test_paged_attention_equals_dense_reference(
    dtype: torch.dtype,
    H: int,
    K: int,
    window: int | None,
    softcap: float | None,
    in_place: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both decoding paths: the paged kernel reading through the block tables, and the gathered
    keys through the functional core (where the policy does not pick attnkit's kernel)."""
    if not in_place:
        monkeypatch.setattr(paged.policy, "one_query_kernel", lambda *args: False)
    E = 8
    cache = make_cache(dtype, K, E)
    # Three decoding sequences (one new token after 5, 0 and 9 cached ones) and two chunks
    # (3 new after 6 cached, 5 new from the start); blocks scattered through the pool.
    parts = [
        SequenceSlice([7, 2], 5, 1),
        SequenceSlice([4], 0, 1),
        SequenceSlice([0, 9, 11], 9, 1),
        SequenceSlice([3, 10, 5], 6, 3),
        SequenceSlice([1, 8], 0, 5),
    ]
    totals = [p.start + p.length for p in parts]
    keys = [torch.randn(K, n, E, dtype=dtype) for n in totals]  # each sequence's whole keys
    values = [torch.randn(K, n, E, dtype=dtype) for n in totals]
    k_pool, v_pool = cache.storage[0]
    for p, k, v in zip(parts, keys, values, strict=True):  # the cached positions
        slots = torch.tensor(cache.slots(p.blocks, 0, p.start), dtype=torch.long)
        k_pool[slots] = k[:, : p.start].transpose(0, 1)
        v_pool[slots] = v[:, : p.start].transpose(0, 1)
    batch = cache.plan(parts)
    new = [slice(p.start, p.start + p.length) for p in parts]
    q = torch.randn(1, H, sum(p.length for p in parts), E, dtype=dtype)
    k_new = torch.cat([k[:, s] for k, s in zip(keys, new, strict=True)], dim=1)[None]
    v_new = torch.cat([v[:, s] for v, s in zip(values, new, strict=True)], dim=1)[None]
    layer = cache.layers()[0]
    assert isinstance(layer, AttendingCache)
    out = layer.attend(q, k_new, v_new, scale=0.3, window=window, softcap=softcap)
    assert batch.singles == 3
    first = 0
    for p, k, v in zip(parts, keys, values, strict=True):
        L, S = p.length, p.start + p.length
        allowed = bottom_right_causal(L, S)
        if window is not None:
            pos = torch.arange(S)
            allowed &= pos[None, :] > (pos[-L:, None] - window)
        expected, _ = reference_attention(
            q[0, :, first : first + L], k, v, allowed, scale=0.3, softcap=softcap
        )
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(
            out[0, :, first : first + L].double(), expected, atol=tol, rtol=tol
        )
        first += L


def test_plan_checks_its_parts() -> None:
    cache = make_cache(torch.float32)
    with pytest.raises(ValueError, match=r"one-token parts first, got lengths \[3, 1\]"):
        cache.plan([SequenceSlice([0], 0, 3), SequenceSlice([1], 0, 1)])
    with pytest.raises(ValueError, match=r"lengths \[0\]"):
        cache.plan([SequenceSlice([0], 0, 0)])
    with pytest.raises(ValueError, match="holds 4 positions, not 6"):
        cache.plan([SequenceSlice([0], 2, 4)])
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(num_layers=1, num_blocks=0, block_size=4, num_kv_heads=1, head_dim=4)


def test_layer_needs_a_plan_of_its_shape() -> None:
    cache = make_cache(torch.float32)
    layer = cache.layers()[0]
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError, match="plan"):
        layer.attend(q, k, k, scale=1.0, window=None, softcap=None)
    cache.plan([SequenceSlice([0], 0, 3)])
    with pytest.raises(ValueError, match=r"packs 3 tokens in one row, got queries \(1, 2, 2, 8\)"):
        layer.attend(q, k, k, scale=1.0, window=None, softcap=None)


def test_memory_follows_tokens_held() -> None:
    cache = make_cache(torch.float32)
    # keys and values of 2 heads x 8 dims, float32, over one layer
    assert cache.bytes_per_token == 2 * 2 * 8 * 4
    assert cache.bytes_per_block == 4 * cache.bytes_per_token


@pytest.mark.skipif(not kernels_available(), reason="the compiled kernels do not build here")
def test_paged_kernel_rejects_keys_outside_the_pool() -> None:
    q, pool = torch.randn(1, 2, 1, 4), torch.randn(8, 1, 4)
    rows = torch.tensor([[0, 3, 9]], dtype=torch.int32)
    one = torch.tensor([1])
    out, flags = paged_one_query_attention(q, pool, pool, rows, one, one, 0.5)
    expected, _ = reference_attention(q[0], pool[3].view(1, 1, 4), pool[3].view(1, 1, 4))
    torch.testing.assert_close(out[0].double(), expected)
    assert flags == 0
    with pytest.raises(ValueError, match=r"outside the pool \(8 rows\)"):
        paged_one_query_attention(q, pool, pool, rows, one, torch.tensor([2]), 0.5)
    with pytest.raises(ValueError, match="width 3"):
        paged_one_query_attention(q, pool, pool, rows, torch.tensor([2]), torch.tensor([2]), 0.5)
    with pytest.raises(TypeError, match="int32 rows"):
        paged_one_query_attention(q, pool, pool, rows.long(), one, one, 0.5)


def test_model_forward_over_a_packed_paged_batch_equals_separate_forwards() -> None:
    from attnkit import TransformerLM
    from attnkit.config import FAMILIES, TransformerConfig

    config = TransformerConfig(
        97, 32, 2, 4, num_kv_heads=2, ffn_dim=64, max_seq_len=64, window=5, **FAMILIES["llama"]
    )
    lm = TransformerLM(config).eval()
    cache = PagedKVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    a, b = torch.randint(0, 97, (1, 7)), torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        # a's first 6 tokens in one forward, then a's last token and all of b packed together
        cache.plan([SequenceSlice([5, 1], 0, 6)])
        lm(a[:, :6], positions=torch.arange(6)[None], kv_caches=cache.layers())
        cache.plan([SequenceSlice([5, 1], 6, 1), SequenceSlice([0, 7, 3], 0, 10)])
        ids = torch.cat([a[:, 6:], b], dim=1)
        positions = torch.cat([torch.tensor([6]), torch.arange(10)])[None]
        at = torch.tensor([0, 10])
        packed = lm(ids, positions=positions, kv_caches=cache.layers(), logits_at=at)
        separate = torch.stack([lm(a)[0, -1], lm(b)[0, -1]])
    torch.testing.assert_close(packed[0], separate, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs explicit positions"):
        lm(a[:, :1], kv_caches=cache.layers())
    with pytest.raises(ValueError, match=r"logits_at takes one \(packed\) row.*got batch 2"):
        lm(torch.cat([a, a]), logits_at=at)
