"""KVCache: storage, views, errors, and cached decoding equal to the full pass."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import attnkit
from attnkit.cache import KVCache

B, K, E = 2, 2, 3


def _kv(length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, K, length, E, dtype=dtype), torch.randn(B, K, length, E, dtype=dtype)


def test_update_returns_everything_so_far() -> None:
    cache = KVCache(B, K, 8, E)
    chunks = [_kv(3), _kv(1), _kv(4)]
    for i, (k, v) in enumerate(chunks):
        all_k, all_v = cache.update(k, v)
        assert torch.equal(all_k, torch.cat([c[0] for c in chunks[: i + 1]], dim=2))
        assert torch.equal(all_v, torch.cat([c[1] for c in chunks[: i + 1]], dim=2))
    assert cache.length == 8 == cache.capacity


def test_update_returns_views_of_the_preallocated_storage() -> None:
    cache = KVCache(B, K, 5, E)
    storage = cache.k.data_ptr()
    all_k, _ = cache.update(*_kv(2))
    all_k2, _ = cache.update(*_kv(2))
    assert all_k.data_ptr() == all_k2.data_ptr() == storage  # no reallocation
    assert cache.k.shape == (B, K, 5, E)


def test_slots_are_an_empty_cache_over_one_rows_later_slots() -> None:
    cache = KVCache(B, K, 6, E)
    part = cache.slots(1, 2)
    assert (part.capacity, part.length) == (4, 0) and part.k.shape == (1, K, 4, E)
    k, v = torch.randn(1, K, 3, E), torch.randn(1, K, 3, E)
    got_k, got_v = part.update(k, v)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # stored in the whole cache's row 1, slots 2-4; nothing else written
    assert torch.equal(cache.k[1, :, 2:5], k[0]) and torch.equal(cache.v[1, :, 2:5], v[0])
    assert not cache.k[0].any() and not cache.k[1, :, :2].any() and not cache.k[1, :, 5].any()
    assert cache.length == 0
    with pytest.raises(ValueError, match="KVCache capacity exceeded"):
        part.update(torch.randn(1, K, 2, E), torch.randn(1, K, 2, E))
    for row, start in ((2, 0), (-1, 0), (0, 6)):
        with pytest.raises(ValueError, match=f"got row={row}, start={start}"):
            cache.slots(row, start)
    both = cache.slots(0, 5, rows=2)  # (several rows: a run of prompts filled in together)
    assert both.k.shape == (2, K, 1, E) and both.capacity == 1
    both.update(torch.ones(2, K, 1, E), torch.ones(2, K, 1, E))
    assert cache.k[:, :, 5].eq(1).all() and cache.v[:, :, 5].eq(1).all()
    for row, rows in ((1, 2), (0, 0), (0, 3)):
        with pytest.raises(ValueError, match=f"rows={rows}"):
            cache.slots(row, 0, rows)


def test_reset_forgets_positions_and_keeps_storage() -> None:
    cache = KVCache(B, K, 4, E)
    cache.update(*_kv(4))
    storage = cache.k.data_ptr()
    cache.reset()
    assert cache.length == 0
    k, v = _kv(2)
    all_k, all_v = cache.update(k, v)
    assert torch.equal(all_k, k) and torch.equal(all_v, v)
    assert cache.k.data_ptr() == storage


def test_buffers_are_not_saved_and_follow_the_module() -> None:
    cache = KVCache(B, K, 4, E, dtype=torch.float64)
    assert cache.k.dtype == cache.v.dtype == torch.float64
    assert cache.state_dict() == {}
    cache.to(torch.float16)
    assert cache.k.dtype == torch.float16


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"sizes must be positive, got \{'capacity': 0\}"):
        KVCache(B, K, 0, E)
    cache = KVCache(B, K, 4, E)
    cache.update(*_kv(3))
    with pytest.raises(ValueError, match=r"capacity exceeded: 3 cached \+ 2 new = 5 > capacity 4"):
        cache.update(*_kv(2))
    assert cache.length == 3  # a failed update changes nothing
    with pytest.raises(ValueError, match=r"got k=\(2, 1, 1, 3\)"):
        cache.update(torch.randn(B, 1, 1, E), torch.randn(B, 1, 1, E))
    with pytest.raises(ValueError, match=r"v=\(2, 2, 1, 4\)"):
        cache.update(torch.randn(B, K, 1, E), torch.randn(B, K, 1, 4))


def test_kv_cache_decoding_equals_full_causal_pass() -> None:
    m = attnkit.MultiHeadAttention(12, 4, num_kv_heads=2, causal=True).eval()
    x = torch.randn(B, 6, 12)
    full, _ = m(x)
    cache = attnkit.KVCache(B, 2, 6, 3)
    steps = [m(x[:, :3], kv_cache=cache)[0]]
    steps += [m(x[:, i : i + 1], kv_cache=cache)[0] for i in range(3, 6)]
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"capacity exceeded: 6 cached \+ 1 new = 7 > capacity 6"):
        m(x[:, :1], kv_cache=cache)
    cache.reset()
    assert cache.length == 0
    assert_close(m(x, kv_cache=cache)[0], full)


def test_update_validates_shape_and_dtype() -> None:
    cache = KVCache(B, K, 4, E)
    k3 = torch.randn(B, 1, E)
    with pytest.raises(ValueError, match=r"same shape \(B, K, L, E\), got k=\(2, 1, 3\)"):
        cache.update(k3, k3)
    with pytest.raises(TypeError, match=r"KVCache stores torch.float32, got k torch.float64"):
        cache.update(*_kv(1, torch.float64))  # never cast silently
    k, v = _kv(1)
    with pytest.raises(TypeError, match=r"got k torch.float32 and v torch.float16"):
        cache.update(k, v.half())
    with pytest.raises(TypeError, match=r"takes tensors, got k=list"):
        cache.update([1.0], v)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sizes must be ints, got \{'capacity': 2.5\}"):
        KVCache(B, K, 2.5, E)  # type: ignore[arg-type]
    assert cache.length == 0  # rejected updates store nothing
    half = KVCache(B, K, 4, E, dtype=torch.float64)
    k, v = _kv(2, torch.float64)
    assert torch.equal(half.update(k, v)[0], k)  # float64 storage keeps float64 exactly


def test_static_slots_equal_appending() -> None:
    """write() at cache_position tensors (the compiled step's form) gives what update() gives."""
    m = attnkit.MultiHeadAttention(12, 4, num_kv_heads=2, causal=True, window=3).eval()
    x = torch.randn(B, 6, 12)
    full, _ = m(x)
    cache = attnkit.KVCache(B, 2, 8, 3)
    steps = [m(x[:, :3], kv_cache=cache)[0]]  # prefill appends
    for i in range(3, 6):
        out, _ = m(x[:, i : i + 1], kv_cache=cache, cache_position=torch.tensor([i]))
        steps.append(out)
    assert cache.length == 3  # the static form leaves the Python counter alone
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    mask = cache.slot_mask(torch.tensor([4]), window=3)
    assert mask.tolist() == [[False, False, True, True, True, False, False, False]]
