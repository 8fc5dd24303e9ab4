"""``flex_attention``: torch's FlexAttention API on attnkit's kernels, without compiling.

A call goes down once:

* inputs, the block mask and the modifications are checked (each ``mask_mod``/``score_mod`` is
  called on a tiny index tile first, so a bad one fails with its name before any kernel runs);
* a mask and score modification that attnkit's structured options can say (presets from
  :mod:`attnkit.flex.presets` and their ``and_masks``: causal, sliding window, documents,
  padding, soft-cap) go to :func:`attnkit.functional.scaled_dot_product_attention`, whose
  kernels have their own fast forward and backward;
* ALiBi (:func:`attnkit.flex.presets.alibi`) over no mask, a causal one or a causal window goes
  to attnkit's flash kernels with the slopes added in the kernel, where the policy says
  (:func:`attnkit.kernels.policy.alibi_kernel`);
* everything else runs :mod:`attnkit.flex.tiles`: full key blocks with no mask work, partial
  ones with ``mask_mod`` on their index tile, empty ones skipped, ``score_mod`` on score tiles,
  and a flash-style backward that also gives the gradients of tensors the ``score_mod``
  captured (closure cells, default arguments, globals it names, attributes of a callable
  object, module parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit import blockwise, functional
from attnkit.flex import tiles
from attnkit.flex.blockmask import BlockMask, index_tensors, mod_name, probe_mask_mod
from attnkit.kernels import policy
from attnkit.kernels.plans import AttentionCall
from attnkit.kernels.tiles import FlashOptions
from attnkit.masks import Structure

__all__ = ["ScoreMod", "captured_tensors", "flex_attention"]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | Any | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with a score modification and a block mask, as torch's ``flex_attention``.

    ``softmax(score_mod(q k^T * scale) masked by block_mask.mask_mod) v``, computed on CPU
    without compiling.

    Args:
        query: Queries.
        key: Keys.
        value: Values.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, called with the score
            tile ``(B, H, Lt, St)`` and broadcastable index tensors ``b (B, 1, 1, 1)``,
            ``h (1, H, 1, 1)``, ``q_idx (1, 1, Lt, 1)``, ``kv_idx (1, 1, 1, St)``.
        block_mask: A :class:`~attnkit.flex.BlockMask` (or torch's FlexAttention
            ``BlockMask``) for exactly these ``(L, S)``; None allows every pair.
        scale: Multiplier of ``q k^T``; defaults to ``1 / sqrt(E)``.
        enable_gqa: Allow fewer key/value heads than query heads (grouped-query attention):
            query head ``h`` uses key/value head ``h // (H // K)``.
        return_lse: Also return the log-sum-exp of the modified, masked scores per query.

    Returns:
        ``out``, or ``(out, lse)`` with ``lse`` float32 in natural log (``-inf`` for a query
        that may attend no key, whose output row is zero).

    Shape:
        query ``(B, H, L, E)``, key ``(B, K, S, E)``, value ``(B, K, S, Ev)`` ->
        out ``(B, H, L, Ev)``, lse ``(B, H, L)``.

    Raises:
        TypeError: Non-tensor or non-float inputs, mixed dtypes, a ``mask_mod`` that does not
            return bool, a ``score_mod`` that does not return a float tensor.
        ValueError: Shapes that do not fit, heads that need ``enable_gqa``, a block mask built
            for other lengths, batch or heads, a ``mask_mod``/``score_mod`` that fails on index
            tensors or returns the wrong shape.
    """
    B, H, L, S, E = _check_inputs(query, key, value, enable_gqa)
    block_mask = as_block_mask(block_mask)
    tile = (min(B, 2), min(H, 2), min(L, 2), min(S, 3), query.dtype, query.device)
    if block_mask is not None:
        _check_block_mask(block_mask, B, H, L, S)
        mask_mod = block_mask.mask_mod
        _once(mask_mod, tile, lambda: probe_mask_mod(mask_mod, B, H, L, S, query.device))
    if score_mod is not None:
        mod = score_mod
        _once(mod, tile, lambda: _probe_score_mod(mod, B, H, L, S, query))
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")

    options = None if return_lse else structured_options(block_mask, score_mod, B, L, S)
    if options is not None:
        return functional.scaled_dot_product_attention(query, key, value, scale=scale, **options)
    alibi = _alibi_flash(query, key, value, score_mod, block_mask, scale, return_lse)
    if alibi is not None:
        out, lse = blockwise.positional_flash(query, key, value, *alibi)
        return (out, lse) if return_lse else out

    dtype = query.dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = query.to(wide), key.to(wide), value.to(wide)
    mods = _mods(score_mod, block_mask, H)
    mods.fused = (
        (score_mod is None or mods.slopes is not None)
        and value.shape[-1] == E
        and q.device.type == "cpu"  # (torch's fused flash kernel of the tiles is its CPU one)
    )
    plan = tiles.tile_plan(block_mask, L, S, B * H, fused=mods.fused)
    if mods.fused and mods.slopes is not None:
        rows = max(r1 - r0 for r0, r1, _ in plan.rows)
        mods.table = tiles.alibi_table(mods.slopes.to(q.device), rows, L, S, q.dtype)
        mods.table_shift = L - 1
    caps = captured_tensors(score_mod) if score_mod is not None else []
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *caps))
    if needs_grad:
        spec = _Spec(plan, mods, scale, tuple(caps))
        out, lse = _FlexFunction.apply(spec, q, k, v, *caps)
    else:
        with torch.no_grad():
            out, lse = tiles.forward(q, k, v, plan, mods, scale)
    out = out.to(dtype)
    return (out, lse.float()) if return_lse else out


