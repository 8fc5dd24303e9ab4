"""Ring attention across processes against one process: time and per-rank peak memory.

:func:`measure_ring` starts ``world`` processes (``torch.multiprocessing``, gloo on localhost,
one thread each), builds one whole causal sequence from a fixed seed, gives each rank its shard
(:func:`attnkit.distributed.shard`) and times :func:`attnkit.distributed.ring_attention`
forward+backward (median of ``repeats`` after one warm-up; the slowest rank counts). Each rank
measures the growth of its peak memory during one forward+backward with
:func:`attnkit.profiling.peak_memory` (the ``VmHWM`` method). With one process the same function
runs without a process group: plain attention on the whole sequence, the single-process run the
ring is compared with. ``attnkit bench --vs`` prints it; ``python -m attnkit.bench.ring [--n
16384] [--ranks 1,2] [--layouts contiguous,zigzag] [--json FILE]`` runs every process count and
layout (the zigzag layout gives each rank two shards, one early and one late, so the causal work
is balanced).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RingJob", "measure_ring"]


@dataclass(frozen=True)
class RingJob:
    """One ring measurement.

    Attributes:
        seq_len: The whole sequence ``N`` (divisible by ``world``, by ``2 * world`` for zigzag).
        world: Processes.
        layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`attnkit.distributed.shard`).
        heads: Attention heads.
        head_dim: Head dim E.
        repeats: Timed forward+backward calls after the warm-up.
    """

    seq_len: int = 16384
    world: int = 2
    layout: str = "contiguous"
    heads: int = 8
    head_dim: int = 64
    repeats: int = 2


def measure_ring(job: RingJob) -> dict[str, list[float]]:
    """Run ``job`` in ``job.world`` fresh processes.

    Args:
        job: What to measure.

    Returns:
        ``{"seconds": [...], "peak": [...]}``: each rank's median forward+backward seconds and
        its peak memory growth in bytes (0 where it cannot be measured), in rank order.

    Raises:
        ValueError: ``world < 1`` or a sequence that does not split evenly.
    """
    import torch.multiprocessing as mp

    from attnkit.distributed import shard_positions

    if job.world < 1:
        raise ValueError(f"world must be >= 1, got {job.world}")
    shard_positions(job.seq_len, 0, job.world, layout=job.layout)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        init = f"file://{Path(tmp) / 'rendezvous'}"
        mp.spawn(_worker, args=(job, init, str(out)), nprocs=job.world)
        result: dict[str, list[float]] = json.loads(out.read_text())
    return result


def _worker(rank: int, job: RingJob, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from attnkit.distributed import ring_attention, shard
    from attnkit.profiling import peak_memory

    torch.set_num_threads(1)
    world = job.world
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)
        shape = (1, job.seq_len, job.heads, job.head_dim)
        whole = [torch.randn(shape, generator=gen).transpose(1, 2) for _ in range(4)]
        layout: Any = job.layout
        q, k, v, grad = (shard(t, 2, rank, world, layout=layout).contiguous() for t in whole)
        del whole
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step() -> None:
            o = ring_attention(q, k, v, causal=True, layout=layout)
            torch.autograd.grad(o, (q, k, v), grad)

        def barrier() -> None:
            if world > 1:
                dist.barrier()

        step()  # warm-up
        barrier()
        peak = peak_memory(step)
        times = []
        for _ in range(job.repeats):
            barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        result = {"seconds": statistics.median(times), "peak": peak or 0}
        gathered: list[Any] = [result]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, result)
        if rank == 0:
            merged = {key: [r[key] for r in gathered] for key in result}
            Path(out).write_text(json.dumps(merged))
    finally:
        if world > 1:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m attnkit.bench.ring", description=__doc__.splitlines()[0]
    )
    p.add_argument("--n", type=int, default=16384, help="whole sequence length")
    p.add_argument("--ranks", default="1,2", help="comma-separated process counts")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layouts", default="contiguous,zigzag")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    import torch

    from attnkit.bench.results import write_report

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
    write_report({"rows": rows}, a.json, "ring.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
