"""Named masks and score modifications for :func:`attnkit.flex.flex_attention`.

Each preset is a callable usable as ``mask_mod(b, h, q_idx, kv_idx)`` or
``score_mod(score, b, h, q_idx, kv_idx)`` and carries a description that lets
:func:`~attnkit.flex.flex_attention` recognise it: ``structure`` (the options of
:func:`attnkit.functional.scaled_dot_product_attention` that say the same mask, served by
attnkit's structured kernels), ``band`` (the allowed offsets ``q_idx - kv_idx``, for block
states from block corners), and for score modifications ``kind`` and their parameters.

Positions are aligned top-left, as in torch's FlexAttention: query ``i`` and key ``i`` are the
same position.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Preset",
    "alibi",
    "alibi_slopes",
    "causal",
    "causal_mask",
    "dilated",
    "document",
    "padding",
    "prefix_lm",
    "relative_bias",
    "sliding_window",
    "softcap",
]


class Preset:
    """A named mask or score modification with its description.

    Attributes:
        __name__: The preset's name and parameters, e.g. ``sliding_window(256)``.
        kind: ``"causal"``, ``"sliding_window"``, ``"alibi"``, ...
        structure: Options of :func:`attnkit.functional.scaled_dot_product_attention` equal to
            this mask (None where they cannot say it; score modifications have none).
        band: Allowed ``q_idx - kv_idx`` as ``(lo, hi)`` where the mask depends on nothing else.
    """

    structure: dict[str, Any] | None = None
    band: tuple[float, float] | None = None

    def __init__(self, kind: str, label: str) -> None:
        self.kind = kind
        self.__name__ = label

    def __repr__(self) -> str:
        return self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """The mask (``b, h, q_idx, kv_idx``) or score modification (``score, b, h, q_idx,
        kv_idx``); each preset defines its own."""
        raise NotImplementedError


class _Causal(Preset):
    def __init__(self) -> None:
        super().__init__("causal", "causal")
        self.structure = {"causal": True}
        self.band = (0.0, math.inf)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx


#: The causal mask (query ``i`` attends keys ``j <= i``) as a ready ``mask_mod``.
causal_mask = _Causal()


def causal() -> Preset:
    """The causal mask: query ``i`` attends keys ``j <= i``."""
    return causal_mask


class _Counted(Preset):
    """A mask of one whole-number parameter ``n``, named ``kind(n)``: ``n`` must be an int of at
    least :attr:`least` (:attr:`needs` says so in the error)."""

    kind: str
    least: int = 1
    needs: str

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < self.least:
            raise ValueError(f"{self.kind} needs {self.needs}, got {n!r}")
        super().__init__(self.kind, f"{self.kind}({n})")
        self.n = n


class _Window(_Counted):
    kind, needs = "sliding_window", "a positive int window"

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.structure = {"causal": True, "window": window}
        self.band = (0.0, float(window - 1))

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        return (d >= 0) & (d < self.n)


def sliding_window(window: int) -> Preset:
    """Causal sliding window: query ``i`` attends keys ``i - window < j <= i`` (``window`` keys,
    itself included), as attnkit's ``window`` option with ``causal``."""
    return _Window(window)


class _PrefixLM(_Counted):
    kind, least, needs = "prefix_lm", 0, "a prefix length >= 0"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx < self.n) | (q_idx >= kv_idx)


def prefix_lm(prefix: int) -> Preset:
    """Prefix language model: every query attends the first ``prefix`` keys, causal after."""
    return _PrefixLM(prefix)


class _Dilated(_Counted):
    kind, needs = "dilated", "a positive int dilation"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        return (d >= 0) & (d % self.n == 0)


def dilated(dilation: int) -> Preset:
    """Causal dilated mask: query ``i`` attends keys ``j <= i`` with ``(i - j) % dilation == 0``."""
    return _Dilated(dilation)


def _int_tensor(name: str, value: Any, dims: tuple[int, ...]) -> Tensor:
    if not isinstance(value, Tensor):
        value = torch.as_tensor(value)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name} needs an integer tensor, got dtype {value.dtype}")
    if value.dim() not in dims:
        raise ValueError(f"{name} needs a tensor with {dims} dims, got shape {tuple(value.shape)}")
    return value.long()


