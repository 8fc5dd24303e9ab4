"""The one attention kernel path of attnkit.

Shape legend (used across the package):
    B batch, H query heads, K key/value heads, L query length, S key length,
    D model dim, E head dim.

Every module in attnkit computes ``softmax(Q K^T * scale + mask) V`` by calling
:func:`scaled_dot_product_attention`. A call goes down once: this module checks the inputs,
asks :mod:`attnkit.kernels.policy` which path serves them
(:func:`~attnkit.kernels.policy.attention_path`; the table is in ``docs/guide/core.md``, "How a
call finds its kernel"), and calls it:

* ``explicit``: weights requested (or no keys): the explicit math below, which is also the
  reference that the tests check the fused path against;
* ``capped``: soft-capped scores: :mod:`attnkit.softcap`;
* ``flash``: causal/window attention on attnkit's flash kernels over the whole sequence
  (:mod:`attnkit.sparse` -> :mod:`attnkit.blockwise`), computing only the keys each block of
  queries may reach;
* ``tiles``: structured sparsity (``window``, ``segment_ids``, ``key_lengths``) on long
  sequences: :mod:`attnkit.sparse`'s tiles, which skip key blocks that are entirely masked;
* ``fused``: torch's fused ``scaled_dot_product_attention`` (``is_causal`` instead of a
  materialized mask whenever that is equivalent).

A decoding step (one query per sequence) takes :func:`one_query` first.

A query row that may attend no key at all gives an output row of exactly zero (and zero weights,
zero gradients) on every path, never NaN. A query's output depends only on the keys and values it
may attend, as in the math: a NaN or inf value there makes that value's column of its row NaN, a
key whose score is NaN or ``+inf`` makes its row NaN (nothing is silently zeroed), a key whose
score is ``-inf`` gets weight 0 like a masked one, and a NaN or inf anywhere else (e.g. an
unwritten KV-cache slot) does not reach it. Float masks follow one rule: an entry at or below
``torch.finfo(dtype).min`` counts as masked, exactly like ``-inf``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import masks as M
from attnkit import softcap as capped
from attnkit import sparse
from attnkit.kernels import attention as attention_kernels
from attnkit.kernels import build, policy
from attnkit.kernels import one_query as one_query_kernels

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["attend", "block_sparse_attention", "scaled_dot_product_attention"]


class Options(M.StructureArgs, total=False):
    """The keyword options of :func:`scaled_dot_product_attention` besides ``return_weights``."""

    scale: float | None
    dropout_p: float
    softcap: float | None


@overload
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = ...,
    *,
    return_weights: Literal[False] = ...,
    **options: Unpack[Options],
) -> Tensor: ...
@overload
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = ...,
    *,
    return_weights: Literal[True],
    **options: Unpack[Options],
) -> tuple[Tensor, Tensor]: ...
def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, **options: Any
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention: ``softmax(q k^T * scale + mask) v``.

    Args:
        q: Queries.
        k: Keys. With heads at dim -3, ``k``/``v`` may have fewer heads than ``q``
            (grouped-query attention) when ``H`` is a multiple of ``K``; query head ``h`` uses
            key/value head ``h // (H // K)``.
        v: Values.
        mask: Bool (``True`` = may attend) or float (added to the scores), broadcastable to
            ``(..., L, S)``. A float entry at or below ``torch.finfo(dtype).min``, for the mask's
            dtype or ``q``'s (after the cast), counts as masked like ``-inf``.
        causal: Query ``i`` may attend key ``j`` iff ``j <= i + (S - L)`` (bottom-right aligned:
            the queries are the last ``L`` positions, as in cached decoding). ANDed with ``mask``.
        window: Sliding window: the query at position ``p`` sees keys ``j`` with
            ``|p - j| < window`` (with ``causal``: ``p - window < j <= p``).
        segment_ids: Integer document ids of the keys, shape ``(B, S)``, for packed sequences;
            the queries take the last ``L`` ids. Attention stays within a document.
        key_lengths: Integer tensor ``(B,)``: key ``j`` of batch ``b`` is real iff
            ``j < key_lengths[b]``.
        scale: Multiplier of the scores; defaults to ``1 / sqrt(E)`` (1 for ``E = 0``, where
            every score is 0 and the output is the mean of the attended values, as in torch).
        dropout_p: Dropout probability on the attention weights (pass 0 at evaluation).
        softcap: Cap the scores smoothly to ``(-softcap, softcap)`` with
            ``tanh(s / softcap) * softcap`` before the mask (Gemma 2's attention-logit
            soft-capping). torch's fused kernels cannot modify scores, so this runs
            :mod:`attnkit.softcap`'s chunked kernel, which skips the keys that ``causal`` and
            ``window`` exclude (float32 for half-precision inputs).
        return_weights: Also return the attention weights (forces the explicit path, computed in
            float32 for half-precision inputs and cast back).

    Returns:
        ``out``, or ``(out, weights)`` when ``return_weights`` is true. ``weights`` are the
        probabilities applied to ``v`` (after dropout), with the query heads expanded. With
        ``H = 0`` heads both are empty.

    Shape:
        q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, Ev)`` (or without a head
        dim: ``(L, E)``, ``(S, E)``, ``(S, Ev)``) -> out ``(..., H, L, Ev)``,
        weights ``(..., H, L, S)``.

    Raises:
        TypeError: Non-tensor inputs, mixed or non-float dtypes, unsupported mask dtype,
            non-integer ``key_lengths``.
        ValueError: Mismatched head dims or lengths, head counts that do not divide, masks that
            do not broadcast, mixed devices, non-finite ``scale``, bad ``dropout_p``/``window``,
            badly shaped or out-of-range ``segment_ids``/``key_lengths`` (or of another batch
            size than ``q``).
    """
    out, weights = attend(q, k, v, mask, **options)
    return out if weights is None else (out, weights)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    return_weights: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    **structure: Unpack[M.StructureArgs],
) -> tuple[Tensor, Tensor | None]:
    """:func:`scaled_dot_product_attention` as an ``(out, weights)`` pair, the call every
    attention layer makes.

    ``weights`` is ``None`` unless ``return_weights``; the arguments are those of
    :func:`scaled_dot_product_attention` (``structure``: ``causal``, ``window``,
    ``segment_ids``, ``key_lengths``).

    Shape:
        q ``(..., H, L, E)``, k/v ``(..., K, S, E)`` -> out ``(..., H, L, Ev)``,
        weights ``(..., H, L, S)``.
    """
    check_inputs(q, k, v, mask, scale, dropout_p)
    check_softcap(softcap)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = resolve_scale(scale, E)
    if L == 1 and not (return_weights or dropout_p):
        out = one_query(q, k, v, mask, scale, structure, softcap=softcap)
        if out is not None:
            return out, None
    rules, mask, batched = _checked(structure, q, k, mask)
    asked = policy.AttentionCall(
        **call_fields(q, k, v, rules),
        batched=batched,
        masked=mask is not None,
        weights=return_weights,
        dropout=dropout_p > 0.0,
        softcap=softcap is not None,
    )
    plan = policy.attention_plan(asked)
    tiles = None
    if plan.path in ("flash", "tiles"):
        tiles = sparse.tile_plan(L, S, rules, math.prod(q.shape[:-3]), q.device, plan.rows)
        if plan.path == "tiles":  # (None where the dense kernel wins)
            tiles = sparse.sparse_plan(tiles, backward=plan.call.grads)
    if tiles is not None:
        out = attend_tiles(q, k, v, tiles, scale=scale, dropout_p=dropout_p, kernels=plan.tiles)
        return out, None
    call = _Call(q, k, v, mask, rules, scale, dropout_p, return_weights)
    if plan.path == "capped":
        assert softcap is not None
        out, weights = _attend_capped(call, softcap, plan.capped)
    else:
        out, weights = _attend_dense(call, explicit=plan.path == "explicit")
    return out, weights if return_weights else None


