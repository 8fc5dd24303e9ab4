"""``attnkit lab``: train a small transformer on a built-in task and write a report.

With no arguments it learns to reverse sequences of 16 symbols (well under a minute on a laptop
CPU) and writes ``runs/lab-reverse/{metrics.json,report.html,checkpoint.safetensors}``.
``--compare-pe`` trains the same encoder without positions, with sinusoidal and with rotary
positions. Under ``torchrun --nproc_per_node=N -m attnkit lab ...`` it trains data-parallel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Task-specific defaults on top of LabConfig's (which are tuned for reverse). Kept here, not in
# the library, so that the Python API has one set of defaults.
TASK_DEFAULTS: dict[str, dict[str, object]] = {
    "reverse": {},
    "copy": {},
    "sort": {"steps": 1000, "seq_len": 12},
    "recall": {"steps": 1000, "seq_len": 10, "num_symbols": 8, "batch_size": 128},
}


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
    m.add_argument("--dim", type=int, default=None, help="model dim D (64)")
    m.add_argument("--layers", type=int, default=None, help="encoder blocks (2)")
    m.add_argument("--heads", type=int, default=None, help="attention heads (4)")
    m.add_argument("--ffn-dim", type=int, default=None, help="feed-forward width (128)")
    m.add_argument("--dropout", type=float, default=None, help="dropout (0)")
    m.add_argument("--seq-len", type=int, default=None, help="training sequence length (16)")
    m.add_argument("--num-symbols", type=int, default=None, help="alphabet size (10)")
    m.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="positions in the tables, for the length tests (4 x seq-len)",
    )

    t = parser.add_argument_group("training")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (400 for reverse)")
    t.add_argument(
        "--batch-size", type=int, default=None, help="global batch, split over processes (64)"
    )
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (3e-3)")
    t.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay (0)")
    t.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (30)")
    t.add_argument("--eval-size", type=int, default=None, help="held-out sequences (1000)")
    t.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (50)")
    t.add_argument(
        "--save-every", type=int, default=None, help="checkpoint every N steps (0: at the end only)"
    )
    t.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="compute device (CUDA if available)"
    )
    t.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per process (1: fastest for these small models)",
    )


def _config(args: argparse.Namespace):  # -> LabConfig
    from attnkit.lab.tasks import TASKS
    from attnkit.lab.train import LabConfig, with_overrides

    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}; valid tasks: {', '.join(TASKS)}")
    base = with_overrides(LabConfig(task=args.task), **TASK_DEFAULTS[args.task])
    return with_overrides(
        base,
        seed=args.seed,
        positions=args.positions,
        dim=args.dim,
        num_layers=args.layers,
        num_heads=args.heads,
        ffn_dim=args.ffn_dim,
        dropout=args.dropout,
        seq_len=args.seq_len,
        num_symbols=args.num_symbols,
        max_seq_len=args.max_seq_len,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        eval_size=args.eval_size,
        eval_every=args.eval_every,
        save_every=args.save_every,
    )


def run(args: argparse.Namespace) -> int:
    """Run the lab; returns 0 on success."""
    import torch

    from attnkit.lab.distributed import init_distributed, shutdown_distributed
    from attnkit.lab.runner import default_out_dir, run_lab

    config = _config(args)  # bad names and sizes fail here, before any process group exists
    out = args.out if args.out is not None else default_out_dir(config, compare_pe=args.compare_pe)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads or 1)
    ctx = init_distributed(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

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
        )
    finally:
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
    return 0
