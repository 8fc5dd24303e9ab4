"""attnkit.flex against torch's eager FlexAttention and float64 explicit math."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn.attention import flex_attention as torch_flex

from attnkit import flex
from attnkit import functional as F_attn
from attnkit.flex import (
    BlockMask,
    and_masks,
    captured_tensors,
    create_block_mask,
    flex_attention,
    noop_mask,
    or_masks,
)
from attnkit.flex import presets as P
from attnkit.flex.blockmask import EMPTY, FULL

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")

B, H = 2, 4


def _inputs(
    L: int,
    S: int,
    E: int = 16,
    K: int = H,
    Ev: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(B, H, L, E, dtype=dtype)
    k = torch.randn(B, K, S, E, dtype=dtype)
    v = torch.randn(B, K, S, Ev or E, dtype=dtype)
    return q, k, v


def _torch(q: Tensor, k: Tensor, v: Tensor, score_mod: Any, mask_mod: Any, **kw: Any) -> Any:
    L, S = q.shape[-2], k.shape[-2]
    bm = None if mask_mod is None else torch_flex.create_block_mask(mask_mod, B, H, L, S, "cpu")
    gqa = q.shape[1] != k.shape[1]
    out, aux = torch_flex.flex_attention(
        q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
        return_aux=torch_flex.AuxRequest(lse=True), **kw,
    )  # fmt: skip
    return out, aux.lse


def _ours(q: Tensor, k: Tensor, v: Tensor, score_mod: Any, mask_mod: Any, **kw: Any) -> Any:
    L, S = q.shape[-2], k.shape[-2]
    bm = None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=32)
    gqa = q.shape[1] != k.shape[1]
    return flex_attention(
        q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True, **kw
    )


def _explicit(q: Tensor, k: Tensor, v: Tensor, score_mod: Any, mask_mod: Any) -> Tensor:
    """float64-ready explicit math: scores, score_mod on the whole matrix, mask, softmax."""
    Bq, Hq, L, E = q.shape
    G = Hq // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(E)
    b = torch.arange(Bq).view(-1, 1, 1, 1)
    h = torch.arange(Hq).view(1, -1, 1, 1)
    qi = torch.arange(L).view(1, 1, -1, 1)
    kv = torch.arange(k.shape[-2]).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, kv)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, kv), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


_bias = torch.randn(B, H)


def _batch_head_bias(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + _bias[b, h] * (q - kv).abs().float().sqrt()


def _per_batch_mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (kv <= q + b * 3) & ((h + kv) % 5 != 0)


def _cases(L: int, S: int) -> dict[str, tuple[Any, Any]]:
    ids = torch.randint(0, 3, (B, S)).sort(dim=-1).values
    return {
        "causal": (None, P.causal()),
        "window": (None, P.sliding_window(9)),
        "prefix_lm": (None, P.prefix_lm(11)),
        "dilated": (None, P.dilated(3)),
        "document": (None, P.document(ids)),
        "document_shared": (None, P.document(ids[0])),
        "padding": (None, P.padding(torch.tensor([S // 3, S]))),
        "alibi_causal": (P.alibi(H), P.causal()),
        "relative_bias": (P.relative_bias(torch.randn(H, 9)), None),
        "softcap_window": (P.softcap(2.0), and_masks(P.causal(), P.sliding_window(13))),
        "custom_b_h_captured": (_batch_head_bias, _per_batch_mask),
        "or_masks": (None, or_masks(P.causal(), lambda b, h, q, kv: kv % 7 == b)),
        "noop": (None, noop_mask),
        "causal_padding": (None, and_masks(P.causal(), P.padding(torch.tensor([S - 5, S // 2])))),
    }


# (L, S, E, K, Ev): Ev == E takes torch's fused tile kernel where the mods allow it
_SHAPES = [(40, 40, 32, 4, 32), (40, 70, 64, 2, 32), (33, 33, 128, 1, 128)]


@pytest.mark.parametrize(
    ("name", "L", "S", "E", "K", "Ev"),
    [(name, *_SHAPES[i % len(_SHAPES)]) for i, name in enumerate(_cases(8, 8))],
)
def test_forward_and_lse_equal_torch_eager(
    name: str, L: int, S: int, E: int, K: int, Ev: int
) -> None:
    score_mod, mask_mod = _cases(L, S)[name]
    q, k, v = _inputs(L, S, E=E, K=K, Ev=Ev)
    out, lse = _ours(q, k, v, score_mod, mask_mod)
    want, want_lse = _torch(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, L)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=0)
    plain = flex_attention(
        q, k, v, score_mod=score_mod, enable_gqa=K != H,
        block_mask=None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S),
    )  # fmt: skip
    torch.testing.assert_close(plain, want, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_torch_block_mask_is_accepted_and_converted() -> None:
    q, k, v = _inputs(300, 300)
    mask = P.sliding_window(70)
    tbm = torch_flex.create_block_mask(mask, None, None, 300, 300, "cpu")
    want = torch_flex.flex_attention(q, k, v, block_mask=tbm)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=tbm), want, atol=2e-5, rtol=0)
    ours = BlockMask.from_torch(tbm)
    assert ours.seq_lengths == (300, 300) and tuple(tbm.BLOCK_SIZE) == ours.BLOCK_SIZE
    assert torch.equal(ours.to_dense(), tbm.to_dense().bool())
    out, lse = flex_attention(q, k, v, score_mod=P.alibi(H), block_mask=ours, return_lse=True)
    want, aux = torch_flex.flex_attention(
        q, k, v, P.alibi(H), tbm, return_aux=torch_flex.AuxRequest(lse=True)
    )
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse, aux.lse, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "mask", [P.causal(), P.sliding_window(100), P.prefix_lm(130), P.dilated(2), noop_mask]
)
def test_block_states_match_torch(mask: Any) -> None:
    ours = create_block_mask(mask, None, None, 512, 384)
    tbm = torch_flex.create_block_mask(mask, None, None, 512, 384, "cpu")
    assert torch.equal(ours.to_dense(), tbm.to_dense().bool())
    full = torch.zeros_like(ours.to_dense())
    for i in range(full.shape[2]):
        n = int(tbm.full_kv_num_blocks[0, 0, i])
        full[0, 0, i, tbm.full_kv_indices[0, 0, i, :n].long()] = True
    assert torch.equal(ours.states == FULL, full)
    assert ours.sparsity() == pytest.approx(tbm.sparsity())


def test_band_states_equal_evaluated_states() -> None:
    """Block states from block corners (band masks) equal those from evaluating the mask."""
    for mask in (P.sliding_window(37), and_masks(P.causal(), P.sliding_window(50)), P.causal()):
        fast = create_block_mask(mask, None, None, 200, 230, BLOCK_SIZE=(16, 24))
        slow = create_block_mask(lambda b, h, q, kv, m=mask: m(b, h, q, kv), None, None, 200, 230,
                                 BLOCK_SIZE=(16, 24))  # fmt: skip
        assert torch.equal(fast.states, slow.states)
        assert (fast.states == EMPTY).any()


def _grads(fn: Callable[[], Tensor], inputs: list[Tensor], g: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(fn(), inputs, g)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", ["closure", "default_arg", "relative_bias", "global"])
def test_gradients_reach_captured_tensors(name: str) -> None:
    L, S, K = 37, 50, 2
    q, k, v = (t.double().requires_grad_() for t in _inputs(L, S, K=K))
    table = torch.nn.Parameter(torch.randn(H, 11, dtype=torch.float64))
    if name == "closure":

        def score_mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
            return torch.tanh(s / 3) * 3 + table[h, (qi - kv).clamp(-5, 5) + 5]

    elif name == "default_arg":

        def score_mod(
            s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor, t: Tensor = table
        ) -> Tensor:
            return s * t[h, 0] + t[h, (qi - kv).clamp(-5, 5) + 5]

    elif name == "global":
        _GLOBAL_TABLE[:] = [table]
        score_mod = _global_bias
    else:
        score_mod = P.relative_bias(table)
    assert any(t is table for t in captured_tensors(score_mod))
    mask = P.prefix_lm(9)
    bm = create_block_mask(mask, B, H, L, S, BLOCK_SIZE=16)
    g = torch.randn(B, H, L, 16, dtype=torch.float64)
    inputs = [q, k, v, table]

    def ours() -> Tensor:
        return flex_attention(q, k, v, score_mod, bm, enable_gqa=True)  # type: ignore[return-value]

    got = _grads(ours, inputs, g)
    want = _grads(lambda: _explicit(q, k, v, score_mod, mask), inputs, g)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= 1e-4


_GLOBAL_TABLE: list[Tensor] = []


def _global_bias(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
    return s + _GLOBAL_TABLE[0][h, (qi - kv).clamp(-5, 5) + 5]


@pytest.mark.parametrize("name", ["alibi_causal", "window", "document", "padding", "none",
                                  "softcap_window", "dilated"])  # fmt: skip
def test_gradients_equal_float64_explicit(name: str) -> None:
    L = S = 45
    score_mod, mask_mod = {**_cases(L, S), "none": (None, None)}[name]
    q, k, v = (t.double().requires_grad_() for t in _inputs(L, S, K=2))
    bm = None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=16)
    g = torch.randn(B, H, L, 16, dtype=torch.float64)
    got = _grads(lambda: flex_attention(q, k, v, score_mod, bm, enable_gqa=True), [q, k, v], g)  # type: ignore[arg-type,return-value]
    want = _grads(lambda: _explicit(q, k, v, score_mod, mask_mod), [q, k, v], g)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= 1e-4


@pytest.mark.parametrize(
    ("mask", "score_mod", "options"),
    [
        (P.causal(), None, {"causal": True}),
        (P.sliding_window(8), None, {"causal": True, "window": 8}),
        (and_masks(P.causal(), P.sliding_window(8)), None, {"causal": True, "window": 8}),
        (and_masks(P.causal(), P.padding(torch.tensor([5, 9]))), None, {"causal": True}),
        (P.causal(), P.softcap(3.0), {"causal": True, "softcap": 3.0}),
        (None, None, {}),
    ],
)
def test_structures_go_to_functional(
    mask: Any, score_mod: Any, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real = F_attn.scaled_dot_product_attention

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(F_attn, "scaled_dot_product_attention", spy)
    q, k, v = _inputs(20, 20)
    bm = None if mask is None else create_block_mask(mask, B, H, 20, 20)
    out = flex_attention(q, k, v, score_mod, bm)
    assert len(calls) == 1 and options.items() <= calls[0].items()
    want = _explicit(q, k, v, score_mod, mask)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "mask", [P.dilated(2), P.prefix_lm(3), or_masks(P.causal(), P.padding(torch.tensor([1, 2])))]
)
def test_other_masks_take_the_tiled_path(mask: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F_attn, "scaled_dot_product_attention", None)
    q, k, v = _inputs(20, 20)
    out = flex_attention(q, k, v, block_mask=create_block_mask(mask, B, H, 20, 20))
    torch.testing.assert_close(out, _explicit(q, k, v, None, mask), atol=2e-5, rtol=0)


def test_causal_with_other_lengths_keeps_top_left_alignment() -> None:
    q, k, v = _inputs(12, 30)
    out = flex_attention(q, k, v, block_mask=create_block_mask(P.causal(), B, H, 12, 30))
    torch.testing.assert_close(out, _torch(q, k, v, None, P.causal())[0], atol=2e-5, rtol=0)


def test_rows_that_attend_nothing_are_zero_with_lse_minus_inf() -> None:
    q, k, v = _inputs(24, 24)
    mask = P.padding(torch.tensor([0, 24]))
    out, lse = _ours(q, k, v, None, and_masks(mask, P.causal()))
    want, want_lse = _torch(q, k, v, None, and_masks(mask, P.causal()))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -math.inf).all())
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse[1], want_lse[1], atol=2e-5, rtol=0)


def test_long_spans_merge_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A span longer than one chunk is merged by the online softmax, to the same answer."""
    from attnkit.kernels import policy

    monkeypatch.setattr(policy.attention, "FLEX_CHUNK_SCORES", 1)
    q, k, v = _inputs(40, 100)
    out, lse = _ours(q, k, v, P.alibi(H), P.prefix_lm(30))
    want, want_lse = _torch(q, k, v, P.alibi(H), P.prefix_lm(30))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=0)


