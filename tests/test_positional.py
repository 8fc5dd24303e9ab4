"""Positional encodings: the blog's classes, rotary conventions and the relative-position facts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnkit.attention import MultiHeadAttention
from attnkit.blog import PositionalMultiHeadSelfAttention
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    apply_rope,
    convert_rotary_convention,
    permute_rotary_weight,
    rope_cos_sin,
    rope_inv_freq,
    sinusoidal_table,
)
from tests.blog_reference import (
    BlogPositionalMultiHeadSelfAttention,
    BlogSinusoidalPositionalEncoding,
    blog_apply_rope,
    blog_rope_cos_sin,
    rope_reference,
)
from tests.helpers import ROPE_LLAMA3 as LLAMA3

# ---------------------------------------------------------------------------------- sinusoidal


@pytest.mark.parametrize("dim", [1, 7, 8, 33])
def test_sinusoidal_matches_blog(dim: int) -> None:
    ours = SinusoidalPositionalEncoding(dim, max_seq_len=50)
    blog = BlogSinusoidalPositionalEncoding(dim, max_seq_len=50)
    assert ours.pe.shape == (50, dim)
    assert ours.pe.dtype == torch.float32
    assert_close(ours.pe, blog.pe, rtol=0, atol=0)
    assert ours.state_dict() == {}  # a recomputable table is not persisted
    x = torch.randn(2, 11, dim)
    assert_close(ours(x), blog(x))


@pytest.mark.parametrize("dim", [5, 8])
def test_sinusoidal_columns_are_sin_and_cos(dim: int) -> None:
    pe = sinusoidal_table(20, dim, base=100.0).double()
    p = torch.arange(20, dtype=torch.float64)[:, None]
    for c in range(dim):
        w = 100.0 ** (-(c - c % 2) / dim)
        expected = torch.sin(p * w) if c % 2 == 0 else torch.cos(p * w)
        assert_close(pe[:, c : c + 1], expected, atol=1e-5, rtol=0)


def test_sinusoidal_too_long_names_both_lengths() -> None:
    enc = SinusoidalPositionalEncoding(8, max_seq_len=10)
    with pytest.raises(ValueError, match=r"12.*10"):
        enc(torch.zeros(1, 12, 8))
    with pytest.raises(ValueError, match=r"10"):
        enc(torch.zeros(1, 2, 8), torch.tensor([3, 10]))


def test_sinusoidal_explicit_positions_gather_rows() -> None:
    enc = SinusoidalPositionalEncoding(6, max_seq_len=32)
    x = torch.randn(2, 3, 6)
    pos = torch.tensor([[5, 6, 7], [0, 1, 2]])
    out = enc(x, pos)
    assert_close(out[0], x[0] + enc.pe[5:8])
    assert_close(out[1], enc(x[1:])[0])


def _shift_matrix(dim: int, d: int, base: float = 10_000.0) -> torch.Tensor:
    """Block-diagonal rotation A_d with PE(p + d) = A_d PE(p), built from d alone."""
    A = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):
        w = base ** (-2 * i / dim)
        c, s = math.cos(w * d), math.sin(w * d)
        # [sin(w(p+d)), cos(w(p+d))] = [[c, s], [-s, c]] @ [sin(wp), cos(wp)]
        A[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, s], [-s, c]])
    return A


@settings(max_examples=40, deadline=None)
@given(p=st.integers(0, 200), d=st.integers(0, 200), half=st.integers(1, 16))
def test_sinusoidal_shift_is_position_independent_linear_map(p: int, d: int, half: int) -> None:
    dim = 2 * half
    pe = sinusoidal_table(401, dim).double()
    A = _shift_matrix(dim, d)
    assert_close(pe[p + d], A @ pe[p], atol=1e-4, rtol=0)
    assert_close(A.T @ A, torch.eye(dim, dtype=torch.float64))  # a rotation: norms preserved


def test_learned_positions_add_rows_and_check_length() -> None:
    emb = LearnedPositionalEmbedding(8, 4)
    x = torch.randn(2, 5, 4)
    assert_close(emb(x), x + emb.weight[:5])
    with pytest.raises(ValueError, match=r"9.*8"):
        emb(torch.zeros(1, 9, 4))


# ----------------------------------------------------------------------------------- rotary


def test_rope_functions_match_blog() -> None:
    cos, sin = rope_cos_sin(12, 8, "cpu")
    bcos, bsin = blog_rope_cos_sin(12, 8)
    assert cos.shape == (12, 4) and cos.dtype == torch.float32
    assert_close(cos, bcos, rtol=0, atol=0)
    assert_close(sin, bsin, rtol=0, atol=0)
    x = torch.randn(2, 3, 12, 8)
    assert_close(apply_rope(x, cos, sin), blog_apply_rope(x, bcos, bsin))
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(4, 7, "cpu")


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_matches_float64_definition(interleaved: bool) -> None:
    rot = RotaryEmbedding(8, base=500.0, interleaved=interleaved)
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    pos = torch.arange(6)
    assert_close(rot(x), rope_reference(x, pos, base=500.0, interleaved=interleaved))
    assert_close(
        rot(x, offset=40), rope_reference(x, pos + 40, base=500.0, interleaved=interleaved)
    )
    packed = torch.tensor([[0, 1, 2, 0, 1, 2], [7, 8, 9, 10, 11, 12]])  # per-sequence positions
    expected = rope_reference(x, packed[:, None, :], base=500.0, interleaved=interleaved)
    assert_close(rot(x, packed), expected)


def test_rotary_odd_head_dim_is_value_error() -> None:
    with pytest.raises(ValueError, match="7"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="even"):
        PositionalMultiHeadSelfAttention(14, 2, use_rope=True)


def test_rotary_tables_are_float32_buffers_recomputed_when_stale() -> None:
    rot = RotaryEmbedding(8)
    assert rot.state_dict() == {}
    rot(torch.randn(1, 1, 5, 8))
    assert rot.cos.dtype == torch.float32 and rot.cos.shape[0] >= 5
    n = rot.cos.shape[0]
    rot(torch.randn(1, 1, 3, 8), offset=n)  # past the table: grows
    assert rot.cos.shape[0] >= n + 3
    rot.half()  # module casts turn the tables to fp16; they must be rebuilt in float32
    assert rot.cos.dtype == torch.float16
    x = torch.randn(1, 1, 4, 8, dtype=torch.float16)
    out = rot(x, offset=100)
    assert rot.cos.dtype == torch.float32
    assert out.dtype == torch.float16


def test_rotary_tables_built_in_inference_mode_still_train() -> None:
    rot = RotaryEmbedding(8)
    with torch.inference_mode():
        rot(torch.randn(1, 1, 4, 8))
    x = torch.randn(1, 1, 4, 8, requires_grad=True)
    rot(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_half_precision_uses_float32_phases_at_large_positions(dtype: torch.dtype) -> None:
    rot = RotaryEmbedding(64)
    x = torch.randn(1, 2, 4, 64).to(dtype)
    pos = torch.arange(30_000, 30_004)
    out = rot(x, pos)
    assert out.dtype == dtype
    expected = rope_reference(x, pos)  # float64 rotation of the same rounded input
    # Only the final rounding to `dtype` may differ: half an ulp. Phases computed in float32
    # arithmetic (p * inv_freq) are off by ~p * 6e-8 rad and fail this by 10-200x.
    eps = torch.finfo(dtype).eps
    assert_close(out.double(), expected, atol=1e-6, rtol=0.6 * eps)


@settings(max_examples=30, deadline=None)
@given(
    p=st.integers(0, 3000),
    s=st.integers(0, 3000),
    shift=st.integers(-2000, 2000),
    interleaved=st.booleans(),
)
def test_rotary_scores_depend_only_on_offset(p: int, s: int, shift: int, interleaved: bool) -> None:
    shift = max(shift, -min(p, s))
    g = torch.Generator().manual_seed(p * 7919 + s)
    q, k = torch.randn(2, 16, dtype=torch.float64, generator=g).unbind(0)
    rot = RotaryEmbedding(16, interleaved=interleaved)

    def score(a: int, b: int) -> torch.Tensor:
        rq = rot(q[None], torch.tensor([a]))[0]
        rk = rot(k[None], torch.tensor([b]))[0]
        return rq @ rk

    assert_close(score(p, s), score(p + shift, s + shift), atol=1e-5, rtol=1e-5)
    # rotation preserves norms
    assert_close(rot(q[None], torch.tensor([p])).norm(), q.norm(), atol=1e-5, rtol=1e-5)


def test_permute_rotary_weight_roundtrip_and_pattern() -> None:
    w = torch.arange(16.0)[:, None].expand(16, 3)
    split = permute_rotary_weight(w, 2, to="split")
    assert split[:8, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert_close(permute_rotary_weight(split, 2, to="interleaved"), w)
    with pytest.raises(ValueError, match="heads"):
        permute_rotary_weight(w, 3, to="split")


@pytest.mark.parametrize("fused", [True, False])
def test_interleaved_with_permuted_weights_equals_split_halves(fused: bool) -> None:
    inter = MultiHeadAttention(
        32,
        4,
        num_kv_heads=2,
        fused_qkv=fused,
        causal=True,
        rotary=RotaryEmbedding(8, interleaved=True),
    )
    split = MultiHeadAttention(
        32,
        4,
        num_kv_heads=2,
        fused_qkv=fused,
        causal=True,
        rotary=RotaryEmbedding(8, interleaved=False),
    )
    # Permute by hand: q rows per query head, k rows per key/value head.
    sd = {k: v.clone() for k, v in inter.state_dict().items()}
    for suffix in ("weight", "bias"):
        if fused:
            t = sd[f"qkv_proj.{suffix}"]
            t[:32] = permute_rotary_weight(t[:32], 4, to="split")
            t[32:48] = permute_rotary_weight(t[32:48], 2, to="split")
        else:
            sd[f"q_proj.{suffix}"] = permute_rotary_weight(sd[f"q_proj.{suffix}"], 4, to="split")
            sd[f"k_proj.{suffix}"] = permute_rotary_weight(sd[f"k_proj.{suffix}"], 2, to="split")
    split.load_state_dict(sd, strict=True)
    x = torch.randn(2, 9, 32)
    assert_close(split(x)[0], inter(x)[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(
        split(x)[0],
        MultiHeadAttention(
            32,
            4,
            num_kv_heads=2,
            fused_qkv=fused,
            causal=True,
            rotary=RotaryEmbedding(8, interleaved=False),
        )(x)[0],
    )
    # The in-place converter does the same, and back.
    expected = inter(x)[0]
    convert_rotary_convention(inter, to="split")
    assert inter.rotary.interleaved is False
    assert_close(inter(x)[0], expected, atol=1e-5, rtol=1e-5)
    convert_rotary_convention(inter, to="interleaved")
    assert_close(inter(x)[0], expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------- the blog's positional attention


@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_positional_attention_loads_blog_state_dict(use_rope: bool, causal: bool) -> None:
    blog = BlogPositionalMultiHeadSelfAttention(32, 4, causal=causal, use_rope=use_rope)
    ours = PositionalMultiHeadSelfAttention(32, 4, causal=causal, use_rope=use_rope)
    ours.load_state_dict(blog.state_dict(), strict=True)
    assert ours.use_rope is use_rope and ours.head_dim == 8
    x = torch.randn(2, 10, 32)
    mask = torch.rand(2, 1, 10, 10) > 0.3
    mask[..., 0] = True  # the blog gives NaN on fully masked rows; keep one key per row
    assert_close(ours(x), blog(x), atol=1e-5, rtol=1e-5)
    assert_close(ours(x, mask), blog(x, mask), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ rotary scaling


def _scaled_inv_freq_by_hand(head_dim: int, base: float, scaling: dict[str, object]) -> list[float]:
    """Per-frequency float64 formulas of linear and Llama 3.1 scaling (Meta's reference code)."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        factor = float(scaling["factor"])  # type: ignore[arg-type]
        if scaling["rope_type"] == "linear":
            out.append(freq / factor)
            continue
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])  # type: ignore[arg-type]
        old = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(freq)
        elif wavelen > old / lo:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_rope_scaling_inverse_frequencies_by_hand(scaling: dict[str, object]) -> None:
    expected = torch.tensor(_scaled_inv_freq_by_hand(12, 10_000.0, scaling), dtype=torch.float64)
    got = rope_inv_freq(12, 10_000.0, scaling)
    assert_close(got, expected, rtol=1e-12, atol=0)
    unscaled = rope_inv_freq(12, 10_000.0)
    if scaling is LLAMA3:  # the three regimes all occur for these sizes
        ratio = unscaled / got
        assert ratio[0] == 1 and ratio[-1] == 8 and 1 < ratio[1] < 8


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.5},
        LLAMA3,
        {**LLAMA3, "original_max_position_embeddings": 8192, "factor": 32.0},
    ],
)
def test_rope_scaling_equals_transformers(scaling: dict[str, object]) -> None:
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        rope_parameters={**scaling, "rope_theta": 500_000.0},
    )
    kind = str(scaling["rope_type"])
    inv_freq, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    assert attention_factor == 1.0
    ours = rope_inv_freq(64, 500_000.0, scaling)
    assert_close(ours.float(), inv_freq, rtol=2e-6, atol=0)
    # The module's tables are the cos/sin of positions times these frequencies.
    rot = RotaryEmbedding(64, base=500_000.0, interleaved=False, scaling=scaling)
    cos, sin = rot.tables(300)
    angles = torch.arange(cos.shape[0], dtype=torch.float64)[:, None] * ours
    assert_close(cos, angles.cos().float())
    assert_close(sin, angles.sin().float())
    x = torch.randn(1, 2, 300, 64)
    theta = angles[:300]  # (L, E/2), float64
    a, b = x.double().chunk(2, dim=-1)  # split halves (interleaved=False)
    rotated = torch.cat((a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()), -1)
    assert_close(rot(x), rotated.float())


def test_rope_scaling_is_validated_by_the_module() -> None:
    with pytest.raises(ValueError, match=r"missing \['factor'\]"):
        RotaryEmbedding(8, scaling={"rope_type": "linear"})
    assert "scaling" in repr(RotaryEmbedding(8, scaling={"type": "linear", "factor": 2.0}))
