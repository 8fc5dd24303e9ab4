"""attnkit's row kernels (``attnkit.kernels.rows``): rotary positions against torch's rotation."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

from attnkit.kernels import build, rows

needs_kernel = pytest.mark.skipif(
    not build.kernels_available(), reason=f"no attnkit kernels: {build.kernels_unavailable()}"
)


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
    got = rows.rotate(x, *full, interleaved=interleaved)
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
    assert_close(rows.rotate(x, *per_row, interleaved=interleaved), got, atol=0, rtol=0)
    assert_close(rows.rotate(x[1], *full, interleaved=interleaved), got[1], atol=0, rtol=0)


@needs_kernel
def test_rotary_inference_runs_the_kernel_and_training_torchs_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from attnkit.positional import RotaryEmbedding

    rotary = RotaryEmbedding(16, interleaved=False)
    x = torch.randn(2, 3, 7, 16)
    calls: list[torch.Size] = []
    kernel = rows.rotate
    monkeypatch.setattr(
        rows, "rotate", lambda x, *a, **k: calls.append(x.shape) or kernel(x, *a, **k)
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
        rows.rotate(x.double(), table, table, interleaved=True)
    with pytest.raises(TypeError, match=r"cos torch\.bfloat16"):
        rows.rotate(x, table.bfloat16(), table, interleaved=True)
    with pytest.raises(
        ValueError, match=r"tables \(L, E\) or \(B, 1, L, E\), got x \(1, 2, 3, 8\)"
    ):
        rows.rotate(x, torch.zeros(4, 8), torch.zeros(4, 8), interleaved=True)
    with pytest.raises(ValueError, match=r"\(B, H, L, E\), \(H, L, E\) or \(L, E\)"):
        rows.rotate(x[0, 0, 0], table[0], table[0], interleaved=True)