def _checked(
    structure: Any, q: Tensor, k: Tensor, mask: Tensor | None
) -> tuple[M.Structure, Tensor | None, bool]:
    """The checked :class:`~attnkit.masks.Structure` of ``structure`` for queries ``q``,
    ``mask`` in the one float-mask rule (:func:`attnkit.masks.checked`), and whether documents
    or lengths are given."""
    unknown = sorted(set(structure) - M.StructureArgs.__optional_keys__)
    if unknown:
        known = sorted(Options.__optional_keys__ | {"return_weights"})
        raise TypeError(f"unknown attention options {unknown}; known: {known}")
    batched = any(structure.get(n) is not None for n in ("segment_ids", "key_lengths"))
    if batched and q.dim() != 4:
        raise ValueError(
            f"segment_ids/key_lengths need q with batch and head dims (B, H, L, E), got "
            f"{tuple(q.shape)}"
        )
    L, S = q.shape[-2], k.shape[-2]
    rules, mask = M.checked(structure, L, S, batch=q.shape[0] if batched else None, mask=mask,
                            dtype=q.dtype)  # fmt: skip
    return rules, mask, batched


def _grads(q: Tensor, k: Tensor, v: Tensor) -> bool:  # (will gradients flow from the output?)
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def call_fields(q: Tensor, k: Tensor, v: Tensor, rules: M.Structure) -> dict[str, Any]:
    """The fields of :class:`~attnkit.kernels.plans.AttentionCall` that every checked call
    reads alike: the inputs' dtype, device and lengths, the structure's causality and window,
    whether gradients flow, and where attnkit's kernels may run."""
    eager = build.eager_cpu(q)
    return {
        "dtype": q.dtype,
        "device": q.device.type,
        "L": q.shape[-2],
        "S": k.shape[-2],
        "causal": rules.causal,
        "window": rules.window,
        "grads": _grads(q, k, v),
        "eager": eager,
        "ready": eager and attention_kernels.flash_available(),
    }


