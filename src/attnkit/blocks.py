"""Transformer blocks: :class:`FeedForward` and :class:`TransformerLayer`, the one block of every
attnkit stack (encoders, language models, BERT).

:class:`TransformerLayer` at defaults is the blog's post-norm block (and
``torch.nn.TransformerEncoderLayer`` with ReLU, ``dropout=0``, ``batch_first=True`` given the
same weights); keyword-only options generalise it: pre-norm, RMSNorm, GELU/SwiGLU, grouped-query
attention, rotary positions, sliding windows, dropout, a KV cache. Its forward returns
``(x, weights or None)``. The blog's ``TransformerBlock`` (same constructor, parameter names and
return values as the blog) is this layer with the blog's names, in :mod:`attnkit.blog`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.attention import AttentionOptions, LayerOptions, MultiHeadAttention, check_keywords
from attnkit.config import TransformerConfig

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

__all__ = ["FeedForward", "OffsetRMSNorm", "TransformerLayer", "make_norm"]

Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh"]
NormType = Literal["layernorm", "rmsnorm", "rmsnorm_plus_one"]

_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh")
_GATED = {"swiglu": "silu", "geglu_tanh": "gelu_tanh"}  # gated activation -> its gate's


class OffsetRMSNorm(nn.RMSNorm):
    """RMSNorm that scales by ``1 + weight`` (Gemma's), computed in float32.

    Its weight starts at zero (the identity scale), as Gemma's checkpoints store it.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__(dim, eps=eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(..., dim) -> (..., dim)``."""
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(norm: str, dim: int, *, eps: float = 1e-5) -> nn.Module:
    """``nn.LayerNorm`` (``"layernorm"``), ``nn.RMSNorm`` (``"rmsnorm"``) or
    :class:`OffsetRMSNorm` (``"rmsnorm_plus_one"``) over ``dim``.

    Raises:
        ValueError: For another ``norm``.
    """
    if norm == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    if norm == "rmsnorm_plus_one":
        return OffsetRMSNorm(dim, eps=eps)
    raise ValueError(f"norm must be 'layernorm', 'rmsnorm' or 'rmsnorm_plus_one', got {norm!r}")


class FeedForward(nn.Module):
    """Position-wise MLP ``linear2(act(linear1(x)))`` (the blog's class at defaults).

    With ``activation="swiglu"`` the first projection is one fused ``gate_up`` (rows
    ``[gate | up]``, ``2 * hidden_dim`` outputs) and the hidden layer is ``silu(gate) * up``
    (the LLaMA MLP); ``linear1`` is then absent. ``"geglu_tanh"`` is the same with a
    tanh-approximated GELU gate (Gemma). State dicts of the unfused form (``gate`` and
    ``linear1``) still load.

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
        self.gated = activation in _GATED
        if self.gated:
            self.gate_up = nn.Linear(in_dim, 2 * hidden_dim, bias=bias)
            self.register_load_state_dict_pre_hook(_fuse_gate_up)
        else:
            self.linear1 = nn.Linear(in_dim, hidden_dim, bias=bias)
        self.linear2 = nn.Linear(hidden_dim, out_dim, bias=bias)
        factories: dict[str, Callable[[], nn.Module]] = {
            "relu": nn.ReLU,
            "gelu": nn.GELU,
            "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
            "silu": nn.SiLU,
        }
        self.activation: nn.Module = factories[_GATED.get(activation, activation)]()
        self.activation_name = activation
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        """Shape: x ``(..., in_dim)`` -> ``(..., out_dim)``."""
        if self.gated:
            gate, up = self.gate_up(x).chunk(2, dim=-1)  # (..., hidden) each
            h = self.activation(gate) * up
        else:
            h = self.activation(self.linear1(x))  # (..., hidden)
        if self.training:
            h = _dropout(h, self.dropout, True)
        return self.linear2(h)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name!r}, dropout={self.dropout}"


def _dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout``, without a call at all where it is the identity (evaluation, ``p = 0``)."""
    return F.dropout(x, p=p, training=True) if training and p > 0 else x


def _fuse_gate_up(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: the unfused SwiGLU names (``gate``, ``linear1``, as attnkit 0.2
    wrote them) into the fused ``gate_up``."""
    for name in ("weight", "bias"):
        gate, up = f"{prefix}gate.{name}", f"{prefix}linear1.{name}"
        if gate in state_dict and up in state_dict:
            state_dict[f"{prefix}gate_up.{name}"] = torch.cat(
                [state_dict.pop(gate), state_dict.pop(up)]
            )


def _attention_options(options: AttentionOptions) -> dict[str, Any]:
    """The :class:`attnkit.attention.AttentionOptions` a block hands ``_build_attention``: the
    five every attention takes (``None`` where not given), ``score_mod`` / ``mask_mod`` only
    when given (a custom ``_build_attention`` without them keeps working)."""
    given = {k: v for k, v in options.items() if v is not None}
    return dict.fromkeys(("num_kv_heads", "rotary", "window", "scale", "softcap")) | given


class TransformerLayer(nn.Module):
    """Self-attention + feed-forward, each with a residual connection and a norm.

    Post-norm (the blog and the original Transformer, default):
    ``x = norm1(x + attn(x)); x = norm2(x + ff(x))``.
    Pre-norm (``norm_first=True``, GPT-2/LLaMA): ``x = x + attn(norm1(x)); x = x + ff(norm2(x))``
    (a pre-norm stack needs a final norm; the models in :mod:`attnkit.models` add it).

    Args:
        dim: Model dim ``D``.
        ffn_dim: Feed-forward hidden dim.
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
        score_mod: An attention variant that rewrites the scores (a name, dict or callable;
            see :class:`attnkit.MultiHeadAttention`).
        mask_mod: An attention variant that masks keys, combined with ``causal``.
        attention: A prebuilt self-attention module to use instead; it is called as
            ``attention(x, mask=mask, **options)`` with the keywords the block's caller gave (those
            of :class:`attnkit.attention.LayerOptions`, each optional) and returns
            ``(out, weights or None)``. The attention options above are then ignored.

    Raises:
        TypeError: For a keyword it does not take, or a ``head_dim`` that is not an int.
        ValueError: For bad sizes or option values.
    """

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_heads: int,
        causal: bool = False,
        *,
        norm_first: bool = False,
        norm: NormType = "layernorm",
        activation: Activation = "relu",
        eps: float = 1e-5,
        dropout: float = 0.0,
        bias: bool = True,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        mlp_bias: bool | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        post_norms: bool = False,
        attention: nn.Module | None = None,
        **options: Unpack[AttentionOptions],
    ) -> None:
        super().__init__()
        check_keywords(type(self).__name__, options, AttentionOptions.__optional_keys__)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)):
            raise TypeError(f"head_dim must be an int, got {head_dim!r}")
        if attention is None:
            attention = self._build_attention(
                dim,
                num_heads,
                head_dim=head_dim,
                causal=causal,
                bias=bias if qkv_bias is None else qkv_bias,
                out_bias=bias if out_bias is None else out_bias,
                dropout=dropout,
                q_norm=make_norm(norm, head_dim or dim // num_heads, eps=eps) if qk_norm else None,
                k_norm=make_norm(norm, head_dim or dim // num_heads, eps=eps) if qk_norm else None,
                **_attention_options(options),
            )
        self.attention = attention
        self.feed_forward = FeedForward(
            dim,
            ffn_dim,
            dim,
            activation=activation,
            dropout=dropout,
            bias=bias if mlp_bias is None else mlp_bias,
        )
        self.norm1 = make_norm(norm, dim, eps=eps)
        self.norm2 = make_norm(norm, dim, eps=eps)
        if post_norms and not norm_first:
            raise ValueError("post_norms (norms after attention and MLP) need norm_first=True")
        # Gemma's extra norms of the attention and feed-forward outputs, before the residuals.
        self.post_attn_norm = make_norm(norm, dim, eps=eps) if post_norms else None
        self.post_ffn_norm = make_norm(norm, dim, eps=eps) if post_norms else None
        self.norm_first, self.dropout = norm_first, dropout

    @classmethod
    def from_config(
        cls, config: TransformerConfig, rotary: nn.Module | None = None, *, layer: int = 0
    ) -> Self:
        """Block ``layer`` of the stack that ``config`` describes.

        Args:
            config: The stack's sizes and options.
            rotary: The rotary module of this block (shared by the blocks of a stack), for
                ``position="rope"``.
            layer: The block's index (its window follows ``config.layer_types``).
        """
        return cls(
            config.dim,
            int(config.ffn_dim or 4 * config.dim),
            config.num_heads,
            config.causal,
            norm_first=config.norm_first,
            norm=config.norm,
            activation=config.activation,
            eps=config.eps,
            dropout=config.dropout,
            num_kv_heads=config.num_kv_heads,
            rotary=rotary,
            window=config.layer_window(layer),
            bias=config.bias,
            qkv_bias=config.qkv_bias,
            out_bias=config.out_bias,
            mlp_bias=config.mlp_bias,
            head_dim=config.head_dim,
            qk_norm=config.qk_norm,
            scale=config.attn_scale,
            softcap=config.attn_softcap,
            post_norms=config.post_norms,
            score_mod=config.score_mod,
            mask_mod=config.mask_mod,
        )

    def forward(
        self, x: Tensor, mask: Tensor | None = None, **options: Unpack[LayerOptions]
    ) -> tuple[Tensor, Tensor | None]:
        """Apply the block.

        Args:
            x: Input tokens.
            mask: Bool (``True`` = may attend) or additive float mask, broadcastable to
                ``(B, H, L, S)``; a key-padding mask is ``(B, 1, 1, S)``.
            **options: ``positions`` (for the rotary module), ``kv_cache`` (this block's
                cache), ``cache_position`` and ``return_weights``, handed to the attention (see
                :class:`attnkit.attention.LayerOptions`).

        Returns:
            ``(x, weights)``: ``x`` of shape ``(B, L, D)``; ``weights`` ``(B, H, L, S)`` when
            asked for, else ``None``.
        """
        training = self.training
        attn_in = self.norm1(x) if self.norm_first else x
        attn_out, weights = self._attend(attn_in, mask, options)
        if self.post_attn_norm is not None:
            attn_out = self.post_attn_norm(attn_out)
        if training:
            attn_out = _dropout(attn_out, self.dropout, True)
        if self.norm_first:
            x = x + attn_out
            ff_out = self.feed_forward(self.norm2(x))
            if self.post_ffn_norm is not None:
                ff_out = self.post_ffn_norm(ff_out)
            return x + (_dropout(ff_out, self.dropout, True) if training else ff_out), weights
        x = self.norm1(x + attn_out)
        ff_out = self.feed_forward(x)
        if training:
            ff_out = _dropout(ff_out, self.dropout, True)
        return self.norm2(x + ff_out), weights

    def _build_attention(self, dim: int, num_heads: int, **options: Any) -> nn.Module:
        """The block's self-attention: a :class:`MultiHeadAttention` with one fused q/k/v."""
        return MultiHeadAttention(dim, num_heads, fused_qkv=True, **options)

    def _attend(
        self, x: Tensor, mask: Tensor | None, options: LayerOptions
    ) -> tuple[Tensor, Tensor | None]:
        """The attention sub-layer's ``(out, weights or None)``."""
        return self.attention(x, mask=mask, **options)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, dropout={self.dropout}"
