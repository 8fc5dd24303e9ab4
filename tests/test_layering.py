"""The package reads top-down: the import-linter layers contract in pyproject.toml holds, and no
module imports itself through others (not even for type hints)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

grimp = pytest.importorskip("grimp")


def test_layers_contract_is_kept() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def _cycle(imports: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the modules (depth-first search), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for other in sorted(imports.get(module, ())):
            if state.get(other) == 1:
                return [*path[path.index(other) :], other]
            if other not in state and (found := visit(other)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(imports):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycles() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    try:
        graph = grimp.build_graph("attnkit")
    finally:
        sys.path.remove(str(ROOT / "src"))
    # A package's __init__ re-exports its modules; edges into a package are edges into __init__.
    packages = {m for m in graph.modules if (ROOT / "src" / m.replace(".", "/")).is_dir()}
    imports = {
        m: {o for o in graph.find_modules_directly_imported_by(m) if o not in packages}
        for m in graph.modules
        if m not in packages
    }
    assert _cycle(imports) is None, f"import cycle: {' -> '.join(_cycle(imports) or [])}"


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
