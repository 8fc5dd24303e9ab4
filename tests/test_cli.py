"""The ``attnkit`` command line: every command's ``--help`` and its error path for bad input.

Bad input ends with exit status 2 and one line on stderr that names the command and the value,
never a traceback; usage errors (argparse) and errors found when the command runs alike.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

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


# ----------------------------------------------------------------------------- lab checkpoints

TINY_LAB = [
    "--seq-len", "6", "--num-symbols", "5", "--dim", "16", "--heads", "2", "--layers", "1",
    "--ffn-dim", "32", "--steps", "2", "--batch-size", "8", "--eval-size", "16",
    "--no-report", "--no-progress", "--threads", "1",
]  # fmt: skip


def run_lab_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    import torch

    threads = torch.get_num_threads()
    try:
        return run(["lab", *argv, *TINY_LAB], capsys)
    finally:
        torch.set_num_threads(threads)  # the command sets the process's thread count


@pytest.mark.parametrize("damage", ["truncated", "header only", "empty", "not safetensors"])
def test_resume_from_a_damaged_checkpoint_is_one_line(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("tqdm")
    import torch

    from attnkit.lab.checkpoint import CHECKPOINT_NAME, save_checkpoint

    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, model=torch.nn.Linear(4, 4))
    data = path.read_bytes()
    cut = {"truncated": data[: len(data) // 2], "header only": data[:6], "empty": b""}
    path.write_bytes(cut.get(damage, b"{not a checkpoint}" * 10))

    code, _, err = run_lab_cli(["--out", str(tmp_path), "--resume"], capsys)
    assert code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # after the one-line "attnkit lab: task ..." notice
    assert last.startswith(f"attnkit lab: error: {path} is damaged or truncated (")
    assert last.endswith("delete it to start over, or run without --resume")


@pytest.mark.slow
def test_lab_removes_temp_files_of_a_killed_run_and_shares_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("tqdm")
    # What a kill -9 during atomic_write leaves: mkstemp names with 8 random characters.
    stale = [
        tmp_path / ".checkpoint.safetensors.k1ll_3d0.tmp",
        tmp_path / ".config.json.ab12cd34.tmp",
    ]
    for path in stale:
        path.write_bytes(b"half a file")
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_text("mine")

    code, _, err = run_lab_cli(["--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert not any(p.exists() for p in stale)
    assert unrelated.read_text() == "mine"
    assert f"removed {stale[0]}, left by an interrupted run" in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == ["notes.tmp"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["checkpoint.safetensors"] == modes["config.json"] == modes["metrics.json"]


# ----------------------------------------------------------------------------- complexity --measure


def test_complexity_measure_of_a_size_that_cannot_be_allocated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # B*L*D = 10^6 * 10^7 * 64 float32 inputs: 2.56e15 bytes, more than any machine has.
    argv = ["--seq-len", "10000000", "--dim", "64", "--heads", "4", "--batch", "1000000"]
    code, out, err = run(["complexity", *argv, "--measure"], capsys)
    assert code == 2 and out == ""
    assert "Traceback" not in err
    assert err.strip() == (
        "attnkit complexity: error: --measure: the layer does not fit in cpu memory at "
        "B=1000000, L=10000000, S=10000000, D=64, float32 (it tried to allocate "
        "2560000000000000 bytes); measure a smaller size, or drop --measure for the "
        "predictions alone"
    )
