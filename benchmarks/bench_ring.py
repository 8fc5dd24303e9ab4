"""Benchmark ring attention: one process against several (gloo on localhost), time and memory.

Usage:
    python benchmarks/bench_ring.py [--n 16384] [--ranks 1,2] [--heads 8] [--dim 64]
        [--layouts contiguous,zigzag] [--repeats 2] [--json FILE]

For every process count and layout it starts that many processes (``torch.multiprocessing``,
gloo, one thread each), builds a whole causal sequence of ``--n`` positions from one seed,
gives each rank its shard, and times ``attnkit.distributed.ring_attention`` forward+backward
(median of ``--repeats`` after one warm-up; the slowest rank counts). Each rank measures its
peak memory growth during one forward+backward with the ``VmHWM`` method of
``attnkit.profiling.peak_memory`` (``/proc/self/clear_refs``). It also reports the rank's
busy time (the forward+backward with the ring's waits) so the causal load imbalance of the
contiguous layout shows. With one process the same function runs without communication.

Recorded (AMD EPYC, 2 cores shared with other jobs at load 12-19, so times are mostly noise;
N=16384, causal, 8 heads, E=64, one round): 1 process 162.5 s, 259 MiB; 2 processes contiguous
153.6 s (1.06x), 244 MiB per rank (0.94x); zigzag 190.7 s (0.85x), 260 MiB per rank (1.00x).
Per rank the ring holds, besides its halved shards, the incoming key/value block and the
travelling key/value gradients (sent and received buffers), which at 2 ranks eat the saving.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnkit.distributed import ring_attention, shard
from attnkit.profiling import peak_memory


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
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                init = f"file://{Path(tmp) / 'rendezvous'}"
                mp.spawn(_worker, args=(world, init, a, layout, str(out)), nprocs=world)
                result = json.loads(out.read_text())
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


def _worker(rank: int, world: int, init: str, a: argparse.Namespace, layout: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)
        whole = [
            torch.randn(1, a.n, a.heads, a.dim, generator=gen).transpose(1, 2) for _ in range(4)
        ]
        q, k, v, grad = (shard(t, 2, rank, world, layout=layout).contiguous() for t in whole)
        del whole
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step() -> None:
            o = ring_attention(q, k, v, causal=True, layout=layout)
            torch.autograd.grad(o, (q, k, v), grad)

        step()  # warm-up
        dist.barrier()
        peak = peak_memory(step)
        times = []
        for _ in range(a.repeats):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        result = {"seconds": statistics.median(times), "peak": peak or 0}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            merged = {key: [r[key] for r in gathered] for key in result}
            Path(out).write_text(json.dumps(merged))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
