"""Every kernel choice attnkit makes, in one place: rules from the probed capabilities, and
measurements where the better kernel depends on the machine.

A choice is a named :class:`Choice` with a few options. :func:`choose` answers it:

1. an environment variable ``ATTNKIT_KERNEL_<NAME>`` (upper case, ``-`` and ``.`` as ``_``)
   naming one of its options wins (for experiments and for pinning a machine);
2. else, for a *measured* choice, the option that ran fastest in a short timing of its
   candidates on this machine, made once at first use and cached in
   ``<cache dir>/policy/<machine key>.json`` beside the compiled kernels (machine key: the CPU,
   its flags, the core count and the torch version, :attr:`Capabilities.key`);
3. else the choice's rule over :func:`attnkit.kernels.probe.capabilities`.

``attnkit kernels`` prints the capabilities, the kernels built, and every choice with the
timings it was made on; ``attnkit kernels --retune`` measures again. Callers in the rest of the
package ask a named function of this module (``policy.<something>(...)``) and never test CPU
features themselves. Measuring never happens inside ``torch.compile`` tracing: a choice a
compiled graph needs is asked before it traces (or reads its rule).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnkit.kernels.probe import Capabilities, cache_dir, capabilities

__all__ = [
    "Choice",
    "Decision",
    "choices",
    "choose",
    "decision",
    "register",
    "retune",
    "tune_file",
]

#: Version of the tune file's layout; a file of another version is measured again.
_TUNE_FORMAT = 1


@dataclass(frozen=True)
class Choice:
    """A kernel choice: its options, why it exists, and how it is decided.

    Attributes:
        name: Short dotted name (``linear.fp32_row``); ``ATTNKIT_KERNEL_LINEAR_FP32_ROW``
            overrides it.
        options: The options, in order of preference where a rule cannot decide.
        doc: One or two sentences: what is chosen and why it depends on the machine.
        rule: The option from the capabilities alone (always defined: it is the answer where
            measuring is impossible, e.g. while tracing, and the fallback of a failed timing).
        candidates: For a measured choice, a function returning one zero-argument callable per
            option to time (options it leaves out are not eligible on this machine), or None.
    """

    name: str
    options: tuple[str, ...]
    doc: str
    rule: Callable[[Capabilities], str]
    candidates: Callable[[], Mapping[str, Callable[[], Any]]] | None = None


@dataclass(frozen=True)
class Decision:
    """How a choice was answered on this machine.

    Attributes:
        name: The choice's name.
        option: The option chosen.
        source: ``"environment"``, ``"measured"``, ``"cached"`` or ``"rule"``.
        seconds: For a measured choice, the median seconds of each candidate timed.
    """

    name: str
    option: str
    source: str
    seconds: dict[str, float] = field(default_factory=dict)


_CHOICES: dict[str, Choice] = {}
_DECIDED: dict[str, Decision] = {}
_LOCK = threading.RLock()


def register(choice: Choice) -> Choice:
    """Add ``choice`` to the policy (modules of this package call it at import)."""
    if choice.name in _CHOICES:
        raise ValueError(f"kernel choice {choice.name!r} is registered twice")
    if not choice.options:
        raise ValueError(f"kernel choice {choice.name!r} has no options")
    _CHOICES[choice.name] = choice
    return choice


def choices() -> dict[str, Choice]:
    """Every registered choice by name."""
    return dict(_CHOICES)


def _env_name(name: str) -> str:
    return "ATTNKIT_KERNEL_" + name.upper().replace(".", "_").replace("-", "_")


def tune_file() -> Path:
    """The file this machine's measured choices are cached in."""
    return cache_dir() / "policy" / f"{capabilities().key}.json"


def _read_tuned() -> dict[str, Any]:
    try:
        data = json.loads(tune_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _TUNE_FORMAT:
        return {}
    tuned = data.get("choices")
    return tuned if isinstance(tuned, dict) else {}


def _write_tuned(tuned: Mapping[str, Any]) -> None:
    """Write the cache atomically (a reader sees the old file or the new one, never half)."""
    caps = capabilities()
    path = tune_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": _TUNE_FORMAT,
            "machine": {
                "cpu": caps.cpu,
                "cores": caps.cores,
                "flags": sorted(caps.flags),
                "torch": caps.torch_version,
            },
            "choices": dict(tuned),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # (a read-only cache: the choice still holds for this process)
        pass


def _time(calls: Mapping[str, Callable[[], Any]], rounds: int = 5) -> dict[str, float]:
    """Median seconds per call of each candidate: one warm-up each, then interleaved rounds
    (neighbours in time share the machine's load, so their ratio is fair on a busy machine)."""
    with torch.no_grad():
        for call in calls.values():
            call()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def _measure(choice: Choice) -> Decision | None:
    assert choice.candidates is not None
    try:
        calls = dict(choice.candidates())
    except Exception:  # (a candidate that cannot be set up here is not eligible)
        return None
    calls = {name: call for name, call in calls.items() if name in choice.options}
    if len(calls) < 2:
        only = next(iter(calls), None)
        return None if only is None else Decision(choice.name, only, "measured")
    try:
        seconds = _time(calls)
    except Exception:
        return None
    best = min(seconds, key=seconds.__getitem__)
    return Decision(choice.name, best, "measured", seconds)


def decision(name: str) -> Decision:
    """How the choice ``name`` is answered here (deciding it now if it was not yet)."""
    try:
        choice = _CHOICES[name]
    except KeyError:
        known = ", ".join(sorted(_CHOICES))
        raise ValueError(f"unknown kernel choice {name!r} (known: {known})") from None
    forced = os.environ.get(_env_name(name))
    if forced:
        if forced not in choice.options:
            raise ValueError(
                f"{_env_name(name)}={forced!r} is not an option of {name!r} "
                f"(options: {', '.join(choice.options)})"
            )
        return Decision(name, forced, "environment")
    done = _DECIDED.get(name)
    if done is not None:
        return done
    if choice.candidates is None or torch.compiler.is_compiling():
        made = Decision(name, choice.rule(capabilities()), "rule")
        if choice.candidates is None:
            _DECIDED[name] = made
        return made
    with _LOCK:
        done = _DECIDED.get(name)
        if done is not None:
            return done
        cached = _read_tuned().get(name)
        if isinstance(cached, dict) and cached.get("option") in choice.options:
            made = Decision(name, cached["option"], "cached", dict(cached.get("seconds", {})))
        else:
            made = _measure(choice) or Decision(name, choice.rule(capabilities()), "rule")
            if made.source == "measured":
                tuned = _read_tuned()
                tuned[name] = {"option": made.option, "seconds": made.seconds}
                _write_tuned(tuned)
        _DECIDED[name] = made
        return made


def choose(name: str) -> str:
    """The option of the choice ``name`` on this machine (see the module's docstring)."""
    return decision(name).option


def retune(names: list[str] | None = None) -> list[Decision]:
    """Measure the measured choices again (all, or ``names``) and rewrite the cache."""
    targets = [n for n in (names or list(_CHOICES)) if _CHOICES[n].candidates is not None]
    with _LOCK:
        tuned = _read_tuned()
        for name in targets:
            _DECIDED.pop(name, None)
            tuned.pop(name, None)
        _write_tuned(tuned)
    return [decision(name) for name in targets]
