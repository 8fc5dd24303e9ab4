"""Attention with soft-capped scores, one chunk of queries at a time.

Gemma 2 caps every attention score smoothly, ``c * tanh(s / c)``, before the mask. torch's fused
kernels cannot modify scores, and the textbook math materializes all ``L * S`` scores and then
makes several passes over them (scale, divide, tanh, multiply, mask, softmax). Here the queries
are cut into chunks of ``rows`` queries; a chunk reads only the contiguous key span its queries
may attend under ``causal`` and ``window`` (and below the longest ``key_lengths``), so a sliding
window costs ``L * (window + rows)`` scores instead of ``L * S`` and a causal prefill about half.
Each chunk's scores land in one preallocated buffer that stays in the CPU caches: ``baddbmm``
with the scale folded in, the cap in place, only the masks that cut the span, an in-place softmax,
and one ``bmm`` with the span's values. With gradients the same steps run out of place, so that
autograd can save what it needs (memory then follows the allowed pairs, like the textbook math).

Where the policy says (:func:`attnkit.kernels.policy.capped_kernel`: without gradients, masks,
weights or dropout, on the CPU, as in a prefill of a causal or sliding-window layer), the whole
attention is :func:`attnkit.kernels.attention.capped_attention` instead: FlashAttention's loop
with the cap, tiles of scores that never leave the caches, one block of queries per thread.

Inputs come validated from :mod:`attnkit.functional`, which also keeps non-finite keys and values
away from the queries that may not attend them. A query that may attend no key gets an output row
(and weights) of exactly zero. Semantics of the structure are those of
:class:`attnkit.masks.Structure` (bottom-right aligned queries).

Shape legend: B batch, H query heads, K key/value heads, G = H / K query heads per key head,
L query length, S key length, E head dim, Ev value head dim.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.kernels import attention as attention_kernels
from attnkit.kernels import policy
from attnkit.masks import Span, Structure, offset_mask

__all__ = ["capped_attention", "decode_step"]


def capped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    structure: Structure,
    *,
    softcap: float,
    scale: float,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    rows: int | None = None,
    finite: bool = False,
    kernel: str = "chunks",
) -> tuple[Tensor, Tensor | None]:
    """``softmax(c * tanh(q k^T * scale / c) + mask) v`` over the keys each query may attend.

    Args:
        q: Queries ``(..., H, L, E)`` or ``(L, E)``, validated by
            :func:`attnkit.functional.check_inputs`.
        k: Keys ``(..., K, S, E)`` with ``H % K == 0`` (grouped-query attention).
        v: Values ``(..., K, S, Ev)``.
        mask: Bool (``True`` = may attend) or additive float mask with masked entries exactly
            ``-inf``, broadcastable to ``(..., H, L, S)``, or None.
        structure: Checked ``causal``/``window``/``segment_ids``/``key_lengths`` (ids and
            lengths of the batch ``B`` of a 4-dim ``q``).
        softcap: The cap ``c > 0``.
        scale: Multiplier of the scores.
        dropout_p: Dropout probability on the attention weights.
        return_weights: Also return the weights ``(..., H, L, S)`` (zero outside each chunk's
            span).
        rows: Queries per chunk; defaults to :func:`attnkit.kernels.policy.capped_chunk_rows`
            (or :func:`~attnkit.kernels.policy.capped_flash_rows` for the flash kernel).
        finite: ``q`` and ``k`` are known to hold no NaN or inf. Without it every score takes
            one more pass that turns an infinite raw score into NaN (see below); with it an
            infinite raw score (finite inputs whose product overflows) is capped to ``c``, as
            ``tanh`` does.
        kernel: The policy's :func:`~attnkit.kernels.policy.capped_kernel`: ``"flash"``
            (attnkit's flash loop with the cap; no gradients, mask, documents, lengths,
            weights or dropout), ``"one-pass"`` (chunks whose cap, causal/window masks and
            softmax are one pass of attnkit's row kernel; no gradients, mask, documents or
            lengths) or ``"chunks"``.

    Returns:
        ``(out, weights or None)`` in ``q``'s dtype, computed in float32 for half precision.

    Shape:
        q ``(..., H, L, E)``, k ``(..., K, S, E)``, v ``(..., K, S, Ev)`` ->
        out ``(..., H, L, Ev)``, weights ``(..., H, L, S)``.
    """
    dtype = q.dtype
    compute = torch.promote_types(dtype, torch.float32)
    squeeze = q.dim() == 2
    if squeeze:  # no head dim: one head
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    batch_shape, (H, L, E), (K, S, Ev) = q.shape[:-3], q.shape[-3:], v.shape[-3:]
    B, G = math.prod(batch_shape), H // K if K else 0  # H = K = 0: an empty output
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if kernel == "flash" and mask is None and K > 0:  # FlashAttention's loop with the cap
        wide = dtype if dtype == torch.bfloat16 else compute  # (the kernel widens bf16 itself)
        out = attention_kernels.capped_attention(
            q.to(wide).reshape(B, H, L, E),
            k.to(wide).reshape(B, K, S, E),
            v.to(wide).reshape(B, K, S, Ev),
            softcap=softcap,
            scale=scale,
            causal=structure.causal,
            window=structure.window,
            finite=finite,
            query_block=rows or policy.capped_flash_rows(structure.window),
        )
        out = out.view(*batch_shape, H, L, Ev).to(dtype)
        return (out.squeeze(0) if squeeze else out), None
    q5 = q.to(compute).reshape(B, K, G, L, E)
    k3 = k.to(compute).reshape(B * K, S, E)
    v3 = v.to(compute).reshape(B * K, S, Ev)
    fmask = bmask = None
    if mask is not None:
        if mask.dtype == torch.bool:
            bmask = _per_chunk(mask, batch_shape, K, G)
        else:
            fmask = _per_chunk(mask.to(compute), batch_shape, K, G)
    rules = structure.to(B, S, q.device) if structure.batched else structure
    off = S - L  # query i sits at key position i + off
    longest = S if rules.key_lengths is None else int(rules.key_lengths.max())
    if rows is None:
        widest = S if rules.window is None else min(S, 2 * rules.window + 1)
        rows = policy.capped_chunk_rows(B * H, widest, L, rules.window)
        if rules.window is not None:
            rows = policy.capped_chunk_rows(B * H, min(S, widest + rows), L, rules.window)

    out = q5.new_empty(B, K, G, L, Ev)
    weights = q5.new_zeros(B, K, G, L, S) if return_weights and not grads else None
    buffer = None if grads else q5.new_empty(B * K * G * rows * min(S, longest))
    # Causal/window masking only: the cap, the masks and the softmax as one in-place pass of
    # attnkit's kernel over each row (torch needs five).
    one_pass = buffer is not None and kernel in ("flash", "one-pass") and bmask is None
    one_pass = one_pass and fmask is None and not rules.batched
    pieces: list[tuple[int, int, int, Tensor, Tensor | None]] = []
    for i0 in range(0, L, rows):
        i1 = min(L, i0 + rows)
        r, p0, p1 = i1 - i0, i0 + off, i1 - 1 + off
        lo, hi = 0, longest
        if rules.causal:
            hi = min(hi, p1 + 1)
        if rules.window is not None:
            lo, hi = max(lo, p0 - rules.window + 1), min(hi, p1 + rules.window)
        if hi <= lo:  # no query of the chunk may attend any key: zero rows
            out[:, :, :, i0:i1].zero_()
            continue
        w = hi - lo
        qc = q5[:, :, :, i0:i1].reshape(B * K, G * r, E)  # a view unless G > 1 and r < L
        kc = k3[:, lo:hi].transpose(1, 2)  # (B*K, E, w)
        # c * tanh(x / c) = 2c * sigmoid(2x / c) - c; softmax ignores the shift by c, and
        # torch's CPU sigmoid is faster than its tanh.
        alpha = 2 * scale / softcap
        if buffer is None:
            s = torch.baddbmm(qc.new_empty(()), qc, kc, beta=0.0, alpha=alpha)
            if not finite:  # inf -> NaN, as below (the gradient of 0 * s * s is 0)
                s = s.addcmul(s, s, value=0)
            s = torch.sigmoid(s) * (2 * softcap)
        else:
            s = buffer[: B * K * G * r * w].view(B * K, G * r, w)
            torch.baddbmm(s, qc, kc, beta=0.0, alpha=alpha, out=s)
            if one_pass:
                attention_kernels.capped_softmax_(
                    s,
                    softcap,
                    first=p0 - lo,
                    period=r,
                    causal=rules.causal,
                    window=rules.window,
                    finite=finite,
                )
                _attend_chunk(s, v3[:, lo:hi], out, weights, i0, i1, lo, dropout_p)
                continue
            # inf -> NaN (s + 0 * s * s), as the textbook math's uncapped +inf score would make the
            # row NaN: the output then shows that a non-finite input was met, and
            # attnkit.functional reruns with its rules (a capped inf would look finite).
            if not finite:
                s.addcmul_(s, s, value=0)
            s.sigmoid_().mul_(_scalar(2 * softcap, s.dtype, s.device))
        s5 = s.view(B, K, G, r, w)
        band = _positional(Span(r, w, lo - p0, rules.causal, rules.window, q.device), compute)
        ok = empty = None
        if grads or rules.batched or bmask is not None or fmask is not None:
            ok = band.ok
            if rules.batched:
                i = torch.arange(i0, i1, device=q.device).view(1, r, 1)
                j = torch.arange(lo, hi, device=q.device).view(1, 1, w)
                b = torch.arange(B, device=q.device).view(B, 1, 1)
                rule = rules.allows(i, j, b, L=L, S=S)[:, None, None]  # (B, 1, 1, r or 1, w)
                ok = rule if ok is None else ok & rule
            if bmask is not None:
                given = _chunk(bmask, i0, i1, lo, hi)
                ok = given if ok is None else ok & given
            if fmask is not None:
                add = _chunk(fmask, i0, i1, lo, hi)
                s5 = s5 + add if grads else s5.add_(add)
                kept = add > -math.inf
                ok = kept if ok is None else ok & kept
            if ok is not None:
                s5 = s5.masked_fill(~ok, -math.inf) if grads else s5.masked_fill_(~ok, -math.inf)
                no_key = ~ok.any(dim=-1, keepdim=True)
                empty = no_key if bool(no_key.any()) else None
        else:  # causal/window only: mask just the columns they cut
            for c0, c1, bias in band.cuts:
                s5[..., c0:c1].add_(bias)
            empty = band.empty
        if empty is not None:  # rows without a key: a finite softmax input, zeroed below
            s5 = s5.masked_fill(empty, 0.0) if grads else s5.masked_fill_(empty, 0.0)
        s = s5.view(B * K, G * r, w) if grads else s
        p = torch.softmax(s, dim=-1) if grads else torch.softmax(s, dim=-1, out=s)
        if empty is not None:
            p5 = p.view(B, K, G, r, w)
            p5 = p5.masked_fill(empty, 0.0) if grads else p5.masked_fill_(empty, 0.0)
            p = p5.view(B * K, G * r, w)
        if grads:
            if dropout_p > 0.0:
                p = F.dropout(p, p=dropout_p)
            o = torch.bmm(p, v3[:, lo:hi]).view(B, K, G, r, Ev)
            pieces.append((i0, lo, hi, o, p.view(B, K, G, r, w) if return_weights else None))
            continue
        _attend_chunk(p, v3[:, lo:hi], out, weights, i0, i1, lo, dropout_p)
    if grads:
        out, weights = _assemble(pieces, q5, k3, v3, L, S, Ev, return_weights)
    out = out.reshape(*batch_shape, H, L, Ev).to(dtype)
    if weights is not None:
        weights = weights.reshape(*batch_shape, H, L, S).to(dtype)
    if squeeze:
        out = out.squeeze(0)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights


def _attend_chunk(
    p: Tensor,
    v: Tensor,
    out: Tensor,
    weights: Tensor | None,
    i0: int,
    i1: int,
    lo: int,
    dropout_p: float,
) -> None:
    """Multiply a chunk's weights ``p`` ``(B*K, G*r, w)`` (queries ``i0:i1``) by its values
    ``v`` ``(B*K, w, Ev)`` (keys from ``lo``) into ``out`` ``(B, K, G, L, Ev)``; copy them into
    ``weights`` ``(B, K, G, L, S)`` when given (after dropout, the weights that were applied)."""
    B, K, G, L, Ev = out.shape
    r, w = i1 - i0, p.shape[2]
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p)
    if G == 1 or r == L:  # the chunk's rows of out as one (B*K, G*r, Ev) view
        torch.bmm(p, v, out=out.view(B * K, G * L, Ev)[:, G * i0 : G * i1])
    else:
        out[:, :, :, i0:i1].copy_(torch.bmm(p, v).view(B, K, G, r, Ev))
    if weights is not None:
        weights[:, :, :, i0:i1, lo : lo + w].copy_(p.view(B, K, G, r, w))


def decode_step(
    q: Tensor, k: Tensor, v: Tensor, *, softcap: float, scale: float, window: int | None = None
) -> Tensor:
    """One query per sequence (a decoding step) with soft-capped scores, in few calls.

    The query sits after every key, so causality masks nothing and a ``window`` keeps the last
    ``window`` keys (a slice). The ``H`` query heads are viewed as ``K`` groups of ``H / K``
    rows, the scores computed as ``q @ k^T``, capped in place and normalised along the keys.
    No mask, no gradients, no weights; non-finite inputs give NaN or infinite output rows (an
    infinite raw score becomes NaN), which the caller checks.

    Args:
        q: Queries ``(B, H, 1, E)``, float32 or float64.
        k: Keys ``(B, K, S, E)`` with ``S >= 1``.
        v: Values ``(B, K, S, Ev)``.
        softcap: The cap ``c > 0``.
        scale: Multiplier of the scores.
        window: Sliding window, if any.

    Returns:
        The output ``(B, H, 1, Ev)``.
    """
    B, H, _, E = q.shape
    K, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    if window is not None and window < S:
        k, v = k[:, :, S - window :], v[:, :, S - window :]
        S = window
    # q @ k^T (k read transposed) with the scale folded in: faster on CPU than k @ q^T, and the
    # scores come out as (B*K, G, S) rows for the softmax along the last dim.
    s = q.new_empty(B * K, H // K, S)
    kt = k.reshape(B * K, S, E).transpose(1, 2)
    torch.baddbmm(s, q.reshape(B * K, H // K, E), kt, beta=0.0, alpha=2 * scale / softcap, out=s)
    # inf -> NaN first (s + 0 * s * s, exact for finite s), as capped_attention; a 0-dim tensor
    # factor costs less than a Python float in mul_ (no scalar wrapped per call).
    s.addcmul_(s, s, value=0).sigmoid_().mul_(_scalar(2 * softcap, s.dtype, s.device))
    p = torch.softmax(s, dim=-1, out=s)
    return torch.bmm(p, v.reshape(B * K, S, Ev)).view(B, H, 1, Ev)


@functools.lru_cache(maxsize=64)
def _scalar(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a 0-dim tensor (cached: never written to)."""
    return torch.tensor(value, dtype=dtype, device=device)


