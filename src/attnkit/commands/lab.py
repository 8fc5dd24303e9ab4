"""``attnkit lab``: train a small transformer on a built-in task and write a report.

With no arguments it learns to reverse sequences of 16 symbols (well under a minute on a laptop
CPU) and writes ``runs/lab-reverse/{metrics.json,report.html,checkpoint.safetensors}``.
``--compare-pe`` trains the same encoder without positions, with sinusoidal and with rotary
positions. Under ``torchrun --nproc_per_node=N -m attnkit lab ...`` it trains data-parallel
(DDP), with ``--fsdp`` with parameters sharded over the processes (FSDP2), or with
``--context-parallel`` with each sequence sharded over them (ring attention).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnkit.lab.train import LabConfig

# Task-specific defaults on top of LabConfig's (which are tuned for reverse). Kept here, not in
# the library, so that the Python API has one set of defaults.
TASK_DEFAULTS: dict[str, dict[str, object]] = {
    "reverse": {},
    "copy": {},
    "sort": {"steps": 1000, "seq_len": 12},
    "recall": {"steps": 1000, "seq_len": 10, "num_symbols": 8, "batch_size": 128},
}

# Options that override one LabConfig field each: (group, flag, type, help with the default).
FIELD_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("model", "--dim", int, "model dim D (64)"),
    ("model", "--layers", int, "encoder blocks (2)"),
    ("model", "--heads", int, "attention heads (4)"),
    ("model", "--ffn-dim", int, "feed-forward width (128)"),
    ("model", "--dropout", float, "dropout (0)"),
    ("model", "--seq-len", int, "training sequence length (16)"),
    ("model", "--num-symbols", int, "alphabet size (10)"),
    ("model", "--max-seq-len", int, "positions in the tables, for the length tests (4 x seq-len)"),
    ("model", "--rope-base", float, "rotary wavelength base, with --positions rope (100)"),
    ("training", "--steps", int, "optimizer steps (400 for reverse)"),
    ("training", "--batch-size", int, "global batch, split over processes (64)"),
    ("training", "--lr", float, "peak learning rate (3e-3)"),
    ("training", "--weight-decay", float, "AdamW weight decay (0)"),
    ("training", "--warmup-steps", int, "linear warmup (30)"),
    ("training", "--eval-size", int, "held-out sequences (1000)"),
    ("training", "--eval-every", int, "evaluate every N steps (50)"),
    ("training", "--save-every", int, "checkpoint every N steps (0: at the end only)"),
)
# The field a FIELD_OPTIONS flag overrides has the flag's name (``--ffn-dim``: ``ffn_dim``), but
# for these.
FIELD_RENAMES = {"layers": "num_layers", "heads": "num_heads"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``lab`` options to ``parser`` (unset options take the task's defaults)."""
    g = parser.add_argument_group("task and output")
    g.add_argument(
        "--task",
        default="reverse",
        metavar="NAME",
        help=f"built-in task: {', '.join(TASK_DEFAULTS)} (default: reverse)",
    )
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output directory (default: runs/lab-TASK[-compare-pe])",
    )
    g.add_argument("--seed", type=int, default=None, help="seed of the model and data (0)")
    g.add_argument(
        "--compare-pe",
        action="store_true",
        help="train with no, sinusoidal and rotary positions and compare them",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out (model, optimizer, step, RNG)",
    )
    g.add_argument("--no-report", action="store_true", help="skip report.html and figures/")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    m = parser.add_argument_group("model (defaults: the task's preset)")
    m.add_argument(
        "--positions",
        choices=("none", "sinusoidal", "rope"),
        default=None,
        help="position scheme (sinusoidal)",
    )
    t = parser.add_argument_group("training")
    groups = {"model": m, "training": t}
    for group, flag, kind, text in FIELD_OPTIONS:
        groups[group].add_argument(flag, type=kind, default=None, help=text)
    t.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="compute device (CUDA if available)"
    )
    t.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="compute dtype; bfloat16 runs the forward passes under torch.autocast (float32)",
    )
    t.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard parameters, gradients and optimizer state (FSDP2) "
        "instead of replicating them (DDP)",
    )
    t.add_argument(
        "--context-parallel",
        action="store_true",
        help="under torchrun: shard each training sequence over the processes (ring "
        "attention) instead of the batch",
    )
    t.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="under torchrun: how long a process waits for the others before the job ends (120)",
    )
    t.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per process (1: fastest for these small models)",
    )


