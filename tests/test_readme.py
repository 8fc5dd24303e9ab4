"""The README's two commands are what users and CI run, its taste runs, its links lead to guide
pages, and DEVELOPING.md maps the package: keep all of it true."""

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
    assert blocks
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


def test_readme_links_resolve_and_reach_every_guide_page():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    relative = [link for link in links if "://" not in link]
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, missing
    guide = {f"docs/guide/{p.name}" for p in (ROOT / "docs" / "guide").glob("*.md")}
    assert guide <= set(relative), sorted(guide - set(relative))


def test_developing_md_lists_every_module():
    """Every module and sub-package of attnkit has a row in DEVELOPING.md's table of files."""
    text = (ROOT / "docs" / "DEVELOPING.md").read_text()
    table = text.split("## Where things are", 1)[1]
    listed = set(re.findall(r"^\| `([^`]+)`", table, flags=re.M))
    package = ROOT / "src" / "attnkit"
    modules = {p.name for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    subpackages = {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    assert modules | subpackages <= listed, sorted(modules | subpackages - listed)
