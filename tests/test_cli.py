"""The ``attnkit`` command line: every command's ``--help`` and its error path for bad input.

Bad input ends with exit status 2 and one line on stderr that names the command and the value,
never a traceback; usage errors (argparse) and errors found when the command runs alike.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest

from attnkit import cli


def run(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``attnkit ARGV`` run in this process."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([command, "--help"], capsys)
    assert code == 0 and err == ""
    assert out.startswith(f"usage: attnkit {command}")
    assert cli.COMMANDS[command] in " ".join(out.split())  # the description, rewrapped


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([], capsys)
    assert code == 0
    for command, text in cli.COMMANDS.items():
        assert command in out and text[:30] in out


# One bad argument per command, rejected by argparse (usage) or by the command (run).
BAD = [
    (["lab", "--steps", "many"], "invalid int value: 'many'"),
    (["lab", "--task", "juggle"], "unknown task 'juggle'"),
    (["complexity", "--seq-len", "8", "--dim", "32"], "required: --heads"),
    (["complexity", "--seq-len", "0", "--dim", "32", "--heads", "4"], "seq_len=0"),
    (["plot", "everything"], "invalid choice: 'everything'"),
    (["plot", "rotary", "--head-dim", "7"], "--head-dim must be even"),
    (["explain", "--layer", "last"], "invalid int value: 'last'"),
    (["bench", "--cases", "sideways"], "invalid choice: 'sideways'"),
    (["bench", "--heads", "0"], "--heads must be >= 1, got 0"),
    (["unknown-command"], "invalid choice: 'unknown-command'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_argument_is_one_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    command = argv[0] if argv[0] in cli.COMMANDS else None
    assert lines[0].startswith(f"attnkit {command}: error: " if command else "attnkit: error: ")
    assert message in lines[0]
    assert "Traceback" not in err


@pytest.mark.slow
def test_bad_argument_exits_2_from_a_real_process() -> None:
    argv = ["complexity", "--seq-len", "8", "--dim", "30", "--heads", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == (
        "attnkit complexity: error: dim (30) must be divisible by num_heads (4), or pass head_dim"
    )
