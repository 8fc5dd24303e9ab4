"""attnkit.complexity's memory model against measured peak memory, textbook and fused attention.

For each N the textbook path (``softmax(q @ k^T / sqrt(E)) @ v`` written out) should grow the
resident peak by about the predicted ``2*B*H*N*N`` elements (scores and weights alive together
while softmax runs) plus its output; the fused path (``attnkit.MultiHeadSelfAttention``) holds no
N x N matrix, so its growth stays a small fraction of that. Peaks come from
:func:`attnkit.profiling.peak_memory` in this process, one measurement at a time.

Usage:
    python -m attnkit.bench.memory                  # N = 1024 2048 4096
    python -m attnkit.bench.memory --seq-lens 2048 --out results.json

Exits with status 1 when a measurement is off the model by more than ``--tolerance``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

import attnkit
from attnkit.bench.results import bench_parser, write_report
from attnkit.complexity import attention_cost
from attnkit.profiling import peak_memory

BATCH, HEADS, HEAD_DIM = 1, 4, 16  # B*H*N*N scores dwarf the N*E terms


def measure(n: int) -> dict[str, float | int | None]:
    """Predicted and measured peak growth (bytes) of both paths at sequence length ``n``."""
    q, k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM) for _ in range(3))  # before the reset
    cost = attention_cost(n, HEADS * HEAD_DIM, HEADS, batch=BATCH)
    out_elements = next(c for c in cost.components if c.name == "weighted_sum").activations

    def textbook() -> None:
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)  # (B, H, N, N)
        weights = scores.softmax(dim=-1)  # (B, H, N, N): both alive while softmax runs
        del scores
        out = weights @ v  # (B, H, N, E)
        del weights, out

    layer = attnkit.MultiHeadSelfAttention(
        HEADS * HEAD_DIM, HEADS * HEAD_DIM, HEADS * HEAD_DIM, HEADS
    )
    layer.eval()
    x = torch.randn(BATCH, n, HEADS * HEAD_DIM)

    def fused() -> None:
        with torch.no_grad():
            layer(x)

    fused()  # warm-up: one-off allocations out of the measurement
    predicted = cost.textbook_peak_attn_bytes + out_elements * cost.bytes_per_element
    return {
        "N": n,
        "predicted_textbook_bytes": predicted,
        "textbook_bytes": peak_memory(textbook),
        "fused_bytes": peak_memory(fused),
    }


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("attnkit.bench.memory", __doc__)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--tolerance", type=float, default=0.25, help="allowed relative error")
    p.add_argument("--out", type=Path, help="default benchmarks/results/memory.json")
    args = p.parse_args(argv)

    rows = [measure(n) for n in args.seq_lens]
    print(f"{'N':>6} {'predicted MiB':>14} {'textbook MiB':>13} {'ratio':>6} {'fused/pred':>10}")
    ok = True
    for r in rows:
        pred, text, fused = r["predicted_textbook_bytes"], r["textbook_bytes"], r["fused_bytes"]
        if text is None or fused is None or pred is None:
            print(f"{r['N']:>6} peak memory cannot be measured here (no /proc/self/clear_refs)")
            return 0
        ratio, fused_share = text / pred, fused / pred
        ok &= abs(ratio - 1) <= args.tolerance and fused_share < args.tolerance
        print(
            f"{r['N']:>6} {pred / 2**20:>14.1f} {text / 2**20:>13.1f} {ratio:>6.2f} "
            f"{fused_share:>10.3f}"
        )
    write_report({"rows": rows}, args.out, "memory.json")
    print(f"the model {'holds' if ok else 'is off'} within {args.tolerance:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
