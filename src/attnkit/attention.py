"""Multi-head attention, and the blog's attention classes as presets of it.

:class:`MultiHeadAttention` is the one general module: self- or cross-attention, separate or fused
q/k/v projections, grouped-query attention (``num_kv_heads``), causal / sliding-window masking,
rotary positions and a KV cache for decoding. It never computes attention itself: it projects,
splits heads and calls :func:`attnkit.functional.scaled_dot_product_attention`.

The projections are plain attributes: ``q_proj``, ``k_proj``, ``v_proj`` (or one fused
``qkv_proj``) and ``out_proj``. The blog's classes (``ScaleDotProductAttention``, ``Attention``,
``SelfAttention``, ``MultiheadCrossAttention``, ``MultiHeadSelfAttention``) keep the blog's
constructor signatures, and a checkpoint key map (:attr:`MultiHeadAttention.checkpoint_names`)
gives their state_dicts the blog's parameter names (``w_q``, ``w_qkv``, ``output_map``...): a
state_dict saved from the blog's code loads with ``strict=True`` and gives the same outputs, and
``state_dict()`` writes the blog's names back. The blog's attribute names are read-only aliases
(``attn.w_qkv is attn.qkv_proj``).

Every layer makes one attention call and passes the weights through: :func:`with_weights` and
:func:`split_weights` convert between the public ``out`` / ``(out, weights)`` return and the
``(out, weights_or_None)`` pair. The keywords every self-attention layer and block forward takes
(``positions``, ``kv_cache``, ``return_weights``) are typed once, as :class:`LayerOptions`; a
layer that only hands them on takes ``**options: Unpack[LayerOptions]``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import torch
from torch import Tensor, nn

from attnkit.cache import KVCache
from attnkit.functional import attend

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Attention",
    "LayerOptions",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
    "MultiheadCrossAttention",
    "ScaleDotProductAttention",
    "SelfAttention",
    "merge_heads",
    "split_heads",
    "split_weights",
    "with_weights",
]


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """``(..., L, H*E) -> (..., H, L, E)``."""
    return x.unflatten(-1, (num_heads, -1)).transpose(-2, -3)


def merge_heads(x: Tensor) -> Tensor:
    """``(..., H, L, E) -> (..., L, H*E)``."""
    return x.transpose(-2, -3).flatten(-2)


def with_weights(out: Tensor, weights: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    """The public return of a layer: ``out``, or ``(out, weights)`` when weights were computed."""
    return out if weights is None else (out, weights)


def split_weights(result: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """Inverse of :func:`with_weights`: ``(out, weights)``, ``weights`` ``None`` if absent."""
    return result if isinstance(result, tuple) else (result, None)


class LayerOptions(TypedDict, total=False):
    """The keyword options of every attention layer's and block's forward.

    Attributes:
        positions: Integer positions of the query tokens for rotary (or sinusoidal) positions,
            shape ``(L,)`` or ``(B, L)``; defaults to ``cache length + arange(L)``.
        kv_cache: The layer's :class:`attnkit.KVCache` for incremental decoding; the new
            keys/values are appended and attention runs over all cached positions.
        return_weights: Also return the attention weights ``(B, H, L, S)`` (default ``False``).
    """

    positions: Tensor | None
    kv_cache: KVCache | None
    return_weights: bool


def _check_positive(**sizes: int | None) -> None:
    bad = {n: s for n, s in sizes.items() if s is not None and (not isinstance(s, int) or s < 1)}
    if bad:
        raise ValueError(f"sizes must be positive ints, got {bad}")


class MultiHeadAttention(nn.Module):
    """General multi-head attention.

    Args:
        embed_dim: Query input dim ``D``.
        num_heads: Query heads ``H``.
        kdim: Key input dim (cross-attention); defaults to ``embed_dim``.
        vdim: Value input dim; defaults to ``kdim``.
        hidden_dim: Total projected dim ``H * E``; defaults to ``embed_dim``.
        out_dim: Output dim; defaults to ``embed_dim``.
        num_kv_heads: Key/value heads ``K`` (grouped-query attention); defaults to ``num_heads``.
        bias: Whether the query/key/value projections have biases.
        out_bias: Whether the output projection has a bias (default ``bias``).
        fused_qkv: One ``Linear`` producing ``[q | k | v]`` (self-attention only).
        dropout: Dropout on the attention weights, active only in training mode.
        causal: Causal masking (bottom-right aligned, see the functional core).
        window: Sliding-window size (see :func:`attnkit.functional.scaled_dot_product_attention`).
        scale: Score multiplier; defaults to ``1 / sqrt(E)``.
        rotary: Optional rotary module applied to queries and keys after the head split; it is
            called as ``rotary(x, positions)`` with ``x`` of shape ``(..., heads, L, E)``.

    Raises:
        ValueError: If sizes are not positive or do not divide.
    """

    #: Checkpoint key map, attribute -> name in state_dicts (e.g. ``{"qkv_proj": "w_qkv"}``).
    #: ``state_dict()`` writes these names and ``load_state_dict`` reads them (and the
    #: attribute names); each mapped name is also a read-only alias of its attribute (a
    #: property that ``__init_subclass__`` installs unless the subclass defines one).
    checkpoint_names: ClassVar[Mapping[str, str]] = {}

    q_proj: nn.Linear  # separate projections (fused_qkv=False)
    k_proj: nn.Linear
    v_proj: nn.Linear
    qkv_proj: nn.Linear  # one fused projection, rows [q | k | v] (fused_qkv=True)
    out_proj: nn.Linear

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        hidden_dim: int | None = None,
        out_dim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        fused_qkv: bool = False,
        dropout: float = 0.0,
        causal: bool = False,
        window: int | None = None,
        scale: float | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__()
        hidden_dim = embed_dim if hidden_dim is None else hidden_dim
        out_dim = embed_dim if out_dim is None else out_dim
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kdim = embed_dim if kdim is None else kdim
        vdim = kdim if vdim is None else vdim
        _check_positive(
            embed_dim=embed_dim,
            num_heads=num_heads,
            kdim=kdim,
            vdim=vdim,
            hidden_dim=hidden_dim,
            out_dim=out_dim,
            num_kv_heads=num_kv_heads,
            window=window,
        )
        if hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim ({hidden_dim}) must be divisible by num_heads ({num_heads})"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if fused_qkv and (kdim != embed_dim or vdim != embed_dim):
            raise ValueError(
                f"fused_qkv needs kdim == vdim == embed_dim, got kdim={kdim}, vdim={vdim}, "
                f"embed_dim={embed_dim}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if scale is not None and not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        self.embed_dim, self.kdim, self.vdim = embed_dim, kdim, vdim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_dim // num_heads
        self.hidden_dim, self.out_dim = hidden_dim, out_dim
        self.fused_qkv = fused_qkv
        self.dropout, self.causal, self.window, self.scale = dropout, causal, window, scale
        kv_hidden = num_kv_heads * self.head_dim
        if fused_qkv:
            self.qkv_proj = nn.Linear(embed_dim, hidden_dim + 2 * kv_hidden, bias=bias)
        else:
            self.q_proj = nn.Linear(embed_dim, hidden_dim, bias=bias)
            self.k_proj = nn.Linear(kdim, kv_hidden, bias=bias)
            self.v_proj = nn.Linear(vdim, kv_hidden, bias=bias)
        self.out_proj = nn.Linear(hidden_dim, out_dim, bias=bias if out_bias is None else out_bias)
        self.rotary = rotary
        self._load_prefix = ""  # set while loading, so error messages use checkpoint names
        if self.checkpoint_names:
            self.register_state_dict_post_hook(_save_with_checkpoint_names)
            self.register_load_state_dict_pre_hook(_load_checkpoint_names)
            self.register_load_state_dict_post_hook(_report_checkpoint_names)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give a subclass a read-only alias property for each of its checkpoint names."""
        super().__init_subclass__(**kwargs)
        for attr, alias in cls.checkpoint_names.items():
            if not hasattr(cls, alias):
                doc = f"The checkpoint name of ``{attr}`` (read-only)."
                setattr(cls, alias, property(operator.attrgetter(attr), doc=doc))

    def __setattr__(self, name: str, value: Any) -> None:
        for attr, alias in self.checkpoint_names.items():
            if name == alias:
                raise AttributeError(
                    f"{name!r} is a read-only alias of {attr!r} in {type(self).__name__}; "
                    f"assign {attr!r} instead"
                )
        super().__setattr__(name, value)

    def _check_last_dims(self, **inputs: Tensor) -> None:
        """Raise naming each of ``query``/``key``/``value`` whose last dim is not this layer's."""
        sizes = {"query": "embed_dim", "key": "kdim", "value": "vdim"}
        bad = [
            f"{name} has last dim {x.shape[-1]}, expected {sizes[name]}="
            f"{getattr(self, sizes[name])} ({name} shape {tuple(x.shape)})"
            for name, x in inputs.items()
            if x.shape[-1] != getattr(self, sizes[name])
        ]
        if bad:
            raise ValueError("; ".join(bad))

    def project_qkv(
        self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Project inputs and split heads.

        Shape:
            query ``(..., L, D)``, key ``(..., S, kdim)``, value ``(..., S, vdim)`` ->
            q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, E)``.
        """
        self._check_last_dims(query=query)
        is_self = key is None or (key is query and (value is None or value is query))
        if self.fused_qkv:
            if not is_self:
                raise ValueError("fused_qkv attention is self-attention: pass only the query")
            kv_hidden = self.num_kv_heads * self.head_dim
            qkv = self.qkv_proj(query)  # (..., L, H*E + 2*K*E)
            q, k, v = qkv.split([self.hidden_dim, kv_hidden, kv_hidden], dim=-1)
        else:
            key = query if key is None else key
            value = key if value is None else value
            self._check_last_dims(key=key, value=value)
            if key.shape[:-1] != value.shape[:-1]:
                raise ValueError(
                    f"key {tuple(key.shape)} and value {tuple(value.shape)} differ "
                    "in batch or length"
                )
            q = self.q_proj(query)  # (..., L, H*E)
            k = self.k_proj(key)  # (..., S, K*E)
            v = self.v_proj(value)  # (..., S, K*E)
        q = split_heads(q, self.num_heads)  # (..., H, L, E)
        k = split_heads(k, self.num_kv_heads)  # (..., K, S, E)
        v = split_heads(v, self.num_kv_heads)  # (..., K, S, E)
        return q, k, v

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        mask: Tensor | None = None,
        **options: Unpack[LayerOptions],
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Args:
            query: Query tokens.
            key: Key tokens (defaults to ``query``).
            value: Value tokens (defaults to ``key``).
            mask: Bool (``True`` = may attend) or additive float mask, broadcastable to
                ``(B, H, L, S)``.
            **options: ``positions`` (of the query tokens, for the rotary module),
                ``kv_cache`` (this layer's cache for incremental decoding) and
                ``return_weights``: see :class:`LayerOptions`.

        Returns:
            ``out`` of shape ``(B, L, out_dim)``, or ``(out, weights)``.

        Raises:
            TypeError: For a keyword that is not a :class:`LayerOptions` key.

        Shape:
            query ``(B, L, D)``, key ``(B, S, kdim)``, value ``(B, S, vdim)`` ->
            ``(B, L, out_dim)``. Leading dims other than ``B`` also work (``(L, D)`` too).
        """
        known = LayerOptions.__optional_keys__
        if not options.keys() <= known:
            raise TypeError(
                f"{type(self).__name__}.forward got unexpected keyword arguments "
                f"{sorted(options.keys() - known)}; it takes {sorted(known)}"
            )
        positions, kv_cache = options.get("positions"), options.get("kv_cache")
        q, k, v = self.project_qkv(query, key, value)
        if self.rotary is not None:
            if k.shape[-2] != q.shape[-2] and kv_cache is None:
                raise ValueError("rotary positions need self-attention (same query/key tokens)")
            if positions is None:
                start = 0 if kv_cache is None else kv_cache.length
                positions = torch.arange(start, start + q.shape[-2], device=q.device)
            q = self.rotary(q, positions)
            k = self.rotary(k, positions)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, K, cached + L, E)
        out, weights = attend(
            q,
            k,
            v,
            mask,
            causal=self.causal,
            window=self.window,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=options.get("return_weights", False),
        )  # (B, H, L, E), (B, H, L, S) or None
        return with_weights(self.out_proj(merge_heads(out)), weights)  # (B, L, out_dim)

    def extra_repr(self) -> str:
        parts = [f"heads={self.num_heads}", f"head_dim={self.head_dim}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"kv_heads={self.num_kv_heads}")
        if self.causal:
            parts.append("causal=True")
        if self.window is not None:
            parts.append(f"window={self.window}")
        return ", ".join(parts)


def _save_with_checkpoint_names(
    module: MultiHeadAttention,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
) -> None:
    """State-dict post-hook: write ``module``'s projections under their checkpoint names."""
    names = module.checkpoint_names
    # The module's entries were added last; re-adding them in order keeps the key order.
    for key in [k for k in state_dict if k.startswith(prefix)]:
        attr, _, rest = key[len(prefix) :].partition(".")
        value = state_dict.pop(key)
        state_dict[f"{prefix}{names.get(attr, attr)}.{rest}" if rest else key] = value


def _load_checkpoint_names(
    module: MultiHeadAttention,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre-hook: read checkpoint names into the projection attributes."""
    module._load_prefix = prefix
    attr_of = {alias: attr for attr, alias in module.checkpoint_names.items()}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name, _, rest = key[len(prefix) :].partition(".")
        if name in attr_of and rest:
            state_dict[f"{prefix}{attr_of[name]}.{rest}"] = state_dict.pop(key)


def _report_checkpoint_names(module: MultiHeadAttention, incompatible: Any) -> None:
    """Load-state-dict post-hook: name missing/unexpected keys by their checkpoint names."""
    prefix, names = module._load_prefix, module.checkpoint_names
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        for i, key in enumerate(keys):
            attr, _, rest = key[len(prefix) :].partition(".")
            if key.startswith(prefix) and attr in names and rest:
                keys[i] = f"{prefix}{names[attr]}.{rest}"


# --------------------------------------------------------------------------------------------
# The blog's classes, same names and constructors; their state_dicts use the blog's names.
# --------------------------------------------------------------------------------------------


class ScaleDotProductAttention(nn.Module):
    """The blog's parameter-free ``softmax(q k^T / sqrt(d_k)) v``.

    Args:
        d_k: The dim whose square root divides the scores.
    """

    def __init__(self, d_k: int) -> None:
        super().__init__()
        _check_positive(d_k=d_k)
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
        return with_weights(*attend(q, k, v, mask, scale=scale, return_weights=return_weights))


class _BlogNames(MultiHeadAttention):
    """Names the blog's multi-head classes share: ``output_map`` and ``dim_per_head``."""

    output_map: nn.Linear  # read-only aliases, installed from checkpoint_names

    @property
    def dim_per_head(self) -> int:
        """The blog's name for the head dim."""
        return self.head_dim


class MultiheadCrossAttention(_BlogNames):
    """The blog's multi-head attention with separate ``w_q``, ``w_k``, ``w_v`` projections.

    Its state_dict uses the blog's names ``w_q``, ``w_k``, ``w_v``, ``output_map`` (also
    read-only aliases of ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``). Its forward is
    :meth:`MultiHeadAttention.forward` with the blog's argument names ``(q, k, v, mask)`` and the
    same keywords (:class:`LayerOptions`).

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

    w_q: nn.Linear  # read-only aliases, installed from checkpoint_names
    w_k: nn.Linear
    w_v: nn.Linear

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int, num_heads: int) -> None:
        super().__init__(dim_in, num_heads, hidden_dim=dim_hidden, out_dim=dim_out)

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
        return super().forward(q, k, v, mask, **options)


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

    The keyword-only options are those of :class:`MultiHeadAttention`; at their defaults this is
    exactly the blog's class. Its state_dict uses the blog's names ``w_qkv`` and ``output_map``
    (also read-only aliases of ``qkv_proj`` and ``out_proj``).

    Args:
        in_dim: Input dim.
        hidden_dim: Total projected dim, split over ``num_heads``.
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
    w_qkv: nn.Linear  # read-only alias, installed from checkpoint_names

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
        super().__init__(
            in_dim,
            num_heads,
            hidden_dim=hidden_dim,
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
        """Self-attention over ``x`` (the keywords are :class:`LayerOptions`).

        Shape:
            x ``(B, N, in_dim)``, mask broadcastable to ``(B, H, N, N)`` -> ``(B, N, out_dim)``.
        """
        return super().forward(x, mask=mask, **options)


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
