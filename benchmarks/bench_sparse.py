"""Benchmark attnkit's block-sparse attention (same code as ``attnkit bench``).

Usage:
    python benchmarks/bench_sparse.py [attnkit bench options]     # the suite, e.g. --quick
    python benchmarks/bench_sparse.py --crossover [--out FILE]    # where block-sparse starts to win

``--crossover`` times block-sparse against torch SDPA with the dense mask over short lengths and
several densities; its table is the evidence behind ``attnkit.sparse.MIN_KEYS`` and
``MAX_DENSITY`` (the fallback rule of ``should_use_block_sparse``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def crossover(out: Path | None, repeats: int = 5) -> int:
    """Time ratio dense/block-sparse over N and window (density) on this CPU; print a table."""
    rows = []
    print(f"{'N':>6} {'W':>6} {'density':>8} {'fwd x':>7} {'fwd+bwd x':>10}  (x > 1: sparse wins)")
    for n in (256, 512, 1024, 2048, 4096):
        for frac in (1 / 16, 1 / 4, 1 / 2, 3 / 4):
            row = _crossover_point(n, max(1, int(frac * n)), repeats)
            rows.append(row)
            print(
                f"{n:>6} {row['window']:>6} {row['density']:>8.3f} {row['fwd']:>7.2f} "
                f"{row['fwd+bwd']:>10.2f}"
            )
    if out is not None:
        out.write_text(json.dumps(rows, indent=2))
    return 0


def _crossover_point(n: int, w: int, repeats: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from attnkit.functional import block_sparse_attention
    from attnkit.sparse import structured_mask

    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    mask = structured_mask(n, n, causal=True, window=w)
    fns = {
        "sparse": lambda: block_sparse_attention(q, k, v, causal=True, window=w),
        "dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    }
    row = {"seq_len": n, "window": w, "density": float(mask.float().mean())}
    for mode in ("fwd", "fwd+bwd"):
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeats + 1):  # the first round warms up
            for name, fn in fns.items():
                start = time.perf_counter()
                with torch.set_grad_enabled(mode == "fwd+bwd"):
                    o = fn()
                    if mode == "fwd+bwd":
                        o.sum().backward()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t[1:]) for name, t in times.items()}
        row[mode] = med["dense"] / med["sparse"]
    return row


def main(argv: list[str] | None = None) -> int:
    from attnkit.commands import bench

    argv = sys.argv[1:] if argv is None else argv
    if "--crossover" in argv:
        p = argparse.ArgumentParser()
        p.add_argument("--crossover", action="store_true")
        p.add_argument("--out", type=Path)
        p.add_argument("--repeats", type=int, default=5)
        a = p.parse_args(argv)
        return crossover(a.out, a.repeats)
    parser = argparse.ArgumentParser(prog="bench_sparse.py", description=__doc__)
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
