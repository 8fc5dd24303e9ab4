"""FlexAttention's API on CPU without compiling: switch by changing the import.

```python
from attnkit.flex import create_block_mask, flex_attention
from attnkit.flex.presets import alibi, sliding_window

block_mask = create_block_mask(sliding_window(256), None, None, L, L)
out = flex_attention(q, k, v, score_mod=alibi(H), block_mask=block_mask)
```

Masks and modifications that attnkit's structured options can say go to
:func:`attnkit.functional.scaled_dot_product_attention`; the rest run the tiled kernel of
:mod:`attnkit.flex.tiles`.
"""

from attnkit.flex import presets
from attnkit.flex.attention import captured_tensors, flex_attention
from attnkit.flex.blockmask import BlockMask, and_masks, create_block_mask, noop_mask, or_masks

__all__ = [
    "BlockMask",
    "and_masks",
    "captured_tensors",
    "create_block_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
    "presets",
]
