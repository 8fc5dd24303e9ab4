"""The README's two commands are what users and CI run: keep them true."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_python_examples_run():
    """Every ```python block of the README runs, in order, in one namespace."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.+?)\n```", readme, flags=re.S)
    assert len(blocks) >= 5
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
