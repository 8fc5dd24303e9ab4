"""Property-based checks of every attention path against the float64 reference.

Random shapes (``L != S``, grouped-query heads, odd head dims, empty dims), dtypes, bool and
float masks, every structure option (causal, window, segment_ids, key_lengths) and softcap, through
each path of :mod:`attnkit.functional`: the fused kernel, the explicit path that returns weights
and the block-sparse tiles of :mod:`attnkit.sparse`. Outputs and gradients are compared with the
textbook math in float64 (:func:`tests.reference.reference_attention`) under the mask rules
written out one pair at a time (:func:`tests.reference.loop_mask`). Derandomized, so CI runs
the same examples every time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.testing import assert_close

from attnkit.functional import block_sparse_attention
from attnkit.functional import scaled_dot_product_attention as sdpa
from tests.reference import loop_mask, reference_attention

PROFILE = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PATHS = ("fused", "weights", "block_sparse")
#: Absolute/relative tolerances of outputs and gradients against float64, per input dtype.
TOL = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}


@dataclass
class Case:
    """One random attention problem and the pieces of its reference."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None  # bool or additive float, as passed to attnkit
    structure: dict[str, Any]  # causal / window / segment_ids / key_lengths
    allowed: Tensor  # bool (B, 1, L, S): the mask's and the structure's pairs
    bias: Tensor | None  # the finite part of a float mask, for the reference
    path: str
    softcap: float | None = None  # Gemma 2's score cap (fused and weights paths)

    def run(self, *, check_weights: bool = True) -> Tensor:
        """The attention output on this case's path (the weights checked on the way)."""
        if self.path == "block_sparse":
            return block_sparse_attention(self.q, self.k, self.v, block_size=2, **self.structure)
        if self.path == "weights":
            q, k, v = self.inputs()
            out, weights = sdpa(
                q, k, v, self.mask, return_weights=True, softcap=self.softcap, **self.structure
            )
            if check_weights:
                ref_w = self.reference()[1]
                atol, rtol = TOL[self.q.dtype]
                assert_close(weights.double(), ref_w.expand_as(weights), atol=atol, rtol=rtol)
            return out
        return sdpa(self.q, self.k, self.v, self.mask, softcap=self.softcap, **self.structure)

    def inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.q, self.k, self.v

    def reference(self) -> tuple[Tensor, Tensor]:
        """The float64 textbook output and weights of this case."""
        return reference_attention(
            *self.inputs(), self.allowed, bias=self.bias, softcap=self.softcap
        )


@st.composite
def cases(draw: st.DrawFn, *, dtypes: tuple[torch.dtype, ...], grad: bool) -> Case:
    """A random problem: shapes, a mask, a structure and a path."""
    path = draw(st.sampled_from(PATHS))
    B = draw(st.integers(1, 2))
    K = draw(st.integers(0, 2))
    H = K * draw(st.integers(1, 3))  # grouped-query: H a multiple of K (both 0: empty)
    S = draw(st.integers(0, 7))
    L = draw(st.one_of(st.just(1), st.integers(0, 7)))  # L = 1: a decode step
    E = draw(st.integers(1, 7))
    Ev = draw(st.one_of(st.just(E), st.integers(1, 5)))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))

    structure: dict[str, Any] = {}
    if draw(st.booleans()):
        structure["causal"] = True
    if draw(st.booleans()):
        structure["window"] = draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(seed)
    if L <= S and draw(st.booleans()):  # documents: queries take the last L ids
        ids = torch.randint(0, 3, (B, S), generator=g).sort(dim=-1).values
        structure["segment_ids"] = ids
    if draw(st.booleans()):
        structure["key_lengths"] = torch.randint(0, S + 1, (B,), generator=g)
    if path == "block_sparse" and not structure:
        structure["causal"] = True  # block-sparse attention needs a structure

    q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, K, S, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, K, S, Ev, generator=g, dtype=torch.float64).to(dtype)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    allowed = loop_mask(L, S, **structure)
    mask = bias = None
    mask_kind = (
        "none" if path == "block_sparse" else draw(st.sampled_from(["none", "bool", "float"]))
    )
    if mask_kind != "none":
        pairs = torch.rand(B, 1, L, S, generator=g) > 0.3
        allowed = allowed & pairs
        if mask_kind == "bool":
            mask = pairs
        else:  # additive: finite values where allowed, -inf elsewhere
            bias = torch.randn(B, 1, L, S, generator=g, dtype=torch.float64).to(dtype)
            mask = bias.masked_fill(~pairs, float("-inf"))
    softcap = None
    if path != "block_sparse" and draw(st.booleans()):
        softcap = draw(st.sampled_from([0.5, 2.0, 30.0]))
    return Case(q, k, v, mask, structure, allowed, bias, path, softcap)


@settings(PROFILE, max_examples=200)
@given(case=cases(dtypes=(torch.float32, torch.float64), grad=True))
def test_outputs_and_gradients_equal_the_float64_reference(case: Case) -> None:
    atol, rtol = TOL[case.q.dtype]
    out = case.run()
    ref, _ = case.reference()
    assert out.dtype == case.q.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert_close(out.double(), ref, atol=atol, rtol=rtol)
    seen = case.allowed.any(-1, keepdim=True)  # (B, 1, L, 1): rows that attend anything
    assert torch.where(seen, 0.0, out.detach()).eq(0).all()  # the others are exactly zero

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = case.inputs()
    got = torch.autograd.grad(out, inputs, g.to(out.dtype), allow_unused=True)
    want = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    for name, a, b in zip("qkv", got, want, strict=True):
        a = torch.zeros_like(inputs[0]) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert torch.isfinite(a).all(), name
        assert_close(a.double(), b.double(), atol=10 * atol, rtol=10 * rtol, msg=name)


