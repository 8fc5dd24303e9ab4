"""attnkit.flex against torch's compiled FlexAttention and dense-mask SDPA.

Usage::

    python -m attnkit.bench.flex_speed [--quick] [--repeats 5] [--threads N]
        [--out benchmarks/results/flex.json]

Rows (each a job, attnkit's time, the peer's, and the ratio ``peer / attnkit``, higher is
faster), every pair timed in one process, interleaved round by round:

* ``flex window fwd``: a causal sliding window through :func:`attnkit.flex.flex_attention`
  (a preset block mask, served by attnkit's structured kernels) against torch's compiled
  ``flex_attention`` on the same mask, warm;
* ``flex window first call``: building the block mask and the first call, against the
  compiled peer's first call (block mask, compilation and one run);
* ``flex alibi+causal fwd``: the ALiBi score modification on a causal block mask (attnkit's
  flash kernel with the slopes, where the policy's ``alibi_kernel`` says) against compiled
  FlexAttention with the same ``score_mod``;
* ``flex window fwd+bwd``: forward and backward of the window against
  ``torch.nn.functional.scaled_dot_product_attention`` with a dense bool mask;
* ``flex alibi+causal fwd+bwd``: forward and backward of the ALiBi row against
  ``scaled_dot_product_attention`` with a dense additive mask holding the biases (compiled
  FlexAttention has no CPU backward).

:func:`flex_rows` returns the rows as dicts with the fields of
:class:`attnkit.bench.vs.VsRow`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.bench.flex import FlexFn, flex_or_reason
from attnkit.bench.results import bench_parser, parse_with_threads, write_report
from attnkit.flex import create_block_mask, flex_attention
from attnkit.flex import presets as P
from attnkit.masks import structured_mask
from attnkit.profiling import time_interleaved

__all__ = ["FlexSpeedJob", "flex_rows", "main"]

FLEX = "torch flex_attention (compiled)"
DENSE = "SDPA dense mask"


@dataclass(frozen=True)
class FlexSpeedJob:
    """The sizes of :func:`flex_rows`.

    Attributes:
        seq_len: Sequence length of the window rows.
        window: Sliding window (keys per query, itself included).
        alibi_len: Sequence length of the ALiBi row.
        heads: Attention heads (batch 1).
        head_dim: Head dim E.
        repeats: Interleaved timed rounds after one warm-up call each.
        flex: Compare with compiled FlexAttention (needs a C++ toolchain for the compiler).
        goals: Whether the rows carry the ratios they aim at (meaningful at the full sizes).
    """

    seq_len: int = 8192
    window: int = 256
    alibi_len: int = 4096
    heads: int = 8
    head_dim: int = 64
    repeats: int = 5
    flex: bool = True
    goals: bool = True

    @classmethod
    def quick(cls) -> FlexSpeedJob:
        """Sizes small enough to run every row in seconds (a smoke test, not a measurement)."""
        return cls(
            seq_len=512, window=32, alibi_len=256, heads=2, head_dim=16, repeats=1, goals=False
        )


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _row(
    job: str,
    peer: str,
    ours: float | None,
    theirs: float | None,
    note: str,
    goal: float | None,
    spec: FlexSpeedJob,
) -> dict[str, Any]:
    return {
        "job": job,
        "peer": peer,
        "attnkit_s": ours,
        "peer_s": theirs,
        "note": note,
        "goal": goal if spec.goals else None,
        "unit": "s",
    }


def _race(
    ours: Callable[[], Tensor],
    peer: FlexFn,
    qkv: tuple[Tensor, Tensor, Tensor],
    want: Tensor,
    repeats: int,
) -> tuple[float, float, float]:
    """Time ``ours`` against ``peer(*qkv)`` (no grad), interleaved round by round.

    Returns:
        ``(ours median seconds, peer median seconds, peer's largest difference from want)``.
    """

    def theirs() -> Tensor:
        with torch.no_grad():
            return peer(*qkv)

    diff = float((theirs() - want).abs().max())
    samples = time_interleaved({"ours": ours, "theirs": theirs}, repeats=repeats)
    return _median(samples["ours"]), _median(samples["theirs"]), diff


def _inputs(n: int, spec: FlexSpeedJob, *, grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    shape = (1, spec.heads, n, spec.head_dim)
    return tuple(torch.randn(shape, requires_grad=grad) for _ in range(3))  # type: ignore[return-value]


def flex_rows(job: FlexSpeedJob) -> list[dict[str, Any]]:
    """Measure ``job``: the rows described in the module docstring.

    Returns:
        Dicts with ``job``, ``peer``, ``attnkit_s``, ``peer_s`` (None where the peer could not
        run), ``note`` (sizes, agreement, why a peer was skipped), ``goal`` and ``unit``.
    """
    rows = _window_rows(job)
    rows.append(_alibi_row(job))
    rows.append(_backward_row(job))
    rows.append(_alibi_backward_row(job))
    return rows


def _window_rows(job: FlexSpeedJob) -> list[dict[str, Any]]:
    n, w = job.seq_len, job.window
    q, k, v = _inputs(n, job)
    sizes = f"N={n}, window {w}, {job.heads} heads x {job.head_dim}"
    start = time.perf_counter()
    block_mask = create_block_mask(P.sliding_window(w), None, None, n, n)
    with torch.no_grad():
        want = flex_attention(q, k, v, block_mask=block_mask)
    assert isinstance(want, Tensor)  # no return_lse: the output alone
    first = time.perf_counter() - start

    def ours() -> Tensor:
        with torch.no_grad():
            return flex_attention(q, k, v, block_mask=block_mask)  # type: ignore[return-value]

    peer, peer_first, why = (None, 0.0, "not asked") if not job.flex else flex_or_reason(
        q, k, causal=True, window=w
    )  # fmt: skip
    if peer is None:
        (ours_s,) = time_interleaved({"ours": ours}, repeats=job.repeats).values()
        return [
            _row("flex window fwd", FLEX, _median(ours_s), None, f"{sizes}; {why}", 1.5, job),
            _row("flex window first call", FLEX, first, None, f"{sizes}; {why}", None, job),
        ]
    ours_t, peer_t, diff = _race(ours, peer, (q, k, v), want, job.repeats)
    note = f"{sizes}; max diff {diff:.1e}"
    return [
        _row(
            "flex window fwd",
            FLEX,
            ours_t,
            peer_t,
            note,
            1.5,
            job,
        ),
        _row(
            "flex window first call",
            FLEX,
            first,
            peer_first,
            f"{sizes}; block mask + first call (target < 1 s)",
            None,
            job,
        ),
    ]


def _alibi_row(job: FlexSpeedJob) -> dict[str, Any]:
    n = job.alibi_len
    q, k, v = _inputs(n, job)
    alibi = P.alibi(job.heads)
    sizes = f"N={n}, ALiBi + causal, {job.heads} heads x {job.head_dim}"
    block_mask = create_block_mask(P.causal(), None, None, n, n)

    def ours() -> Tensor:
        with torch.no_grad():
            return flex_attention(q, k, v, alibi, block_mask)  # type: ignore[return-value]

    want = ours()
    peer, _, why = (None, 0.0, "not asked") if not job.flex else flex_or_reason(
        q, k, score_mod=alibi, causal=True
    )  # fmt: skip
    if peer is None:
        (ours_s,) = time_interleaved({"ours": ours}, repeats=job.repeats).values()
        return _row("flex alibi+causal fwd", FLEX, _median(ours_s), None, f"{sizes}; {why}",
                    1.0, job)  # fmt: skip
    ours_t, peer_t, diff = _race(ours, peer, (q, k, v), want, job.repeats)
    return _row("flex alibi+causal fwd", FLEX, ours_t, peer_t, f"{sizes}; max diff {diff:.1e}",
                1.0, job)  # fmt: skip


def _backward_row(job: FlexSpeedJob) -> dict[str, Any]:
    n, w = job.seq_len, job.window
    q, k, v = _inputs(n, job, grad=True)
    block_mask = create_block_mask(P.sliding_window(w), None, None, n, n)
    dense = structured_mask(n, n, causal=True, window=w)  # (L, S) bool, True = may attend

    def ours() -> Tensor:
        return flex_attention(q, k, v, block_mask=block_mask)  # type: ignore[return-value]

    def theirs() -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    ours_s, theirs_s, diff = _grad_race(ours, theirs, (q, k, v), job.repeats)
    note = f"N={n}, window {w}, {job.heads} heads x {job.head_dim}; max grad diff {diff:.1e}"
    return _row("flex window fwd+bwd", DENSE, ours_s, theirs_s, note, 12.0, job)


def _alibi_backward_row(job: FlexSpeedJob) -> dict[str, Any]:
    n = job.alibi_len
    q, k, v = _inputs(n, job, grad=True)
    alibi = P.alibi(job.heads)
    block_mask = create_block_mask(P.causal(), None, None, n, n)
    i = torch.arange(n)
    bias = P.alibi_slopes(job.heads).view(-1, 1, 1) * (i[None, :] - i[:, None])  # (H, L, S)
    dense = bias.masked_fill(i[None, :] > i[:, None], -math.inf).unsqueeze(0)

    def ours() -> Tensor:
        return flex_attention(q, k, v, alibi, block_mask)  # type: ignore[return-value]

    def theirs() -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    ours_s, theirs_s, diff = _grad_race(ours, theirs, (q, k, v), job.repeats)
    note = (
        f"N={n}, ALiBi + causal, {job.heads} heads x {job.head_dim}; the peer's mask holds the "
        f"biases; max grad diff {diff:.1e}"
    )
    return _row("flex alibi+causal fwd+bwd", DENSE, ours_s, theirs_s, note, 1.0, job)


def _grad_race(
    ours: Callable[[], Tensor],
    theirs: Callable[[], Tensor],
    inputs: tuple[Tensor, Tensor, Tensor],
    repeats: int,
) -> tuple[float, float, float]:
    """Time the forward and backward of ``ours`` against ``theirs`` (the same gradient of the
    output), interleaved round by round.

    Returns:
        ``(ours median seconds, theirs median seconds, largest input-gradient difference)``.
    """
    q = inputs[0]
    g = torch.randn(q.shape[0], q.shape[1], q.shape[2], inputs[2].shape[-1])

    def step(fn: Callable[[], Tensor]) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.backward(fn(), g)
            for t in inputs:
                t.grad = None

        return run

    grads = [torch.autograd.grad(fn(), inputs, g) for fn in (ours, theirs)]
    diff = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
    samples = time_interleaved({"ours": step(ours), "theirs": step(theirs)}, repeats=repeats)
    return _median(samples["ours"]), _median(samples["theirs"]), diff


def main(argv: list[str] | None = None) -> int:
    p: argparse.ArgumentParser = bench_parser("attnkit.bench.flex_speed", __doc__)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--repeats", type=int, help="interleaved timed rounds")
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    p.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/flex.json)")
    a = parse_with_threads(p, argv)
    job = FlexSpeedJob.quick() if a.quick else FlexSpeedJob()
    changes: dict[str, Any] = {"flex": not a.no_flex}
    if a.repeats:
        changes["repeats"] = a.repeats
    job = FlexSpeedJob(**{**job.__dict__, **changes})
    rows = flex_rows(job)
    for row in rows:
        ratio = (
            f"{row['peer_s'] / row['attnkit_s']:.2f}x"
            if row["peer_s"] and row["attnkit_s"]
            else "-"
        )
        print(f"{row['job']:<26} {row['attnkit_s'] or 0:9.4f}s  {row['peer']:<34} "
              f"{row['peer_s'] or 0:9.4f}s  {ratio:>7}  {row['note']}")  # fmt: skip
    write_report({"job": job.__dict__, "rows": rows}, a.out, "flex.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
