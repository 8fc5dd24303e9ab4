"""attnkit.bench.flex: FlexAttention's mask_mod is attnkit's Structure, on every rule."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from attnkit.bench.flex import mask_mod
from attnkit.functional import scaled_dot_product_attention as sdpa
from attnkit.masks import Structure
from tests.reference import loop_mask

B, L, S = 2, 5, 9
SEG = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2]])
LENGTHS = torch.tensor([9, 6])
STRUCTURES = {
    "causal": {"causal": True},
    "window": {"window": 3},
    "causal-window": {"causal": True, "window": 3},
    "documents": {"causal": True, "segment_ids": SEG},
    "padding": {"key_lengths": LENGTHS},
    "everything": {"causal": True, "window": 4, "segment_ids": SEG, "key_lengths": LENGTHS},
}


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_mask_mod_equals_the_rules_written_out(name):
    kw = STRUCTURES[name]
    fn = mask_mod(Structure(**kw), batch=B, L=L, S=S)
    b = torch.arange(B).view(B, 1, 1)
    i = torch.arange(L).view(1, L, 1)
    j = torch.arange(S).view(1, 1, S)
    got = fn(b, torch.zeros_like(b), i, j).expand(B, L, S)
    want = loop_mask(L, S, **kw).expand(B, 1, L, S)[:, 0]  # independent of attnkit
    assert torch.equal(got, want)


def test_mask_mod_checks_the_structure():
    with pytest.raises(ValueError, match="window"):
        mask_mod(Structure(window=0), batch=1, L=4, S=4)


@pytest.mark.slow
# (Eager FlexAttention is the reference here: small shapes, no compile, torch says so.)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ["causal-window", "everything"])
def test_flex_attention_with_the_mask_mod_equals_attnkit(name):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    kw = STRUCTURES[name]
    n = 32  # one FlexAttention block is 16 or more queries: several blocks, some skipped
    seg = torch.arange(n).div(7, rounding_mode="floor").expand(B, n)
    kw = {**kw, **({"segment_ids": seg} if "segment_ids" in kw else {})}
    kw = {**kw, **({"key_lengths": torch.tensor([n, 20])} if "key_lengths" in kw else {})}
    q, k, v = (torch.randn(B, 2, n, 8) for _ in range(3))
    block = flex.create_block_mask(
        mask_mod(Structure(**kw), batch=B, L=n, S=n), B, None, n, n, device="cpu", BLOCK_SIZE=16
    )
    assert_close(flex.flex_attention(q, k, v, block_mask=block), sdpa(q, k, v, **kw))
