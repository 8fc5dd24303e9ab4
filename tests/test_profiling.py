"""attnkit.profiling's timers: what they call, in what order, and what they return.

Speeds are not tested here (the machine is shared): the timers are checked with work whose
duration is known from below (sleeps), and peak memory is exercised by ``benchmarks/``.
"""

from __future__ import annotations

import time

import pytest

from attnkit.profiling import best_time, matmul_flops_per_second, time_call, time_interleaved


def test_time_call_measures_the_call() -> None:
    assert time_call(lambda: time.sleep(0.02)) >= 0.02


def test_time_interleaved_runs_rounds_in_order() -> None:
    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    samples = time_interleaved(fns, repeats=3)
    assert calls == ["a", "b"] * 3  # one call of each per round, never a run of one kind
    assert list(samples) == ["a", "b"] and all(len(s) == 3 for s in samples.values())


def test_time_interleaved_keeps_each_implementation_apart() -> None:
    samples = time_interleaved({"fast": lambda: None, "slow": lambda: time.sleep(0.01)}, repeats=2)
    assert min(samples["slow"]) >= 0.01  # the sleeps are booked to "slow", not to "fast"
    assert sum(samples["fast"]) < sum(samples["slow"])


def test_best_time_warms_up_then_keeps_the_fastest() -> None:
    delays = iter([0.03, 0.02, 0.0, 0.01])  # the first call is the warm-up, not counted
    calls = []

    def work() -> None:
        calls.append(1)
        time.sleep(next(delays))

    best = best_time(work, min_runs=3, max_runs=3, budget_s=0.0)
    assert len(calls) == 4
    assert best < 0.01


def test_best_time_stops_at_max_runs() -> None:
    calls: list[int] = []
    best_time(lambda: calls.append(1), min_runs=2, max_runs=5, budget_s=60.0)
    assert len(calls) == 1 + 5


def test_matmul_rate_counts_two_n_cubed_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    import attnkit.profiling as profiling

    monkeypatch.setattr(profiling, "best_time", lambda fn, device, budget_s: (fn(), 0.5)[1])
    assert matmul_flops_per_second(size=64) == 2 * 64**3 / 0.5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: time_interleaved({"a": lambda: None}, repeats=0), "repeats must be >= 1, got 0"),
        (lambda: best_time(lambda: None, min_runs=0), "min_runs <= max_runs, got 0 and 50"),
        (lambda: best_time(lambda: None, min_runs=5, max_runs=2), "got 5 and 2"),
        (lambda: matmul_flops_per_second(size=0), "size must be >= 1, got 0"),
    ],
)
def test_bad_arguments_raise(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
