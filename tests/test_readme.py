"""The README's two commands are what users and CI run, and DEVELOPING.md maps the package:
keep both true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick)


def test_quickstart_has_exactly_two_commands_pinning_torch():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    for cmd in cmds:
        assert "torch==2.13.0" in cmd
    assert cmds[0].endswith("attnkit lab")
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == _commands()[1]


@pytest.mark.slow
def test_python_examples_run():
    """Every ```python block of the README runs, in order, in one namespace."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.+?)\n```", readme, flags=re.S)
    assert len(blocks) >= 5
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


def test_developing_md_lists_every_module():
    """Every module and sub-package of attnkit has a row in DEVELOPING.md's table of files."""
    text = (ROOT / "docs" / "DEVELOPING.md").read_text()
    table = text.split("## Where things are", 1)[1]
    listed = set(re.findall(r"^\| `([^`]+)`", table, flags=re.M))
    package = ROOT / "src" / "attnkit"
    modules = {p.name for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    subpackages = {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    assert modules | subpackages <= listed, sorted(modules | subpackages - listed)