def as_block_mask(block_mask: Any) -> BlockMask | None:
    """``block_mask`` as attnkit's :class:`~attnkit.flex.BlockMask` (torch's is converted)."""
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    if all(hasattr(block_mask, n) for n in ("kv_num_blocks", "kv_indices", "mask_mod")):
        return BlockMask.from_torch(block_mask)
    raise TypeError(f"block_mask must be a BlockMask or None, got {type(block_mask).__name__}")


def structured_options(
    block_mask: BlockMask | None, score_mod: ScoreMod | None, B: int, L: int, S: int
) -> dict[str, Any] | None:
    """The options of :func:`attnkit.functional.scaled_dot_product_attention` that compute this
    call (its structured kernels), or None where they cannot say the mask or modification."""
    mask = _mask_structure(block_mask)
    if mask is None:
        return None
    options = dict(mask)
    if score_mod is not None:
        if getattr(score_mod, "kind", None) != "softcap":
            return None
        options["softcap"] = score_mod.cap  # type: ignore[attr-defined]
    if (options.get("causal") or "segment_ids" in options) and L != S:
        return None  # attnkit aligns queries bottom-right; FlexAttention's indices top-left
    ids = options.get("segment_ids")
    if ids is not None:
        if ids.shape[-1] != S or (ids.dim() == 2 and ids.shape[0] != B):
            return None  # (the tiled path's mask_mod raises on what does not fit)
        options["segment_ids"] = ids.expand(B, S)
    lengths = options.get("key_lengths")
    if lengths is not None and (lengths.shape[0] != B or bool((lengths > S).any())):
        return None
    return options


def _mask_structure(block_mask: BlockMask | None) -> dict[str, Any] | None:
    """The structured options ``block_mask``'s ``mask_mod`` says (``{}`` for no mask), or None
    where it says none (a mask of the user's own)."""
    if block_mask is None:
        return {}
    structure: dict[str, Any] | None = getattr(block_mask.mask_mod, "structure", None)
    return structure