def test_half_precision_is_computed_wide_and_cast_back() -> None:
    q, k, v = _inputs(20, 20, dtype=torch.bfloat16)
    bm = create_block_mask(P.dilated(2), B, H, 20, 20)
    out = flex_attention(q, k, v, P.alibi(H), bm)
    assert out.dtype == torch.bfloat16
    want = flex_attention(q.float(), k.float(), v.float(), P.alibi(H), bm)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=0)


def _bad_index(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return torch.ones(3)[q * 10] > 0


def _int_mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (q >= kv).int()


def _wide_mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return torch.ones(5, 5, 5, 5, dtype=torch.bool)


def _int_score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return q - kv


def _wide_score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s.unsqueeze(0).repeat(2, 1, 1, 1, 1)


def _failing_score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("mask_mod", "error", "match"),
    [
        (_bad_index, ValueError, "mask_mod _bad_index failed on index tensors"),
        (
            _int_mask,
            TypeError,
            "mask_mod _int_mask must return a bool tensor, got dtype torch.int32",
        ),
        (_wide_mask, ValueError, r"mask_mod _wide_mask returned shape \(5, 5, 5, 5\)"),
    ],
)
def test_bad_mask_mods_name_themselves(mask_mod: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        create_block_mask(mask_mod, B, H, 8, 8)


@pytest.mark.parametrize(
    ("score_mod", "error", "match"),
    [
        (_failing_score, ValueError, "score_mod _failing_score failed on a score tile.*boom"),
        (_int_score, TypeError, "score_mod _int_score must return a float tensor"),
        (_wide_score, ValueError, r"score_mod _wide_score returned shape \(2, 2, 2, 2, 3\)"),
        (P.alibi(3), ValueError, r"score_mod alibi\(3\) has 3 slopes for 4 heads"),
    ],
)
def test_bad_score_mods_name_themselves(score_mod: Any, error: type, match: str) -> None:
    q, k, v = _inputs(8, 8)
    with pytest.raises(error, match=match):
        flex_attention(q, k, v, score_mod=score_mod)


def test_bad_inputs_are_named() -> None:
    q, k, v = _inputs(8, 10, K=2)
    bm = create_block_mask(P.causal(), B, H, 8, 8)
    with pytest.raises(
        ValueError, match=r"mask_mod causal\) was built for \(Q_LEN, KV_LEN\) \(8, 8\)"
    ):
        flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        flex_attention(q, k, v)
    with pytest.raises(ValueError, match=r"B=3, H=4, but the inputs have B=2"):
        flex_attention(
            q, k, v, block_mask=create_block_mask(P.causal(), 3, H, 8, 10), enable_gqa=True
        )
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        flex_attention(q, k, v, block_mask="causal", enable_gqa=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sliding_window needs a positive int window, got 0"):
        P.sliding_window(0)
    with pytest.raises(TypeError, match="padding lengths needs an integer tensor"):
        P.padding(torch.tensor([1.5]))


def test_alibi_slopes_are_the_standard_ones() -> None:
    torch.testing.assert_close(P.alibi_slopes(8), torch.tensor([2.0 ** (-i) for i in range(1, 9)]))
    six = P.alibi_slopes(6)  # four of 2^(-8/4 i), then every other of eight heads' slopes
    want = [2.0 ** (-2 * i) for i in range(1, 5)] + [2.0 ** (-1), 2.0 ** (-3)]
    torch.testing.assert_close(six, torch.tensor(want))


def test_public_names() -> None:
    import attnkit

    assert attnkit.flex is flex
    for name in ("flex_attention", "create_block_mask", "and_masks", "or_masks", "noop_mask",
                 "BlockMask"):  # fmt: skip
        assert hasattr(flex, name)
    for name in ("causal", "causal_mask", "alibi", "relative_bias", "softcap", "prefix_lm",
                 "sliding_window", "document", "padding", "dilated"):  # fmt: skip
        assert callable(getattr(P, name))


@pytest.mark.slow
def test_flex_speed_rows_carry_the_fields_of_a_vs_row() -> None:
    from attnkit.bench.flex_speed import FlexSpeedJob, flex_rows
    from attnkit.bench.pages import _flex_tables
    from attnkit.bench.vs import VsRow

    job = FlexSpeedJob(**{**FlexSpeedJob.quick().__dict__, "flex": False, "seq_len": 128,
                          "window": 16, "alibi_len": 64})  # fmt: skip
    rows = flex_rows(job)
    assert [r["job"] for r in rows] == [
        "flex window fwd", "flex window first call", "flex alibi+causal fwd",
        "flex window fwd+bwd", "flex alibi+causal fwd+bwd",
    ]  # fmt: skip
    for row in rows:
        VsRow(**row)  # (the fields attnkit bench --vs takes)
        assert row["attnkit_s"] > 0
    assert rows[-1]["peer_s"] > 0 and rows[-2]["peer_s"] > 0 and rows[0]["peer_s"] is None
    assert "max grad diff" in rows[-1]["note"] and float(rows[-1]["note"].split()[-1]) < 1e-4
    table = _flex_tables({"rows": rows}, "flex.json")[0]
    assert [c[0] for c in table.rows] == [r["job"] for r in rows]


@pytest.mark.parametrize("mask", [P.causal(), and_masks(P.causal(), P.prefix_lm(0))])
def test_causal_diagonal_tiles_without_grouping(mask: Any) -> None:
    """ALiBi on a causal band: diagonal tiles use the fused kernel's own causal masking."""
    L = 50
    q, k, v = (t.double().requires_grad_() for t in _inputs(L, L))
    bm = create_block_mask(mask, B, H, L, L, BLOCK_SIZE=16)
    g = torch.randn(B, H, L, 16, dtype=torch.float64)
    out = flex_attention(q, k, v, P.alibi(H), bm)
    want = _explicit(q, k, v, P.alibi(H), mask)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    got = torch.autograd.grad(out, [q, k, v], g)
    for a, b in zip(got, torch.autograd.grad(want, [q, k, v], g), strict=True):
        assert _rel(a, b) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("mask", "L", "S", "K"),
    [(P.causal(), 150, 150, 2), (P.sliding_window(40), 130, 130, H), (None, 60, 90, 2),
     (P.causal(), 50, 110, H)],
)  # fmt: skip
def test_alibi_runs_in_the_flash_kernels_with_its_gradients(
    monkeypatch: pytest.MonkeyPatch, mask: Any, L: int, S: int, K: int, dtype: torch.dtype
) -> None:
    """ALiBi over no mask, a causal one or a causal window: one call of attnkit's flash kernel
    with the slopes (no bias tensor, no tiles), FlexAttention's top-left indices kept; output,
    log-sum-exp and gradients equal the float64 math."""
    from attnkit.kernels import attention as attention_kernels

    calls: list[bool] = []
    real = attention_kernels.flash_attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("alibi_slopes") is not None)
        return real(*args, **kwargs)

    q, k, v = (t.to(dtype).requires_grad_() for t in _inputs(L, S, K=K))
    bm = None if mask is None else create_block_mask(mask, B, H, L, S, BLOCK_SIZE=32)
    g = torch.randn(B, H, L, 16).to(dtype)
    flex_attention(q, k, v, P.alibi(H), bm, enable_gqa=K != H)  # (decides measured choices,
    with torch.no_grad():  # with gradients and without: timing them calls the kernel too)
        flex_attention(q, k, v, P.alibi(H), bm, enable_gqa=K != H)
    monkeypatch.setattr(attention_kernels, "flash_attention", spy)
    out = flex_attention(q, k, v, P.alibi(H), bm, enable_gqa=K != H)
    assert calls == [True]
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _explicit(*wide, P.alibi(H), mask)
    got = torch.autograd.grad(out, [q, k, v], g)
    grads = torch.autograd.grad(want, wide, g.double())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)
    for a, b in zip(got, grads, strict=True):
        assert _rel(a.double(), b) <= tol
    with torch.no_grad():
        _, lse = flex_attention(q, k, v, P.alibi(H), bm, enable_gqa=K != H, return_lse=True)
    ref = _explicit_lse(*wide, P.alibi(H), mask)
    torch.testing.assert_close(lse.double(), ref, atol=2e-5, rtol=0)
    assert len(calls) == 2