class _Call(NamedTuple):
    """A checked :func:`attend` call on one of its dense paths (:func:`_attend_dense`,
    :func:`_attend_capped`): the arguments as :func:`attend`'s, ``mask`` bool or
    :func:`attnkit.masks.as_additive`, ``rules`` its checked structure."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    rules: M.Structure
    scale: float
    dropout_p: float
    return_weights: bool


def _attend_dense(call: _Call, *, explicit: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`attend` on torch's fused kernel, or the explicit math (``explicit``), with the
    structure folded into one bool constraint; ``(out, weights or None)``, weights only from
    the explicit math."""
    q, k, v, mask, rules, scale, dropout_p, _ = call
    L, S = q.shape[-2], k.shape[-2]
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    # Plain causal stays is_causal where L == S (top-left and bottom-right alignment coincide).
    is_causal = rules.causal and not rules.sparse and mask is None and L == S and not explicit
    mask = M.restrict(mask, None if is_causal else rules.constraint(L, S, device=q.device))

    def allowed() -> Tensor | None:
        if is_causal:
            return M.causal_mask(L, S, device=q.device)
        return None if mask is None else M.allowed(mask)

    def run(k: Tensor, v: Tensor, drop: Tensor | None) -> tuple[Tensor, Tensor | None]:
        this_mask, this_causal = mask, is_causal
        if drop is not None:  # is_causal cannot take extra masked pairs: spell it out
            this_mask = M.restrict(mask if mask is not None else allowed(), ~drop)
            this_causal = False
        if explicit or S == 0:
            return _explicit_attention(q, k, v, this_mask, scale=scale, dropout_p=dropout_p)
        out = _fused_attention(
            q, k, v, this_mask, is_causal=this_causal, scale=scale, dropout_p=dropout_p, gqa=gqa
        )
        return out, None

    return _without_leaks(run, q, k, v, allowed, scale=scale)