def _assemble(
    pieces: list[tuple[int, int, int, Tensor, Tensor | None]],
    q5: Tensor,
    k3: Tensor,
    v3: Tensor,
    L: int,
    S: int,
    Ev: int,
    return_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """The chunks computed with autograd, as ``(out, weights)`` ``(B, K, G, L, Ev / S)``.

    Rows of skipped chunks are zeros; when no chunk was computed the output still depends on
    every input (with zero gradients), as the textbook math's does.
    """
    B, K, G = q5.shape[:3]
    outs, probs, at = [], [], 0
    for i0, lo, hi, o, p in pieces:
        if i0 > at:  # skipped chunks before this one
            outs.append(q5.new_zeros(B, K, G, i0 - at, Ev))
            probs.append(q5.new_zeros(B, K, G, i0 - at, S))
        outs.append(o)
        if p is not None:
            probs.append(F.pad(p, (lo, S - hi)))
        at = i0 + o.shape[3]
    if at < L or not outs:
        outs.append(q5.new_zeros(B, K, G, L - at, Ev))
        probs.append(q5.new_zeros(B, K, G, L - at, S))
    out = torch.cat(outs, dim=3)
    if not pieces:  # keep the graph: zero gradients for every input, never NaN
        never = torch.zeros((), dtype=torch.bool, device=q5.device)
        out = out + torch.where(never, q5.sum() + k3.sum() + v3.sum(), 0.0)
    weights = torch.cat(probs, dim=3) if return_weights else None
    return out, weights


def _per_chunk(mask: Tensor, batch_shape: torch.Size, K: int, G: int) -> Tensor:
    """A mask broadcastable to ``(*batch_shape, H, L, S)`` as a ``(B or 1, K or 1, G or 1, L, S)``
    tensor whose chunks broadcast against the scores ``(B, K, G, rows, width)``."""
    L, S = mask.shape[-2:]
    lead = mask.shape[:-2]
    if all(n == 1 for n in lead):
        return mask.reshape(1, 1, 1, L, S)
    full = mask.expand(*batch_shape, K * G, L, S)
    B = math.prod(batch_shape)
    return full.reshape(B, K, G, L, S)  # a view where the dims allow, else one copy


def _chunk(mask: Tensor, i0: int, i1: int, lo: int, hi: int) -> Tensor:
    """Rows ``i0:i1`` and keys ``lo:hi`` of a :func:`_per_chunk` mask; a dim of size 1 (a mask
    broadcast over the queries, like a key-padding mask, or over the keys) is kept whole."""
    rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
    keys = slice(None) if mask.shape[-1] == 1 else slice(lo, hi)
    return mask[..., rows, keys]


@dataclass(frozen=True)
class _Band:
    """What ``causal``/``window`` allow in a chunk's span (see :func:`_positional`).

    Attributes:
        ok: Bool ``(rows, width)`` (``True`` = may attend), or None when every pair may.
        cuts: ``(c0, c1, bias)`` for the column ranges ``c0:c1`` where some pair is masked:
            ``bias`` is ``(rows, c1 - c0)``, 0 where allowed and ``-inf`` where masked (adding
            it in place is faster on CPU than ``masked_fill_``).
        empty: Bool ``(rows, 1)`` of the queries without any key, or None when there is none.
    """

    ok: Tensor | None
    cuts: tuple[tuple[int, int, Tensor], ...]
    empty: Tensor | None


@functools.lru_cache(maxsize=256)
def _positional(span: Span, dtype: torch.dtype) -> _Band:
    """The :class:`_Band` of a chunk's key span (cached: a prefill repeats the same few
    shapes)."""
    ok = offset_mask(*span)
    rows, width, device = span.rows, span.width, span.device
    if ok is None:
        return _Band(None, (), None)
    cut_columns = (~ok).any(dim=0).tolist()
    cuts, c = [], 0
    while c < width:  # maximal runs of columns with a masked pair
        if cut_columns[c]:
            c1 = c
            while c1 < width and cut_columns[c1]:
                c1 += 1
            bias = torch.zeros(rows, c1 - c, dtype=dtype, device=device)
            cuts.append((c, c1, bias.masked_fill_(~ok[:, c:c1], -math.inf)))
            c = c1
        else:
            c += 1
    empty = ~ok.any(dim=-1, keepdim=True)
    return _Band(ok, tuple(cuts), empty if bool(empty.any()) else None)
