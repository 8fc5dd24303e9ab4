"""``python -m attnkit.bench.fused``: a quick run's report and the page table it gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnkit.bench import fused as bench_fused
from attnkit.bench import pages
from attnkit.kernels import build

pytestmark = pytest.mark.skipif(
    not build.kernels_available(), reason="attnkit's kernels are not built on this machine"
)


def test_a_quick_run_writes_rows_that_the_pages_show(tmp_path: Path) -> None:
    out = tmp_path / "fused.json"
    argv = ["--model", "llama-tiny", "--new", "4", "--repeats", "1", "--out", str(out)]
    assert bench_fused.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "fused" and "machine" in report
    rows = {r["kind"]: r for r in report["rows"]}
    assert set(rows) == set(bench_fused.KINDS)
    for r in rows.values():
        assert r["fused_ms"] > 0 and r["blocks_ms"] > 0
        assert r["speedup"] == pytest.approx(r["blocks_ms"] / r["fused_ms"])
    assert rows["fp32"]["identical"]  # (float32: the same kernels, within float rounding)
    (table,) = pages.load_tables(tmp_path)[0]
    assert table.topic == "decoding" and len(table.rows) == len(bench_fused.KINDS)
    assert table.rows[0][0] == "fp32"