@settings(PROFILE, max_examples=60)
@given(case=cases(dtypes=(torch.bfloat16, torch.float16), grad=False))
def test_half_precision_outputs_are_within_rounding_of_the_reference(case: Case) -> None:
    # The reference runs on the same rounded inputs: what is left is the kernels' arithmetic.
    atol, rtol = TOL[case.q.dtype]
    out = case.run()
    ref, _ = case.reference()
    assert out.dtype == case.q.dtype and out.shape == ref.shape
    assert_close(out.double(), ref, atol=atol, rtol=rtol)


@settings(PROFILE, max_examples=80)
@given(
    case=cases(dtypes=(torch.float32,), grad=False),
    where=st.sampled_from(["k", "v"]),
    value=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    at=st.tuples(st.integers(0, 10), st.integers(0, 10), st.integers(0, 10)),
)
def test_a_non_finite_key_or_value_reaches_the_rows_the_math_says(
    case: Case, where: str, value: float, at: tuple[int, int, int]
) -> None:
    # One non-finite element at key j of head h: as in the math, a row becomes NaN iff it may
    # attend key j and its score is NaN or +inf (a key), or that element's output column does
    # iff the row may attend key j (a value); a -inf score gives key j weight 0 there; nothing
    # else changes.
    B, K, S = case.k.shape[:3]
    if K == 0 or S == 0 or case.q.shape[-2] == 0:
        return
    b, h, j = at[0] % B, at[1] % K, at[2] % S
    t = case.k if where == "k" else case.v
    e = at[2] % t.shape[-1]
    bad = t.clone()
    bad[b, h, j, e] = value
    q, k, v = case.q, (bad if where == "k" else case.k), (bad if where == "v" else case.v)
    # (without a softcap: a capped infinite score is finite, see masks.NonFinite.key_scores)
    bad_case = Case(q, k, v, case.mask, case.structure, case.allowed, case.bias, case.path)
    out = bad_case.run(check_weights=False)

    groups = q.shape[1] // K
    heads = torch.arange(q.shape[1]) // groups == h  # query heads reading k/v head h
    allowed = case.allowed.expand(B, 1, *case.allowed.shape[-2:])
    reach = allowed[b, 0, :, j].view(1, -1) & heads.view(-1, 1)  # (H, L)
    dropped = torch.zeros_like(reach)
    if where == "k":
        scores = (q[b].double() @ k[b, h, j].double()) * q.shape[-1] ** -0.5  # (H, L)
        dropped = reach & (scores == -float("inf"))
        reach = reach & ~(scores == -float("inf"))
    nan_rows = torch.zeros(out.shape[:-1], dtype=torch.bool)
    nan_rows[b] = reach
    if where == "k":  # a NaN or +inf score: the whole row
        nan = nan_rows.unsqueeze(-1).expand_as(out)
    else:  # a value reaches only its own output column, as in the math
        nan = torch.zeros(out.shape, dtype=torch.bool)
        nan[..., e] = nan_rows
    assert torch.equal(torch.isnan(out), nan)
    # The other rows: the clean math with key j masked where its score was -inf.
    allowed = allowed.expand(B, q.shape[1], *allowed.shape[-2:]).clone()
    allowed[b, :, :, j] &= ~dropped
    clean_k = k.clone() if where == "k" else k
    clean_v = v.clone() if where == "v" else v
    (clean_k if where == "k" else clean_v)[b, h, j, e] = 0.0
    ref, _ = reference_attention(q, clean_k, clean_v, allowed, bias=case.bias)
    assert_close(out[~nan].double(), ref[~nan], atol=2e-5, rtol=1e-4)


def test_the_strategy_reaches_every_path_and_option() -> None:
    # The properties above only mean something if the examples cover the space: draw from the
    # same strategy and check that each path meets each structure option and edge shape.
    seen: dict[str, set[str]] = {path: set() for path in PATHS}

    @settings(PROFILE, max_examples=300)
    @given(case=cases(dtypes=(torch.float32,), grad=False))
    def collect(case: Case) -> None:
        H, L, E = case.q.shape[1:]
        K, S, Ev = case.k.shape[1], case.k.shape[2], case.v.shape[-1]
        seen[case.path].update(name for name in case.structure)
        seen[case.path].update(
            name
            for name, hit in (
                ("L != S", L != S and L > 0 and S > 0),
                ("gqa", H > K > 0),
                ("odd E", E % 2 == 1),
                ("Ev != E", Ev != E),
                ("empty", 0 in (H, L, S)),
                ("decode", L == 1 and S > 1),
                ("bool mask", case.mask is not None and case.mask.dtype == torch.bool),
                ("float mask", case.mask is not None and case.mask.dtype != torch.bool),
                ("softcap", case.softcap is not None),
            )
            if hit
        )

    collect()
    for path in PATHS:
        expected = {"causal", "window", "segment_ids", "key_lengths", "L != S", "gqa", "odd E"}
        expected |= {"Ev != E", "empty", "decode"}
        if path != "block_sparse":
            expected |= {"bool mask", "float mask", "softcap"}
        assert expected <= seen[path], (path, sorted(expected - seen[path]))
