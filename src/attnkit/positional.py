"""Position information: sinusoidal tables, learned embeddings and rotary embeddings (RoPE).

Attention is permutation-equivariant; these modules give it a sense of order.

* :class:`SinusoidalPositionalEncoding` and :class:`LearnedPositionalEmbedding` *add* a vector per
  position to the token embeddings (usually once, before the first block).
* Rotary embeddings rotate each query/key channel pair by a position-dependent angle inside every
  attention layer, so that ``<R_p q, R_s k>`` depends only on ``s - p``. :class:`RotaryEmbedding`
  is the module handed to :class:`attnkit.MultiHeadAttention` as ``rotary``; :func:`rope_cos_sin`
  and :func:`apply_rope` are the blog's functions.

Rotary pair conventions:

* ``interleaved=True`` (the blog, the RoFormer paper, Meta's original LLaMA code): channel pairs
  are adjacent, ``(x[2i], x[2i+1])``.
* ``interleaved=False`` (GPT-NeoX, Hugging Face): pairs are the two halves,
  ``(x[i], x[i + E/2])``.

Both rotate pair ``i`` by ``p * base^(-2i/E)``. They are the same model up to a fixed permutation
of each head's query/key channels; :func:`permute_rotary_weight` and
:func:`convert_rotary_convention` convert weights between them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from attnkit.attention import MultiHeadAttention
from attnkit.config import check_rope_scaling
from attnkit.kernels import build, rows

__all__ = [
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "apply_rope",
    "convert_rotary_convention",
    "permute_rotary_weight",
    "reserved_rotary_tables",
    "rope_cos_sin",
    "rope_inv_freq",
    "sinusoidal_table",
]

RotaryConvention = Literal["interleaved", "split"]


def _values_checkable() -> bool:
    """Whether checks that read position values may run.

    Under ``torch.compile`` they may not: a Python branch on a tensor's value (``positions.min()
    < 0``) cannot be part of a graph, so ``torch.compile(model, fullgraph=True)`` would fail.
    Compiled graphs keep the shape and dtype checks; an index past a table still fails there,
    as an indexing error instead of a ValueError.
    """
    return not torch.compiler.is_compiling()


def _check_positions(positions: Tensor, length: int, *, values: bool = True) -> None:
    if (
        not isinstance(positions, Tensor)
        or positions.dtype.is_floating_point
        or (positions.dtype == torch.bool)
    ):
        raise TypeError(f"positions must be an integer tensor, got {positions!r:.80}")
    if positions.dim() not in (1, 2) or positions.shape[-1] != length:
        raise ValueError(
            f"positions must have shape (L,) or (B, L) with L={length}, got "
            f"{tuple(positions.shape)}"
        )
    if values and _values_checkable() and positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be non-negative, got min {int(positions.min())}")


# --------------------------------------------------------------------------------------------
# Absolute positions, added to the input
# --------------------------------------------------------------------------------------------


def sinusoidal_table(
    seq_len: int, dim: int, *, base: float = 10_000.0, device: torch.device | str | None = None
) -> Tensor:
    """The sinusoidal table of the original Transformer, in float32.

    ``PE[p, 2i] = sin(p * w_i)`` and ``PE[p, 2i+1] = cos(p * w_i)`` with ``w_i = base^(-2i/dim)``.
    For odd ``dim`` the last column is a sine (there is one more sine than cosine); every other
    column is unchanged. Angles are computed in float32 exactly as in the blog, so tables match it
    bit for bit.

    Args:
        seq_len: Number of positions.
        dim: Embedding dim (any positive int).
        base: Wavelength base.
        device: Device of the result.

    Returns:
        Float32 tensor of shape ``(seq_len, dim)``.

    Raises:
        ValueError: If ``seq_len < 0`` or ``dim < 1``.
    """
    if seq_len < 0 or dim < 1:
        raise ValueError(f"need seq_len >= 0 and dim >= 1, got seq_len={seq_len}, dim={dim}")
    position = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None]  # (L, 1)
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    angles = position * inv_freq[None, :]  # (L, ceil(dim/2))
    pe = torch.zeros(seq_len, dim, device=device)
    pe[:, 0::2] = angles.sin()
    pe[:, 1::2] = angles[:, : dim // 2].cos()
    return pe


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the sinusoidal table to the input (the blog's class).

    Args:
        dim: Embedding dim (odd dims work, see :func:`sinusoidal_table`).
        max_seq_len: Rows of the table; longer sequences are an error.
        base: Wavelength base.

    Attributes:
        pe: Float32 table of shape ``(max_seq_len, dim)`` (a non-persistent buffer, cast to the
            input's dtype at use).
    """

    pe: Tensor

    def __init__(self, dim: int, max_seq_len: int = 4096, base: float = 10_000.0) -> None:
        super().__init__()
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.dim, self.max_seq_len, self.base = dim, max_seq_len, base
        self.register_buffer("pe", sinusoidal_table(max_seq_len, dim, base=base), persistent=False)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Return ``x + PE[positions]``.

        Args:
            x: Input tokens.
            positions: Integer positions ``(L,)`` or ``(B, L)``; defaults to ``0 .. L-1``.

        Raises:
            ValueError: If a position does not fit in the table (the message names both
                lengths), or ``x`` has the wrong last dim.

        Shape:
            x ``(B, L, dim)`` (or ``(L, dim)``) -> same.
        """
        if x.shape[-1] != self.dim:
            raise ValueError(f"x has last dim {x.shape[-1]}, expected dim={self.dim}")
        L = x.shape[-2]
        if positions is None:
            if self.pe.shape[0] < L:
                raise ValueError(
                    f"sequence length {L} exceeds max_seq_len {self.pe.shape[0]} of the "
                    "sinusoidal table; build SinusoidalPositionalEncoding with a larger max_seq_len"
                )
            return x + self.pe[:L].to(dtype=x.dtype, device=x.device)
        _check_positions(positions, L)
        if _values_checkable() and positions.numel() and int(positions.max()) >= self.pe.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} (needs length {int(positions.max()) + 1}) "
                f"exceeds max_seq_len {self.pe.shape[0]} of the sinusoidal table"
            )
        return x + self.pe.to(device=x.device)[positions].to(x.dtype)  # (B?, L, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_seq_len={self.max_seq_len}, base={self.base}"


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained vector per position (BERT/GPT-2 style).

    Args:
        max_seq_len: Number of positions.
        dim: Embedding dim.

    Attributes:
        weight: Parameter of shape ``(max_seq_len, dim)``.
    """

    def __init__(self, max_seq_len: int, dim: int) -> None:
        super().__init__()
        if max_seq_len < 1 or dim < 1:
            raise ValueError(f"sizes must be positive, got max_seq_len={max_seq_len}, dim={dim}")
        self.max_seq_len, self.dim = max_seq_len, dim
        self.weight = nn.Parameter(torch.empty(max_seq_len, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Return ``x + weight[positions]`` (positions default to ``0 .. L-1``).

        Raises:
            ValueError: If a position is ``>= max_seq_len`` (naming both lengths).

        Shape:
            x ``(B, L, dim)`` -> same; positions ``(L,)`` or ``(B, L)``.
        """
        L = x.shape[-2]
        if positions is None:
            top = L
            positions = torch.arange(L, device=x.device)
        else:
            _check_positions(positions, L)
            checkable = _values_checkable() and positions.numel()
            top = int(positions.max()) + 1 if checkable else 0
        if top > self.max_seq_len:
            raise ValueError(
                f"sequence needs {top} positions but max_seq_len is {self.max_seq_len}"
            )
        return x + self.weight[positions].to(x.dtype)

    def extra_repr(self) -> str:
        return f"max_seq_len={self.max_seq_len}, dim={self.dim}"


# --------------------------------------------------------------------------------------------
# Rotary embeddings
# --------------------------------------------------------------------------------------------


def rope_cos_sin(
    seq_len: int, head_dim: int, device: torch.device | str | None, base: float = 10_000.0
) -> tuple[Tensor, Tensor]:
    """The blog's rotary tables for positions ``0 .. seq_len-1``, computed in float32.

    Args:
        seq_len: Number of positions.
        head_dim: Head dim ``E`` (must be even).
        device: Device of the tables.
        base: Wavelength base.

    Returns:
        ``(cos, sin)``, each float32 of shape ``(seq_len, head_dim // 2)``.

    Raises:
        ValueError: If ``head_dim`` is odd or not positive.
    """
    _check_head_dim(head_dim)
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    positions = torch.arange(seq_len, device=device).float()
    angles = positions[:, None] * inv_freq[None, :]  # (L, E/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = True) -> Tensor:
    """Rotate channel pairs of ``x`` by the angles whose cosines/sines are given.

    The rotation runs in float32 (float64 for float64 inputs) and the result is cast back to
    ``x.dtype``, so half-precision inputs keep accurate phases.

    Args:
        x: Queries or keys.
        cos: Cosines of the angles.
        sin: Sines of the angles.
        interleaved: Pair adjacent channels ``(2i, 2i+1)`` (the blog) instead of the halves
            ``(i, i + E/2)`` (GPT-NeoX / Hugging Face).

    Returns:
        Rotated tensor, same shape and dtype as ``x``.

    Shape:
        x ``(B, H, L, E)``, cos/sin ``(L, E/2)`` or anything broadcastable to
        ``(B, H, L, E/2)`` -> ``(B, H, L, E)``.

    Raises:
        ValueError: If the tables' last dim is not ``E / 2``.
    """
    E = x.shape[-1]
    if E % 2 or cos.shape[-1] != E // 2 or sin.shape != cos.shape:
        raise ValueError(
            f"rotary tables must have last dim E/2 for E={E}, got cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)}"
        )
    return _rotate(x, *_full_width(cos, sin, interleaved), interleaved)


#: Dtypes the rotation runs in as they are.
_WIDE = (torch.float32, torch.float64)


def _full_width(cos: Tensor, sin: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    """Half-width tables as the full-width ``(cos, signed sin)`` that :func:`_rotate` takes.

    Each channel's cosine, and the sine with the sign it takes in its pair: ``-sin`` on the
    first channel of a pair, ``+sin`` on the second.

    Shape:
        ``(..., E/2)`` each -> ``(..., E)`` each.
    """
    if interleaved:
        return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor, interleaved: bool) -> Tensor:
    """:func:`apply_rope` with full-width tables: ``x * cos + partner(x) * signed_sin``, where
    ``partner`` swaps the two channels of each pair (adjacent ones, or the two halves). Each
    output channel is ``x_i cos - x_j sin`` or ``x_i cos + x_j sin`` as in the textbook form
    (``a - b`` is ``a + (-b)``).

    Half-precision ``x`` is rotated in float32 and rounded once. Eager CPU inference runs
    attnkit's kernel (:func:`_native_rotation`); otherwise (gradients, compiled graphs, other
    dtypes) the product with ``cos`` makes a new tensor in the compute dtype, each half of the
    pairs adds its partner's product to it in place (no swapped copy of ``x``, as ``roll`` and
    ``addcmul`` would make), and the result is cast back.

    Shape:
        x ``(..., L, E)``, cos/signed_sin broadcastable to it -> like ``x``.
    """
    E = x.shape[-1]
    if E % 2 or cos.shape[-1] != E:
        raise ValueError(f"rotary tables must have last dim E={E}, got {tuple(cos.shape)}")
    if _native_rotation(x, cos, signed_sin):
        return rows.rotate(x, cos, signed_sin, interleaved=interleaved)
    compute = x.dtype if x.dtype in _WIDE else torch.promote_types(x.dtype, torch.float32)
    if cos.dtype != compute:
        cos, signed_sin = cos.to(compute), signed_sin.to(compute)
    out = x * cos  # (compute dtype: cos's)
    if interleaved:  # pairs are adjacent channels
        pairs, xs, ss = (t.unflatten(-1, (E // 2, 2)) for t in (out, x, signed_sin))
        first, second = pairs[..., 0], pairs[..., 1]
        first.addcmul_(xs[..., 1], ss[..., 0])
        second.addcmul_(xs[..., 0], ss[..., 1])
    else:  # pairs are the two halves
        h = E // 2
        out[..., :h].addcmul_(x[..., h:], signed_sin[..., :h])
        out[..., h:].addcmul_(x[..., :h], signed_sin[..., h:])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _native_rotation(x: Tensor, cos: Tensor, signed_sin: Tensor) -> bool:
    """Whether :func:`attnkit.kernels.rows.rotate` computes this rotation: eager CPU inference on
    float32 or bf16 heads with the rotary module's float32 rows (``(L, E)``, or ``(B, 1, L, E)``
    for per-sequence positions), where attnkit's kernels run. One pass and one new tensor
    instead of five."""
    if (
        x.dtype not in (torch.float32, torch.bfloat16)
        or cos.dtype != torch.float32
        or signed_sin.dtype != torch.float32
        or not 2 <= x.dim() <= 4
        or x.stride(-1) != 1
        or not build.eager_cpu(x)
        or (
            torch.is_grad_enabled()
            and (x.requires_grad or cos.requires_grad or signed_sin.requires_grad)
        )
    ):
        return False
    L, E = x.shape[-2:]
    fits = cos.shape == (L, E) or (x.dim() == 4 and cos.shape == (x.shape[0], 1, L, E))
    return fits and signed_sin.shape == cos.shape and build.kernels_available()


def _check_head_dim(head_dim: int) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim >= 2, got {head_dim!r}")


def rope_inv_freq(
    head_dim: int, base: float = 10_000.0, scaling: dict[str, Any] | None = None
) -> Tensor:
    """Rotary inverse frequencies ``base^(-2i/E)``, optionally rescaled, in float64.

    ``scaling`` follows Hugging Face's ``rope_scaling``: ``"linear"`` divides every frequency by
    ``factor``; ``"llama3"`` (Llama 3.1) divides the low frequencies (wavelength above
    ``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps the high ones
    (wavelength below ``original_max_position_embeddings / high_freq_factor``) and interpolates
    smoothly in between.

    Args:
        head_dim: Head dim ``E`` (even).
        base: Wavelength base.
        scaling: ``None`` or a ``rope_scaling`` dict (see :class:`attnkit.TransformerConfig`).

    Returns:
        Float64 tensor of shape ``(E/2,)``.

    Raises:
        ValueError: For an odd ``head_dim`` or a bad ``scaling``.
    """
    _check_head_dim(head_dim)
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = check_rope_scaling(scaling)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for :class:`attnkit.MultiHeadAttention` (``rotary=...``).

    The cos/sin tables are float32, non-persistent buffers, computed from float64 angles (so
    positions in the tens of thousands keep accurate phases) and recomputed when the device
    changes, when a module-wide ``.half()``/``.to(dtype)`` cast them, or when a position beyond
    the table is asked for (the table then grows to the next power of two).

    Args:
        head_dim: Head dim ``E`` (must be even).
        base: Wavelength base.
        interleaved: Pair adjacent channels (the blog) instead of halves (GPT-NeoX/HF).
        scaling: Frequency rescaling, Hugging Face's ``rope_scaling`` (see
            :func:`rope_inv_freq`).

    Raises:
        ValueError: If ``head_dim`` is odd or not positive, or ``scaling`` is bad.
    """

    cos: Tensor
    sin: Tensor

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10_000.0,
        interleaved: bool = True,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        _check_head_dim(head_dim)
        if not base > 1.0:
            raise ValueError(f"base must be > 1, got {base}")
        self.head_dim, self.base, self.interleaved = head_dim, float(base), interleaved
        self.scaling = check_rope_scaling(scaling)
        self.register_buffer("cos", torch.empty(0, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim // 2), persistent=False)
        # (positions, their version, cos rows, sin rows) of the last call; see _rows.
        self._memo: tuple[Tensor, int, Tensor, Tensor] | None = None
        # (the cos table and the pairing they were made from, full-width cos, signed sin); see
        # _full_tables.
        self._full: tuple[Tensor, bool, Tensor, Tensor] | None = None
        # Positions the full tables cover for compiled calls, 0 when none: see reserve.
        self._reserved = 0

    def tables(
        self, length: int, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """Float32 ``(cos, sin)`` covering at least positions ``0 .. length-1``.

        Shape:
            ``(N, E/2)`` each, ``N >= length``.
        """
        device = torch.device(device) if device is not None else self.cos.device
        stale = self.cos.dtype != torch.float32 or self.cos.device != device
        if stale or self.cos.shape[0] < length:
            n = max(16, 1 << max(length - 1, 0).bit_length())
            # Tables built during inference_mode would be unusable in a later training step.
            with torch.inference_mode(False):
                cos, sin = self._cos_sin(torch.arange(n))  # (N, E/2) each
                self.cos, self.sin = cos.to(device), sin.to(device)
        return self.cos, self.sin

    def reserve(self, length: int, device: torch.device | str | None = None) -> int:
        """Make the tables cover ``length`` positions and let compiled calls gather from them.

        A compiled forward cannot grow a table (that needs the positions' values), so without a
        reservation it computes each position's rows afresh in every layer; with one, a
        position's rows are a lookup. Compiled calls then need positions below the reservation:
        one past it fails as an indexing error. :func:`reserved_rotary_tables` reserves for the
        span of a ``with`` block. Returns the positions reserved (``length`` rounded up to the
        table's size, so that nearby lengths give one graph); ``0`` releases the reservation.

        Raises:
            ValueError: If ``length`` is negative.
        """
        if length < 0:
            raise ValueError(f"length must be non-negative, got {length}")
        if length == 0:
            self._reserved = 0
            return 0
        cos, _ = self._full_tables(length, torch.device(device) if device else self.cos.device)
        self._reserved = cos.shape[0]
        return self._reserved

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 cos and sin of the float64 angles of ``positions``: ``(..., E/2)`` each."""
        inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling).to(positions.device)
        angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., E/2)
        return angles.cos().to(torch.float32), angles.sin().to(torch.float32)

    def forward(self, x: Tensor, positions: Tensor | None = None, *, offset: int = 0) -> Tensor:
        """Rotate ``x`` by its positions.

        Args:
            x: Queries or keys.
            positions: Integer positions ``(L,)`` or per-sequence ``(B, L)`` (packed sequences);
                default ``offset .. offset+L-1``.
            offset: First position when ``positions`` is omitted (cached decoding).

        Shape:
            x ``(..., heads, L, E)`` (or ``(L, E)``) -> same.

        Raises:
            ValueError: If ``x`` has the wrong head dim or ``positions`` the wrong shape.
        """
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x has head dim {x.shape[-1]}, expected {self.head_dim}")
        L = x.shape[-2]
        if positions is None:
            if offset < 0:
                raise ValueError(f"offset must be non-negative, got {offset}")
            cos, sin = self.tables(offset + L, x.device)
            cos, sin = cos[offset : offset + L], sin[offset : offset + L]
            return _rotate(x, *_full_width(cos, sin, self.interleaved), self.interleaved)
        memo = self._memo
        if memo is None or memo[0] is not positions:  # checked when first seen (values: _rows)
            _check_positions(positions, L, values=False)
        if positions.device != x.device:
            positions = positions.to(x.device)
        cos, sin = self._rows(positions, x.device)
        return _rotate(x, cos, sin, self.interleaved)

    def step_rows(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The full-width ``(cos, signed sin)`` rows of a step's ``positions`` (one sequence's
        tokens, or one token of each sequence), as the rotary kernel reads them
        (:func:`attnkit.kernels.rows.rotate`): each channel's cosine, and its sine with the sign
        of its pair's formula. Contiguous float32.

        Shape:
            positions ``(L,)``, ``(1, L)`` or ``(B, 1)`` -> ``(L or B, E)`` each.

        Raises:
            ValueError: For negative positions, or several tokens of several sequences.
        """
        if positions.dim() > 2 or (positions.dim() == 2 and 1 not in positions.shape):
            raise ValueError(
                f"step_rows takes positions (L,), (1, L) or (B, 1), got {tuple(positions.shape)}"
            )
        cos, sin = self._rows(positions, self.cos.device)
        n = positions.numel()
        return cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()

    def _full_tables(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """:meth:`tables` at full width (see :func:`_full_width`), made once per table.

        Shape:
            ``(N, E)`` each, ``N >= length``.
        """
        cos, sin = self.tables(length, device)
        full = self._full
        if full is None or full[0] is not cos or full[1] != self.interleaved:
            with torch.inference_mode(False):  # usable by a later training step too
                full = (cos, self.interleaved, *_full_width(cos, sin, self.interleaved))
            self._full = full
        return full[2], full[3]

    def _rows(self, positions: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """The tables' rows of ``positions`` at full width (see :func:`_full_width`), shaped to
        broadcast over heads.

        A model hands the same positions tensor to the queries and keys of every layer: the
        rows of the last one are kept (with the tensor, so that its identity and version name
        it) and reused, instead of gathered 2 x layers times per step.

        Shape:
            positions ``(L,)`` -> ``(L, E)``; ``(B, L)`` -> ``(B, 1, L, E)``.
        """
        remember = _values_checkable() and not positions.is_inference()  # no version counter
        full = self._full
        reserved = (
            self._reserved
            and full is not None
            and full[1] == self.interleaved  # (not converted since)
            and full[2].device == device
        )
        if not _values_checkable() and reserved:
            # compiled, with tables reserved (see reserve): the rows are gathered
            cos, sin = full[2][positions], full[3][positions]  # type: ignore[index]
        elif not _values_checkable():  # compiled: the table's rows, computed per position
            cos, sin = _full_width(*self._cos_sin(positions), self.interleaved)
        else:
            memo = self._memo if remember else None
            if (
                memo is not None
                and memo[0] is positions
                and memo[1] == positions._version
                and memo[2].device == device
                and self._full is not None
                and self._full[1] == self.interleaved  # not converted since
                # rows made under inference_mode cannot be saved for a backward
                and (torch.is_inference_mode_enabled() or not memo[2].is_inference())
            ):
                return memo[2], memo[3]
            top = 0
            if positions.numel():
                low, high = (int(t) for t in torch.aminmax(positions))
                if low < 0:
                    raise ValueError(f"positions must be non-negative, got min {low}")
                top = high + 1
            cos, sin = self._full_tables(top, device)
            cos, sin = cos[positions], sin[positions]  # (L, E) or (B, L, E)
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (B, 1, L, E): broadcast heads
        if remember:
            self._memo = (positions, positions._version, cos, sin)
        return cos, sin

    def extra_repr(self) -> str:
        text = f"head_dim={self.head_dim}, base={self.base}, interleaved={self.interleaved}"
        return text if self.scaling is None else f"{text}, scaling={self.scaling}"


def permute_rotary_weight(weight: Tensor, num_heads: int, *, to: RotaryConvention) -> Tensor:
    """Reorder a query or key projection's output channels between rotary conventions.

    ``to="split"`` maps each head's channels ``[0, 1, 2, 3, ...]`` (interleaved pairs) to
    ``[0, 2, 4, ..., 1, 3, 5, ...]`` (pairs in halves), as in Hugging Face's LLaMA conversion;
    ``to="interleaved"`` is the inverse. Since queries and keys get the same permutation, scores
    (hence outputs) are unchanged.

    Args:
        weight: A ``Linear`` weight ``(heads * E, in)`` or bias ``(heads * E,)``.
        num_heads: Heads in ``weight`` (query heads for q, key/value heads for k).
        to: Target convention, ``"split"`` or ``"interleaved"``.

    Returns:
        A new tensor of the same shape.

    Raises:
        ValueError: If the sizes do not fit or ``to`` is unknown.
    """
    if to not in ("split", "interleaved"):
        raise ValueError(f"to must be 'split' or 'interleaved', got {to!r}")
    rows = weight.shape[0]
    if num_heads < 1 or rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(
            f"weight with {rows} output channels does not split into {num_heads} heads of even "
            "head dim"
        )
    E = rows // num_heads
    rest = weight.shape[1:]
    w = (
        weight.reshape(num_heads, E // 2, 2, *rest)
        if to == "split"
        else (weight.reshape(num_heads, 2, E // 2, *rest))
    )
    return w.transpose(1, 2).reshape(weight.shape).clone()


@torch.no_grad()
def convert_rotary_convention(model: nn.Module, *, to: RotaryConvention) -> nn.Module:
    """Switch every rotary attention in ``model`` to another pair convention, in place.

    For each :class:`attnkit.MultiHeadAttention` whose ``rotary`` is a :class:`RotaryEmbedding`
    in the other convention, the query and key projections are permuted with
    :func:`permute_rotary_weight` and the rotary module's ``interleaved`` flag is flipped. The
    model computes the same function afterwards.

    Returns:
        ``model``.
    """
    if to not in ("split", "interleaved"):
        raise ValueError(f"to must be 'split' or 'interleaved', got {to!r}")
    want = to == "interleaved"
    # Collect first: a rotary module may be shared by several layers.
    todo: list[tuple[MultiHeadAttention, RotaryEmbedding]] = [
        (m, m.rotary)
        for m in model.modules()
        if isinstance(m, MultiHeadAttention)
        and isinstance(m.rotary, RotaryEmbedding)
        and m.rotary.interleaved != want
    ]
    for attn, _ in todo:
        H, K = attn.num_heads, attn.num_kv_heads
        q_rows, k_rows = H * attn.head_dim, K * attn.head_dim
        if attn.fused_qkv:
            projs = [(attn.qkv_proj, [(0, q_rows, H), (q_rows, k_rows, K)])]
        else:
            projs = [(attn.q_proj, [(0, q_rows, H)]), (attn.k_proj, [(0, k_rows, K)])]
        for linear, slices in projs:
            for start, n, heads in slices:
                for p in (linear.weight, linear.bias):
                    if p is not None:
                        p[start : start + n] = permute_rotary_weight(
                            p[start : start + n], heads, to=to
                        )
    for _, rotary in todo:
        rotary.interleaved = want
    return model


@contextlib.contextmanager
def reserved_rotary_tables(model: nn.Module, length: int) -> Iterator[None]:
    """Within the block, every :class:`RotaryEmbedding` of ``model`` keeps tables for
    ``length`` positions that compiled calls gather from (:meth:`RotaryEmbedding.reserve`);
    each module's earlier reservation comes back after it.

    Raises:
        ValueError: If ``length`` is negative.
    """
    modules = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    before = [m._reserved for m in modules]
    try:
        for m in modules:
            m.reserve(length)
        yield
    finally:
        for m, n in zip(modules, before, strict=True):
            m._reserved = n