class _Document(Preset):
    def __init__(self, ids: Tensor) -> None:
        super().__init__("document", "document")
        self.ids = _int_tensor("document ids", ids, (1, 2))
        self.structure = {"segment_ids": self.ids}

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        ids = self.ids.to(q_idx.device)
        if ids.dim() == 1:
            return ids[q_idx] == ids[kv_idx]
        return ids[b, q_idx] == ids[b, kv_idx]


def document(ids: Tensor) -> Preset:
    """Packed documents: a query attends the keys of its own document.

    Args:
        ids: Integer document id per token, ``(S,)`` shared by the batch or ``(B, S)``.
    """
    return _Document(ids)


class _Padding(Preset):
    def __init__(self, lengths: Tensor) -> None:
        super().__init__("padding", "padding")
        self.lengths = _int_tensor("padding lengths", lengths, (1,))
        self.structure = {"key_lengths": self.lengths}

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < self.lengths.to(kv_idx.device)[b]


def padding(lengths: Tensor) -> Preset:
    """Key padding: in batch entry ``b`` only keys ``j < lengths[b]`` are real.

    Args:
        lengths: Integer ``(B,)`` key lengths.
    """
    return _Padding(lengths)


def alibi_slopes(num_heads: int) -> Tensor:
    """The standard ALiBi slopes of ``num_heads`` heads (float32 ``(H,)``): the geometric
    sequence ``2^(-8/n), 2^(-16/n), ...`` for a power of two ``n``; otherwise those of the
    nearest smaller power of two followed by every other slope of the next one."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi needs a positive int num_heads, got {num_heads!r}")

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    below = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(below)
    if below < num_heads:
        slopes += powers(2 * below)[0::2][: num_heads - below]
    return torch.tensor(slopes, dtype=torch.float32)


class _Alibi(Preset):
    def __init__(self, num_heads: int) -> None:
        self.slopes = alibi_slopes(num_heads)
        super().__init__("alibi", f"alibi({num_heads})")
        self.num_heads = num_heads

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        slope = self.slopes.to(score.device)[h]
        return score + slope * (kv_idx - q_idx)


def alibi(num_heads: int) -> Preset:
    """ALiBi score modification: ``score + slope[h] * (kv_idx - q_idx)`` with the standard
    slopes (:func:`alibi_slopes`)."""
    return _Alibi(num_heads)


class _RelativeBias(Preset):
    def __init__(self, table: Tensor) -> None:
        if not isinstance(table, Tensor) or table.dim() != 2 or table.shape[1] % 2 != 1:
            shape = tuple(table.shape) if isinstance(table, Tensor) else type(table).__name__
            raise ValueError(f"relative_bias needs a table (H, 2 * max_offset + 1), got {shape}")
        super().__init__("relative_bias", "relative_bias")
        self.table = table
        self.max_offset = (table.shape[1] - 1) // 2

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        r = self.max_offset
        offset = torch.clamp(q_idx - kv_idx, -r, r) + r
        return score + self.table[h, offset]


def relative_bias(table: Tensor) -> Preset:
    """Learned relative position bias: ``score + table[h, clamp(q_idx - kv_idx, -R, R) + R]``.

    Args:
        table: ``(H, 2 * R + 1)`` bias per head and offset (e.g. an ``nn.Parameter``: its
            gradient flows through :func:`attnkit.flex.flex_attention`).
    """
    return _RelativeBias(table)


class _Softcap(Preset):
    def __init__(self, cap: float) -> None:
        if (
            isinstance(cap, bool)
            or not isinstance(cap, (int, float))
            or not cap > 0
            or (not math.isfinite(cap))
        ):
            raise ValueError(f"softcap needs a finite cap > 0, got {cap!r}")
        super().__init__("softcap", f"softcap({cap})")
        self.cap = float(cap)

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return torch.tanh(score / self.cap) * self.cap


def softcap(cap: float) -> Preset:
    """Soft-capping of the scores: ``cap * tanh(score / cap)`` (Gemma 2)."""
    return _Softcap(cap)
