"""Claims 4 to 8: attention without positions is permutation-equivariant; the sinusoidal table
shifts by rotations and spans many wavelengths; RoPE keeps norms and makes scores relative."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import (
    PositionalTransformerBlock,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
)
from attnkit.tour.verdict import ClaimResult, claim_result, seeded

__all__ = [
    "Rotate",
    "check_frequencies",
    "check_permutation",
    "check_rope_norm",
    "check_rope_relative",
    "check_sinusoidal_shift",
]

Rotate = Callable[[Tensor, Tensor], Tensor]  # (x (..., L, E), positions (L,)) -> rotated x


# --------------------------------------------------------------------------- 4: permutation


def _permutation_error(module: nn.Module, *, dim: int, seed: int) -> float:
    gen = seeded(seed)
    x = torch.randn(2, 12, dim, generator=gen)
    perm = torch.randperm(12, generator=gen)
    with torch.no_grad():
        return float((module(x[:, perm]) - module(x)[:, perm]).abs().max())


def check_permutation(
    module: nn.Module | None = None, *, dim: int = 32, tolerance: float = 1e-5, seed: int = 0
) -> ClaimResult:
    """Claim 4: without positions, ``f(x[perm]) == f(x)[perm]``.

    Args:
        module: Maps ``(B, L, dim)`` to ``(B, L, dim)``; default the blog's ``TransformerBlock``.
        dim: Model dim.
        tolerance: Largest allowed ``|f(P x) - P f(x)|``.
        seed: Seed of the input and the permutation.

    Returns:
        The claim's result; measured also holds the same error with sinusoidal and rotary
        positions, for contrast.
    """
    torch.manual_seed(seed)
    under_test = module if module is not None else TransformerBlock(dim, 2 * dim, 4)
    err = _permutation_error(under_test.eval(), dim=dim, seed=seed)
    contrast = {
        kind: _permutation_error(
            PositionalTransformerBlock(dim, 2 * dim, 4, position_type=kind).eval(),
            dim=dim,
            seed=seed,
        )
        for kind in ("sinusoidal", "rope")
    }
    passed = err <= tolerance
    verdict = f"max |f(Px) - P f(x)| = {err:.2e} (tolerance {tolerance:.0e})"
    measured = {"max_error": err, "tolerance": tolerance, "with_positions": contrast}
    label = "module under test" if module is not None else "no positions"
    return claim_result(4, passed, measured, verdict, {"label": label})


# --------------------------------------------------------------------------- 5, 6: sinusoidal


def _sinusoidal_table(dim: int = 64, length: int = 512) -> Tensor:
    return SinusoidalPositionalEncoding(dim=dim, max_seq_len=length).pe.double()  # (length, dim)


def _pair_angles(table: Tensor) -> Tensor:
    """Angle of each (even, odd) channel pair seen as a point (cos-part, sin-part): (N, dim/2)."""
    pairs = table.reshape(table.shape[0], -1, 2)  # (N, dim/2, 2): (sin, cos) per the blog
    return torch.atan2(pairs[..., 0], pairs[..., 1])


def check_sinusoidal_shift(
    table: Tensor | None = None,
    *,
    shifts: Sequence[int] = (1, 7, 50, 300),
    tolerance: float = 1e-4,
) -> ClaimResult:
    """Claim 5: ``PE(p + k) = M_k PE(p)`` for every p, with ``M_k`` a rotation per channel pair.

    For each shift ``k`` and pair, ``M_k`` is the rotation taking ``PE(0)`` to ``PE(k)`` (read off
    the table); the check is that the same rotation takes ``PE(p)`` to ``PE(p + k)`` for every p.

    Args:
        table: ``(positions, dim)`` table under test; default ``SinusoidalPositionalEncoding``'s.
        shifts: Shifts ``k``.
        tolerance: Largest allowed ``|PE(p + k) - M_k PE(p)|``.

    Returns:
        The claim's result.
    """
    pe = (table if table is not None else _sinusoidal_table()).double()
    N, dim = pe.shape
    pairs = pe.reshape(N, dim // 2, 2)  # (N, P, 2)
    errors: dict[str, float] = {}
    per_pair: dict[int, Tensor] = {}
    for k in shifts:
        a, b = pairs[0], pairs[k]  # (P, 2)
        # rotation angle from PE(0) to PE(k) in each pair's plane, and the ratio of lengths
        theta = torch.atan2(a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0], (a * b).sum(-1))  # (P,)
        c, s = theta.cos(), theta.sin()
        x, y = pairs[: N - k, :, 0], pairs[: N - k, :, 1]
        rotated = torch.stack((c * x - s * y, s * x + c * y), dim=-1)  # (N-k, P, 2)
        err = (rotated - pairs[k:]).abs().amax(-1)  # (N-k, P)
        errors[str(k)] = float(err.max())
        per_pair[k] = err.amax(0)
    worst = max(errors.values())
    passed = worst <= tolerance
    verdict = (
        f"largest error over all p, pairs and k in {list(shifts)}: {worst:.2e} "
        f"(tolerance {tolerance:.0e})"
    )
    return claim_result(
        5,
        passed,
        {"max_error_per_shift": errors, "tolerance": tolerance, "positions": N, "dim": dim},
        verdict,
        {"table": pe, "per_pair": per_pair},
    )


def check_frequencies(table: Tensor | None = None) -> ClaimResult:
    """Claim 6: each channel pair turns at its own speed; low pairs fast, high pairs slowly.

    Every pair's angular speed is measured from the table (the unwrapped angle's mean step); its
    wavelength is ``2π / speed``. Passes when the wavelengths increase strictly with the pair
    index, the first is under 10 positions and the last over 1000 times the first.

    Args:
        table: ``(positions, dim)`` table under test; default ``SinusoidalPositionalEncoding``'s.

    Returns:
        The claim's result.
    """
    pe = (table if table is not None else _sinusoidal_table()).double()
    angles = _pair_angles(pe)  # (N, P)
    step = torch.remainder(angles.diff(dim=0) + math.pi, 2 * math.pi) - math.pi  # wrapped steps
    speed = step.mean(0).abs()  # (P,) radians per position
    wavelength = (2 * math.pi / speed.clamp_min(1e-12)).tolist()
    increasing = all(b > a for a, b in itertools.pairwise(wavelength))
    short = wavelength[0] < 10
    long = wavelength[-1] > 1000 * wavelength[0]
    verdict = (
        f"wavelengths rise with the pair index: {increasing}; shortest {wavelength[0]:.2f} "
        f"positions (< 10: {short}); longest {wavelength[-1]:.0f} (> 1000x the shortest: {long})"
    )
    measured = {"wavelengths": wavelength, "radians_per_position": speed.tolist()}
    return claim_result(6, increasing and short and long, measured, verdict, {"table": pe})


# --------------------------------------------------------------------------- 7, 8: RoPE


def _default_rotate(head_dim: int = 64) -> Rotate:
    rope = RotaryEmbedding(head_dim)
    return lambda x, positions: rope(x, positions)


def check_rope_norm(
    rotate: Rotate | None = None, *, head_dim: int = 64, tolerance: float = 1e-5, seed: int = 0
) -> ClaimResult:
    """Claim 7: ``|rope(x, p)| == |x|``, for every vector and every channel pair.

    Args:
        rotate: ``(x, positions) -> rotated x`` under test; default ``RotaryEmbedding``
            (both pair conventions are measured when it is the default).
        head_dim: E.
        tolerance: Largest allowed relative change of a norm.
        seed: Seed of the vectors.

    Returns:
        The claim's result.
    """
    gen = seeded(seed)
    x = torch.randn(2, 4, 256, head_dim, generator=gen)  # (B, H, L, E)
    positions = torch.cat([torch.arange(128), torch.arange(100_000, 100_128)])  # near and far
    rotations = (
        {"under test": rotate}
        if rotate is not None
        else {
            "interleaved (blog)": _default_rotate(head_dim),
            "split halves (NeoX)": (lambda r: lambda t, p: r(t, p))(
                RotaryEmbedding(head_dim, interleaved=False)
            ),
        }
    )
    measured: dict[str, Any] = {"tolerance": tolerance}
    worst = 0.0
    before = x.norm(dim=-1).flatten()
    after = {}
    for name, fn in rotations.items():
        with torch.no_grad():
            y = fn(x, positions)
        ratio = y.norm(dim=-1) / x.norm(dim=-1)
        rel = float((ratio - 1).abs().max())
        measured[name] = {"max_relative_norm_change": rel}
        worst = max(worst, rel)
        after[name] = y.norm(dim=-1).flatten()
    verdict = f"largest relative change of a norm: {worst:.2e} (tolerance {tolerance:.0e})"
    drawing = {"before": before, "after": after}
    return claim_result(7, worst <= tolerance, measured, verdict, drawing)


def check_rope_relative(
    rotate: Rotate | None = None,
    *,
    head_dim: int = 64,
    length: int = 48,
    far: int = 5000,
    tolerance: float = 1e-4,
    seed: int = 0,
) -> ClaimResult:
    """Claim 8: ``rope(q, p) · rope(k, s)`` depends only on ``s - p``.

    Scores of one query and one key placed at every pair of positions form a matrix whose
    diagonals (constant ``s - p``) must be constant, also when both positions move ``far`` ahead;
    the scores must still vary across offsets (otherwise positions would carry nothing).

    Args:
        rotate: ``(x, positions) -> rotated x`` under test; default ``RotaryEmbedding``.
        head_dim: E.
        length: Positions ``0 .. length-1`` on each side.
        far: Shift applied to both positions for the second matrix.
        tolerance: Largest allowed spread along a diagonal, relative to the scores' scale.
        seed: Seed of the query and key.

    Returns:
        The claim's result.
    """
    fn = rotate if rotate is not None else _default_rotate(head_dim)
    gen = seeded(seed)
    q = torch.randn(head_dim, generator=gen).expand(length, head_dim)
    k = torch.randn(head_dim, generator=gen).expand(length, head_dim)
    pos = torch.arange(length)
    with torch.no_grad():
        scores = fn(q, pos) @ fn(k, pos).T  # (p, s)
        shifted = fn(q, pos + far) @ fn(k, pos + far).T
    scale = float(scores.abs().max())
    spread = 0.0
    by_offset = []
    for off in range(-(length - 1), length):
        diag = torch.diagonal(scores, offset=off)
        spread = max(spread, float(diag.max() - diag.min()))
        by_offset.append(float(diag.mean()))
    move = float((shifted - scores).abs().max())
    varies = float(torch.tensor(by_offset).std()) > 0.05 * scale
    ok = spread <= tolerance * scale and move <= tolerance * scale and varies
    verdict = (
        f"largest spread along a diagonal {spread:.2e}, change when both positions move by "
        f"{far}: {move:.2e} (tolerance {tolerance:.0e} x scale {scale:.2f}); varies with the "
        f"offset: {varies}"
    )
    measured = {
        "diagonal_spread": spread,
        "shift_change": move,
        "scale": scale,
        "varies_with_offset": varies,
        "tolerance": tolerance,
    }
    return claim_result(8, ok, measured, verdict, {"scores": scores, "by_offset": by_offset})
