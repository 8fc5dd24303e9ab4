"""One ``attnkit lab`` run: train (one model, or one per position scheme), evaluate, write files.

Only the main process writes: ``checkpoint.safetensors`` and ``config.json`` (per model),
``metrics.json`` and ``report.html`` with its ``figures/``.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from attnkit.lab import checkpoint as ckpt
from attnkit.lab.distributed import DistContext
from attnkit.lab.train import (
    POSITIONS,
    LabConfig,
    TrainResult,
    default_lengths,
    length_generalization,
    train,
)

__all__ = ["default_out_dir", "prepare_out_dir", "run_lab"]


def default_out_dir(config: LabConfig, *, compare_pe: bool = False) -> Path:
    """``runs/lab-<task>`` (``runs/lab-<task>-compare-pe`` for the comparison)."""
    return Path("runs") / (f"lab-{config.task}" + ("-compare-pe" if compare_pe else ""))


def prepare_out_dir(path: str | Path) -> Path:
    """Create ``path`` if needed and check that files can be written in it.

    Raises:
        ValueError: If the directory cannot be created or written (the message says why).
    """
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"cannot write to the output directory {str(out)!r}: {err.strerror or err}"
        ) from err
    return out


def _sizes(result: TrainResult, out: Path | None) -> dict[str, Any]:
    cfg = result.config
    task = cfg.make_task()
    sizes: dict[str, Any] = {
        "num_params": result.num_params,
        "vocab_size": task.vocab_size,
        "seq_len": cfg.seq_len,
        "dim": cfg.dim,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "ffn_dim": cfg.ffn_dim,
        "batch_size": cfg.batch_size,
        "train_sequences": result.step * cfg.batch_size,
        "eval_sequences": int(result.eval["sequences"]),
    }
    if out is not None and (out / ckpt.CHECKPOINT_NAME).is_file():
        sizes["checkpoint_bytes"] = (out / ckpt.CHECKPOINT_NAME).stat().st_size
    return sizes


def _summary(result: TrainResult) -> dict[str, Any]:
    return {
        "eval_accuracy": result.eval["accuracy"],
        "eval_sequence_accuracy": result.eval["sequence_accuracy"],
        "eval_loss": result.eval["loss"],
        "train_time_s": result.train_time_s,
        "steps": result.step,
    }


def run_lab(
    config: LabConfig,
    *,
    out_dir: str | Path,
    resume: bool = False,
    compare_pe: bool = False,
    report: bool = True,
    ctx: DistContext | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    fsdp: bool = False,
    context_parallel: bool = False,
) -> dict[str, Any]:
    """Train, evaluate and write ``metrics.json`` (and ``report.html``) into ``out_dir``.

    Args:
        config: The run. With ``compare_pe`` its ``positions`` picks the model whose attention
            maps the report shows; all three schemes are trained.
        out_dir: Output directory (written by the main process only).
        resume: Continue each model from its checkpoint in ``out_dir``.
        compare_pe: Train the same encoder with no, sinusoidal and rotary positions.
        report: Also write ``report.html`` and ``figures/``.
        ctx: Data-parallel context.
        progress: Show progress bars.
        log: Receives one-line messages (main process only).
        fsdp: Shard the model over the processes with FSDP2 (see :func:`train`).
        context_parallel: Shard each sequence over the processes (see :func:`train`).

    Returns:
        The metrics written to ``metrics.json`` (on every process).
    """
    ctx = ctx if ctx is not None else DistContext()
    say = log if (log is not None and ctx.is_main) else (lambda _msg: None)
    out = Path(out_dir)
    if ctx.is_main:
        prepare_out_dir(out)
        for stale in ckpt.remove_temp_files(out):
            say(f"removed {stale}, left by an interrupted run")
    ctx.barrier()
    started = time.perf_counter()

    def fit(cfg: LabConfig, where: Path) -> TrainResult:
        if ctx.is_main:
            where.mkdir(parents=True, exist_ok=True)
            for stale in ckpt.remove_temp_files(where):
                say(f"removed {stale}, left by an interrupted run")
        ctx.barrier()
        return train(
            cfg,
            out_dir=where,
            resume=resume,
            ctx=ctx,
            progress=progress,
            log=log,
            fsdp=fsdp,
            context_parallel=context_parallel,
        )

    compare: dict[str, TrainResult] | None = None
    if compare_pe:
        compare = {}
        for pe in POSITIONS:
            say(f"--compare-pe: training with positions={pe}")
            compare[pe] = fit(replace(config, positions=pe), out / f"pe-{pe}")
        result = compare[config.positions]
    else:
        result = fit(config, out)

    lengths = default_lengths(config)
    models = compare if compare is not None else {config.positions: result}
    length_table: dict[str, dict[int, float | None]] = {}
    if ctx.is_main:
        for name, res in models.items():
            length_table[name] = length_generalization(
                res.model,
                res.config.make_task(),
                lengths,
                size=min(500, config.eval_size),
                seed=config.seed,
            )

    metrics: dict[str, Any] = {
        "task": config.task,
        "description": config.make_task().description,
        "positions": config.positions,
        **_summary(result),
        "resumed_from": result.resumed_from,
        "sizes": _sizes(result, out if compare is None else out / f"pe-{config.positions}"),
        "config": config.to_dict(),
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "length_generalization": {
            name: {str(n): a for n, a in row.items()} for name, row in length_table.items()
        },
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    if compare is not None:
        metrics["compare_pe"] = {pe: res.eval["accuracy"] for pe, res in compare.items()}
        metrics["compare_pe_details"] = {pe: _summary(res) for pe, res in compare.items()}
    if ctx.is_main:
        if report:
            from attnkit.lab.report import ReportData, write_report

            path = write_report(
                out,
                ReportData(
                    result=result, metrics=metrics, length_table=length_table, compare=compare
                ),
            )
            metrics["report"] = path.name
        metrics["total_time_s"] = time.perf_counter() - started
        ckpt.write_json(out / "metrics.json", metrics)
    ctx.barrier()
    return metrics
