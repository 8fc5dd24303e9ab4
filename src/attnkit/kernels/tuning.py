"""The machinery of attnkit's kernel choices: named choices, environment overrides, and
measurements made once per machine and cached.

A choice is a named :class:`Choice` with a few options. :func:`choose` answers it:

1. an environment variable ``ATTNKIT_KERNEL_<NAME>`` (upper case, ``-`` and ``.`` as ``_``)
   naming one of its options wins (for experiments and for pinning a machine);
2. else, for a *measured* choice, the option that ran fastest in a short timing of its
   candidates on this machine, made once at first use and cached in
   ``<cache dir>/policy/<machine key>-<code key>.json`` beside the compiled kernels (machine
   key: the CPU, its flags, the core count and the torch version, :attr:`Capabilities.key`;
   code key: the kernel package's sources, so changed kernels are measured again);
3. else the choice's rule over :func:`attnkit.kernels.probe.capabilities`.

The choices themselves, and the functions the rest of attnkit asks, are in
:mod:`attnkit.kernels.policy`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
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
    "declare",
    "env_var",
    "on_reset",
    "register",
    "reset",
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
        margin: How many times faster another candidate must run than the rule's option to be
            chosen instead (1.0: the fastest wins; more keeps the rule's option where the two
            are close, through timing noise).
    """

    name: str
    options: tuple[str, ...]
    doc: str
    rule: Callable[[Capabilities], str]
    candidates: Callable[[], Mapping[str, Callable[[], Any]]] | None = None
    margin: float = 1.0


@dataclass(frozen=True)
class Decision:
    """How a choice was answered on this machine.

    Attributes:
        name: The choice's name.
        option: The option chosen.
        source: ``"environment"``, ``"measured"``, ``"cached"`` or ``"rule"``; ``"pending"``
            for a measured choice asked with ``measure=False`` before it was measured (the
            option is the rule's until then).
        seconds: For a measured choice, the seconds of each candidate timed (the fastest call).
    """

    name: str
    option: str
    source: str
    seconds: dict[str, float] = field(default_factory=dict)


_CHOICES: dict[str, Choice] = {}
_DECIDED: dict[str, Decision] = {}
_LOCK = threading.RLock()
_FORGET: list[Callable[[], None]] = []


def register(choice: Choice) -> Choice:
    """Add ``choice`` to the policy (modules of this package call it at import)."""
    if choice.name in _CHOICES:
        raise ValueError(f"kernel choice {choice.name!r} is registered twice")
    if not choice.options:
        raise ValueError(f"kernel choice {choice.name!r} has no options")
    _CHOICES[choice.name] = choice
    return choice


def declare(
    name: str,
    options: tuple[str, ...],
    doc: str,
    rule: Callable[[Capabilities], str],
    candidates: Callable[[], Mapping[str, Callable[[], Any]]] | None = None,
    *,
    margin: float = 1.0,
) -> Choice:
    """:func:`register` the :class:`Choice` of these fields."""
    return register(Choice(name, options, doc, rule, candidates, margin))


def choices() -> dict[str, Choice]:
    """Every registered choice by name."""
    return dict(_CHOICES)


def env_var(name: str) -> str:
    """The environment variable that overrides the choice ``name``."""
    return "ATTNKIT_KERNEL_" + name.upper().replace(".", "_").replace("-", "_")


@functools.cache
def _code_key() -> str:
    """A short hash of the kernel package's sources (Python and C): the candidates a choice
    times change with them, so a cached measurement is kept only for the code that made it."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*package.glob("*.py"), *(package / "csrc").glob("*.*")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:8]


def tune_file() -> Path:
    """The file this machine's measured choices are cached in (named by the machine's key and
    the kernel code's)."""
    return cache_dir() / "policy" / f"{capabilities().key}-{_code_key()}.json"


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


def _time(calls: Mapping[str, Callable[[], Any]], rounds: int = 7) -> dict[str, float]:
    """The fastest of a few timed calls of each candidate, in seconds: one warm-up each, then
    interleaved rounds (neighbours in time share the machine's load). The minimum, not the
    median: another process's work only ever adds time, and on a busy machine a thread pool
    that waits for a descheduled thread can add more than the call itself takes."""
    with torch.no_grad():
        for call in calls.values():
            call()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - start)
    return {name: min(times) for name, times in samples.items()}


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
    ruled = choice.rule(capabilities())

    def best(seconds: dict[str, float]) -> str:
        fastest = min(seconds, key=seconds.__getitem__)
        if ruled in seconds and seconds[ruled] <= choice.margin * seconds[fastest]:
            return ruled
        return fastest

    try:
        seconds = _time(calls)
        if best(seconds) != ruled:  # (confirmed by a second timing before the rule is left)
            again = _time(calls)
            seconds = {name: min(t, again[name]) for name, t in seconds.items()}
    except Exception:  # (a candidate that fails here is not eligible: the rule stands)
        return None
    return Decision(choice.name, best(seconds), "measured", seconds)


def decision(name: str, *, measure: bool = True) -> Decision:
    """How the choice ``name`` is answered here (deciding it now if it was not yet; with
    ``measure=False`` a measured choice neither measured nor cached is not measured: its
    decision is the rule's, with source ``"pending"``)."""
    try:
        choice = _CHOICES[name]
    except KeyError:
        known = ", ".join(sorted(_CHOICES))
        raise ValueError(f"unknown kernel choice {name!r} (known: {known})") from None
    forced = os.environ.get(env_var(name))
    if forced:
        if forced not in choice.options:
            raise ValueError(
                f"{env_var(name)}={forced!r} is not an option of {name!r} "
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
        elif not measure:
            return Decision(name, choice.rule(capabilities()), "pending")
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


def on_reset(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever decisions are forgotten (:func:`reset`, :func:`retune`): for
    records derived from decisions, such as the policy's plans."""
    _FORGET.append(forget)


def reset() -> None:
    """Forget this process's decisions (the cache file stays): the next question decides again,
    reading the environment and the cache."""
    with _LOCK:
        _DECIDED.clear()
        for forget in _FORGET:
            forget()


def retune(names: list[str] | None = None) -> list[Decision]:
    """Measure the measured choices again (all, or ``names``) and rewrite the cache."""
    targets = [n for n in (names or list(_CHOICES)) if _CHOICES[n].candidates is not None]
    with _LOCK:
        for forget in _FORGET:
            forget()
        tuned = _read_tuned()
        for name in targets:
            _DECIDED.pop(name, None)
            tuned.pop(name, None)
        _write_tuned(tuned)
    return [decision(name) for name in targets]
