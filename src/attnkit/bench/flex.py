"""torch's FlexAttention as a peer, with the mask rules of :class:`attnkit.masks.Structure`.

FlexAttention takes the mask as a function of index tensors, ``mask_mod(b, h, q_idx, kv_idx)``;
:func:`mask_mod` derives it from :meth:`attnkit.masks.Structure.allows`, so every comparison
against FlexAttention uses exactly attnkit's rules (bottom-right alignment, windows, documents,
key padding) instead of a restatement of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnkit.masks import Structure, StructureArgs

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FlexArgs", "FlexFn", "compiled_flex", "flex_or_reason", "mask_mod"]

#: ``fn(q, k, v) -> out`` of :func:`compiled_flex`.
FlexFn = Callable[[Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[..., Tensor]


class FlexArgs(StructureArgs, total=False):
    """The keyword arguments of :func:`compiled_flex`: the mask's ``structure`` and the
    ``scale`` and ``score_mod`` of the scores."""

    scale: float | None
    score_mod: ScoreMod | None


def mask_mod(structure: Structure, *, batch: int, L: int, S: int) -> MaskMod:
    """FlexAttention's ``mask_mod`` for ``structure``: ``True`` where a query may attend a key.

    Args:
        structure: The constraints; checked against ``L``, ``S`` and ``batch`` here.
        batch: Batch size of the attention call.
        L: Query length.
        S: Key length.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``, equal to ``structure.mask(L, S)[b, 0, q_idx, kv_idx]``.

    Raises:
        ValueError: If the structure does not fit ``L``, ``S`` and ``batch``.
    """
    structure.check(L, S, batch=batch if structure.batched else None)
    given = [t for t in (structure.segment_ids, structure.key_lengths) if t is not None]
    rules = structure.to(batch, S, given[0].device if given else None)

    def allows(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return rules.allows(i, j, b, L=L, S=S)

    return allows


def compiled_flex(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    **structure: Unpack[StructureArgs],
) -> tuple[FlexFn, float]:
    """Compiled FlexAttention for inputs shaped like ``q`` and ``k``, under ``structure``.

    The first call (block mask, compilation, one run on ``q`` and ``k``) is timed and done here.
    This is the one FlexAttention peer of every benchmark.

    Args:
        q: Queries ``(B, H, L, E)``.
        k: Keys ``(B, K, S, E)``; also the values of the first call.
        scale: Multiplier of the scores (default ``1 / sqrt(E)``).
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` (e.g. a soft cap).
        **structure: ``causal``, ``window``, ``segment_ids``, ``key_lengths``.

    Returns:
        ``(fn, first_call_seconds)`` with ``fn(q, k, v)`` the compiled attention.

    Raises:
        ImportError: If this torch has no FlexAttention.
        Exception: Whatever compilation raises (e.g. no C++ toolchain); callers report it.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, L, S = q.shape[0], q.shape[-2], k.shape[-2]
    fn = mask_mod(Structure(**structure), batch=B, L=L, S=S)
    start = time.perf_counter()
    block_mask = create_block_mask(fn, B, None, L, S, device=str(q.device))
    compiled: Any = torch.compile(flex_attention)
    gqa = q.shape[-3] != k.shape[-3]
    with torch.no_grad():
        compiled(q, k, k, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    first = time.perf_counter() - start

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out: Tensor = compiled(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa
        )
        return out

    return run, first


def flex_or_reason(
    q: Tensor, k: Tensor, **options: Unpack[FlexArgs]
) -> tuple[FlexFn | None, float, str]:
    """:func:`compiled_flex` with ``options``, or why it cannot run here (a torch without
    FlexAttention, no C++ toolchain for the compiler, an unsupported backend), for tables that
    report and go on.

    Returns:
        ``(fn, first_call_seconds, "")``, or ``(None, 0.0, reason)``.
    """
    try:
        fn, first = compiled_flex(q, k, **options)
    except ImportError:
        return None, 0.0, "FlexAttention skipped: not in this torch"
    except Exception as err:  # whatever compilation raises: the table says so
        return None, 0.0, f"FlexAttention skipped: {type(err).__name__}: {str(err)[:80]}"
    return fn, first, ""