def captured_tensors(fn: Any) -> list[Tensor]:
    """Tensors that need gradients among what ``fn`` reads: closure cells, default arguments,
    the globals its code names, attributes of a callable object, parameters of a module,
    followed through nested functions, partials and containers."""
    found: list[Tensor] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > 6 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                found.append(obj)
        elif isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                visit(p, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for x in obj:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # (an empty cell)
                    visit(cell.cell_contents, depth + 1)
            visit(obj.__defaults__ or (), depth + 1)
            visit(obj.__kwdefaults__ or {}, depth + 1)
            names = obj.__code__.co_names
            visit([obj.__globals__[n] for n in names if n in obj.__globals__], depth + 1)
        elif callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
            visit(vars(obj), depth + 1)

    visit(fn, 0)
    return found


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What the autograd function needs besides tensors."""

    plan: tiles.TilePlan
    mods: tiles.Mods
    scale: float
    captured: tuple[Tensor, ...]


class _FlexFunction(torch.autograd.Function):
    """The tiled forward, and its flash-style backward recomputed from the log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, spec: _Spec, q: Tensor, k: Tensor, v: Tensor, *caps: Tensor) -> Any:
        out, lse = tiles.forward(q, k, v, spec.plan, spec.mods, spec.scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        spec: _Spec = ctx.spec
        dq, dk, dv, dcaps = tiles.backward(
            q, k, v, out, lse, grad_out.contiguous(), spec.plan, spec.mods, spec.scale,
            spec.captured,
        )  # fmt: skip
        return (None, dq, dk, dv, *dcaps)


#: The probe tiles each modification has passed (see :func:`_once`).
_PROBED: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def _once(fn: Any, tile: tuple[Any, ...], probe: Callable[[], None]) -> None:
    """Run ``probe`` unless ``fn`` passed it on the same probe tile before (the probe runs a
    few small calls, a noticeable share of a short attention call)."""
    try:
        seen = _PROBED.setdefault(fn, set())
    except TypeError:  # (not weakly referenceable: probe every time)
        probe()
        return
    if tile not in seen:
        probe()
        seen.add(tile)


def _alibi_flash(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: ScoreMod | None,
    block_mask: BlockMask | None,
    scale: float,
    return_lse: bool,
) -> tuple[FlashOptions, str] | None:
    """The options and products of attnkit's flash kernels for an ALiBi call over no mask, a
    causal one or a causal window (the slopes added in the kernel, queries and keys indexed
    from 0 as FlexAttention indexes them), or None where the policy leaves it to the tiles."""
    if getattr(score_mod, "kind", None) != "alibi":
        return None
    mask = _mask_structure(block_mask)
    if mask is None or not set(mask) <= {"causal", "window"}:
        return None
    rules = Structure(causal=bool(mask.get("causal", False)), window=mask.get("window"))
    call = AttentionCall(**functional.call_fields(q, k, v, rules))
    if return_lse and call.grads:
        return None  # (the flash kernels' log-sum-exp carries no gradient; the tiles' does)
    products = policy.alibi_kernel(call)
    if products is None:
        return None
    slopes = _mods(score_mod, block_mask, q.shape[1]).slopes
    options: FlashOptions = {
        "scale": scale,
        "causal": rules.causal,
        "window": rules.window,
        "first": 0,
        "alibi_slopes": slopes,
    }
    return options, products


def _mods(score_mod: ScoreMod | None, block_mask: BlockMask | None, H: int) -> tiles.Mods:
    mask_mod = None if block_mask is None else block_mask.mask_mod
    if getattr(score_mod, "kind", None) == "alibi":
        slopes: Tensor = score_mod.slopes  # type: ignore[union-attr]
        if slopes.shape[0] != H:
            raise ValueError(
                f"score_mod {mod_name(score_mod)} has {slopes.shape[0]} slopes for {H} heads"
            )
        return tiles.Mods(score_mod, mask_mod, slopes=slopes, identity_grad=True)
    return tiles.Mods(score_mod, mask_mod)


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool
) -> tuple[int, int, int, int, int]:
    functional.check_heads(q, k, v)
    B, H, L, E = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: query {B}, key {k.shape[0]}, value {v.shape[0]}")
    if k.shape[-1] != E:
        raise ValueError(f"query and key head dims differ: {E} and {k.shape[-1]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"key {tuple(k.shape)} and value {tuple(v.shape)} do not pair")
    K, S = k.shape[1], k.shape[2]
    if K != H and not enable_gqa:
        raise ValueError(f"query has {H} heads and key {K}: pass enable_gqa=True for GQA")
    if K == 0 or H % K:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({K})")
    if 0 in (B, H, L, S):
        raise ValueError(f"empty inputs: query {tuple(q.shape)}, key {tuple(k.shape)}")
    return B, H, L, S, E


def _check_block_mask(block_mask: BlockMask, B: int, H: int, L: int, S: int) -> None:
    name = mod_name(block_mask.mask_mod)
    if block_mask.seq_lengths != (L, S):
        raise ValueError(
            f"block_mask (mask_mod {name}) was built for (Q_LEN, KV_LEN) "
            f"{block_mask.seq_lengths}, but query/key lengths are {(L, S)}"
        )
    if block_mask.B not in (1, B) or block_mask.H not in (1, H):
        raise ValueError(
            f"block_mask (mask_mod {name}) was built for B={block_mask.B}, H={block_mask.H}, "
            f"but the inputs have B={B}, H={H}"
        )


def _probe_score_mod(score_mod: ScoreMod, B: int, H: int, L: int, S: int, q: Tensor) -> None:
    """Call ``score_mod`` on a tiny score tile and check what it returns."""
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable, got {type(score_mod).__name__}")
    name = mod_name(score_mod)
    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    b, h, qi, kv = index_tensors(
        min(B, 2), min(H, 2), torch.arange(min(L, 2), device=q.device),
        torch.arange(min(S, 3), device=q.device),
    )  # fmt: skip
    tile = (b.shape[0], h.shape[1], qi.shape[2], kv.shape[3])
    score = torch.zeros(tile, dtype=dtype, device=q.device)
    try:
        with torch.no_grad():
            out = score_mod(score, b, h, qi, kv)
    except Exception as err:
        raise ValueError(
            f"score_mod {name} failed on a score tile {tile} with index tensors b "
            f"{tuple(b.shape)}, h {tuple(h.shape)}, q_idx {tuple(qi.shape)}, kv_idx "
            f"{tuple(kv.shape)}: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(out, Tensor):
        raise TypeError(f"score_mod {name} must return a tensor, got {type(out).__name__}")
    if not out.is_floating_point():
        raise TypeError(f"score_mod {name} must return a float tensor, got dtype {out.dtype}")
    try:
        ok = tuple(torch.broadcast_shapes(tuple(out.shape), tile)) == tile
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"score_mod {name} returned shape {tuple(out.shape)} for a score tile {tile}"
        )
