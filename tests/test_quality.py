"""The code standards that CI enforces: ruff (lint + format) and mypy on the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it is part of the dev extra")
    return found


def test_ruff_check_and_format_are_clean():
    check = _run(_tool("ruff"), "check", "src", "tests", "benchmarks")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = _run(_tool("ruff"), "format", "--check", "src")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.slow
def test_mypy_is_clean():
    res = _run(_tool("mypy"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_deprecation_raised_from_attnkit_or_the_tests_fails_the_test():
    """pyproject.toml's filterwarnings turn the project's deprecations into errors, by the module
    a warning is attributed to; other modules' warnings stay warnings."""
    code = compile("import warnings\nwarnings.warn('old API', DeprecationWarning)", "<m>", "exec")
    for module in ("attnkit.models", "tests.test_models"):
        with pytest.raises(DeprecationWarning, match="old API"):
            exec(code, {"__name__": module})
    with warnings.catch_warnings(record=True) as seen:  # keeps the filters in force
        exec(code, {"__name__": "some_dependency"})
    assert [str(w.message) for w in seen] == ["old API"]
