"""The blog's classes, under the blog's names, built on attnkit's general modules.

Each class keeps the blog's constructor, its parameter names in ``state_dict()`` (a state_dict
saved from the blog's code loads with ``strict=True`` and gives the same outputs) and its return
values (``out``, or ``(out, weights)`` when weights are asked for). Each is a preset of one
general module: the attention classes of :class:`attnkit.MultiHeadAttention`, the blocks of
:class:`attnkit.blocks.TransformerLayer`. The blog's attribute names are read-only aliases of
attnkit's (``attn.w_qkv is attn.qkv_proj``).

Deliberate differences from the blog (documented in the README): the blog's
``MultiHeadSelfAttention`` einops pattern raises on current einops (attnkit splits heads with a
reshape); fully-masked query rows give zeros instead of NaN; ``TransformerBlock`` takes a mask.
``PositionalTransformerBlock`` keeps the blog's behaviour of adding sinusoidal positions in every
block (attnkit's models add them once).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit.attention import LayerOptions, MultiHeadAttention, split_heads
from attnkit.blocks import TransformerLayer
from attnkit.cache import KVCache
from attnkit.functional import attend
from attnkit.positional import RotaryEmbedding, SinusoidalPositionalEncoding

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Attention",
    "MultiHeadSelfAttention",
    "MultiheadCrossAttention",
    "PositionalMultiHeadSelfAttention",
    "PositionalTransformerBlock",
    "ScaleDotProductAttention",
    "SelfAttention",
    "TransformerBlock",
]


def _public(out: Tensor, weights: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    """The blog's return: ``out``, or ``(out, weights)`` when weights were computed."""
    return out if weights is None else (out, weights)


