"""attnkit: attention made real.

One fast attention core (:func:`scaled_dot_product_attention`), the blog's classes built on it,
and tools to see and measure every claim about attention. ``import attnkit`` needs only torch.
"""

from attnkit import complexity, flex, masks
from attnkit.attention import MultiHeadAttention, merge_heads, split_heads
from attnkit.blocks import FeedForward, TransformerLayer
from attnkit.blog import (
    Attention,
    MultiheadCrossAttention,
    MultiHeadSelfAttention,
    PositionalMultiHeadSelfAttention,
    PositionalTransformerBlock,
    ScaleDotProductAttention,
    SelfAttention,
    TransformerBlock,
)
from attnkit.cache import KVCache
from attnkit.config import PRESETS, TransformerConfig
from attnkit.functional import scaled_dot_product_attention
from attnkit.masks import attention_mask_from_padding
from attnkit.models import TransformerEncoder, TransformerLM
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

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
    "MultiheadCrossAttention",
    "PositionalMultiHeadSelfAttention",
    "PositionalTransformerBlock",
    "RotaryEmbedding",
    "ScaleDotProductAttention",
    "SelfAttention",
    "SentenceEncoder",
    "SinusoidalPositionalEncoding",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerEncoder",
    "TransformerLM",
    "TransformerLayer",
    "__version__",
    "apply_rope",
    "attention_mask_from_padding",
    "complexity",
    "convert_rotary_convention",
    "flex",
    "masks",
    "merge_heads",
    "permute_rotary_weight",
    "rope_cos_sin",
    "rope_inv_freq",
    "scaled_dot_product_attention",
    "show",
    "show_model",
    "sinusoidal_table",
    "split_heads",
]


def __getattr__(name: str) -> object:
    # Imported on first use, so that ``import attnkit`` needs only torch and loads no more than
    # the core: SentenceEncoder needs the ``models`` extra (tokenizers, safetensors, the bundled
    # model); show/show_model (the explorer in a notebook) sit above the core.
    if name == "SentenceEncoder":
        from attnkit.interop.sentence import SentenceEncoder

        return SentenceEncoder
    if name in ("show", "show_model"):
        from attnkit import notebook

        return getattr(notebook, name)
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
