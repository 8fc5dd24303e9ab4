"""``torchrun --nproc_per_node=2 -m attnkit lab``: data-parallel on CPU (gloo) = one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("tqdm")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from safetensors.torch import load_file

from attnkit.cli import main
from attnkit.lab.checkpoint import load_checkpoint
from attnkit.lab.train import eval_set, load_trained


def _losses(run: Path) -> torch.Tensor:
    history = load_checkpoint(run / "checkpoint.safetensors")[1]["history"]
    return torch.tensor([h["loss"] for h in history if "loss" in h])


ARGS = [
    "--seq-len",
    "6",
    "--num-symbols",
    "5",
    "--dim",
    "32",
    "--heads",
    "2",
    "--layers",
    "1",
    "--ffn-dim",
    "64",
    "--steps",
    "30",
    "--batch-size",
    "32",
    "--lr",
    "1e-2",
    "--eval-size",
    "100",
    "--eval-every",
    "10",
    "--no-report",
    "--no-progress",
    "--seed",
    "2",
]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path: Path) -> None:
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",  # torchrun picks a free port itself: no race with other processes
        "-m",
        "attnkit",
        "lab",
        "--out",
        str(ddp_dir),
        *ARGS,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("eval_accuracy") == 1  # only rank 0 prints the summary

    threads = torch.get_num_threads()
    try:
        assert main(["lab", "--out", str(single_dir), *ARGS]) == 0
    finally:
        torch.set_num_threads(threads)

    ddp = json.loads((ddp_dir / "metrics.json").read_text())
    single = json.loads((single_dir / "metrics.json").read_text())
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert ddp["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-3)
    assert ddp["eval_accuracy"] == pytest.approx(single["eval_accuracy"], abs=0.02)

    # Same training-loss curve (rank 0 logs the loss all-reduced over both processes).
    torch.testing.assert_close(_losses(ddp_dir), _losses(single_dir), rtol=1e-3, atol=1e-4)
    # Same function. (Weights are not compared one by one: the key bias gets a gradient that is
    # zero up to rounding, which Adam's normalisation turns into steps of random sign.)
    model_a, config, _ = load_trained(ddp_dir)
    model_b, _, _ = load_trained(single_dir)
    x, _ = eval_set(config.make_task(), 100, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(model_a(x), model_b(x), rtol=1e-3, atol=2e-3)
    a = load_file(str(ddp_dir / "checkpoint.safetensors"))
    b = load_file(str(single_dir / "checkpoint.safetensors"))
    assert a.keys() == b.keys()
    torch.testing.assert_close(a["model.head.weight"], b["model.head.weight"], rtol=1e-3, atol=2e-3)
    # Nothing but rank 0's files: no stray temp files from the other rank.
    assert sorted(p.name for p in ddp_dir.iterdir()) == sorted(
        ["checkpoint.safetensors", "config.json", "metrics.json"]
    )


def test_batch_must_split_over_processes() -> None:
    from attnkit.lab.distributed import DistContext
    from attnkit.lab.train import LabConfig, train

    ctx = DistContext(rank=0, world_size=3)
    with pytest.raises(
        ValueError,
        match=r"batch_size \(32\) must be divisible by the number "
        r"of processes \(3\)",
    ):
        train(LabConfig(batch_size=32, steps=1), ctx=ctx, progress=False)
