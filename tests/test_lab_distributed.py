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
from attnkit.lab.train import eval_set, evaluate, load_trained


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


def _torchrun(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


FSDP_ARGS = [a if a != "30" else "10" for a in ARGS] + ["--layers", "2", "--eval-every", "5"]

RESUME_SCRIPT = """
import sys
from attnkit.lab.distributed import init_distributed, shutdown_distributed
from attnkit.lab.train import LabConfig, train

config = LabConfig(seq_len=6, num_symbols=5, dim=32, num_heads=2, num_layers=2, ffn_dim=64,
                   steps=10, batch_size=32, lr=1e-2, eval_size=100, eval_every=5, seed=2)
ctx = init_distributed("cpu")
train(config, out_dir=sys.argv[1], ctx=ctx, progress=False, stop_after=5, fsdp=True)
shutdown_distributed(ctx)
"""


@pytest.mark.slow
def test_fsdp_matches_ddp_saves_full_state_and_resumes(tmp_path: Path) -> None:
    ddp, fsdp, resumed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "resumed"
    _torchrun("-m", "attnkit", "lab", "--out", str(ddp), *FSDP_ARGS)
    _torchrun("-m", "attnkit", "lab", "--fsdp", "--out", str(fsdp), *FSDP_ARGS)
    # Same loss as DDP over the 10 steps.
    torch.testing.assert_close(_losses(fsdp), _losses(ddp), rtol=1e-5, atol=0)
    assert json.loads((fsdp / "metrics.json").read_text())["world_size"] == 2
    # The checkpoint is the full state, in the single-process format: same keys and values
    # (weights and optimizer moments) as the DDP run's, and one process loads it.
    a = load_file(str(fsdp / "checkpoint.safetensors"))
    b = load_file(str(ddp / "checkpoint.safetensors"))
    assert a.keys() == b.keys()
    for key in a.keys() - {"rng.torch"}:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    model, config, _ = load_trained(fsdp)
    x, _ = eval_set(config.make_task(), 20, seed=0)
    assert model(x).shape == (20, 6, config.make_task().vocab_size)
    # Stopped after step 5 (checkpoint written), resumed to 10: the same losses afterwards.
    script = tmp_path / "stop_at_5.py"
    script.write_text(RESUME_SCRIPT)
    _torchrun(str(script), str(resumed))
    assert load_checkpoint(resumed / "checkpoint.safetensors")[1]["step"] == 5
    _torchrun("-m", "attnkit", "lab", "--fsdp", "--resume", "--out", str(resumed), *FSDP_ARGS)
    torch.testing.assert_close(_losses(resumed), _losses(fsdp), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_with_a_message(tmp_path: Path) -> None:
    import signal
    import socket
    import time

    out = tmp_path / "run"
    args = [a if a != "30" else "5000" for a in ARGS] + ["--save-every", "2", "--eval-every", "0"]
    cmd = [sys.executable, "-m", "attnkit", "lab", "--fsdp", "--timeout", "30", "--out", str(out)]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The two ranks are started as torchrun would start them, without torchrun's agent: the agent
    # stops every rank as soon as one fails, before a survivor could report it.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [
        subprocess.Popen(
            [*cmd, *args],
            env=env | {"RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    proc = procs[0]
    try:
        start = time.monotonic()
        while not (out / "checkpoint.safetensors").exists():  # training is under way
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() - start < 180, "no checkpoint within 180 s"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)  # one rank dies mid-run
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert proc.returncode != 0
    assert time.monotonic() - killed < 30  # within the stated timeout
    assert "attnkit lab: error: rank 0 of 2: the process group failed" in stderr, stderr[-3000:]
    assert "--resume" in stderr
    # The last complete checkpoint is intact and loads in one process.
    _, _, meta = load_trained(out)
    assert meta["step"] >= 2 and meta["step"] % 2 == 0


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["sinusoidal", "rope"])
def test_context_parallel_matches_one_process(positions: str, tmp_path: Path) -> None:
    # Each sequence of 6 split into 3 + 3 positions over two processes, attention by ring.
    cp, single = tmp_path / "cp", tmp_path / "single"
    args = [a if a != "30" else "20" for a in ARGS] + ["--layers", "2", "--positions", positions]
    _torchrun("-m", "attnkit", "lab", "--context-parallel", "--out", str(cp), *args)
    threads = torch.get_num_threads()
    try:
        assert main(["lab", "--out", str(single), *args]) == 0
    finally:
        torch.set_num_threads(threads)
    assert len(_losses(cp)) == 20
    torch.testing.assert_close(_losses(cp), _losses(single), rtol=1e-4, atol=0)
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (cp, single))
    assert a["eval_accuracy"] == pytest.approx(b["eval_accuracy"], abs=0.01)


@pytest.mark.slow
def test_fsdp_with_context_parallel_matches_one_process(tmp_path: Path) -> None:
    # Parameters sharded by FSDP2 and sequences by the ring, over the same two processes.
    both, single = tmp_path / "both", tmp_path / "single"
    args = [a if a != "30" else "20" for a in ARGS] + ["--layers", "2"]
    _torchrun("-m", "attnkit", "lab", "--fsdp", "--context-parallel", "--out", str(both), *args)
    threads = torch.get_num_threads()
    try:
        assert main(["lab", "--out", str(single), *args]) == 0
    finally:
        torch.set_num_threads(threads)
    assert len(_losses(both)) == 20
    torch.testing.assert_close(_losses(both), _losses(single), rtol=1e-4, atol=0)
    # The full checkpoint loads in one process and gives the trained model's accuracy.
    model, config, _ = load_trained(both)
    metrics = json.loads((both / "metrics.json").read_text())
    x, y = eval_set(config.make_task(), config.eval_size, config.seed)
    assert evaluate(model, x, y)["accuracy"] == pytest.approx(metrics["eval_accuracy"], abs=1e-6)


def test_context_parallel_needs_divisible_sequences() -> None:
    from attnkit.lab.distributed import DistContext
    from attnkit.lab.train import LabConfig, train

    ctx = DistContext(rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"seq_len \(6\) must be divisible by the number"):
        train(LabConfig(seq_len=6, steps=1), ctx=ctx, progress=False, context_parallel=True)
    with pytest.raises(ValueError, match=r"seq_len \(6\) must be divisible by the number"):
        train(LabConfig(seq_len=6, steps=1), ctx=ctx, context_parallel=True, fsdp=True)