def one_query(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    structure: Any,
    *,
    softcap: float | None = None,
) -> Tensor | None:
    """The decoding step's attention (one query per sequence), or None to take the general path.

    One query sits after every key (bottom-right alignment), so causality masks nothing and a
    window keeps the last ``window`` keys: a slice, not a mask. The ``H`` query heads are viewed
    as ``K`` groups of ``H / K`` rows of one key/value head each, so grouped-query attention
    needs no expanded keys; the kernel is the policy's
    (:func:`~attnkit.kernels.policy.one_query_kernel`). The general path's non-finite rules are
    kept by checking the output (attnkit's kernel flags it; torch's output rows must be finite
    and not all zero); otherwise the general path recomputes the step. Only plain inputs come
    here: heads ``(B, H, 1, E)``, a bool key-padding mask ``(B, 1, 1, S)`` at most, no documents
    or lengths, nothing empty, not under ``torch.compile``.

    With a ``softcap`` (checked by the caller) the kernel caps the scores (an infinite one makes
    its row NaN, which is flagged); where it cannot run, the step is
    :func:`attnkit.softcap.decode_step` (no mask, float32/float64, no gradients), which turns an
    infinite score into NaN, so any non-finite input it reads shows in the output's sum.

    Shape:
        q ``(B, H, 1, E)``, k/v ``(B, K, S, E)`` -> ``(B, H, 1, Ev)``.
    """
    window = structure.get("window")
    if (
        q.dim() != 4
        or not structure.keys() <= {"causal", "window"}
        or (window is not None and (isinstance(window, bool) or not isinstance(window, int)))
        or (window is not None and window < 1)
        or 0 in q.shape
        or 0 in k.shape
        or v.shape[-1] == 0
        or _no_data_branches(q)
    ):
        return None
    B, H, _, E = q.shape
    K, S = k.shape[1], k.shape[2]
    if window is not None and window < S:
        k, v = k[:, :, S - window :], v[:, :, S - window :]
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
            return None
        if window is not None and window < S:
            mask = mask[..., S - window :]
    grads = _grads(q, k, v)
    if policy.one_query_kernel(q.dtype, q.device.type, grads) and build.kernels_available():
        # attnkit's kernel: a query with no key, or a non-finite output, is flagged, and the
        # general path recomputes the step with its rules.
        out, flags = one_query_kernels.one_query_attention(q, k, v, mask, scale, softcap=softcap)
        return None if flags else out
    if softcap is not None:
        if mask is not None or grads or q.dtype not in (torch.float32, torch.float64):
            return None
        out = capped.decode_step(q, k, v, softcap=softcap, scale=scale)  # (the window's slice)
        return out if math.isfinite(float(out.sum())) else None
    if mask is not None and not bool(mask.any(dim=-1).all()):  # a row with no key: general path
        return None
    grouped = q.reshape(B, K, H // K, E)  # (B, K, H/K, E)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    # The check also covers the query: a NaN or inf in it makes every score of its row NaN or
    # infinite, whose output row is NaN or all zero.
    if M.may_hide_non_finite(out, None):
        return None
    return out.view(B, H, 1, v.shape[-1])


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    **structure: Unpack[M.StructureArgs],
) -> Tensor:
    """Attention under structured masks that skips key blocks that are entirely masked.

    Same result as dense attention with :func:`attnkit.sparse.structured_mask` as the mask, at a
    cost that follows the number of allowed (query, key) pairs rather than ``L * S``.

    Args:
        q: Queries.
        k: Keys; may have fewer heads than ``q`` (grouped-query, ``H % K == 0``).
        v: Values.
        block_size: Query rows per tile; defaults to :func:`attnkit.blockwise.tile_rows`.
        scale: Multiplier of the scores; defaults to ``1 / sqrt(E)``.
        dropout_p: Dropout probability on the attention weights.
        **structure: ``causal``, ``window``, ``segment_ids``, ``key_lengths``, as in
            :class:`~attnkit.masks.Structure`.

    Returns:
        The attention output; rows with no allowed key are exactly zero. A non-finite query,
        key or value makes NaN the rows that may attend it, and only those.

    Shape:
        q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, Ev)`` (or ``(L, E)``,
        ``(S, E)``, ``(S, Ev)`` without heads), segment_ids ``(B, S)``, key_lengths ``(B,)``
        where ``B`` is the product of the leading dims -> ``(..., H, L, Ev)``.

    Raises:
        TypeError: Non-tensor or non-float inputs, mismatched dtypes, non-integer lengths.
        ValueError: Mismatched shapes, ``H % K != 0``, ``window < 1``, badly shaped or
            out-of-range ``segment_ids``/``key_lengths``, bad ``scale``/``dropout_p``/
            ``block_size``.
    """
    check_inputs(q, k, v, None, scale, dropout_p)
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    B = math.prod(q.shape[:-3])
    rules, _ = M.checked(structure, L, S, batch=B, mask=None, dtype=q.dtype)
    call = policy.AttentionCall(
        **call_fields(q, k, v, rules), batched=rules.batched, dropout=dropout_p > 0.0
    )
    kernels = policy.tile_kernels(call)
    rows = block_size or policy.tile_rows(L, rules.window, q.dtype)
    tiles = sparse.tile_plan(L, S, rules, B, q.device, rows)
    scale = resolve_scale(scale, E)
    return attend_tiles(q, k, v, tiles, scale=scale, dropout_p=dropout_p, kernels=kernels)


