"""Transformer blocks: the blog's ``FeedForward``/``TransformerBlock`` and its positional variant.

With default options every class here is the blog's class: same constructor, same parameter
names (a blog state_dict loads with ``strict=True``) and the same outputs.
:class:`TransformerBlock` at defaults also equals ``torch.nn.TransformerEncoderLayer``
(post-norm, ReLU, ``dropout=0``, ``batch_first=True``) given the same weights. Keyword-only
options generalise it: pre-norm, RMSNorm, GELU/SwiGLU, grouped-query attention, rotary positions,
sliding windows, dropout, a KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.attention import LayerOptions, MultiHeadSelfAttention, split_weights, with_weights
from attnkit.positional import PositionalMultiHeadSelfAttention, SinusoidalPositionalEncoding

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

    from attnkit.config import TransformerConfig

__all__ = ["FeedForward", "PositionalTransformerBlock", "TransformerBlock", "make_norm"]

Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu"]
NormType = Literal["layernorm", "rmsnorm"]

_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu")


def make_norm(norm: str, dim: int, *, eps: float = 1e-5) -> nn.Module:
    """``nn.LayerNorm`` (``"layernorm"``) or ``nn.RMSNorm`` (``"rmsnorm"``) over ``dim``.

    Raises:
        ValueError: For another ``norm``.
    """
    if norm == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {norm!r}")


class FeedForward(nn.Module):
    """Position-wise MLP ``linear2(act(linear1(x)))`` (the blog's class at defaults).

    With ``activation="swiglu"`` a ``gate`` projection is added and the hidden layer is
    ``silu(gate(x)) * linear1(x)`` (the LLaMA MLP; ``linear1`` is the "up" projection).

    Args:
        in_dim: Input dim.
        hidden_dim: Hidden dim.
        out_dim: Output dim.
        activation: ``"relu"`` (default), ``"gelu"`` (exact erf), ``"gelu_tanh"``, ``"silu"``
            or ``"swiglu"``.
        dropout: Dropout on the hidden layer (training mode only).
        bias: Whether the projections have biases.

    Raises:
        ValueError: For an unknown activation or a bad dropout.
    """

    def __init__(
        self,
        in_dim: int,
        hidden_dim: int,
        out_dim: int,
        *,
        activation: Activation = "relu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.linear1 = nn.Linear(in_dim, hidden_dim, bias=bias)
        self.linear2 = nn.Linear(hidden_dim, out_dim, bias=bias)
        self.gate = nn.Linear(in_dim, hidden_dim, bias=bias) if activation == "swiglu" else None
        factories: dict[str, Callable[[], nn.Module]] = {
            "relu": nn.ReLU,
            "gelu": nn.GELU,
            "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
            "silu": nn.SiLU,
            "swiglu": nn.SiLU,
        }
        self.activation: nn.Module = factories[activation]()
        self.activation_name = activation
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        """Shape: x ``(..., in_dim)`` -> ``(..., out_dim)``."""
        if self.gate is not None:
            h = self.activation(self.gate(x)) * self.linear1(x)  # (..., hidden)
        else:
            h = self.activation(self.linear1(x))  # (..., hidden)
        h = F.dropout(h, p=self.dropout, training=self.training)
        return self.linear2(h)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name!r}, dropout={self.dropout}"


class TransformerBlock(nn.Module):
    """Self-attention + feed-forward, each with a residual connection and a norm.

    Post-norm (the blog and the original Transformer, default):
    ``x = norm1(x + attn(x)); x = norm2(x + ff(x))``.
    Pre-norm (``norm_first=True``, GPT-2/LLaMA): ``x = x + attn(norm1(x)); x = x + ff(norm2(x))``
    (a pre-norm stack needs a final norm; the models in :mod:`attnkit.models` add it).

    Args:
        dim: Model dim ``D``.
        hidden_dim: Feed-forward hidden dim.
        num_heads: Query heads ``H``.
        causal: Causal self-attention.
        norm_first: Pre-norm instead of post-norm.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        activation: Feed-forward activation (see :class:`FeedForward`).
        eps: Norm epsilon (``1e-5`` as torch; BERT uses ``1e-12``).
        dropout: Dropout on the attention weights, the hidden layer of the feed-forward and
            both residual branches (as ``nn.TransformerEncoderLayer``); training mode only.
        num_kv_heads: Key/value heads for grouped-query attention (default ``num_heads``).
        rotary: Rotary module applied to queries and keys (e.g.
            :class:`attnkit.positional.RotaryEmbedding`; may be shared between blocks).
        window: Sliding-window size of the attention.
        bias: Biases in the attention and feed-forward projections (default of the three below).
        qkv_bias: Biases of the query/key/value projections (default ``bias``).
        out_bias: Bias of the attention output projection (default ``bias``).
        mlp_bias: Biases of the feed-forward projections (default ``bias``).
        head_dim: Attention head dim ``E`` (default ``dim // num_heads``); the attention's
            projected width is ``num_heads * head_dim``.
        attention: A prebuilt self-attention module to use instead; it is called as
            ``attention(x, mask, **options)`` with the keywords the block's caller gave (those
            of :class:`attnkit.attention.LayerOptions`, each optional). The attention options
            above are then ignored.

    Raises:
        ValueError: For bad sizes or option values.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_heads: int,
        causal: bool = False,
        *,
        norm_first: bool = False,
        norm: NormType = "layernorm",
        activation: Activation = "relu",
        eps: float = 1e-5,
        dropout: float = 0.0,
        num_kv_heads: int | None = None,
        rotary: nn.Module | None = None,
        window: int | None = None,
        bias: bool = True,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        mlp_bias: bool | None = None,
        head_dim: int | None = None,
        attention: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)):
            raise TypeError(f"head_dim must be an int, got {head_dim!r}")
        if attention is None:
            attention = MultiHeadSelfAttention(
                dim,
                dim if head_dim is None else num_heads * head_dim,
                dim,
                num_heads,
                causal,
                num_kv_heads=num_kv_heads,
                rotary=rotary,
                window=window,
                bias=bias if qkv_bias is None else qkv_bias,
                out_bias=bias if out_bias is None else out_bias,
                dropout=dropout,
            )
        self.attention = attention
        self.feed_forward = FeedForward(
            dim,
            hidden_dim,
            dim,
            activation=activation,
            dropout=dropout,
            bias=bias if mlp_bias is None else mlp_bias,
        )
        self.norm1 = make_norm(norm, dim, eps=eps)
        self.norm2 = make_norm(norm, dim, eps=eps)
        self.norm_first, self.dropout = norm_first, dropout

    @classmethod
    def from_config(cls, config: TransformerConfig, rotary: nn.Module | None = None) -> Self:
        """One block of the stack that ``config`` describes.

        Args:
            config: The stack's sizes and options.
            rotary: The stack's rotary module (shared by its blocks), for ``position="rope"``.
        """
        return cls(
            config.dim,
            config.ffn_dim,
            config.num_heads,
            config.causal,
            norm_first=config.norm_first,
            norm=config.norm,
            activation=config.activation,
            eps=config.eps,
            dropout=config.dropout,
            num_kv_heads=config.num_kv_heads,
            rotary=rotary,
            window=config.window,
            bias=config.bias,
            qkv_bias=config.qkv_bias,
            out_bias=config.out_bias,
            mlp_bias=config.mlp_bias,
            head_dim=config.head_dim,
        )

    def forward(
        self, x: Tensor, mask: Tensor | None = None, **options: Unpack[LayerOptions]
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Apply the block.

        Args:
            x: Input tokens.
            mask: Bool (``True`` = may attend) or additive float mask, broadcastable to
                ``(B, H, L, S)``; a key-padding mask is ``(B, 1, 1, S)``.
            **options: ``positions`` (for the rotary module), ``kv_cache`` (this block's cache)
                and ``return_weights``, handed to the attention (see
                :class:`attnkit.attention.LayerOptions`).

        Returns:
            ``x`` of shape ``(B, L, D)``, or ``(x, weights)`` with weights ``(B, H, L, S)``.
        """
        attn_in = self.norm1(x) if self.norm_first else x
        attn_out, weights = split_weights(self.attention(attn_in, mask, **options))
        attn_out = F.dropout(attn_out, p=self.dropout, training=self.training)
        if self.norm_first:
            x = x + attn_out
            ff_out = self.feed_forward(self.norm2(x))
            x = x + F.dropout(ff_out, p=self.dropout, training=self.training)
        else:
            x = self.norm1(x + attn_out)
            ff_out = self.feed_forward(x)
            x = self.norm2(x + F.dropout(ff_out, p=self.dropout, training=self.training))
        return with_weights(x, weights)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, dropout={self.dropout}"


class PositionalTransformerBlock(TransformerBlock):
    """The blog's post-norm block with sinusoidal or rotary positions.

    Kept as in the blog: with ``position_type="sinusoidal"`` the table is added to the input of
    *every* block (so stacking these blocks re-adds positions each time; the models in
    :mod:`attnkit.models` add them once instead). With ``"rope"`` the block's attention rotates
    queries and keys and ``position`` is ``nn.Identity``.

    Args:
        dim: Model dim.
        hidden_dim: Feed-forward hidden dim.
        num_heads: Number of heads.
        position_type: ``"rope"`` or ``"sinusoidal"``.
        max_seq_len: Rows of the sinusoidal table.
        causal: Causal self-attention.

    Raises:
        ValueError: For an unknown ``position_type``.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_heads: int,
        position_type: str = "rope",
        max_seq_len: int = 4096,
        causal: bool = False,
    ) -> None:
        if position_type not in {"sinusoidal", "rope"}:
            raise ValueError(f"position_type must be 'sinusoidal' or 'rope', got {position_type!r}")
        attention = PositionalMultiHeadSelfAttention(
            dim, num_heads, causal=causal, use_rope=position_type == "rope"
        )
        super().__init__(dim, hidden_dim, num_heads, causal, attention=attention)
        self.position_type = position_type
        self.position: nn.Module = (
            SinusoidalPositionalEncoding(dim, max_seq_len)
            if position_type == "sinusoidal"
            else nn.Identity()
        )

    def forward(
        self, x: Tensor, mask: Tensor | None = None, **options: Unpack[LayerOptions]
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Add sinusoidal positions (if any), then apply the block (see
        :meth:`TransformerBlock.forward`). With a ``kv_cache`` and no ``positions``, positions
        continue after the cached ones."""
        if isinstance(self.position, SinusoidalPositionalEncoding):
            kv_cache = options.get("kv_cache")
            if options.get("positions") is None and kv_cache is not None and kv_cache.length:
                start = kv_cache.length
                options["positions"] = torch.arange(start, start + x.shape[-2], device=x.device)
            x = self.position(x, options.get("positions"))
        return super().forward(x, mask, **options)
