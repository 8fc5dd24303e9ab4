"""attnkit.distributed: ring attention over real gloo processes equals attention on the whole
sequence in float64, values and q/k/v gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnkit.distributed import (
    RingKernel,
    ring_attention,
    shard,
    shard_positions,
    unshard,
)
from tests.reference import reference_attention


def _inputs(B, H, K, N, E, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, E, generator=gen).transpose(1, 2)  # a projection's memory
    k = torch.randn(B, K, N, E, generator=gen)
    v = torch.randn(B, K, N, E, generator=gen)
    grad = torch.randn(B, H, N, E, generator=gen)
    return q, k, v, grad


def _worker(rank, world, init, case):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for one in case if isinstance(case, list) else [case]:
            _check_case(rank, world, one)
    finally:
        dist.destroy_process_group()


def _check_case(rank, world, case):
    """One case: this rank's output and gradients against the float64 whole sequence."""
    B, H, K, N, E, causal, layout, *rest = case
    options = {"chunk": rest[0]} if rest else {}
    q, k, v, grad = _inputs(B, H, K, N, E, seed=N + H + int(causal))
    # The reference on the whole sequence, in float64.
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    allowed = torch.ones(N, N, dtype=torch.bool).tril() if causal else None
    ref, _ = reference_attention(*leaves, allowed)
    ref_grads = torch.autograd.grad(ref, leaves, grad.double())
    # This rank's shards, in float32.
    mine = [shard(t, 2, rank, world, layout=layout).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, causal=causal, layout=layout, **options)
    grads = torch.autograd.grad(out, mine, shard(grad, 2, rank, world, layout=layout))
    expected = [shard(t, 2, rank, world, layout=layout) for t in (ref, *ref_grads)]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), expected, strict=True):
        assert got.dtype == torch.float32, name
        err = (got.double() - want).abs().max().item()
        assert err < 1e-5, f"rank {rank}: {name} differs by {err:.2e} ({case})"


def _spawn(world, case, tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(world, init, case), nprocs=world, join=True)


@pytest.mark.parametrize("causal", [False, True])
def test_two_ranks_equal_whole_sequence(causal, tmp_path):
    _spawn(2, (1, 2, 2, 1024, 16, causal, "contiguous"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "causal, layout, heads, N",
    [
        (False, "contiguous", (4, 2), 1024),
        (True, "contiguous", (4, 2), 2048),
        (True, "zigzag", (2, 1), 1024),
        (True, "zigzag", (1, 1), 4096),
    ],
)
def test_four_ranks_equal_whole_sequence(causal, layout, heads, N, tmp_path):
    # Four ranks on a 2-core machine; GQA and the zigzag layout (each process holds the
    # float64 reference of the whole sequence, so the long case has one head).
    H, K = heads
    _spawn(4, (2 if N < 4096 else 1, H, K, N, 8, causal, layout), tmp_path)


def test_blocks_travel_in_pieces(tmp_path):
    # 3 uneven pieces of 85-86 keys per shard of 256: the diagonal piece is cut too.
    layouts = [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")]
    _spawn(2, [(1, 4, 2, 512, 8, c, layout, 90) for c, layout in layouts], tmp_path)


def test_zigzag_on_two_ranks(tmp_path):
    _spawn(2, (1, 2, 1, 512, 8, True, "zigzag"), tmp_path)


def test_one_process_without_a_group_is_local_attention():
    q, k, v, grad = _inputs(2, 4, 2, 48, 8, seed=0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, causal=True, scale=0.3)
    ref, _ = reference_attention(q, k, v, torch.ones(48, 48, dtype=torch.bool).tril(), scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert not dist.is_initialized()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(
        *ref_leaves, torch.ones(48, 48, dtype=torch.bool).tril(), scale=0.3
    )
    want = torch.autograd.grad(ref, ref_leaves, grad.double())
    got = torch.autograd.grad(out, leaves, grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)


def test_shard_positions_and_unshard():
    assert shard_positions(8, 1, 2).tolist() == [4, 5, 6, 7]
    assert shard_positions(8, 0, 2, layout="zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 1, 2, layout="zigzag").tolist() == [2, 3, 4, 5]
    x = torch.arange(24).view(2, 12)
    for layout in ("contiguous", "zigzag"):
        parts = [shard(x, 1, r, 3, layout=layout) for r in range(3)]
        assert torch.equal(unshard(parts, 1, layout=layout), x)
    # The zigzag shards of a causal sequence carry equal numbers of allowed pairs.
    areas = [int(shard_positions(64, r, 4, layout="zigzag").add(1).sum()) for r in range(4)]
    assert len(set(areas)) == 1


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: shard_positions(10, 0, 4), ValueError, "divisible by 4"),
        (lambda: shard_positions(8, 0, 2, layout="zigzag2"), ValueError, "layout"),
        (lambda: shard_positions(8, 2, 2), ValueError, "rank=2"),
        (
            lambda: ring_attention(
                torch.ones(1, 3, 4, 2), torch.ones(1, 2, 4, 2), torch.ones(1, 2, 4, 2)
            ),
            ValueError,
            "multiple",
        ),
        (
            lambda: ring_attention(
                torch.ones(1, 2, 4, 2), torch.ones(1, 2, 6, 2), torch.ones(1, 2, 6, 2), causal=True
            ),
            ValueError,
            "L=4, S=6",
        ),
        (
            lambda: ring_attention(torch.ones(2, 4, 2), torch.ones(2, 4, 2), torch.ones(2, 4, 2)),
            ValueError,
            "heads",
        ),
        (
            lambda: ring_attention(
                torch.ones(1, 1, 4, 2),
                torch.ones(1, 1, 4, 2, dtype=torch.float64),
                torch.ones(1, 1, 4, 2),
            ),
            TypeError,
            "dtypes",
        ),
        (
            lambda: ring_attention(
                torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), scale=-1.0
            ),
            ValueError,
            "scale",
        ),
        (
            lambda: RingKernel()(
                torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), window=2
            ),
            ValueError,
            "window",
        ),
        (lambda: RingKernel(layout="x"), ValueError, "layout"),
    ],
)
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_ring_kernel_has_the_attend_signature():
    q, k, v, _ = _inputs(1, 2, 2, 16, 4, seed=1)
    out, weights = RingKernel()(q, k, v, None, causal=True, scale=None, dropout_p=0.0)
    ref, _ = reference_attention(q, k, v, torch.ones(16, 16, dtype=torch.bool).tril())
    assert weights is None
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)