def _config(args: argparse.Namespace) -> LabConfig:
    from attnkit.lab.tasks import TASKS
    from attnkit.lab.train import LabConfig, with_overrides

    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}; valid tasks: {', '.join(TASKS)}")
    base = with_overrides(LabConfig(task=args.task), **TASK_DEFAULTS[args.task])
    fields: dict[str, object] = {}
    for _, flag, _, _ in FIELD_OPTIONS:
        dest = flag.removeprefix("--").replace("-", "_")  # where argparse stored the value
        fields[FIELD_RENAMES.get(dest, dest)] = getattr(args, dest)
    return with_overrides(
        base, seed=args.seed, positions=args.positions, dtype=args.dtype, **fields
    )


def run(args: argparse.Namespace) -> int:
    """Run the lab; returns 0 on success."""
    import torch

    from attnkit.lab.checkpoint import CheckpointError
    from attnkit.lab.distributed import DEFAULT_TIMEOUT_S, init_distributed, shutdown_distributed
    from attnkit.lab.runner import default_out_dir, run_lab

    config = _config(args)  # bad names and sizes fail here, before any process group exists
    out = args.out if args.out is not None else default_out_dir(config, compare_pe=args.compare_pe)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads or 1)
    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    ctx = init_distributed(args.device, timeout_s=timeout)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    failed = False
    try:
        if ctx.is_main:
            where = f" on {ctx.world_size} processes" if ctx.distributed else ""
            log(
                f"attnkit lab: task {config.task} ({config.make_task().description}), "
                f"{config.positions} positions, {config.steps} steps{where} -> {out}"
            )
        metrics = run_lab(
            config,
            out_dir=out,
            resume=args.resume,
            compare_pe=args.compare_pe,
            report=not args.no_report,
            ctx=ctx,
            progress=not args.no_progress,
            log=log,
            fsdp=args.fsdp,
            context_parallel=args.context_parallel,
        )
    except CheckpointError as err:
        raise CheckpointError(f"{err}: delete it to start over, or run without --resume") from err
    except RuntimeError as err:  # torch.distributed.DistBackendError is one
        if not (ctx.distributed and _lost_contact(err)):
            raise
        failed = True
        reason = " ".join(str(err).split())[:300]
        print(
            f"attnkit lab: error: rank {ctx.rank} of {ctx.world_size}: the process group "
            f"failed ({type(err).__name__}: {reason}). Another process stopped, or did not "
            f"answer within the {timeout:g} s timeout (--timeout); this process ends too. "
            f"Restart with --resume to continue from the last complete checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        if not failed:  # a broken group may not shut down cleanly: the process just exits
            shutdown_distributed(ctx)
    if ctx.is_main:
        print(
            f"eval_accuracy {metrics['eval_accuracy']:.4f}  "
            f"train_time {metrics['train_time_s']:.1f} s  "
            f"total {metrics['total_time_s']:.1f} s"
        )
        if "compare_pe" in metrics:
            print(
                "compare_pe " + "  ".join(f"{k} {v:.4f}" for k, v in metrics["compare_pe"].items())
            )
        print(f"metrics: {out / 'metrics.json'}")
        if "report" in metrics:
            print(f"report:  {out / metrics['report']}")
        if metrics.get("explorers"):
            print(f"explorer: {out / next(iter(metrics['explorers'].values()))}")
    return 0


def _lost_contact(err: BaseException) -> bool:
    """Whether ``err`` says the process group broke (a peer died or timed out)."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(s in text for s in ("gloo", "Connection", "onnection reset", "timed out",
                                   "Timed out", "NCCL", "Socket", "socket"))  # fmt: skip