def _pair(result: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """The inverse of :func:`_public`."""
    return result if isinstance(result, tuple) else (result, None)


def _alias(attr: str) -> property:
    """A read-only property naming ``attr`` by the blog's name."""

    def get(self: nn.Module) -> nn.Module:
        module: nn.Module = getattr(self, attr)
        return module

    return property(get, doc=f"The blog's name of ``{attr}`` (read-only).")


class _BlogNames(MultiHeadAttention):
    """A :class:`MultiHeadAttention` whose state_dicts use the blog's names.

    ``checkpoint_names`` maps attribute -> blog name (``{"qkv_proj": "w_qkv"}``):
    ``state_dict()`` writes the blog's names, ``load_state_dict`` reads them (and attnkit's),
    and missing/unexpected keys are reported by the blog's names.
    """

    checkpoint_names: ClassVar[Mapping[str, str]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_prefix = ""  # set while loading, so error messages use the blog's names
        self.register_state_dict_post_hook(_save_with_checkpoint_names)
        self.register_load_state_dict_pre_hook(_load_checkpoint_names)
        self.register_load_state_dict_post_hook(_report_checkpoint_names)

    def __setattr__(self, name: str, value: Any) -> None:
        for attr, alias in self.checkpoint_names.items():
            if name == alias:
                raise AttributeError(
                    f"{name!r} is a read-only alias of {attr!r} in {type(self).__name__}; "
                    f"assign {attr!r} instead"
                )
        super().__setattr__(name, value)

    @property
    def dim_per_head(self) -> int:
        """The blog's name for the head dim."""
        return self.head_dim


def _save_with_checkpoint_names(
    module: _BlogNames, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """State-dict post-hook: write ``module``'s projections under the blog's names."""
    names = module.checkpoint_names
    # The module's entries were added last; re-adding them in order keeps the key order.
    for key in [k for k in state_dict if k.startswith(prefix)]:
        attr, _, rest = key[len(prefix) :].partition(".")
        value = state_dict.pop(key)
        state_dict[f"{prefix}{names.get(attr, attr)}.{rest}" if rest else key] = value


def _load_checkpoint_names(
    module: _BlogNames, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load-state-dict pre-hook: read the blog's names into the projection attributes."""
    module._load_prefix = prefix
    attr_of = {alias: attr for attr, alias in module.checkpoint_names.items()}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name, _, rest = key[len(prefix) :].partition(".")
        if name in attr_of and rest:
            state_dict[f"{prefix}{attr_of[name]}.{rest}"] = state_dict.pop(key)


def _report_checkpoint_names(module: _BlogNames, incompatible: Any) -> None:
    """Load-state-dict post-hook: name missing/unexpected keys by the blog's names."""
    prefix, names = module._load_prefix, module.checkpoint_names
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        for i, key in enumerate(keys):
            attr, _, rest = key[len(prefix) :].partition(".")
            if key.startswith(prefix) and attr in names and rest:
                keys[i] = f"{prefix}{names[attr]}.{rest}"


class ScaleDotProductAttention(nn.Module):
    """The blog's parameter-free ``softmax(q k^T / sqrt(d_k)) v``.

    Args:
        d_k: The dim whose square root divides the scores.
    """

    def __init__(self, d_k: int) -> None:
        super().__init__()
        if isinstance(d_k, bool) or not isinstance(d_k, int) or d_k < 1:
            raise ValueError(f"sizes must be positive ints, got {{'d_k': {d_k!r}}}")
        self.d_k = d_k

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Shape: q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)`` -> ``(..., L, Ev)``."""
        scale = 1.0 / math.sqrt(self.d_k)
        return _public(*attend(q, k, v, mask, scale=scale, return_weights=return_weights))


class MultiheadCrossAttention(_BlogNames):
    """The blog's multi-head attention with separate ``w_q``, ``w_k``, ``w_v`` projections.

    Its state_dict uses the blog's names ``w_q``, ``w_k``, ``w_v``, ``output_map`` (also
    read-only aliases of ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``). Its forward is
    :meth:`MultiHeadAttention.forward` with the blog's argument names ``(q, k, v, mask)``, the
    same keywords (:class:`attnkit.attention.LayerOptions`) and the blog's return.

    Args:
        dim_in: Input dim of queries, keys and values.
        dim_hidden: Total projected dim, split over ``num_heads``.
        dim_out: Output dim.
        num_heads: Number of heads.
    """

    checkpoint_names: ClassVar[Mapping[str, str]] = {
        "q_proj": "w_q",
        "k_proj": "w_k",
        "v_proj": "w_v",
        "out_proj": "output_map",
    }
    w_q = _alias("q_proj")
    w_k = _alias("k_proj")
    w_v = _alias("v_proj")
    output_map = _alias("out_proj")

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int, num_heads: int) -> None:
        if isinstance(num_heads, int) and num_heads > 0 and dim_hidden % num_heads:
            raise ValueError(
                f"hidden_dim ({dim_hidden}) must be divisible by num_heads ({num_heads})"
            )
        head_dim = dim_hidden // num_heads if isinstance(num_heads, int) and num_heads else None
        super().__init__(dim_in, num_heads, head_dim=head_dim, out_dim=dim_out)

    def get_heads(self, tokens: Tensor, linear_layer: nn.Module) -> Tensor:
        """Project ``tokens`` and split heads: ``(B, N, dim_in) -> (B, H, N, E)``."""
        return split_heads(linear_layer(tokens), self.num_heads)

    def forward(  # type: ignore[override]
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        **options: Unpack[LayerOptions],
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Shape: q ``(B, L, dim_in)``, k/v ``(B, S, dim_in)`` -> ``(B, L, dim_out)``."""
        return _public(*super().forward(q, k, v, mask, **options))


class Attention(MultiheadCrossAttention):
    """The blog's single-head attention with separate ``w_q``, ``w_k``, ``w_v`` and ``output_map``.

    :class:`MultiheadCrossAttention` with one head (same forward ``(q, k, v, mask)``).

    Args:
        dim_in: Input dim of queries, keys and values.
        dim_hidden: Projected dim (the scores are divided by ``sqrt(dim_hidden)``).
        dim_out: Output dim.
    """

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int) -> None:
        super().__init__(dim_in, dim_hidden, dim_out, 1)


class MultiHeadSelfAttention(_BlogNames):
    """The blog's multi-head self-attention with a fused ``w_qkv`` and optional causal mask.

    The keyword-only options are those of :class:`attnkit.MultiHeadAttention`; at their
    defaults this is exactly the blog's class. Its state_dict uses the blog's names ``w_qkv``
    and ``output_map`` (also read-only aliases of ``qkv_proj`` and ``out_proj``).

    Args:
        in_dim: Input dim.
        hidden_dim: Total projected dim ``H * E``, split over ``num_heads`` (the blog's name).
        out_dim: Output dim.
        num_heads: Number of heads.
        causal: Forbid attending to later tokens.
        num_kv_heads: Key/value heads (grouped-query attention).
        bias: Whether the projections have biases.
        out_bias: Whether the output projection has a bias (default ``bias``).
        dropout: Dropout on the attention weights (training mode only).
        window: Sliding-window size.
        scale: Score multiplier (default ``1 / sqrt(E)``).
        rotary: Rotary module applied to queries and keys.
    """

    checkpoint_names: ClassVar[Mapping[str, str]] = {"qkv_proj": "w_qkv", "out_proj": "output_map"}
    w_qkv = _alias("qkv_proj")
    output_map = _alias("out_proj")

    def __init__(
        self,
        in_dim: int,
        hidden_dim: int,
        out_dim: int,
        num_heads: int,
        causal: bool = False,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        window: int | None = None,
        scale: float | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        if isinstance(num_heads, int) and num_heads > 0 and hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim ({hidden_dim}) must be divisible by num_heads ({num_heads})"
            )
        super().__init__(
            in_dim,
            num_heads,
            head_dim=hidden_dim // num_heads if isinstance(num_heads, int) and num_heads else None,
            out_dim=out_dim,
            fused_qkv=True,
            causal=causal,
            num_kv_heads=num_kv_heads,
            bias=bias,
            out_bias=out_bias,
            dropout=dropout,
            window=window,
            scale=scale,
            rotary=rotary,
        )

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, **options: Unpack[LayerOptions]
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Self-attention over ``x`` (the keywords are :class:`attnkit.attention.LayerOptions`).

        Shape:
            x ``(B, N, in_dim)``, mask broadcastable to ``(B, H, N, N)`` -> ``(B, N, out_dim)``.
        """
        return _public(*super().forward(x, mask=mask, **options))


class SelfAttention(MultiHeadSelfAttention):
    """The blog's single-head self-attention with one fused ``w_qkv`` projection.

    :class:`MultiHeadSelfAttention` with one head (its forward takes ``(x, mask)``, plus that
    class's keywords).

    Args:
        dim_in: Input dim.
        dim_hidden: Projected dim of each of q, k, v.
        dim_out: Output dim.
    """

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int) -> None:
        super().__init__(dim_in, dim_hidden, dim_out, 1)


class PositionalMultiHeadSelfAttention(MultiHeadSelfAttention):
    """The blog's self-attention with fused ``qkv``/``output`` projections and optional RoPE.

    A :class:`MultiHeadSelfAttention` whose state_dict uses the blog's names for this class,
    ``qkv`` and ``output`` (also read-only aliases of ``qkv_proj`` and ``out_proj``); its
    forward is ``(x, mask=None, *, positions, kv_cache, return_weights)``.

    With ``use_rope`` the queries and keys are rotated with a
    :class:`attnkit.positional.RotaryEmbedding` in the blog's interleaved convention (positions
    ``0 .. L-1`` unless ``positions`` is given, or continuing after the cache).

    Args:
        dim: Model dim (input, hidden and output).
        num_heads: Number of heads.
        causal: Forbid attending to later tokens.
        use_rope: Apply rotary embeddings to queries and keys.

    Raises:
        ValueError: If ``dim`` is not divisible by ``num_heads`` or, with ``use_rope``, the head
            dim is odd.
    """

    checkpoint_names: ClassVar[Mapping[str, str]] = {"qkv_proj": "qkv", "out_proj": "output"}
    qkv = _alias("qkv_proj")
    output = _alias("out_proj")

    def __init__(
        self, dim: int, num_heads: int, causal: bool = False, use_rope: bool = False
    ) -> None:
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        rotary = RotaryEmbedding(dim // num_heads, interleaved=True) if use_rope else None
        super().__init__(dim, dim, dim, num_heads, causal, rotary=rotary)
        self.use_rope = use_rope


class TransformerBlock(TransformerLayer):
    """The blog's post-norm block: self-attention + feed-forward, residuals and norms.

    :class:`attnkit.blocks.TransformerLayer` with the blog's constructor (``hidden_dim`` is the
    feed-forward width), its attention a :class:`MultiHeadSelfAttention` (state_dict names
    ``attention.w_qkv``, ``attention.output_map``, ``feed_forward.linear1``...) and the blog's
    return: ``x``, or ``(x, weights)`` when weights are asked for. The keyword-only options are
    :class:`attnkit.blocks.TransformerLayer`'s; at their defaults this is the blog's block.

    Args:
        dim: Model dim ``D``.
        hidden_dim: Feed-forward hidden dim.
        num_heads: Query heads ``H``.
        causal: Causal self-attention.
        **options: :class:`attnkit.blocks.TransformerLayer`'s keyword options (``norm_first``,
            ``norm``, ``activation``, ``eps``, ``dropout``, ``num_kv_heads``, ``rotary``,
            ``window``, ``bias``, ``qkv_bias``, ``out_bias``, ``mlp_bias``, ``head_dim``), or
            ``attention``: a prebuilt self-attention module returning the blog's ``out`` or
            ``(out, weights)``.
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_heads: int, causal: bool = False, **options: Any
    ) -> None:
        super().__init__(dim, hidden_dim, num_heads, causal, **options)

    def _build_attention(self, dim: int, num_heads: int, **options: Any) -> nn.Module:
        """The blog's :class:`MultiHeadSelfAttention` (the blog's names in the state_dict)."""
        head_dim, causal = options.pop("head_dim"), options.pop("causal")
        extras = {k: options.pop(k, None) for k in ("q_norm", "k_norm", "softcap")}
        if any(v is not None for v in extras.values()):
            raise ValueError(
                f"the blog's TransformerBlock has no qk-norm or soft-capping, got {extras}; "
                "use attnkit.TransformerLayer"
            )
        hidden = dim if head_dim is None else num_heads * head_dim
        return MultiHeadSelfAttention(dim, hidden, dim, num_heads, causal, **options)

    def _attend(
        self, x: Tensor, mask: Tensor | None, options: LayerOptions
    ) -> tuple[Tensor, Tensor | None]:
        return _pair(self.attention(x, mask=mask, **options))

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, **options: Unpack[LayerOptions]
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Apply the block (see :meth:`attnkit.blocks.TransformerLayer.forward`).

        Returns:
            ``x`` of shape ``(B, L, D)``, or ``(x, weights)`` with weights ``(B, H, L, S)``.
        """
        return _public(*super().forward(x, mask, **options))


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

    def forward(  # type: ignore[override]
        self, x: Tensor, mask: Tensor | None = None, **options: Unpack[LayerOptions]
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Add sinusoidal positions (if any), then apply the block (see
        :meth:`TransformerBlock.forward`). With a ``kv_cache`` and no ``positions``, positions
        continue after the cached ones."""
        if isinstance(self.position, SinusoidalPositionalEncoding):
            kv_cache = options.get("kv_cache")
            if (
                options.get("positions") is None
                and isinstance(kv_cache, KVCache)
                and kv_cache.length
            ):
                start = kv_cache.length
                options["positions"] = torch.arange(start, start + x.shape[-2], device=x.device)
            x = self.position(x, options.get("positions"))
        return super().forward(x, mask, **options)