def attend_tiles(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: sparse.TilePlan,
    *,
    scale: float,
    dropout_p: float,
    kernels: policy.TileKernels,
) -> Tensor:
    """:func:`attnkit.sparse.tiled_attention` (arguments as its own, checked), with non-finite
    inputs reaching only the queries that may attend them (see :func:`_without_leaks`).

    Shape:
        q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, Ev)`` -> ``(..., H, L, Ev)``.
    """

    def allowed() -> Tensor:
        mask = plan.structure.mask(plan.L, plan.S, device=q.device)  # (B or 1, 1, L, S)
        if not plan.structure.batched or q.dim() < 3:
            return mask[0, 0]  # (L, S)
        return mask.expand(plan.B, 1, plan.L, plan.S).reshape(*q.shape[:-3], 1, plan.L, plan.S)

    # torch's flash kernel divides by the head count: empty inputs take the dense path.
    empty = 0 in (q.numel(), k.numel(), v.numel())

    def run(k: Tensor, v: Tensor, drop: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if drop is None and not empty:
            out = sparse.tiled_attention(
                q, k, v, plan, scale=scale, dropout_p=dropout_p, kernels=kernels
            )
            return out, None
        # Dense: empty inputs, or pairs to drop (a -inf score on a non-finite key), which the
        # tiles have no mask for.
        mask = allowed() if drop is None else allowed() & ~drop
        return _explicit_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p)[0], None

    # Here L is about S, so reading k and v first (two reductions) is cheaper than checking the
    # output's rows afterwards.
    return _without_leaks(run, q, k, v, allowed, scale=scale, search_first=True)[0]


