"""attnkit: attention made real.

One fast attention core (:func:`scaled_dot_product_attention`), the blog's classes built on it,
and tools to see and measure every claim about attention. ``import attnkit`` needs only torch.
"""

from attnkit import complexity, masks
from attnkit.attention import (
    Attention,
    MultiHeadAttention,
    MultiheadCrossAttention,
    MultiHeadSelfAttention,
    ScaleDotProductAttention,
    SelfAttention,
    merge_heads,
    split_heads,
)
from attnkit.cache import KVCache
from attnkit.functional import scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
    "MultiheadCrossAttention",
    "ScaleDotProductAttention",
    "SelfAttention",
    "__version__",
    "complexity",
    "masks",
    "merge_heads",
    "scaled_dot_product_attention",
    "split_heads",
]
