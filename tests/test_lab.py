"""Tests for the lab: tasks, checkpoints, training, resume, report and the ``attnkit lab`` CLI."""

from __future__ import annotations

import base64
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
pytest.importorskip("safetensors")
pytest.importorskip("tqdm")

from attnkit.cli import main  # noqa: E402
from attnkit.config import TransformerConfig  # noqa: E402
from attnkit.lab import checkpoint as ckpt  # noqa: E402
from attnkit.lab.runner import run_lab  # noqa: E402
from attnkit.lab.tasks import IGNORE, TASKS, get_task, is_held_out  # noqa: E402
from attnkit.lab.train import (  # noqa: E402
    LabConfig,
    attention_weights,
    autocast,
    build_model,
    eval_set,
    head_alignment,
    load_trained,
    train,
    train_batch,
)

PNG = b"\x89PNG\r\n\x1a\n"

# Learns reversal of 6 symbols in about a second on one CPU thread.
TINY = LabConfig(
    seq_len=6,
    num_symbols=5,
    dim=32,
    num_heads=2,
    num_layers=1,
    ffn_dim=64,
    steps=150,
    batch_size=32,
    lr=1e-2,
    eval_every=25,
    eval_size=200,
)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and bitwise reproducible
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    """One tiny full run with the report, shared by the report tests."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("lab") / "run"
    metrics = run_lab(TINY, out_dir=out, progress=False)
    return out, metrics


# --------------------------------------------------------------------------- tasks


def _reference_targets(name: str, row: list[int], v: int) -> list[int]:
    n = len(row)
    if name == "reverse":
        return row[::-1]
    if name == "sort":
        return sorted(row)
    if name == "copy":
        return [IGNORE] * (n // 2) + row[: n // 2]
    table = {row[i]: row[i + 1] for i in range(0, n - 2, 2)}
    return [IGNORE] * (n - 1) + [table[row[-1]]]


@pytest.mark.parametrize("name", list(TASKS))
def test_task_targets_match_reference(name: str) -> None:
    task = get_task(name, seq_len=10, num_symbols=6)
    x, y = task.sample(32, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (32, 10) and x.dtype == torch.int64
    assert int(x.max()) < task.vocab_size
    for row, target in zip(x.tolist(), y.tolist(), strict=True):
        assert target == _reference_targets(name, row, 6)
    if name == "recall":
        keys = x[:, 0:8:2]
        assert all(len(set(k)) == len(k) for k in keys.tolist())  # keys are distinct


@pytest.mark.parametrize("name", list(TASKS))
def test_task_sampling_is_deterministic(name: str) -> None:
    task = get_task(name, seq_len=8, num_symbols=6)
    a = task.sample(16, torch.Generator().manual_seed(3))
    b = task.sample(16, torch.Generator().manual_seed(3))
    c = task.sample(16, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_held_out_split_is_disjoint_from_training() -> None:
    task = get_task("reverse", seq_len=6, num_symbols=5)
    train_rows = torch.cat([train_batch(TINY, task, s)[0] for s in range(50)])
    eval_rows, _ = eval_set(task, 300, seed=0)
    assert not is_held_out(train_rows).any() and is_held_out(eval_rows).all()
    seen = {tuple(r) for r in train_rows.tolist()}
    assert seen.isdisjoint(tuple(r) for r in eval_rows.tolist())


def test_reverse_sources_are_the_anti_diagonal() -> None:
    task = get_task("reverse", seq_len=5, num_symbols=4)
    src = task.sources(torch.zeros(2, 5, dtype=torch.int64))
    assert torch.equal(src[0], torch.eye(5, dtype=torch.bool).flip(-1))


def test_task_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="valid tasks: reverse, copy, sort, recall"):
        get_task("palindrome", seq_len=8, num_symbols=4)
    with pytest.raises(ValueError, match="even seq_len"):
        get_task("copy", seq_len=7, num_symbols=4)
    with pytest.raises(ValueError, match="distinct keys"):
        get_task("recall", seq_len=20, num_symbols=4)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        get_task("reverse", seq_len=0, num_symbols=4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": 30, "num_heads": 4}, r"dim \(30\) must be divisible by num_heads \(4\)"),
        ({"dim": 12, "num_heads": 4, "positions": "rope"}, "rope needs an even head dim"),
        ({"positions": "alibi"}, "positions must be one of none, sinusoidal, rope"),
        ({"seq_len": 40, "max_seq_len": 20}, r"max_seq_len \(20\) must be >= seq_len \(40\)"),
        ({"steps": 0}, "sizes must be positive"),
        ({"task": "nope"}, "valid tasks"),
        ({"dtype": "float16"}, "dtype must be one of float32, bfloat16; got 'float16'"),
    ],
)
def test_config_rejects_sizes_that_do_not_fit(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(TINY, **changes)


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    model = build_model(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = train_batch(TINY, TINY.make_task(), 0)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    rng = torch.get_rng_state()
    path = ckpt.save_checkpoint(
        tmp_path / "c.safetensors",
        model=model,
        optimizer=opt,
        metadata={"step": 7, "config": TINY.to_dict()},
    )
    tensors, meta = ckpt.load_checkpoint(path)
    assert meta["step"] == 7 and LabConfig.from_dict(meta["config"]) == TINY
    assert torch.equal(tensors["rng.torch"], rng)

    torch.manual_seed(123)
    fresh = build_model(TINY)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh.load_state_dict(ckpt.model_state(tensors))
    ckpt.restore_optimizer(fresh_opt, tensors, meta)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    saved, restored = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for idx, fields in saved.items():
        for name, value in fields.items():
            torch.testing.assert_close(restored[idx][name], value, rtol=0, atol=0)
    assert not list(tmp_path.glob(".*.tmp"))


def test_checkpoint_write_is_atomic(tmp_path: Path) -> None:
    model = build_model(TINY)
    path = ckpt.save_checkpoint(tmp_path / "c.safetensors", model=model, metadata={"step": 1})
    before = path.read_bytes()

    def crash(tmp: str) -> None:
        Path(tmp).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_write(path, crash)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temp file left
    assert ckpt.load_checkpoint(path)[1]["step"] == 1


def test_load_trained_checks_the_saved_model_config(tmp_path: Path) -> None:
    model = build_model(TINY)
    meta = {"config": TINY.to_dict(), "model": TINY.model_config().to_dict()}
    ckpt.save_checkpoint(tmp_path / ckpt.CHECKPOINT_NAME, model=model, metadata=meta)
    loaded, config, _ = load_trained(tmp_path)
    assert config == TINY and loaded.config == TINY.model_config()
    wrong = TINY.model_config().replace(max_seq_len=TINY.table_len + 1)
    meta["model"] = wrong.to_dict()
    ckpt.save_checkpoint(tmp_path / ckpt.CHECKPOINT_NAME, model=model, metadata=meta)
    with pytest.raises(ValueError, match=r"does not match its lab config"):
        load_trained(tmp_path)


def test_load_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        ckpt.load_checkpoint(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an attnkit lab checkpoint"):
        ckpt.load_checkpoint(tmp_path / "other.safetensors")


# --------------------------------------------------------------------------- training


def test_short_run_learns_the_task_and_attends_along_the_anti_diagonal() -> None:
    result = train(TINY, progress=False)
    assert result.eval["accuracy"] >= 0.97, result.eval
    assert result.history[0]["accuracy"] < 0.6  # it was learned, not known
    task = TINY.make_task()
    x, _ = eval_set(task, 100, seed=5)
    align = head_alignment(task, x, attention_weights(result.model, x))  # (layers, H)
    # Chance is 1/6 per head; the two heads may share the anti-diagonal between them.
    assert float(align.max()) > 0.5 and float(align.sum(-1).max()) > 0.9, align


def test_bfloat16_autocast_learns_as_well_as_float32() -> None:
    fp32 = train(TINY, progress=False)
    bf16 = train(replace(TINY, dtype="bfloat16"), progress=False)
    assert bf16.eval["accuracy"] >= 0.97, bf16.eval
    assert abs(bf16.eval["accuracy"] - fp32.eval["accuracy"]) <= 0.02
    # It ran in bf16: other numbers, float32 master weights, bf16 logits under the context.
    assert bf16.history[0]["loss"] != fp32.history[0]["loss"]
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    x, _ = eval_set(TINY.make_task(), 4, seed=0)
    with autocast("bfloat16", "cpu"):
        assert bf16.model(x).dtype == torch.bfloat16
    with autocast("float32", "cpu"):
        assert bf16.model(x).dtype == torch.float32


def test_training_is_deterministic_in_the_seed() -> None:
    cfg = replace(TINY, steps=20, eval_every=0)
    a, b = train(cfg, progress=False), train(cfg, progress=False)
    c = train(replace(cfg, seed=1), progress=False)
    for (k, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=k)
    assert not torch.equal(a.model.head.weight, c.model.head.weight)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    cfg = replace(TINY, steps=40, eval_every=0, dropout=0.1)  # dropout: the RNG state matters
    straight = train(cfg, out_dir=tmp_path / "a", progress=False)
    (tmp_path / "b").mkdir()
    first = train(cfg, out_dir=tmp_path / "b", progress=False, stop_after=20)
    assert first.step == 20
    torch.manual_seed(999)  # resume must restore the RNG, not rely on the caller's
    resumed = train(cfg, out_dir=tmp_path / "b", resume=True, progress=False)
    assert resumed.resumed_from == 20 and resumed.step == 40
    for (k, p), q in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=k)
    assert [h["step"] for h in resumed.history] == [h["step"] for h in straight.history]
    assert resumed.eval["loss"] == pytest.approx(straight.eval["loss"], rel=1e-5)


def test_resume_refuses_other_options(tmp_path: Path) -> None:
    cfg = replace(TINY, steps=5, eval_every=0)
    train(cfg, out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"dim: saved 32 vs asked 64"):
        train(replace(cfg, dim=64), out_dir=tmp_path, resume=True, progress=False)
    more = train(replace(cfg, steps=8), out_dir=tmp_path, resume=True, progress=False)
    assert more.step == 8 and more.resumed_from == 5


# --------------------------------------------------------------------------- report


@pytest.mark.slow
def test_run_writes_metrics_checkpoint_and_config(tiny_run) -> None:
    out, metrics = tiny_run
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["eval_accuracy"] == metrics["eval_accuracy"] >= 0.97
    assert on_disk["total_time_s"] >= on_disk["train_time_s"]
    sizes = on_disk["sizes"]
    assert sizes["num_params"] == sum(p.numel() for p in build_model(TINY).parameters())
    assert sizes["checkpoint_bytes"] == (out / "checkpoint.safetensors").stat().st_size
    assert LabConfig.from_dict(json.loads((out / "config.json").read_text())) == TINY
    _, meta = ckpt.load_checkpoint(out / "checkpoint.safetensors")
    assert TransformerConfig.from_dict(meta["model"]) == TINY.model_config()
    assert load_trained(out)[0].config == TINY.model_config()
    assert set(on_disk["length_generalization"]["sinusoidal"]) >= {"6", "12"}


@pytest.mark.slow
def test_report_embeds_every_figure_it_promises(tiny_run) -> None:
    out, metrics = tiny_run
    page = (out / "report.html").read_text()
    figures = metrics["figures"]
    expected = {
        "scaling",
        "softmax",
        "attention_grid",
        "attention_head",
        "cost_curves",
        "positions_sinusoidal",
        "positions_rotary",
        "rotary_relative",
        "training_curves",
    }
    assert {Path(f).stem for f in figures} == expected
    embedded = dict(
        re.findall(r'src="data:image/png;base64,([^"]+)"[^>]*data-file="([^"]+)"', page)
    )
    by_file = {v: k for k, v in embedded.items()}
    for rel in figures:
        data = (out / rel).read_bytes()
        assert data.startswith(PNG) and len(data) > 2000
        assert base64.b64decode(by_file[rel]) == data
    for heading in (
        "rescale factor",
        "Attention weights of the trained model",
        "cost of this model",
        "Positions",
        "Training",
    ):
        assert heading in page
    assert "2*B*H*L*S*E" in page  # the cost table's formulas
    assert "Length generalization" in page


def test_report_figure_is_a_deprecated_name_of_figure_spec() -> None:
    from attnkit.lab import report

    with pytest.warns(DeprecationWarning, match=r"Figure is now FigureSpec") as w:
        old = report.Figure
    assert old is report.FigureSpec
    assert [r.filename for r in w] == [__file__]
    with pytest.raises(AttributeError, match=r"no attribute 'Figures'"):
        report.Figures  # noqa: B018


@pytest.mark.slow
def test_report_attention_pictures_depend_on_the_model(tiny_run, tmp_path: Path) -> None:
    out, _ = tiny_run
    from attnkit.lab.report import ReportData, write_report

    untrained = train(replace(TINY, steps=1, eval_every=0), progress=False)
    write_report(tmp_path, ReportData(result=untrained, metrics={}))
    for name in ("attention_grid.png", "attention_head.png", "training_curves.png"):
        assert (tmp_path / "figures" / name).read_bytes() != (out / "figures" / name).read_bytes()
    assert (tmp_path / "figures" / "softmax.png").read_bytes() == (
        out / "figures" / "softmax.png"
    ).read_bytes()  # same input, same picture


@pytest.mark.slow
def test_compare_pe_in_miniature(tmp_path: Path) -> None:
    metrics = run_lab(TINY, out_dir=tmp_path, compare_pe=True, progress=False)
    acc = metrics["compare_pe"]
    assert set(acc) == {"none", "sinusoidal", "rope"}
    assert acc["sinusoidal"] >= 0.97
    assert acc["none"] < 0.6 < acc["sinusoidal"]  # no positions: cannot learn reversal
    assert json.loads((tmp_path / "metrics.json").read_text())["compare_pe"] == acc
    assert set(metrics["length_generalization"]) == {"none", "sinusoidal", "rope"}
    page = (tmp_path / "report.html").read_text()
    assert "Does the encoder need positions?" in page
    for name in ("figures/compare_pe.png", "figures/compare_pe_attention.png"):
        assert name in metrics["figures"] and f'data-file="{name}"' in page
    for pe in ("none", "sinusoidal", "rope"):
        assert (tmp_path / f"pe-{pe}" / "checkpoint.safetensors").is_file()


# --------------------------------------------------------------------------- CLI


def test_cli_runs_a_tiny_lab(tmp_path: Path, capsys) -> None:
    code = main(
        [
            "lab",
            "--out",
            str(tmp_path),
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
            "16",
            "--eval-size",
            "50",
            "--no-report",
            "--no-progress",
            "--seed",
            "3",
            "--dtype",
            "bfloat16",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "eval_accuracy" in out and str(tmp_path / "metrics.json") in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["seed"] == 3 and metrics["config"]["steps"] == 30
    assert metrics["config"]["dtype"] == "bfloat16"
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--task", "palindrome"],
            "unknown task 'palindrome'; valid tasks: reverse, copy, sort, recall",
        ),
        (["--dim", "30", "--heads", "4"], r"dim \(30\) must be divisible by num_heads \(4\)"),
        (["--task", "copy", "--seq-len", "7"], "even seq_len"),
        (["--batch-size", "0"], "sizes must be positive"),
        (["--threads", "0"], "--threads must be >= 1"),
    ],
)
def test_cli_bad_input_gets_a_clear_error(argv: list[str], message: str, capsys) -> None:
    assert main(["lab", *argv, "--out", "/nonexistent/never-written"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_knows_every_task() -> None:
    from attnkit.commands.lab import TASK_DEFAULTS

    assert list(TASK_DEFAULTS) == list(TASKS)
    for name, preset in TASK_DEFAULTS.items():
        LabConfig(task=name, **preset)  # every preset is a valid config


def test_cli_unwritable_out_dir(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["lab", "--out", str(blocker / "run"), "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot write to the output directory" in err and "a-file" in err


def test_cli_resume_without_checkpoint(tmp_path: Path, capsys) -> None:
    assert main(["lab", "--out", str(tmp_path), "--resume", "--steps", "1", "--no-progress"]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_rope_base_reaches_the_rotary_model_and_old_runs_keep_theirs() -> None:
    rope = replace(TINY, positions="rope")
    assert rope.rope_base == 100.0
    assert build_model(rope).rotary.base == 100.0  # type: ignore[union-attr]
    assert build_model(replace(rope, rope_base=500.0)).rotary.base == 500.0  # type: ignore[union-attr]
    # the other encoders keep TransformerConfig's base (unused by them)
    assert (
        TINY.model_config().rope_base == TransformerConfig.__dataclass_fields__["rope_base"].default
    )
    # a config.json written before rope_base existed: its rotary model was trained with 10,000
    saved = {k: v for k, v in rope.to_dict().items() if k != "rope_base"}
    assert LabConfig.from_dict(saved).rope_base == 10_000.0
    assert LabConfig.from_dict(rope.to_dict()) == rope
    with pytest.raises(ValueError, match=r"rope_base must be a number > 1, got 1.0"):
        replace(rope, rope_base=1.0)