def _without_leaks(
    run: Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor | None]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Callable[[], Tensor | None],
    *,
    scale: float,
    softcap: float | None = None,
    search_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``run(k, v, None)`` so that a non-finite query, key or value reaches exactly the queries
    that may attend it, as the math says: their rows become NaN, and no other row changes.

    A NaN or inf at a masked position leaks through the kernels (``0 * NaN``, ``NaN - inf``),
    and torch's fused kernel returns zeros for a row whose every score is NaN. So non-finite
    key rows and value entries are zeroed and what they reach set to NaN afterwards
    (:class:`attnkit.masks.NonFinite`): a row reaches a
    non-finite value it may attend, and a non-finite key whose score is NaN or ``+inf``; a
    ``-inf`` score is weight 0 (an inf in one key element gives ``+inf`` scores for some queries
    and ``-inf`` for others), so such pairs are rerun as masked (``run(k, v, drop)``). A
    non-finite value entry reaches only its own output column. Finding them
    reads ``k`` and ``v`` once, which at ``L = 1`` (decoding) costs as much as the attention
    itself, so without gradients the output is checked first (``L`` rows): a leak shows there
    as NaN and a hidden NaN as an all-zero row; only then are ``k`` and ``v`` searched and the
    kernel rerun. With gradients they are searched first, since the backward would leak
    ``0 * NaN`` into the other gradients even when the output is clean. Under ``torch.compile``
    and on the meta device (no data-dependent branches) the kernel runs as it is.

    Args:
        run: Attention on given keys and values, returning ``(out, weights or None)``; its
            third argument is ``None`` or a bool mask broadcastable to the scores of the pairs
            to treat as masked besides those ``allowed`` excludes.
        q: The queries.
        k: The keys.
        v: The values.
        allowed: Builds the bool mask (``True`` = may attend) broadcastable to the scores, or
            ``None`` when every key may be attended; called only for non-finite inputs.
        scale: Multiplier of the scores (for the scores of non-finite keys).
        softcap: The scores' soft cap, if any (see :meth:`attnkit.masks.NonFinite.key_scores`).
        search_first: Search ``k`` and ``v`` before the kernel even without gradients (when
            ``L`` is not small against ``S``, that is cheaper than checking the output).

    Returns:
        ``(out, weights or None)``.
    """
    if _no_data_branches(q):
        return run(k, v, None)
    grads = _grads(q, k, v)
    if grads or search_first:
        found = M.NonFinite.search(k, v)
    else:
        out, weights = run(k, v, None)
        if not M.may_hide_non_finite(out, weights):
            return out, weights
        found = M.NonFinite.search(k, v)
    if found.bad_k is None and found.bad_v is None:
        return run(k, v, None) if grads or search_first else (out, weights)
    mask = allowed()
    poisoned, drop = found.key_scores(q, k, mask, scale=scale, softcap=softcap)
    out, weights = run(found.k, found.v, drop)
    return found.propagate(out, weights, q, poisoned, mask)


def _no_data_branches(t: Tensor) -> bool:  # (meta tensors, torch.compile: no value branches)
    return t.device.type == "meta" or torch.compiler.is_compiling()


def check_softcap(softcap: float | None) -> None:
    """Raise a ValueError unless ``softcap`` is ``None`` or a positive finite number."""
    if softcap is not None and not (isinstance(softcap, int | float) and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")


def resolve_scale(scale: float | None, E: int) -> float:
    """``scale`` as a float, defaulting to ``1 / sqrt(E)``.

    For ``E = 0`` every score is 0 whatever the scale, so attention averages the values (as
    torch's SDPA does); the default is then 1 instead of a division by zero.
    """
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(E) if E else 1.0


def _fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    gqa: bool,
) -> Tensor:
    row_ok = None
    if mask is not None:
        row_ok = M.row_has_key(mask)
        # Rows without any allowed key would be softmax over all -inf (NaN on some backends):
        # let them attend everywhere, then zero them. Gradients through them are then zero.
        if mask.dtype == torch.bool:
            mask = mask | ~row_ok
        else:
            mask = mask.to(q.dtype).masked_fill(~row_ok, 0.0)
    if (
        gqa
        and q.dim() >= 3
        and q.shape[-2] == 1
        and not is_causal
        and not dropout_p
        and (mask is None or (mask.shape[-2] == 1 and (mask.dim() < 3 or mask.shape[-3] == 1)))
    ):
        # One query per head (a decoding step): the H / K query heads sharing a key/value head
        # become that head's rows, so each key/value head is read once, not H / K times
        # (fewer, larger problems for the fused kernel).
        H, K = q.shape[-3], k.shape[-3]
        if (
            torch.compiler.is_compiling()
            and q.dim() == 4
            and (mask is None or mask.dtype == torch.bool)
            and policy.one_query_kernel(q.dtype, q.device.type, _grads(q, k, v))
            and build.kernels_loaded()  # (built before the trace: a build is not traced)
        ):
            # attnkit's kernel as one op of the graph: it reads only the keys the mask allows
            # (a static cache's filled slots), where the fused kernel reads every slot. The
            # mask is (S,), (1, S), (1, 1, S) or (B or 1, 1, 1, S) here: (B or 1, 1, 1, S).
            keys = None if mask is None else mask.reshape(-1, 1, 1, mask.shape[-1])
            out = torch.ops.attnkit.one_query_attention(q, k, v, keys, scale)
        else:
            grouped = q.reshape(*q.shape[:-3], K, H // K, q.shape[-1])
            out = F.scaled_dot_product_attention(
                grouped, k, v, attn_mask=mask, dropout_p=0.0, scale=scale
            ).reshape(*q.shape[:-1], v.shape[-1])
    else:
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=gqa,
        )
    if _no_data_branches(q) or not M.is_finite(q):  # (the add costs a pass over the output)
        out = out + M.nan_rows(q)
    if row_ok is not None:
        out = torch.where(row_ok, out, 0.0)  # no key to attend: zero, even for a NaN query
    return out


def _attend_capped(call: _Call, softcap: float, kernel: str) -> tuple[Tensor, Tensor | None]:
    """:func:`attend` with soft-capped scores: :func:`attnkit.softcap.capped_attention` on the
    policy's ``kernel`` (:func:`~attnkit.kernels.policy.capped_kernel`), which reads only the
    key span each chunk of queries may attend, under the non-finite rules of
    :func:`_without_leaks`; ``(out, weights or None)``."""
    q, k, v, mask, rules, scale, dropout_p, return_weights = call
    L, S = q.shape[-2], k.shape[-2]
    grads = _grads(q, k, v)

    def allowed() -> Tensor | None:
        given = mask if mask is None else M.allowed(mask)
        return M.restrict(given, rules.constraint(L, S, device=q.device))

    # With many queries, searching k and v first (two reductions) costs less than checking the
    # output (a norm per row); the kernel's keys are then finite (with gradients they are
    # searched anyway), and with a finite q its inf -> NaN pass over the scores can go.
    branches = not _no_data_branches(q)
    search_first = branches and 16 * L >= S
    finite = branches and (search_first or grads) and M.is_finite(q)

    def run(k: Tensor, v: Tensor, drop: Tensor | None) -> tuple[Tensor, Tensor | None]:
        this_mask = mask if drop is None else M.restrict(mask, ~drop)
        return capped.capped_attention(
            q,
            k,
            v,
            this_mask,
            rules,
            softcap=softcap,
            scale=scale,
            dropout_p=dropout_p,
            return_weights=return_weights,
            finite=finite,
            kernel=kernel,
        )

    return _without_leaks(
        run, q, k, v, allowed, scale=scale, softcap=softcap, search_first=search_first
    )


def _explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float,
    dropout_p: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The textbook math, in float32 for half-precision inputs; fully-masked rows are zero.

    With ``softcap`` the scores are capped smoothly to ``(-softcap, softcap)`` by
    ``tanh(s / softcap) * softcap`` before the mask (Gemma 2's attention-logit soft-capping).
    """
    dtype = q.dtype
    wide = torch.promote_types(dtype, torch.float32)  # float32 for half precision, as torch's
    q, k, v = (t.to(wide) for t in (q, k, v))  # no copy for float32/float64
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)  # (..., H, S, E)
        v = v.repeat_interleave(groups, dim=-3)  # (..., H, S, Ev)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., H, L, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    row_ok = None
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
        row_ok = M.row_has_key(mask)
        scores = scores.masked_fill(~row_ok, 0.0)  # finite softmax input, zeroed below
    weights = torch.softmax(scores, dim=-1)
    if row_ok is not None:
        weights = weights.masked_fill(~row_ok, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return (weights @ v).to(dtype), weights.to(dtype)  # (..., H, L, Ev), (..., H, L, S)


def check_heads(
    q: Tensor, k: Tensor, v: Tensor, names: tuple[str, str, str] = ("query", "key", "value")
) -> None:
    """The first checks of an entry point that takes ``(B, heads, length, E)`` inputs only:
    three float tensors of 4 dims, of one dtype and on one device (``names`` in the errors).

    Raises:
        TypeError: Non-tensor or non-float inputs, mixed dtypes.
        ValueError: Inputs that are not 4-dim, mixed devices.
    """
    for name, t in zip(names, (q, k, v), strict=True):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-dim (B, heads, length, E), got {tuple(t.shape)}")
    together = ", ".join(names)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{together} dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"{together} devices differ: {q.device}, {k.device}, {v.device}")


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, dropout_p: float
) -> None:
    """The checks of :func:`scaled_dot_product_attention` on everything but the structure.

    Raises:
        TypeError: Non-tensor inputs, mixed or non-float dtypes, unsupported mask dtype.
        ValueError: Mismatched shapes, head counts that do not divide, masks that do not
            broadcast, mixed devices, non-finite ``scale``, bad ``dropout_p``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(
            f"q, k, v must share one floating dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    if not (q.dim() == k.dim() == v.dim()) or q.dim() < 2:
        raise ValueError(
            "q, k, v must have the same number (>= 2) of dims, got shapes "
            f"q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k head dims differ: q={tuple(q.shape)} (E={q.shape[-1]}), "
            f"k={tuple(k.shape)} (E={k.shape[-1]})"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must agree in all but the last dim, got k={tuple(k.shape)}, "
            f"v={tuple(v.shape)}"
        )
    if q.dim() >= 3:
        H, K = q.shape[-3], k.shape[-3]
        if q.shape[:-3] != k.shape[:-3]:
            raise ValueError(f"q and k batch dims differ: q={tuple(q.shape)}, k={tuple(k.shape)}")
        if (K == 0 and H != 0) or (K != 0 and H % K):  # H = K = 0: an empty output
            raise ValueError(
                f"query heads ({H}) must be a multiple of key/value heads ({K}) "
                f"(q={tuple(q.shape)}, k={tuple(k.shape)})"
            )
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(
                f"mask must be bool (True = may attend) or float (additive), got {mask.dtype}"
            )
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
        target = (*q.shape[:-1], k.shape[-2])
        try:
            ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                f"{tuple(target)}"
            )
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
