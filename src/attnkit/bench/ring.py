"""Ring attention across processes against one process: time and per-rank peak memory.

:func:`measure_ring` starts ``world`` processes (``torch.multiprocessing``, gloo on localhost,
one thread each), builds one whole causal sequence from a fixed seed, gives each rank its shard
(:func:`attnkit.distributed.shard`) and times :func:`attnkit.distributed.ring_attention`
forward+backward (median of ``repeats`` after one warm-up; the slowest rank counts). Each rank
measures the growth of its peak memory during one forward+backward with
:func:`attnkit.profiling.peak_memory` (the ``VmHWM`` method). With one process the same function
runs without a process group: plain attention on the whole sequence, the single-process run the
ring is compared with. ``attnkit bench --vs`` and ``benchmarks/bench_ring.py`` print it.
"""

from __future__ import annotations

import json
import statistics
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
