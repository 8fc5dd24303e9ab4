"""Multi-head attention: the one general module every layer of attnkit is built on.

:class:`MultiHeadAttention` does self- or cross-attention, with separate or fused q/k/v
projections, grouped-query attention (``num_kv_heads``), causal / sliding-window masking,
rotary positions and a :class:`attnkit.KVCache` for decoding. It never computes attention
itself: it projects, splits heads and calls its ``kernel`` (by default
:func:`attnkit.functional.attend`, the functional core; another algorithm with the same
signature, e.g. ring attention across processes, is swapped in by assigning the attribute).

Its forward returns ``(out, weights)`` with ``weights`` ``None`` unless asked for (as
``torch.nn.MultiheadAttention`` does). The projections are plain attributes: ``q_proj``,
``k_proj``, ``v_proj`` (or one fused ``qkv_proj``) and ``out_proj``; ``state_dict()`` uses
exactly these names. The blog's classes, with the blog's names and return values, are in
:mod:`attnkit.blog`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor, nn

from attnkit import functional
from attnkit import masks as M
from attnkit.cache import AttendingCache, KVCache
from attnkit.variants import FlexVariant

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "AttentionOptions",
    "Kernel",
    "LayerOptions",
    "MultiHeadAttention",
    "check_keywords",
    "merge_heads",
    "split_heads",
]

#: The signature of an attention kernel (:func:`attnkit.functional.attend`):
#: ``kernel(q, k, v, mask, *, causal, window, scale, dropout_p, return_weights)`` returning
#: ``(out, weights or None)``.
Kernel = Callable[..., tuple[Tensor, Tensor | None]]


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """``(..., L, H*E) -> (..., H, L, E)``."""
    return x.unflatten(-1, (num_heads, -1)).transpose(-2, -3)


def merge_heads(x: Tensor) -> Tensor:
    """``(..., H, L, E) -> (..., L, H*E)``."""
    if x.dim() == 4 and x.shape[2] == 1 and x.is_contiguous():  # one token: a plain view
        return x.view(x.shape[0], 1, -1)
    return x.transpose(-2, -3).flatten(-2)


class LayerOptions(TypedDict, total=False):
    """The keyword options of every attention layer's and block's forward.

    Attributes:
        positions: Integer positions of the query tokens for rotary (or sinusoidal) positions,
            shape ``(L,)`` or ``(B, L)``; defaults to ``cache length + arange(L)``.
        kv_cache: The layer's :class:`attnkit.KVCache` for incremental decoding; the new
            keys/values are appended and attention runs over all cached positions. Or an
            :class:`attnkit.cache.AttendingCache` (explicit ``positions`` needed), which stores
            them and attends itself.
        cache_position: ``(L,)`` int tensor, the cache slots of the new tokens: the keys and
            values are written there and attention runs over every slot with a mask (one
            static-shaped graph for every decoding step; see :meth:`attnkit.KVCache.write`).
            Without it the new tokens are appended after :attr:`attnkit.KVCache.length`.
        return_weights: Also return the attention weights ``(B, H, L, S)`` (default ``False``).
    """

    positions: Tensor | None
    kv_cache: KVCache | AttendingCache | None
    cache_position: Tensor | None
    return_weights: bool


class AttentionOptions(TypedDict, total=False):
    """The options of :class:`MultiHeadAttention` that a block hands its attention as they were
    given (:class:`attnkit.blocks.TransformerLayer` takes them under the same names); each is
    ``None`` unless given.

    Attributes:
        num_kv_heads: Key/value heads ``K`` (grouped-query attention); defaults to ``num_heads``.
        window: Sliding-window size (see :func:`attnkit.functional.scaled_dot_product_attention`).
        scale: Score multiplier; defaults to ``1 / sqrt(E)``.
        softcap: Attention-logit soft-capping ``tanh(s / softcap) * softcap`` (Gemma 2).
        rotary: Rotary module applied to queries and keys after the head split.
        score_mod: An attention variant that rewrites the scores (a name, dict or callable).
        mask_mod: An attention variant that masks keys, combined with ``causal``.
    """

    num_kv_heads: int | None
    window: int | None
    scale: float | None
    softcap: float | None
    rotary: nn.Module | None
    score_mod: Any
    mask_mod: Any


def check_keywords(what: str, options: Mapping[str, Any], known: frozenset[str]) -> None:
    """Raise unless every key of ``options`` (the ``**options`` of ``what``) is ``known``.

    Raises:
        TypeError: Naming the unexpected keywords and the known ones.
    """
    if not options.keys() <= known:
        raise TypeError(
            f"{what} got unexpected keyword arguments {sorted(options.keys() - known)}; it "
            f"takes {sorted(known)}"
        )


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
        head_dim: Head dim ``E``; defaults to ``embed_dim // num_heads``.
        hidden_dim: Deprecated: the projected width ``H * E`` (use ``head_dim``).
        out_dim: Output dim; defaults to ``embed_dim``.
        num_kv_heads: Key/value heads ``K`` (grouped-query attention); defaults to ``num_heads``.
        bias: Whether the query/key/value projections have biases.
        out_bias: Whether the output projection has a bias (default ``bias``).
        fused_qkv: One ``Linear`` producing ``[q | k | v]`` (self-attention only).
        dropout: Dropout on the attention weights, active only in training mode.
        causal: Causal masking (bottom-right aligned, see the functional core).
        window: Sliding-window size (see :func:`attnkit.functional.scaled_dot_product_attention`).
        scale: Score multiplier; defaults to ``1 / sqrt(E)``.
        softcap: Attention-logit soft-capping ``tanh(s / softcap) * softcap`` (Gemma 2).
        q_norm: Optional module applied to each head's queries ``(..., E)`` before the rotary
            positions (qk-norm: Qwen3, Gemma 3).
        k_norm: The same for the keys.
        rotary: Optional rotary module applied to queries and keys after the head split; it is
            called as ``rotary(x, positions)`` with ``x`` of shape ``(..., heads, L, E)``.
        score_mod: An attention variant that rewrites the scores: a named one of
            :data:`attnkit.config.FLEX_VARIANTS` (``"alibi"``, ``{"name": "softcap", "cap":
            30.0}``, ...) or a callable ``score_mod(score, b, h, q_idx, kv_idx)``. The layer
            then attends through :mod:`attnkit.flex` (see :class:`attnkit.variants.FlexVariant`;
            ``q_idx`` and ``kv_idx`` are absolute positions, also in cached decoding).
        mask_mod: The same for a mask (``"prefix_lm"``, ``"sliding_window"``, ``"dilated"``, or
            a callable ``mask_mod(b, h, q_idx, kv_idx) -> bool``), combined with ``causal``.

    Attributes:
        kernel: The attention algorithm (see :data:`Kernel`); :func:`attnkit.functional.attend`
            unless replaced. Not used with a ``score_mod`` / ``mask_mod``.
        variant: The :class:`attnkit.variants.FlexVariant` of ``score_mod`` / ``mask_mod``, or
            ``None``.

    Raises:
        TypeError: For a keyword it does not take.
        ValueError: If sizes are not positive or do not divide.
    """

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
        head_dim: int | None = None,
        hidden_dim: int | None = None,
        out_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        fused_qkv: bool = False,
        dropout: float = 0.0,
        causal: bool = False,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        **options: Unpack[AttentionOptions],
    ) -> None:
        super().__init__()
        check_keywords(type(self).__name__, options, AttentionOptions.__optional_keys__)
        num_kv_heads, window = options.get("num_kv_heads"), options.get("window")
        scale, softcap = options.get("scale"), options.get("softcap")
        score_mod, mask_mod = options.get("score_mod"), options.get("mask_mod")
        if hidden_dim is not None:
            if head_dim is not None:
                raise ValueError(
                    f"give head_dim ({head_dim}) or its deprecated form hidden_dim ({hidden_dim}),"
                    " not both"
                )
            warnings.warn(
                "MultiHeadAttention(hidden_dim=...) is deprecated; use head_dim "
                "(hidden_dim = num_heads * head_dim)",
                DeprecationWarning,
                stacklevel=2,
            )
        else:
            hidden_dim = embed_dim if head_dim is None else num_heads * head_dim
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
        functional.check_softcap(softcap)
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
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rotary = options.get("rotary")
        self.softcap = softcap
        self.kernel: Kernel = functional.attend
        self.variant: FlexVariant | None = None
        if score_mod is not None or mask_mod is not None:
            if window is not None or softcap is not None:
                raise ValueError(
                    f"give window ({window}) and softcap ({softcap}) as a mask_mod and a score_mod "
                    "when the layer has a score_mod or mask_mod"
                )
            self.variant = FlexVariant(
                score_mod=score_mod, mask_mod=mask_mod, num_heads=num_heads, causal=causal
            )

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
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Args:
            query: Query tokens.
            key: Key tokens (defaults to ``query``).
            value: Value tokens (defaults to ``key``).
            mask: Bool (``True`` = may attend) or additive float mask, broadcastable to
                ``(B, H, L, S)``; with a ``cache_position`` it covers every cache slot.
            **options: ``positions`` (of the query tokens, for the rotary module),
                ``kv_cache`` (this layer's cache for incremental decoding),
                ``cache_position`` and ``return_weights``: see :class:`LayerOptions`.

        Returns:
            ``(out, weights)``: ``out`` of shape ``(B, L, out_dim)``; ``weights``
            ``(B, H, L, S)`` when ``return_weights``, else ``None``.

        Raises:
            TypeError: For a keyword that is not a :class:`LayerOptions` key.

        Shape:
            query ``(B, L, D)``, key ``(B, S, kdim)``, value ``(B, S, vdim)`` ->
            ``(B, L, out_dim)``. Leading dims other than ``B`` also work (``(L, D)`` too).
        """
        check_keywords(f"{type(self).__name__}.forward", options, LayerOptions.__optional_keys__)
        positions, kv_cache = options.get("positions"), options.get("kv_cache")
        cache_position = options.get("cache_position")
        rotary = self.rotary
        if rotary is not None and positions is None:
            positions = cache_position
        attending = kv_cache is not None and not isinstance(kv_cache, KVCache)
        if attending and (positions is None or options.get("return_weights", False)):
            raise ValueError(
                "an attending cache needs explicit positions and returns no weights, got "
                f"positions={positions}, return_weights={options.get('return_weights')}"
            )
        if rotary is not None and positions is None:
            start = 0 if not isinstance(kv_cache, KVCache) else kv_cache.length
            positions = torch.arange(start, start + query.shape[-2], device=query.device)
        if self.fused_qkv and key is None and value is None and self.q_norm is self.k_norm is None:
            # The queries' and keys' heads lie side by side in the fused projection: one rotary
            # call rotates both (fewer small kernels per decoding step).
            if query.shape[-1] != self.embed_dim:
                self._check_last_dims(query=query)
            qkv = self.qkv_proj(query)  # (..., L, (H + 2K) * E)
            if query.dim() == 3 and query.shape[1] == 1:  # one token: heads are a plain view
                heads = qkv.view(query.shape[0], -1, 1, self.head_dim)
            else:
                heads = qkv.unflatten(-1, (-1, self.head_dim)).transpose(-2, -3)
            H, K = self.num_heads, self.num_kv_heads  # heads: (..., H + 2K, L, E)
            qk, v = heads[..., : H + K, :, :], heads[..., H + K :, :, :]
            if rotary is not None:
                qk = rotary(qk, positions)
            q, k = qk[..., :H, :, :], qk[..., H:, :, :]
        else:
            q, k, v = self.project_qkv(query, key, value)
            if self.q_norm is not None:
                q = self.q_norm(q)
            if self.k_norm is not None:
                k = self.k_norm(k)
            if rotary is not None:
                if k.shape[-2] != q.shape[-2] and kv_cache is None:
                    raise ValueError("rotary positions need self-attention (same query/key tokens)")
                q, k = rotary(q, positions), rotary(k, positions)
        causal, window = self.causal, self.window
        if kv_cache is not None and not isinstance(kv_cache, KVCache):  # attending
            # The cache's layout is its own (e.g. the serving engine's block tables): it stores
            # the keys/values and runs each sequence's attention itself.
            scale = functional.resolve_scale(self.scale, q.shape[-1])
            out = kv_cache.attend(
                q, k, v, scale=scale, window=window, softcap=self.softcap
            )  # (B, H, L, E)
            return self.out_proj(merge_heads(out)), None
        if isinstance(kv_cache, KVCache) and cache_position is not None:
            k, v = kv_cache.write(k, v, cache_position)  # (B, K, C, E): every slot
            # Slots after a token's own are empty or stale: the (L, C) slot mask holds the
            # causal order and the window.
            if self.variant is None:
                mask = M.restrict(mask, kv_cache.slot_mask(cache_position, window=window))
            else:  # the variant orders the tokens itself (a prefix sees its future prefix)
                filled = torch.arange(k.shape[-2], device=k.device) <= cache_position[-1]
                mask = M.restrict(mask, filled.expand(cache_position.shape[0], -1))
            causal, window = False, None
        elif isinstance(kv_cache, KVCache):
            k, v = kv_cache.update(k, v)  # (B, K, cached + L, E)
        return_weights = options.get("return_weights", False)
        if self.variant is not None:
            return self._attend_variant(
                self.variant, q, k, v, mask, kv_cache, cache_position, return_weights
            )
        if (
            q.shape[-2] == 1
            and kv_cache is not None
            and self.kernel is functional.attend
            and not return_weights
            and not (self.training and self.dropout)
        ):
            # A decoding step through the default kernel: its one-query path directly (the
            # shapes and dtypes are this layer's own, checked by the projection and the cache).
            structure = {"window": window} if window is not None else {}
            scale = functional.resolve_scale(self.scale, q.shape[-1])
            one = functional.one_query(q, k, v, mask, scale, structure, softcap=self.softcap)
            if one is not None:
                return self.out_proj(merge_heads(one)), None
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        out, weights = self.kernel(
            q,
            k,
            v,
            mask,
            causal=causal,
            window=window,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
            **extra,
        )  # (B, H, L, E), (B, H, L, S) or None
        return self.out_proj(merge_heads(out)), weights  # (B, L, out_dim)

    def _attend_variant(
        self,
        variant: FlexVariant,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        kv_cache: KVCache | None,
        cache_position: Tensor | None,
        return_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The attention of a layer with a ``score_mod`` / ``mask_mod`` (through its variant).

        Queries sit at the end of the keys (bottom-right, as the causal mask), or at their
        ``cache_position`` slots, whose slot mask is already in ``mask``.
        """
        unbatched = q.dim() == 3
        if unbatched:  # (H, L, E): one sequence
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        L, S = q.shape[-2], k.shape[-2]
        q_positions = None  # query i at position i
        if kv_cache is not None and cache_position is not None:
            q_positions = cache_position
        elif L != S:
            q_positions = torch.arange(S - L, S, device=q.device)
        out, weights = variant.attend(
            q,
            k,
            v,
            mask,
            q_positions=q_positions,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
        )  # (B, H, L, E), (B, H, L, S) or None
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return self.out_proj(merge_heads(out)), weights if return_weights else None

    def extra_repr(self) -> str:
        parts = [f"heads={self.num_heads}", f"head_dim={self.head_dim}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"kv_heads={self.num_kv_heads}")
        if self.causal:
            parts.append("causal=True")
        if self.window is not None:
            parts.append(f"window={self.window}")
        return ", ".join(parts)
