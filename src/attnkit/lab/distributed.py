"""Data-parallel training with ``torch.distributed``: one process per device, launched by torchrun.

``torchrun --nproc_per_node=2 -m attnkit lab ...`` sets ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads them (``env://``)
and picks gloo on CPU, nccl on CUDA. Without ``WORLD_SIZE > 1`` everything runs in one process and
no process group is created.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT_S", "DistContext", "init_distributed", "shutdown_distributed"]


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the data-parallel group.

    Attributes:
        rank: Global rank (0 writes files and prints).
        world_size: Number of processes.
        local_rank: Rank on this machine (selects the CUDA device).
        device: Device this process computes on.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Whether this process writes files and prints (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is in use."""
        return self.world_size > 1

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few numbers over all processes (identity in one process)."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        """Wait for every process (no-op in one process)."""
        if self.distributed:
            dist.barrier()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError as err:
        raise ValueError(f"environment variable {name} must be an int, got {raw!r}") from err


#: Seconds a collective waits for the other processes before it fails (``--timeout``).
DEFAULT_TIMEOUT_S = 120.0


def init_distributed(
    device: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> DistContext:
    """Join the process group described by the environment, or return a single-process context.

    Args:
        device: ``"cpu"``, ``"cuda"`` or None (CUDA if available, else CPU).
        timeout_s: How long a collective waits for the other processes before it raises, so a
            process that stopped answering cannot hang the others for longer. (A process that
            dies is noticed sooner: gloo fails on the closed connection, and torchrun stops the
            remaining processes once one exits with an error.)

    Returns:
        The context of this process.

    Raises:
        ValueError: For a bad ``device`` or inconsistent environment variables.
    """
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s!r}")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or None, got {device!r}")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= RANK < WORLD_SIZE, got RANK={rank}, WORLD_SIZE={world}")
    if use_cuda:
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world == 1:
        return DistContext(device=dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            init_method="env://",
            world_size=world,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return DistContext(rank=rank, world_size=world, local_rank=local, device=dev)


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave the process group created by :func:`init_distributed` (no-op in one process)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
