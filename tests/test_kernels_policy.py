"""The kernel policy (``attnkit.kernels.policy``): environment overrides, measured choices cached
per machine (atomically) and reused, retuning, the rule where a measurement cannot be made, and
the ``attnkit kernels`` command that shows it all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from attnkit import cli
from attnkit.commands import kernels as command
from attnkit.kernels import build, policy, probe, tuning

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache folder, and the process's decisions forgotten before and after."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    policy.reset()
    yield tmp_path
    policy.reset()


def _choice(
    monkeypatch: pytest.MonkeyPatch,
    calls: list[str],
    *,
    fast: str = "b",
    fail: bool = False,
    name: str = "test.pick",
) -> policy.Choice:
    """A measured choice between ``a`` (the rule's) and ``b``, whose candidates record their
    set-ups in ``calls``; ``fast`` is the one that sleeps least, ``fail`` makes the set-up fail."""

    def candidates() -> dict[str, Callable[[], Any]]:
        calls.append("setup")
        if fail:
            raise RuntimeError("this candidate cannot run here")
        slow = {"a": 0.004, "b": 0.004}
        slow[fast] = 0.0
        return {k: (lambda t=t: _sleep(t)) for k, t in slow.items()}

    choice = policy.Choice(name, ("a", "b"), "a test choice", lambda caps: "a", candidates)
    monkeypatch.setitem(tuning._CHOICES, name, choice)
    return choice


def _sleep(seconds: float) -> None:
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_an_environment_variable_names_the_option(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _choice(monkeypatch, calls)
    assert policy.env_var("test.pick") == "ATTNKIT_KERNEL_TEST_PICK"
    monkeypatch.setenv("ATTNKIT_KERNEL_TEST_PICK", "a")
    made = policy.decision("test.pick")
    assert (made.option, made.source, made.seconds) == ("a", "environment", {})
    assert policy.choose("test.pick") == "a" and calls == []  # (nothing measured)
    monkeypatch.setenv("ATTNKIT_KERNEL_TEST_PICK", "c")
    with pytest.raises(ValueError, match=r"ATTNKIT_KERNEL_TEST_PICK='c'.*options: a, b"):
        policy.choose("test.pick")
    monkeypatch.setenv("ATTNKIT_KERNEL_LINEAR_INT8", "fastest")
    with pytest.raises(ValueError, match="ATTNKIT_KERNEL_LINEAR_INT8='fastest'"):
        policy.choose("linear.int8")
    with pytest.raises(ValueError, match="unknown kernel choice 'nope'"):
        policy.choose("nope")


def test_a_measured_choice_is_cached_atomically_and_reused(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _choice(monkeypatch, calls, fast="b")
    made = policy.decision("test.pick")
    assert (made.option, made.source) == ("b", "measured") and calls == ["setup"]
    assert set(made.seconds) == {"a", "b"} and made.seconds["b"] < made.seconds["a"]
    file = policy.tune_file()
    assert file.parent == fresh / "policy"
    assert [p.name for p in file.parent.iterdir()] == [file.name]  # (no temporary left)
    data = json.loads(file.read_text())
    assert data["choices"]["test.pick"]["option"] == "b"
    assert data["machine"]["cores"] >= 1
    # the next process (decisions forgotten) reads the cache: no measurement
    policy.reset()
    again = policy.decision("test.pick")
    assert (again.option, again.source) == ("b", "cached") and calls == ["setup"]
    assert again.seconds == pytest.approx(made.seconds)
    # a damaged cache is measured again (and rewritten whole)
    file.write_text("{not json")
    policy.reset()
    assert policy.decision("test.pick").source == "measured" and calls == ["setup"] * 2
    assert json.loads(file.read_text())["choices"]["test.pick"]["option"] == "b"


def test_retune_measures_again_and_rewrites_the_cache(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _choice(monkeypatch, calls, fast="b")
    assert policy.choose("test.pick") == "b"
    _choice(monkeypatch, calls, fast="a")  # (the machine changed its mind)
    assert policy.choose("test.pick") == "b"  # (decided: kept)
    (made,) = policy.retune(["test.pick"])
    assert (made.option, made.source) == ("a", "measured") and calls == ["setup"] * 2
    assert json.loads(policy.tune_file().read_text())["choices"]["test.pick"]["option"] == "a"
    policy.reset()
    assert policy.decision("test.pick").source == "cached"


def test_the_rule_answers_where_a_candidate_fails_or_while_compiling(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _choice(monkeypatch, calls, fail=True)
    made = policy.decision("test.pick")
    assert (made.option, made.source) == ("a", "rule") and calls == ["setup"]
    assert not policy.tune_file().exists()  # (a rule is not cached: measured next process)
    # not measured: pending, the rule's option
    _choice(monkeypatch, calls, name="test.later")
    made = policy.decision("test.later", measure=False)
    assert (made.option, made.source) == ("a", "pending") and calls == ["setup"]
    # a rule close to the fastest keeps its option (the margin)
    choice = _choice(monkeypatch, calls, name="test.close")
    monkeypatch.setitem(
        tuning._CHOICES, "test.close", policy.Choice(**{**choice.__dict__, "margin": 1e9})
    )
    assert policy.decision("test.close").option == "a"


def test_every_linear_choice_is_named_documented_and_its_rule_an_option() -> None:
    caps = probe.capabilities()
    names = set(policy.choices())
    for name in (
        "linear.float_dots",
        "linear.int8_dots",
        "linear.fp32_row",
        "linear.compiled_row.float32",
        "linear.compiled_row.bfloat16",
        "linear.fp32_prompt",
        "linear.bf16_prompt",
        "linear.int8",
        "linear.int4",
        "rows.norm_row",
    ):
        assert name in names
        choice = policy.choices()[name]
        assert choice.doc and choice.rule(caps) in choice.options


def test_the_plan_follows_the_environment(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, option in (
        ("LINEAR_FP32_ROW", "stream"),
        ("LINEAR_FP32_PROMPT", "onednn"),
        ("LINEAR_BF16_PROMPT", "upcast"),
        ("ROWS_NORM_ROW", "kernel"),
    ):
        monkeypatch.setenv(f"ATTNKIT_KERNEL_{name}", option)
    plan = policy.linear_plan()
    kernels = build.kernels_available()
    assert plan.kernels is kernels and plan.fp32_prompt_onednn and plan.bf16_upcast
    assert plan.fp32_row == ("stream" if kernels else "transposed")
    assert plan.norm_row_kernel is kernels and not plan.with_compiled
    assert policy.linear_plan() is plan  # (decided once)


def test_the_command_prints_every_choice(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["kernels", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"machine", "compilers", "kernels", "ops", "choices", "tune_file"}
    by_name = {c["name"]: c for c in data["choices"]}
    assert set(by_name) == set(policy.choices())
    for name, c in by_name.items():
        assert c["option"] in c["options"] and c["env"] == policy.env_var(name)
        assert c["source"] in ("environment", "measured", "cached", "rule", "pending")
        assert bool(c["seconds"]) <= (c["source"] in ("measured", "cached"))
    assert by_name["linear.compiled_row.float32"]["source"] == "rule"
    assert data["kernels"]["built"] is build.kernels_available()
    assert cli.main(["kernels"]) == 0
    text = capsys.readouterr().out
    for name in by_name:
        assert name in text and policy.env_var(name) in text
    assert ("built: " in text) is build.kernels_available()


def test_the_command_names_the_fallback_without_a_compiler(tmp_path: Path) -> None:
    """A fresh install on a machine without a C compiler: it says so, names what runs
    instead, and still shows every choice (in a new process: nothing built or decided)."""
    env = {**os.environ, "ATTNKIT_CACHE_DIR": str(tmp_path), "CC": "/nonexistent/cc"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    done = subprocess.run(
        [sys.executable, "-m", "attnkit", "kernels", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["kernels"]["built"] is False and data["ops"]["built"] is False
    assert data["kernels"]["fallback"] == command.KERNELS_FALLBACK
    why = data["kernels"]["why_not"]
    assert "/nonexistent/cc" in why or "needs Linux" in why or "CPU lacks" in why
    by_name = {c["name"]: c for c in data["choices"]}
    assert by_name["linear.int4"]["option"] == "dequantize"  # (no kernel: the float product)
    assert "stream" not in by_name["linear.fp32_row"]["seconds"]
    text = command.format_report(data)
    assert "not built" in text and command.KERNELS_FALLBACK in text
