"""A layer's attention variant: a named or custom ``score_mod`` / ``mask_mod`` run through
:mod:`attnkit.flex`.

:class:`FlexVariant` is what a :class:`attnkit.MultiHeadAttention` holds when its config names a
variant (``TransformerConfig(score_mod="alibi")``, ``mask_mod={"name": "prefix_lm", "prefix":
16}``) or is given a callable. It builds the preset of :mod:`attnkit.flex.presets` (a
learnable relative-bias table is its parameter ``bias_table``) and combines it with the layer's
own rules: the causal mask, the mask given to ``forward`` and the query positions of a cached
decoding step, so that ``q_idx`` and ``kv_idx`` are always absolute positions.

Under ``torch.compile`` the call is one custom op, ``attnkit::flex_layer`` (with its backward,
``attnkit::flex_layer_backward``): the variant is looked up by a name in the graph and its
tensors (the bias table) are inputs, so a ``fullgraph=True`` capture neither breaks nor traces
the kernel. Eager calls go to :func:`attnkit.flex.flex_attention` directly, so tensors that a
custom callable captures get gradients there too.
"""

# No ``from __future__ import annotations``: torch.library reads the op's annotations.

import itertools
import math
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.config import check_flex_spec

__all__ = ["FlexVariant", "explicit_attention"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

# key -> variant: the custom op's graph holds the key, a string, and its kernel (:func:`_flex`,
# also the eager call) looks the variant up by it.
_LIVE: "weakref.WeakValueDictionary[str, FlexVariant]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class FlexVariant(nn.Module):
    """The ``score_mod`` / ``mask_mod`` of one attention layer, with the layer's own rules.

    Args:
        score_mod: A spec of :data:`attnkit.config.FLEX_VARIANTS` (name or dict) or a callable
            ``score_mod(score, b, h, q_idx, kv_idx)``; ``None`` for none.
        mask_mod: The same for ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
        num_heads: Query heads ``H`` (ALiBi's slopes, the bias table's rows).
        causal: Combine a callable ``mask_mod`` (or none) with the causal mask. The named masks
            are causal by themselves (a prefix-LM after its prefix).

    Attributes:
        bias_table: The learnable table of a ``relative_bias`` variant, ``(H, 2 * max_distance
            + 1)`` (see :func:`attnkit.flex.presets.relative_bias`: entry ``[h, d +
            max_distance]`` is head ``h``'s bias at offset ``d = q_idx - kv_idx``, clamped to
            ``max_distance``). Zero at the start.

    Raises:
        ValueError: If both are ``None``, or for a bad spec (see
            :func:`attnkit.config.check_flex_spec`).
    """

    def __init__(
        self,
        *,
        score_mod: Any = None,
        mask_mod: Any = None,
        num_heads: int,
        causal: bool,
    ) -> None:
        super().__init__()
        self.score_spec = check_flex_spec(score_mod, "score_mod")
        self.mask_spec = check_flex_spec(mask_mod, "mask_mod")
        if self.score_spec is None and self.mask_spec is None:
            raise ValueError("a FlexVariant needs a score_mod or a mask_mod")
        self.num_heads, self.causal = num_heads, causal
        self.bias_table: nn.Parameter | None = None
        if isinstance(self.score_spec, dict) and self.score_spec["name"] == "relative_bias":
            width = 2 * self.score_spec["max_distance"] + 1
            self.bias_table = nn.Parameter(torch.zeros(num_heads, width))
        self.key = f"variant-{next(_KEYS)}"
        _LIVE[self.key] = self

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (deepcopy, pickle) is a layer of its own: its own key for the custom op.
        super().__setstate__(state)
        self.key = f"variant-{next(_KEYS)}"
        _LIVE[self.key] = self

    def captured(self) -> list[Tensor]:
        """The tensors the mods read that may need gradients (inputs of the custom op)."""
        return [] if self.bias_table is None else [self.bias_table]

    def _score_preset(self, captured: list[Tensor]) -> ScoreMod | None:
        from attnkit.flex import presets

        spec = self.score_spec
        if spec is None or callable(spec):
            return spec
        name = spec["name"]
        if name == "alibi":
            return presets.alibi(self.num_heads)
        if name == "softcap":
            return presets.softcap(float(spec["cap"]))
        return presets.relative_bias(captured[0])

    def _mask_preset(self) -> MaskMod | None:
        """The mask of the variant and the layer's causal order, in absolute positions."""
        from attnkit.flex import and_masks, presets

        spec = self.mask_spec
        if isinstance(spec, dict):  # the named masks are causal by themselves
            name = spec["name"]
            if name == "prefix_lm":
                return presets.prefix_lm(spec["prefix"])
            if name == "sliding_window":
                return presets.sliding_window(spec["window"])
            return presets.dilated(spec["dilation"])
        if spec is None:
            return presets.causal() if self.causal else None
        return and_masks(presets.causal(), spec) if self.causal else spec

    def mods(
        self, captured: list[Tensor], q_positions: Tensor | None, mask: Tensor | None
    ) -> tuple[ScoreMod | None, MaskMod | None]:
        """The ``score_mod`` and ``mask_mod`` of one call, in the call's own indices.

        Args:
            captured: :meth:`captured` (or the custom op's copies of it).
            q_positions: ``(L,)`` absolute position of each query (a key's is its index), or
                ``None`` where query ``i`` is at position ``i``.
            mask: The layer's bool (``True`` = may attend) or additive float mask,
                ``(B or 1, H or 1, L, S)``, or ``None``.

        Returns:
            The variant's presets themselves where there is nothing to add (so that
            :func:`attnkit.flex.flex_attention` recognises them), else closures over them.
        """
        preset_score = self._score_preset(captured)
        preset_mask = self._mask_preset()
        if q_positions is None and mask is None:
            return preset_score, preset_mask
        positions = q_positions
        bool_mask = mask if mask is not None and mask.dtype == torch.bool else None
        float_mask = mask if mask is not None and mask.dtype != torch.bool else None

        def at(q: Tensor) -> Tensor:
            return q if positions is None else positions[q]

        score_mod: ScoreMod | None = None
        if preset_score is not None or float_mask is not None:

            def score_mod(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                if preset_score is not None:
                    score = preset_score(score, b, h, at(q), kv)
                if float_mask is not None:
                    score = score + _at(float_mask, b, h, q, kv).to(score.dtype)
                return score

        mask_mod: MaskMod | None = None
        if preset_mask is not None or bool_mask is not None:

            def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                allowed = None if preset_mask is None else preset_mask(b, h, at(q), kv)
                if bool_mask is not None:
                    given = _at(bool_mask, b, h, q, kv)
                    allowed = given if allowed is None else allowed & given
                assert allowed is not None
                return allowed

        return score_mod, mask_mod

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        *,
        q_positions: Tensor | None,
        scale: float | None,
        dropout_p: float = 0.0,
        return_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of one layer call through the variant.

        Weights (``return_weights``) and dropout need the whole score matrix: they take the
        explicit path (:func:`explicit_attention`); every other call goes through
        :func:`attnkit.flex.flex_attention` (one custom op while compiling).

        Shape:
            q ``(B, H, L, E)``, k/v ``(B, K, S, E)``, q_positions ``(L,)`` (``None``: query
            ``i`` at position ``i``) -> out ``(B, H, L, Ev)``, weights ``(B, H, L, S)``.
        """
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        captured = self.captured()
        if return_weights or dropout_p:
            L, S = q.shape[-2], k.shape[-2]
            score_mod, mask_mod = self.mods(captured, q_positions, _as_4d(mask, L, S))
            return explicit_attention(q, k, v, score_mod, mask_mod, scale, dropout_p=dropout_p)
        if torch.compiler.is_compiling():
            out = torch.ops.attnkit.flex_layer(q, k, v, q_positions, mask, captured, self.key,
                                               scale)  # fmt: skip
            return out, None
        return _flex(q, k, v, q_positions, mask, captured, self.key, scale), None

    def extra_repr(self) -> str:
        def text(spec: Any) -> str:
            return getattr(spec, "__name__", repr(spec)) if callable(spec) else repr(spec)

        return f"score_mod={text(self.score_spec)}, mask_mod={text(self.mask_spec)}"


def _at(t: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``t[b, h, q, kv]`` of a ``(B or 1, H or 1, L, S)`` mask (size-1 dims broadcast)."""
    return t[b if t.shape[0] > 1 else 0, h if t.shape[1] > 1 else 0, q, kv]


def _as_4d(mask: Tensor | None, L: int, S: int) -> Tensor | None:
    """A mask broadcastable to ``(B, H, L, S)`` as a ``(B or 1, H or 1, L, S)`` tensor."""
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(*mask.shape[:2], L, S)


def _flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_positions: Tensor | None,
    mask: Tensor | None,
    captured: list[Tensor],
    variant: str,
    scale: float,
) -> Tensor:
    """:func:`attnkit.flex.flex_attention` with the mods and block mask of the variant whose
    ``key`` is ``variant``: an eager call, and the kernel of the custom op
    ``attnkit::flex_layer``."""
    from attnkit.flex import create_block_mask, flex_attention

    layer = _LIVE[variant]
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    score_mod, mask_mod = layer.mods(captured, q_positions, _as_4d(mask, L, S))
    block_mask = None
    if mask_mod is not None:
        # Per batch entry / head only where something can differ between them.
        custom = callable(layer.mask_spec)
        batched = custom or (mask is not None and mask.dim() == 4 and mask.shape[0] > 1)
        heads = custom or (mask is not None and mask.dim() >= 3 and mask.shape[-3] > 1)
        block_mask = create_block_mask(
            mask_mod, B if batched else None, H if heads else None, L, S, device=q.device
        )
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                         enable_gqa=k.shape[1] != H)  # fmt: skip
    return out.contiguous()  # type: ignore[union-attr]


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: ScoreMod | None,
    mask_mod: MaskMod | None,
    scale: float,
    *,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Attention with the whole score matrix: the mods evaluated on broadcast index grids.

    A fully masked row gives zero weights and a zero output.

    Shape:
        q ``(B, H, L, E)``, k/v ``(B, K, S, E)`` -> out ``(B, H, L, Ev)``, weights
        ``(B, H, L, S)``.
    """
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != H:  # grouped-query attention: each key head serves H / K query heads
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    device = q.device
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    i = torch.arange(L, device=device).view(1, 1, L, 1)
    j = torch.arange(S, device=device).view(1, 1, 1, S)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, L, S)
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    if mask_mod is not None:
        allowed = mask_mod(b, h, i, j).expand(B, H, L, S)
        scores = scores.masked_fill(~allowed, -math.inf)
    weights = scores.softmax(-1).nan_to_num(0.0)  # a fully masked row: zeros
    if dropout_p:
        weights = nn.functional.dropout(weights, p=dropout_p)
    return weights @ v, weights


# ---------------------------------------------------------------------------------------------
# The custom ops: one opaque call per layer under torch.compile.


_flex_layer = torch.library.custom_op("attnkit::flex_layer", _flex, mutates_args=())


@_flex_layer.register_fake
def _flex_layer_fake(q: Tensor, k: Tensor, v: Tensor, *_: object) -> Tensor:
    # (the output's shape is the queries' with the values' head dim; the rest do not change it)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("attnkit::flex_layer_backward", mutates_args=())
def _flex_layer_backward(
    grad: Tensor,
    inputs: list[Tensor],
    q_positions: Tensor | None,
    mask: Tensor | None,
    variant: str,
    scale: float,
) -> list[Tensor]:
    """The gradients of :func:`_flex` for its differentiable ``inputs`` (``q``, ``k``, ``v``
    and the captured tensors, in that order), by autograd through :mod:`attnkit.flex`'s own
    backward.

    A custom op's kernel runs below autograd (the dispatcher excludes its keys in the calling
    thread), so the recomputation runs in a worker thread, whose dispatch state is fresh.
    """

    def recompute() -> list[Tensor]:
        leaves = [t.detach().requires_grad_() for t in inputs]
        with torch.enable_grad():
            q, k, v, *captured = leaves
            out = _flex(q, k, v, q_positions, mask, captured, variant, scale)
            grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
        return [
            torch.zeros_like(t, memory_format=torch.contiguous_format)
            if g is None
            else g.contiguous()
            for t, g in zip(leaves, grads, strict=True)
        ]

    return _worker().submit(recompute).result()


def _worker() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnkit-flex-backward")
    return _POOL


_POOL: ThreadPoolExecutor | None = None


@_flex_layer_backward.register_fake
def _flex_layer_backward_fake(grad: Tensor, inputs: list[Tensor], *_: object) -> list[Tensor]:
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, q_positions, mask, captured, variant, scale = inputs
    ctx.save_for_backward(q, k, v, q_positions, *captured)
    ctx.mask, ctx.variant, ctx.scale = mask, variant, scale


def _backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    q, k, v, q_positions, *captured = ctx.saved_tensors
    grads = torch.ops.attnkit.flex_layer_backward(
        grad, [q, k, v, *captured], q_positions, ctx.mask, ctx.variant, ctx.scale
    )
    return grads[0], grads[1], grads[2], None, None, list(grads[3:]), None, None


_flex_layer.register_autograd(_backward, setup_context=_setup_context)
