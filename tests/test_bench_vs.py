"""``attnkit bench --vs`` and the progress bar of ``attnkit bench`` (tiny sizes)."""

from __future__ import annotations

import json
import sys

import pytest

from attnkit.bench import vs as bench_vs
from attnkit.cli import main


@pytest.mark.slow
def test_vs_quick_table_and_json(tmp_path, capsys):
    path = tmp_path / "vs.json"
    assert main(["bench", "--vs", "--quick", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # Optional peers are imported quietly: no native-library load failures between the rows.
    assert "Failed to load" not in out + captured.err
    report = json.loads(path.read_text())
    rows = {(r["job"], r["peer"]): r for r in report["rows"]}
    for job in ("window fwd", "window fwd+bwd", "documents fwd", "documents fwd+bwd"):
        r = rows[(job, "dense-mask SDPA")]
        assert r["attnkit_s"] > 0 and r["peer_s"] > 0
        assert abs(r["speedup"] - r["peer_s"] / r["attnkit_s"]) < 1e-12
        assert "max diff" in r["note"] and float(r["note"].rsplit(" ", 1)[1]) < 1e-4
        assert job in out
    flex_peer = "torch flex_attention (compiled)"  # not compiled in --quick without --flex
    for job in ("flex window fwd", "flex window first call", "flex alibi+causal fwd"):
        r = rows[(job, flex_peer)]
        assert r["attnkit_s"] > 0 and r["peer_s"] is None and "not asked" in r["note"]
    backward = rows[("flex window fwd+bwd", "SDPA dense mask")]
    assert backward["peer_s"] > 0 and float(backward["note"].rsplit(" ", 1)[1]) < 1e-4
    assert "flex window fwd+bwd" in out
    minilm = rows[("MiniLM encode", "sentence-transformers")]
    assert minilm["peer_s"] > 0 and float(minilm["note"].rsplit(" ", 1)[1]) < 1e-5
    decode = rows[("decode llama-tiny", "transformers LlamaForCausalLM")]
    assert (
        decode["attnkit_s"] > 0 and decode["peer_s"] > 0 and "same tokens: True" in decode["note"]
    )
    batched = rows[("decode llama-tiny batched", "transformers batched generate")]
    assert batched["peer_s"] > 0 and "same tokens: True" in batched["note"]
    assert batched["goal"] == 2.0
    first = rows[("first token llama-tiny bfloat16 P=16", "transformers LlamaForCausalLM")]
    assert first["peer_s"] > 0 and first["goal"] == 1.0 and "same first token" in first["note"]
    own = rows[("first token llama-tiny bf16 weights P=16", "attnkit fp32 weights")]
    fp32 = rows[("first token llama-tiny float32 P=16", "transformers LlamaForCausalLM")]
    assert own["peer_s"] == pytest.approx(fp32["attnkit_s"]) and fp32["goal"] is None
    lookup = rows[("speculative prompt lookup", "attnkit plain greedy")]
    assert lookup["attnkit_s"] > 0 and lookup["peer_s"] > 0 and "same tokens" in lookup["note"]
    assert report["config"]["attention"]["seq_len"] == 512 and report["machine"]["torch"]
    assert "x = peer time / attnkit time" in out


@pytest.mark.slow
def test_missing_peer_is_a_row_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import fails
    config = bench_vs.VsConfig(texts=2, long_words=5, repeats=1)
    (row,) = bench_vs.ROW_MAKERS["sentence"](config)
    assert row.peer_s is None and row.speedup is None and "peer skipped" in row.note
    assert "-" in bench_vs.format_vs_table([row], config).splitlines()[-1]


def test_target_says_by_how_much_a_goal_is_missed():
    row = bench_vs.VsRow("window fwd+bwd", "dense-mask SDPA", 1.0, 11.3, goal=12.0)
    assert row.target == ">= 12x: 6% short"
    assert bench_vs.VsRow("j", "p", 1.0, 12.5, goal=12.0).target == ">= 12x: met"
    assert bench_vs.VsRow("j", "p", 1.0, None, goal=1.0).target == ">= 1x"
    assert bench_vs.VsRow("j", "p", 1.0, 2.0).target == ""


def test_registered_rows_join_the_table(monkeypatch):
    monkeypatch.setattr(bench_vs, "ROW_MAKERS", {})
    bench_vs.register("decoding", lambda c: [bench_vs.VsRow("decode", "transformers", 0.5, 1.0)])
    (row,) = bench_vs.run_vs(bench_vs.VsConfig(), progress=False)
    assert row.speedup == 2.0
    table = bench_vs.format_vs_table([row], bench_vs.VsConfig())
    assert "decode" in table and "2.00" in table


@pytest.mark.slow
def test_default_bench_shows_a_progress_bar(capsys):
    argv = ["bench", "--seq-len", "64", "--cases", "window", "--heads", "1", "--head-dim", "8"]
    assert main([*argv, "--window", "8", "--repeats", "1", "--no-backward"]) == 0
    err = capsys.readouterr().err
    assert "attnkit bench" in err and "1/1" in err  # tqdm's counter


@pytest.mark.slow
def test_ring_rows_compare_two_processes_with_one():
    config = bench_vs.VsConfig(bench_vs.AttentionJob(heads=2, head_dim=8), repeats=1, ring_len=256)
    timing, memory = bench_vs.ROW_MAKERS["ring"](config)
    assert timing.job == "ring fwd+bwd 2 ranks" and timing.peer == "1 process"
    assert timing.attnkit_s > 0 and timing.peer_s > 0 and timing.goal is None
    assert memory.unit == "bytes" and memory.attnkit_s >= 0 and memory.peer_s >= 0
    assert memory.goal == pytest.approx(1 / 0.6) and memory.target.startswith(">= 1.67x")
    line = bench_vs.format_vs_table([memory], config).splitlines()[-1]
    assert "MiB" in line and "goal <= 0.6x one process" in line