def _explicit_lse(q: Tensor, k: Tensor, v: Tensor, score_mod: Any, mask_mod: Any) -> Tensor:
    """The log-sum-exp of :func:`_explicit`'s modified, masked scores."""
    L, S = q.shape[-2], k.shape[-2]
    G = q.shape[1] // k.shape[1]
    s = q.detach() @ k.detach().repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    qi, kv = torch.arange(L).view(1, 1, -1, 1), torch.arange(S).view(1, 1, 1, -1)
    s = score_mod(s, None, torch.arange(q.shape[1]).view(1, -1, 1, 1), qi, kv)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(None, None, qi, kv), -math.inf)
    return torch.logsumexp(s, -1)


def test_alibi_keeps_the_tiles_where_the_policy_says() -> None:
    """The policy's ALiBi rule: attnkit's flash kernels only for plain calls they may run."""
    from attnkit.kernels import policy

    call = policy.AttentionCall(torch.float32, "cpu", 64, 64, causal=True, eager=True, ready=True)
    assert policy.alibi_kernel(call) == "widened"
    for field in ("batched", "masked", "weights", "dropout", "softcap"):
        assert policy.alibi_kernel(dataclasses.replace(call, **{field: True})) is None
    for changed in ({"eager": False}, {"ready": False}, {"dtype": torch.float64}):
        assert policy.alibi_kernel(dataclasses.replace(call, **changed)) is None
    bf16 = dataclasses.replace(call, dtype=torch.bfloat16)
    assert policy.alibi_kernel(bf16) == policy.flash_bf16_products()
    grads = dataclasses.replace(bf16, grads=True)
    assert policy.alibi_kernel(grads) == policy.bf16_backward_products()
