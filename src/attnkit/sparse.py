"""Block-sparse attention for structured masks: sliding windows, packed documents, key padding.

A dense kernel given a structured mask still computes all ``L * S`` scores and then throws most
of them away. Here the queries are cut into tiles, each tile reads only the one contiguous key
span its queries may attend, and tiles with equally shaped spans run as one batched call of
torch's CPU flash kernel on strided views, with a shared mask or none: see
:mod:`attnkit.blockwise`, the kernel. The cost therefore grows as ``L * (W + rows)`` for a
window ``W`` and as ``sum(doc_len^2)`` for documents, instead of ``L * S``.

Mask semantics are those of :func:`attnkit.functional.scaled_dot_product_attention`, defined
once in :mod:`attnkit.masks` (:class:`~attnkit.masks.Structure`): the query ``i`` sits at key
position ``p = i + (S - L)`` (bottom-right alignment) and may attend key ``j`` iff every given
constraint holds (``causal``: ``j <= p``; ``window``: ``|p - j| < window``; ``segment_ids``: same
document; ``key_lengths``: ``j < key_lengths[b]``).

Two steps: :func:`tile_plan` cuts the tiles and groups them into runs (:class:`TilePlan`), and
:func:`tiled_attention` runs a plan on inputs that :mod:`attnkit.functional` has validated.
When a plan beats the dense kernel is the policy's rule
(:func:`attnkit.kernels.policy.block_sparse`; :func:`should_use_block_sparse` asks it). The
public entry, :func:`attnkit.functional.block_sparse_attention`, validates its inputs and runs
a plan.

A query that may attend no key gets an output row of exactly zero with zero gradients.

FlexAttention (``torch.nn.attention.flex_attention`` + ``create_block_mask``, compiled) is the
alternative a user would pick; ``attnkit bench --vs`` and ``python -m attnkit.bench.structured
--flex`` time it side by side (its first call compiles per shape and mask).

Shape legend: B batch, H query heads, K key/value heads, L query length, S key length,
E head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit.blockwise import TileRun, attend_positional, attend_runs, plan_runs
from attnkit.kernels import policy
from attnkit.masks import Structure, StructureArgs, structured_mask

if TYPE_CHECKING:
    from typing_extensions import Unpack


__all__ = [
    "should_use_block_sparse",
    "sparse_plan",
    "structured_mask",
    "tile_plan",
    "window_tiles",
]


@dataclass(frozen=True)
class TilePlan:
    """Which keys each query tile reads, grouped into kernel calls; :func:`tiled_attention`
    runs it.

    Attributes:
        structure: The constraints, ids and lengths as ``(B, S)``/``(B,)`` long tensors.
        L: Query length.
        S: Key length.
        B: Batch size (the product of the inputs' leading dims).
        device: Where the inputs live.
        rows: Query rows per tile, or None for :func:`attnkit.kernels.policy.tile_rows`.
    """

    structure: Structure
    L: int
    S: int
    B: int
    device: torch.device | str | None = None
    rows: int | None = None

    @functools.cached_property
    def runs(self) -> list[TileRun]:
        """The tiles, as :class:`attnkit.blockwise.TileRun` batched calls (planned on first
        use: a causal/window call on attnkit's flash kernels needs none, and planning a long
        causal sequence costs tens of milliseconds)."""
        return plan_runs(self.B, self.L, self.S, self.structure, rows=self.rows, device=self.device)

    @property
    def covered(self) -> int:
        """How many of the ``B * L * S`` scores the tiles compute."""
        return sum(r.count * r.rows * r.width for r in self.runs)


def should_use_block_sparse(
    L: int,
    S: int,
    *,
    block_size: int | None = None,
    backward: bool = False,
    **structure: Unpack[StructureArgs],
) -> bool:
    """Whether :func:`attnkit.functional.block_sparse_attention` should beat the dense fused kernel:
    the policy's rule (:func:`attnkit.kernels.policy.block_sparse`) on this structure's tiles.

    Args:
        L: Query length.
        S: Key length.
        block_size: As in :func:`attnkit.functional.block_sparse_attention`.
        backward: Whether gradients will be computed.
        **structure: ``causal``, ``window``, ``segment_ids``, ``key_lengths``, as in
            :class:`~attnkit.masks.Structure`.

    Returns:
        ``True`` when the block-sparse path should be used.

    Raises:
        TypeError: Non-integer ``key_lengths``.
        ValueError: Negative lengths, ``window < 1``, badly shaped or out-of-range ids/lengths.
    """
    rules = Structure(**structure)
    B = rules.check(L, S)
    if S < policy.SPARSE_MIN_KEYS or not (rules.sparse or rules.causal):  # (no plan needed)
        return False
    device = next((t.device for t in (rules.segment_ids, rules.key_lengths) if t is not None), None)
    plan = tile_plan(L, S, rules, B, device, block_size)
    return sparse_plan(plan, backward=backward) is not None


def sparse_plan(plan: TilePlan, *, backward: bool) -> TilePlan | None:
    """``plan`` (a :func:`tile_plan`), or None where the policy's
    :func:`~attnkit.kernels.policy.block_sparse` says the dense kernel wins."""
    worth = policy.block_sparse(
        plan.L, plan.S, covered=plan.covered, batch=plan.B, backward=backward
    )
    return plan if worth else None


def tile_plan(
    L: int,
    S: int,
    structure: Structure,
    B: int,
    device: torch.device | str | None,
    block_size: int | None,
) -> TilePlan:
    """The :class:`TilePlan` of a checked structure (tiles of ``block_size`` or the default)."""
    return TilePlan(structure.to(B, S, device), L, S, B, device, block_size)


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: TilePlan,
    *,
    scale: float,
    dropout_p: float,
    kernels: policy.TileKernels,
) -> Tensor:
    """Run a :class:`TilePlan` on validated inputs.

    See :func:`attnkit.functional.block_sparse_attention`.

    Args:
        q: Queries, validated by :func:`attnkit.functional.check_inputs`.
        k: Keys.
        v: Values.
        plan: The tile plan for these inputs' ``L``, ``S`` and batch.
        scale: Multiplier of the scores.
        dropout_p: Dropout probability on the attention weights.
        kernels: The policy's :func:`~attnkit.kernels.policy.tile_kernels`: with
            ``kernels.flash`` a causal/window structure is one call of attnkit's flash kernels.

    Returns:
        The attention output; rows with no allowed key are exactly zero.

    Shape:
        As :func:`attnkit.functional.block_sparse_attention`.
    """
    squeeze = q.dim() == 2
    if squeeze:  # no head dim: (L, E) -> (1, L, E)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    batch_shape, (H, L, E), (K, S, Ev) = q.shape[:-3], q.shape[-3:], v.shape[-3:]
    B = plan.B
    q, k, v = q.reshape(B, H, L, E), k.reshape(B, K, S, E), v.reshape(B, K, S, Ev)
    rules = plan.structure
    if kernels.flash and not rules.batched and dropout_p == 0.0:
        out = attend_positional(q, k, v, rules, scale=scale, products=kernels.products)
    else:
        runs = plan.runs
        out = attend_runs(q, k, v, runs, scale=scale, dropout_p=dropout_p, kernels=kernels)
    out = out.reshape(*batch_shape, H, L, Ev)  # (..., H, L, Ev)
    return out.squeeze(0) if squeeze else out


def window_tiles(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    rows: int | None,
    window: int,
    kernels: policy.TileKernels | None = None,
) -> Tensor:
    """A causal sliding-window attention in tiles of ``rows`` queries (None: the default
    tiling) on ``kernels`` (default torch's flash kernel on every tile), finite inputs
    ``(B, H, L, E)``, with autograd: what the policy times for its bf16 choices
    (:func:`attnkit.kernels.policy.bf16_structured`, ``attention.bf16_backward``)."""
    B, _, L, E = q.shape
    plan = tile_plan(L, k.shape[2], Structure(causal=True, window=window), B, q.device, rows)
    kernels = policy.TileKernels(flash=False) if kernels is None else kernels
    return attend_runs(q, k, v, plan.runs, scale=E**-0.5, dropout_p=0.0, kernels=kernels)


policy.provide_attention_kernel("tiles", window_tiles)
