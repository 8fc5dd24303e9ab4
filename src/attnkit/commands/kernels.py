"""``attnkit kernels``: what this machine offers attnkit's kernels, and every kernel choice made.

Prints the capabilities the probe found (:mod:`attnkit.kernels.probe`), the compilers, whether
attnkit's C kernels and the C++ ops are built (where, or why not and what runs instead), and
every choice of :mod:`attnkit.kernels.policy`: the option taken, where it came from (an
environment variable, a measurement made now, the cache of an earlier one, or the rule), the
timings it was made on, and the variable that overrides it. ``--retune`` measures the measured
choices again (the compiled-row choices compile small graphs: tens of seconds); ``--json`` prints
the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: What runs where attnkit's C kernels are not built.
KERNELS_FALLBACK = "torch's kernels"
#: What compiled graphs' attnkit ops run where their C++ implementations are not built.
OPS_FALLBACK = "the ops' Python implementations (each call through the interpreter)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kernels`` options to ``parser``."""
    parser.add_argument(
        "--retune", action="store_true", help="measure the measured choices again (and cache them)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


#: Prefixes of the choices the command does not measure unasked: compiled decoding's, whose
#: timings compile graphs (a small model's step, for ``decoding.compiled_step.*``).
LAZY = ("linear.compiled_row.", "decoding.compiled_step.")


def report(*, retune: bool = False) -> dict[str, Any]:
    """This machine's kernels and choices as a JSON-ready dict (see the module's docstring).

    Builds the kernels and the ops where they were not built yet; measures the measured choices
    that are neither measured nor cached, except those of compiled decoding (:data:`LAZY`: they
    are measured when compiled decoding first runs, or with ``retune``).
    """
    from attnkit.kernels import build, policy, probe

    caps = probe.capabilities()
    kernels = build.kernels_available()
    ops = kernels and build.load_ops()
    if retune:
        policy.retune()
    choices = []
    for name, choice in policy.choices().items():
        made = policy.decision(name, measure=not name.startswith(LAZY))
        choices.append(
            {
                "name": name,
                "option": made.option,
                "source": made.source,
                "seconds": made.seconds,
                "options": list(choice.options),
                "measured": choice.candidates is not None,
                "env": policy.env_var(name),
                "doc": choice.doc,
            }
        )
    path, ops_path = build.kernels_path(), build.ops_path()
    return {
        "machine": {
            "cpu": caps.cpu,
            "machine": caps.machine,
            "system": caps.system,
            "cores": caps.cores,
            "threads": caps.threads,
            "torch": caps.torch_version,
            "flags": sorted(caps.flags),
            "features": caps.features(),
            "key": caps.key,
        },
        "compilers": {"c": caps.c_compiler, "cxx": caps.cxx_compiler},
        "cache_dir": str(probe.cache_dir()),
        "tune_file": str(policy.tune_file()),
        "kernels": {
            "built": kernels,
            "path": None if path is None else str(path),
            "why_not": build.kernels_unavailable(),
            "fallback": None if kernels else KERNELS_FALLBACK,
        },
        "ops": {
            "built": ops,
            "path": None if ops_path is None else str(ops_path),
            "why_not": "" if ops else build.ops_unavailable(),
            "fallback": None if ops else OPS_FALLBACK,
        },
        "choices": choices,
    }


def _seconds(seconds: dict[str, float]) -> str:
    return ", ".join(f"{name} {value * 1e3:.3g} ms" for name, value in seconds.items())


def format_report(data: dict[str, Any]) -> str:
    """:func:`report`'s dict as the text ``attnkit kernels`` prints."""
    machine = data["machine"]
    lines = [
        f"machine   {machine['cpu']} ({machine['machine']}, {machine['system']}), "
        f"{machine['cores']} cores, {machine['threads']} threads, torch {machine['torch']}",
        f"flags     {' '.join(machine['flags']) or '(none of interest)'}",
    ]
    lines += [f"  {'yes' if on else 'no ':3}  {name}" for name, on in machine["features"].items()]
    compilers = data["compilers"]
    no_c, no_cxx = "none found (set CC, or install gcc)", "none found (set CXX, or install g++)"
    lines.append(f"C         {compilers['c'] or no_c}")
    lines.append(f"C++       {compilers['cxx'] or no_cxx}")
    for key, title in (("kernels", "C kernels"), ("ops", "C++ ops")):
        part = data[key]
        if part["built"]:
            lines.append(f"{title:9} built: {part['path']}")
        else:
            lines.append(f"{title:9} not built: {part['why_not']}")
            lines.append(f"{'':9} instead: {part['fallback']}")
    lines.append(f"cache     {data['tune_file']}")
    lines.append("")
    lines.append("choices (option, source; override with the variable shown)")
    names = max((len(choice["name"]) for choice in data["choices"]), default=0)
    options = max((len(choice["option"]) for choice in data["choices"]), default=0)
    for choice in data["choices"]:
        lines.append(
            f"  {choice['name']:{names}}  {choice['option']:{options}}  {choice['source']}"
        )
        lines.append(f"      options: {' | '.join(choice['options'])}; {choice['env']}=...")
        if choice["seconds"]:
            lines.append(f"      timed: {_seconds(choice['seconds'])}")
        elif choice["source"] == "pending":
            lines.append("      measured when compiled decoding first runs (or --retune)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the report (text or ``--json``); 0."""
    data = report(retune=args.retune)
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(data))
    return 0
