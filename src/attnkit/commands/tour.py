"""``attnkit tour --out DIR``: measure every claim of the blog on attnkit's own modules.

Writes ``DIR/report.html`` (the claims in the blog's order, each with its verdict, numbers and
figure), ``DIR/claims.json`` (``id``, ``claim``, ``passed``, ``measured``, ``figure`` per claim),
the figures under ``DIR/figures/`` and ``DIR/explorer.html`` (the trained model of claim 10 in the
interactive explorer). Prints one line per claim; exits with 1 if any claim fails.

Needs the ``lab`` extra (matplotlib, tqdm).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tour`` options to ``parser``."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("tour"),
        help="directory for report.html, claims.json, figures/ and explorer.html (default: tour)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the tour; print each claim's verdict and the report's path. 1 if a claim fails."""
    from attnkit.tour import run_tour

    results = run_tour(args.out, log=print)
    print(args.out / "report.html")
    print(args.out / "claims.json")
    failed = [r.id for r in results if not r.passed]
    print(
        f"{len(results) - len(failed)} of {len(results)} claims pass"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0
