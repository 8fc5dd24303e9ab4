"""attnkit.bench.pages: the results pages and the README's table come from the benchmark JSON,
and the committed ones are what the committed JSON gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnkit.bench import pages
from attnkit.bench.results import machine, write_report

ROOT = Path(__file__).resolve().parents[1]
MACHINE = {
    "cpu": "Test CPU 9000",
    "cores": 4,
    "threads": 4,
    "torch": "2.13.0",
    "date": "2026-01-02",
}


def _vs_report() -> dict[str, object]:
    def row(job: str, peer: str, ours: float, theirs: float | None, unit: str = "s") -> dict:
        speedup = None if theirs is None else theirs / ours
        return {"job": job, "peer": peer, "attnkit_s": ours, "peer_s": theirs, "note": "n",
                "goal": None, "unit": unit, "speedup": speedup, "target": ""}  # fmt: skip

    return {
        "kind": "vs",
        "machine": MACHINE,
        "config": {},
        "rows": [
            row("window fwd", "dense-mask SDPA", 0.010, 0.150),
            row("window fwd", "FlexAttention (compiled)", 0.010, None),
            row("decode llama-135m compile", "transformers LlamaForCausalLM", 1.0, 2.5),
            row("ring memory 2 ranks", "1 process", 2**20, 2**21, "bytes"),
            row("MiniLM encode", "sentence-transformers", 0.5, 1.0),
        ],
    }


def _records() -> dict[str, object]:
    return {
        "machines": {"old": {"cpu": "Old CPU", "cores": 2, "torch": "2.13"}},
        "tables": [
            {"id": "earlier-01", "topic": "quantization", "section": "A round", "machine": "old",
             "date": "2025-12-31", "context": "What ran.", "columns": ["weights", "x"],
             "rows": [["int8", "3.10x"], ["int4 | packed", "5.00x"]]},
        ],
    }  # fmt: skip


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "vs.json").write_text(json.dumps(_vs_report()))
    (folder / "earlier.json").write_text(json.dumps(_records()))
    tried = {"items": [{"topic": "core", "tried": "Three passes", "outcome": "0.9x",
                        "machine": "old"}], "machines": _records()["machines"]}  # fmt: skip
    (folder / "tried.json").write_text(json.dumps(tried))
    return folder


def test_pages_carry_every_table_with_its_machine(tmp_path: Path) -> None:
    got = pages.render_pages(_folder(tmp_path))
    assert set(got) == {f"{t}.md" for t in pages.TOPICS} | {"tried.md"}
    structured = got["structured.md"]
    assert "*Machine: Test CPU 9000, 4 cores, 4 threads, torch 2.13.0, 2026-01-02*" in structured
    # 0.150 / 0.010 = 15x, and the peer that could not run is a dash, not a figure
    assert "| window fwd | 10.0 ms | dense-mask SDPA | 150.0 ms | 15.00x | - | n |" in structured
    assert "| window fwd | 10.0 ms | FlexAttention (compiled) | - | - | - | n |" in structured
    assert "| ring memory 2 ranks | 1.0 MiB | 1 process | 2.0 MiB | 2.00x |" in got["long.md"]
    assert "decode llama-135m compile" in got["decoding.md"]
    assert "MiniLM encode" in got["peers.md"]
    quant = got["quantization.md"]
    assert "## Earlier rounds" in quant and "### A round" in quant
    assert "*Machine: Old CPU, 2 cores, torch 2.13, 2025-12-31*" in quant
    assert "| int4 \\| packed | 5.00x |" in quant  # a cell's pipe does not split the row
    assert "No results yet." in got["core.md"]
    assert "- Three passes: 0.9x (Old CPU)." in got["tried.md"]


def test_bf16_gains_table_divides_each_gain_by_torchs(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    rows = [
        {"impl": "torch causal SDPA", "mode": "fwd", "fp32_s": 0.2, "bf16_s": 0.1, "speedup": 2.0,
         "bf16_max_err": 0.01, "speedup_vs_torch": 1.0},
        {"impl": "attnkit window", "mode": "fwd", "fp32_s": 0.03, "bf16_s": 0.01, "speedup": 3.0,
         "bf16_max_err": 0.02, "speedup_vs_torch": 1.5},
    ]  # fmt: skip
    config = {"n": 64, "kernels": {"attention.bf16_backward": "flash"}}
    report = {"machine": MACHINE, "config": config, "rows": rows}
    (folder / "structured_bf16.json").write_text(json.dumps(report))
    structured = pages.render_pages(folder)["structured.md"]
    assert "## What bf16 gains over fp32" in structured
    assert "| attnkit window | fwd | 30.0 | 10.0 | 3.00x | 1.50x | 2.0e-02 |" in structured
    assert "N=64" in structured and "bf16_backward flash" in structured


def test_readme_table_picks_one_figure_per_headline(tmp_path: Path) -> None:
    tables, _ = pages.load_tables(_folder(tmp_path))
    headlines = (
        pages.Headline("window", "dense SDPA", "vs-structured",
                       {"job": "window fwd", "peer": "dense-mask SDPA"}, "x"),
        pages.Headline("int8", "transformers", "earlier-01", {"weights": "int8"}, "x"),
    )  # fmt: skip
    table = pages.readme_table(tables, headlines)
    lines = table.splitlines()
    assert lines[2] == "| window | dense SDPA | 15.00x | Test CPU 9000, 4 cores, 2026-01-02 |"
    assert lines[3] == "| int8 | transformers | 3.10x | Old CPU, 2 cores, 2025-12-31 |"
    missing = (pages.Headline("w", "p", "vs-structured", {"job": "nope"}, "x"),)
    with pytest.raises(ValueError, match="0 rows"):
        pages.readme_table(tables, missing)
    with pytest.raises(ValueError, match="no table 'gone'"):
        pages.readme_table(tables, (pages.Headline("w", "p", "gone", {}, "x"),))
    older = pages.Headline("int8", "transformers", "gone", {}, "x", headlines[1])
    assert pages.readme_table(tables, (older,)).splitlines()[2] == lines[3]
    readme = f"a\n{pages.README_START}\nold\n{pages.README_END}\nb\n"
    assert pages.update_readme(readme, table) == (
        f"a\n{pages.README_START}\n{table}{pages.README_END}\nb\n"
    )
    with pytest.raises(ValueError, match="markers"):
        pages.update_readme("no markers", table)


def test_unknown_topic_is_an_error(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    bad = _records()
    bad["tables"][0]["topic"] = "gossip"  # type: ignore[index]
    (folder / "earlier.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="gossip"):
        pages.load_tables(folder)


def test_reports_name_their_machine(tmp_path: Path) -> None:
    report = write_report({"rows": [1]}, tmp_path / "r.json", "r.json")
    written = json.loads((tmp_path / "r.json").read_text())
    assert written == report and written["rows"] == [1]
    assert set(written["machine"]) >= {"cpu", "cores", "torch", "date"}
    assert written["machine"]["torch"] == machine()["torch"]


def test_reports_print_a_line_per_row_before_their_notes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = {"rows": [{"x": 1}, {"x": 2}], "notes": ["n"]}
    write_report(report, tmp_path / "r.json", "r.json", lambda r: f"x = {r['x']}")
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["x = 1", "x = 2", "note: n", f"wrote {tmp_path / 'r.json'}"]


def test_committed_pages_are_what_the_committed_json_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert pages.main(["--check"]) == 0
