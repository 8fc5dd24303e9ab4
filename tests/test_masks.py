"""Mask builders and the structured-mask rules, against masks written out one entry at a time."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from attnkit import masks as M
from tests.reference import bottom_right_causal


def _loop(L, S, rule):
    """Bool (L, S) with entry (i, j) = rule(i, j), written independently of attnkit."""
    rows = [[bool(rule(i, j)) for j in range(S)] for i in range(L)]
    return torch.tensor(rows, dtype=torch.bool).view(L, S)


@pytest.mark.parametrize(("L", "S"), [(3, 5), (5, 5), (5, 3), (0, 4), (4, 0)])
def test_causal_mask_both_alignments(L, S):
    assert_close(M.causal_mask(L, S), _loop(L, S, lambda i, j: j <= i + S - L))
    assert_close(M.causal_mask(L, S, align="top_left"), _loop(L, S, lambda i, j: j <= i))
    if L and S:
        assert_close(M.causal_mask(L, S), bottom_right_causal(L, S))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize(("L", "S", "window"), [(6, 9, 2), (9, 6, 3), (5, 5, 1), (4, 4, 10)])
def test_sliding_window_mask(L, S, window, causal, align):
    off = S - L if align == "bottom_right" else 0

    def rule(i, j):
        return abs(i + off - j) < window and (not causal or j <= i + off)

    got = M.sliding_window_mask(L, S, window=window, causal=causal, align=align)
    assert_close(got, _loop(L, S, rule))


def test_padding_and_document_masks():
    pad = M.padding_mask(torch.tensor([2, 0, 3]), 4)
    assert pad.shape == (3, 1, 1, 4)
    expected = [[True, True, False, False], [False] * 4, [True, True, True, False]]
    assert pad[:, 0, 0].tolist() == expected
    assert M.padding_mask(torch.tensor([1, 3])).shape == (2, 1, 1, 3)  # S defaults to the max
    doc = M.document_mask(torch.tensor([[0, 0, 1]]))
    assert doc[0, 0].tolist() == [[True, True, False], [True, True, False], [False, False, True]]
    q_ids, kv_ids = torch.tensor([[5, 7]]), torch.tensor([[7, 5, 5, 9]])
    cross = M.document_mask(q_ids, kv_ids)
    assert cross.shape == (1, 1, 2, 4)
    assert cross[0, 0].tolist() == [[False, True, True, False], [True, False, False, False]]


def test_combine_and_to_additive():
    a, b = torch.rand(3, 3) > 0.5, torch.rand(3, 3) > 0.5
    assert_close(M.combine_masks(a, None, b), a & b)
    assert M.combine_masks(None) is None
    assert_close(M.to_additive(a), torch.where(a, 0.0, float("-inf")))
    assert M.to_additive(a, torch.float16).dtype == torch.float16


def test_structured_mask_equals_the_builders():
    # The same rules through structured_mask and through the user-facing builders.
    seg = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [4, 4, 4, 4, 3, 3, 3]])
    lengths = torch.tensor([7, 5])
    got = M.structured_mask(5, 7, causal=True, window=3, segment_ids=seg, key_lengths=lengths)
    want = M.combine_masks(
        M.sliding_window_mask(5, 7, window=3, causal=True),
        M.document_mask(seg[:, 2:], seg),
        M.padding_mask(lengths, 7),
    )
    assert got.shape == (2, 1, 5, 7)
    assert_close(got, want.expand(2, 1, 5, 7))
    assert M.structured_mask(3, 4).shape == (1, 1, 3, 4) and M.structured_mask(3, 4).all()


def test_structure_check_returns_batch_and_names_bad_values():
    ids = torch.zeros(2, 6, dtype=torch.long)
    assert M.Structure(segment_ids=ids).check(4, 6) == 2
    assert M.Structure(key_lengths=torch.tensor([3])).check(4, 6, batch=5) == 5  # 1 broadcasts
    assert M.Structure(window=2).check(4, 6) == 1
    with pytest.raises(ValueError, match=r"segment_ids has batch size 2, expected 3 \(or 1\)"):
        M.Structure(segment_ids=ids).check(4, 6, batch=3)
    with pytest.raises(ValueError, match=r"segment_ids has batch size 2, expected 3"):
        M.Structure(segment_ids=ids, key_lengths=torch.tensor([1, 2, 3])).check(4, 6)
    with pytest.raises(TypeError, match=r"key_lengths must be an integer tensor.*float32"):
        M.Structure(key_lengths=torch.tensor([1.0])).check(4, 6)
    with pytest.raises(ValueError, match=r"lengths must be non-negative, got L=-1, S=6"):
        M.Structure().check(-1, 6)


def test_builder_errors_name_the_values():
    with pytest.raises(ValueError, match="window must be a positive int, got -1"):
        M.sliding_window_mask(3, window=-1)
    with pytest.raises(ValueError, match="window must be a positive int, got True"):
        M.structured_mask(3, 3, window=True)
    with pytest.raises(TypeError, match="lengths must be an integer tensor, got Tensor of dtype"):
        M.padding_mask(torch.tensor([1.5]))
    with pytest.raises(ValueError, match=r"lengths must be in \[0, S=2\], got \[3\]"):
        M.padding_mask(torch.tensor([3]), 2)
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\), got \(1, 1\)"):
        M.padding_mask(torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"\(B, L\) and \(B, S\), got \(1, 2\) and \(2, 2\)"):
        M.document_mask(torch.zeros(1, 2), torch.zeros(2, 2))
    with pytest.raises(TypeError, match="bool masks"):
        M.combine_masks(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="expects a bool mask"):
        M.to_additive(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="align must be"):
        M.causal_mask(2, align="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lengths must be non-negative, got L=-2"):
        M.causal_mask(-2)
