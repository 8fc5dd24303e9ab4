"""Benchmark ring attention: one process against several (gloo on localhost), time and memory.

Usage:
    python benchmarks/bench_ring.py [--n 16384] [--ranks 1,2] [--heads 8] [--dim 64]
        [--layouts contiguous,zigzag] [--repeats 2] [--json FILE]

For every process count and layout it runs :func:`attnkit.bench.ring.measure_ring` (the
measurement behind the ring rows of ``attnkit bench --vs``): that many processes
(``torch.multiprocessing``, gloo, one thread each) each take their shard of one causal sequence
of ``--n`` positions and time ``attnkit.distributed.ring_attention`` forward+backward (median of
``--repeats`` after one warm-up; the slowest rank counts), and measure their peak memory growth
during one forward+backward with the ``VmHWM`` method of ``attnkit.profiling.peak_memory``
(``/proc/self/clear_refs``). Each rank's time is listed, so the causal load imbalance of the
contiguous layout shows. With one process the same function runs without a process group
(plain attention on the whole sequence).

Recorded (AMD EPYC, 2 cores, quiet; N=16384, causal, 8 heads, E=64, one round; the blocks on
attnkit's flash kernels, which add their gradients to the running sums): 1 process 19.2 s,
129.0 MiB; 2 processes contiguous 15.3 s (1.25x), 74.8 MiB per rank (0.58x); zigzag 14.1 s
(1.36x), 77.5 MiB (0.60x). The blocks travel in pieces of ``attnkit.distributed.CHUNK`` keys in
two reused buffer sets (see ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from attnkit.bench.ring import RingJob, measure_ring


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=16384, help="whole sequence length")
    p.add_argument("--ranks", default="1,2", help="comma-separated process counts")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layouts", default="contiguous,zigzag")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, causal, fp32, N={a.n}, H={a.heads}, E={a.dim}, "
          f"one thread per process, median of {a.repeats}")  # fmt: skip
    print(f"{'ranks':>5} {'layout':<11} {'fwd+bwd s':>10} {'peak MiB/rank':>14} {'x 1 proc':>9}")
    rows: list[dict[str, Any]] = []
    single: dict[str, float] = {}
    for world in (int(r) for r in a.ranks.split(",")):
        for layout in a.layouts.split(",") if world > 1 else ["contiguous"]:
            job = RingJob(a.n, world, layout, a.heads, a.dim, a.repeats)
            result = measure_ring(job)
            seconds = max(result["seconds"])
            peak = max(result["peak"])
            if world == 1:
                single = {"seconds": seconds, "peak": peak}
            rel_t = single["seconds"] / seconds if single else float("nan")
            rel_m = peak / single["peak"] if single else float("nan")
            print(f"{world:>5} {layout:<11} {seconds:>10.2f} {peak / 2**20:>14.1f} "
                  f"{rel_t:>8.2f}x  (memory {rel_m:.2f}x; per rank s "
                  f"{', '.join(f'{s:.2f}' for s in result['seconds'])})")  # fmt: skip
            rows.append({"ranks": world, "layout": layout, "n": a.n, **result,
                         "speedup": rel_t, "memory_ratio": rel_m})  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
