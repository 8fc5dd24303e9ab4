"""Where benchmark results go, and the record of the machine they were measured on.

Every benchmark writes its report as JSON with :func:`write_report`, which adds
:func:`machine` (CPU model, cores, threads, torch version, date) so that a table made from it can
name where it ran. Reports go to ``benchmarks/results/`` under the current folder unless a path
is given; the results pages are generated from that folder (:mod:`attnkit.bench.pages`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS",
    "bench_parser",
    "cpu_model",
    "machine",
    "parse_with_threads",
    "write_json",
    "write_report",
]

#: The folder reports go to by default, relative to the current folder.
RESULTS = Path("benchmarks") / "results"


def cpu_model() -> str:
    """The CPU's model name as the operating system reports it (``platform.processor()`` or the
    machine type where ``/proc/cpuinfo`` is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine a measurement runs on: ``cpu``, ``cores``, ``threads``, ``torch``,
    ``python``, ``platform``, ``date`` (UTC, ISO) and ``load`` (the one-minute load average
    when the report is written, where the system gives one: a shared machine's ratios move
    with it)."""
    import torch

    try:
        load: float | None = round(os.getloadavg()[0], 1)
    except (AttributeError, OSError):
        load = None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "load": load,
    }


def bench_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of ``python -m module``, described by the first line of its ``doc``."""
    description = doc.splitlines()[0] if doc else None
    return argparse.ArgumentParser(prog=f"python -m {module}", description=description)


def parse_with_threads(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser``'s arguments from ``argv``, with ``--threads N`` added and applied: torch's
    intra-op threads for the run (the count :func:`machine` records); unset or 0 leaves torch's
    choice."""
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return args


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_report(
    report: dict[str, Any],
    out: Path | None,
    name: str,
    line: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, Any]:
    """Print ``report``'s rows (``line`` of each, where given) and its notes, add the
    :func:`machine` record (unless it has one) and write it to ``out`` (default
    ``benchmarks/results/<name>``).

    Returns:
        The report as written.
    """
    if line is not None:
        for row in report["rows"]:
            print(line(row))
    for note in report.get("notes", []):
        print(f"note: {note}")
    report = {"machine": machine(), **report} if "machine" not in report else report
    path = out or RESULTS / name
    write_json(path, report)
    print(f"wrote {path}")
    return report
