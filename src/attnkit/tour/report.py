"""The tour's run and its page: measure every claim, draw it, write the report.

:func:`run_tour` runs the checks of :mod:`attnkit.tour.claims` in the blog's order (then
today's variants), draws each
result with :mod:`attnkit.tour.figures` and writes ``report.html`` (the shared page shell of
:mod:`attnkit.pages`), ``claims.json``, one PNG per claim under ``figures/`` and ``explorer.html``:
the trained model of claim 10 in the interactive explorer (:mod:`attnkit.explorer`).

Needs matplotlib (the ``viz`` extra) for the figures and tqdm (``lab``) for the training.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from attnkit import viz
from attnkit.explorer import write_explorer
from attnkit.pages import figure, page
from attnkit.tour.claims import BLOG_ORDER, CHECKS, ClaimResult
from attnkit.tour.figures import draw

__all__ = ["run_tour"]

CSS = """
.pass{background:#2ca02c;color:#fff;padding:1px 6px;border-radius:3px}
.fail{background:#d62728;color:#fff;padding:1px 6px;border-radius:3px}
.verdict{color:#333}
"""


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch threads (tiny ops stall on oversubscribed cores), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_tour(out_dir: str | Path, *, log: Callable[[str], None] | None = None) -> list[ClaimResult]:
    """Measure the claims and write ``report.html``, ``claims.json``, figures and explorer.

    Args:
        out_dir: Directory to write (created).
        log: Called with one line per claim as it finishes.

    Returns:
        The results in the blog's order.
    """
    out = Path(out_dir)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    results: list[ClaimResult] = []
    entries = []
    explorer = None
    with _threads(1):
        for cid in BLOG_ORDER:
            t0 = time.perf_counter()
            res = CHECKS[cid]()
            if res.explorer is not None:
                tokens, weights = res.explorer
                explorer = write_explorer(
                    out / "explorer.html",
                    tokens,
                    weights,
                    title="Attention of the tour's trained model",
                    description="The reverse task, a held-out input: output i needs input n-1-i.",
                )
            name = f"figures/claim-{cid:02d}.png"
            viz.save_figure(draw(res), out / name)
            res.measured["seconds"] = round(time.perf_counter() - t0, 3)
            entries.append(res.to_dict(name))
            results.append(res)
            if log is not None:
                log(f"claim {cid:2d} {'PASS' if res.passed else 'FAIL'}: {res.verdict}")
    (out / "claims.json").write_text(
        json.dumps(sorted(entries, key=lambda e: e["id"]), indent=2), encoding="utf-8"
    )
    (out / "report.html").write_text(_report(out, results, explorer), encoding="utf-8")
    return results


def _claim(out: Path, r: ClaimResult, explorer: Path | None) -> str:
    """One claim's section: badge, claim, verdict, the explorer link (claim 10), the figure."""
    esc = html.escape
    name = f"figures/claim-{r.id:02d}.png"
    badge = '<span class="pass">PASS</span>' if r.passed else '<span class="fail">FAIL</span>'
    link = ""
    if r.explorer is not None and explorer is not None:
        link = (
            f'<p><a href="{esc(explorer.name)}"><b>Open the trained model in the interactive '
            "explorer</b></a>: hover a token to see where every head looks.</p>"
        )
    return (
        f'<section class="claim" id="claim-{r.id}" data-passed="{str(r.passed).lower()}">'
        f"<h3>{badge} Claim {r.id}. {esc(r.claim)}</h3>"
        f"<p class=verdict>Measured: {esc(r.verdict)}.</p>{link}"
        f"{figure(out / name, f'Figure of claim {r.id}.', file=name)}</section>"
    )


def _report(out: Path, results: Sequence[ClaimResult], explorer: Path | None) -> str:
    passed = sum(r.passed for r in results)
    parts = []
    section = None
    for r in results:
        if r.section != section:
            section = r.section
            parts.append(f"<h2>{html.escape(section)}</h2>")
        parts.append(_claim(out, r, explorer))
    body = (
        "<h1>A tour of <i>All you need for attention</i>, measured</h1>\n"
        "<p>Each claim of the blog is checked on attnkit's own modules: the blog's classes, the "
        "positional encodings, the models and a model trained by the lab; two more claims "
        "measure variants of today's models (soft-capping, qk-norm). "
        f"<b>{passed} of {len(results)}</b> claims pass. The numbers are in "
        '<a href="claims.json">claims.json</a>.</p>\n' + "\n".join(parts)
    )
    return page("attnkit tour: the blog's claims, measured", body, css=CSS)
