"""attnkit.viz's pictures of attention variants and ``attnkit plot masks``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.patches import Rectangle  # noqa: E402

from attnkit import viz  # noqa: E402
from attnkit.flex import presets  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _loop(rule, L: int, S: int) -> torch.Tensor:
    return torch.tensor([[bool(rule(i, j)) for j in range(S)] for i in range(L)])


@pytest.mark.parametrize(
    ("mod", "rule"),
    [
        (presets.causal(), lambda i, j: j <= i),
        (presets.sliding_window(3), lambda i, j: 0 <= i - j < 3),
        (presets.prefix_lm(4), lambda i, j: j < 4 or j <= i),
        (presets.dilated(2), lambda i, j: j <= i and (i - j) % 2 == 0),
    ],
)
def test_mask_grid_is_the_rule_written_out(mod, rule) -> None:
    assert torch.equal(viz.mask_grid(mod, 9, 11), _loop(rule, 9, 11))


def test_mask_grid_reads_the_batch_entry_and_head() -> None:
    def per_head(b, h, q, kv):
        return (kv <= q) & (kv >= h + b)

    assert torch.equal(
        viz.mask_grid(per_head, 5, head=2, batch=1), _loop(lambda i, j: 3 <= j <= i, 5, 5)
    )


def test_block_states_count_each_block() -> None:
    allowed = viz.mask_grid(presets.sliding_window(4), 16)
    states = viz.block_states(allowed, 4)
    for i in range(4):
        for j in range(4):
            tile = allowed[4 * i : 4 * i + 4, 4 * j : 4 * j + 4]
            want = 0 if not tile.any() else 2 if tile.all() else 1
            assert states[i, j] == want
    # a ragged edge: blocks past the end count only the real scores
    assert viz.block_states(torch.ones(5, 5, dtype=torch.bool), 4).tolist() == [[2, 2], [2, 2]]


def test_mask_picture_draws_the_mask_and_the_computed_blocks() -> None:
    fig = viz.mask_picture(presets.sliding_window(4), 32, block_size=8)
    ax = fig.axes[0]
    pixels = ax.images[0].get_array()
    assert (pixels.astype(bool) == viz.mask_grid(presets.sliding_window(4), 32).numpy()).all()
    states = viz.block_states(viz.mask_grid(presets.sliding_window(4), 32), 8)
    edges = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(edges) == int((states > 0).sum())  # one outline per computed block
    assert f"{int((states > 0).sum())} of 16 blocks computed" in ax.get_title()


def test_score_bias_is_alibi_per_head(tmp_path: Path) -> None:
    bias = viz.bias_values(presets.alibi(4), 6, 8, num_heads=4)
    slopes = torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(4)], dtype=torch.float64)
    i, j = torch.arange(6).view(6, 1), torch.arange(8).view(1, 8)
    torch.testing.assert_close(bias, slopes.view(4, 1, 1) * (j - i), rtol=1e-6, atol=1e-6)
    fig = viz.score_bias(presets.alibi(4), 6, 8, num_heads=4)
    assert sum(1 for ax in fig.axes if ax.images) == 4
    assert viz.save_figure(fig, tmp_path / "alibi").read_bytes().startswith(PNG)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: viz.mask_grid(lambda b, h, q, kv: q.item() > 0, 4), "mask_mod <lambda> failed"),
        (
            lambda: viz.mask_grid(lambda b, h, q, kv: (q - kv).float(), 4),
            "must return a bool tensor",
        ),
        (lambda: viz.mask_grid(presets.causal(), 0), "lengths must be positive"),
        (lambda: viz.block_states(torch.ones(2, 2, dtype=torch.bool), 0), "block_size"),
        (lambda: viz.bias_values(lambda s, b, h, q, kv: s[0], 4), "must return a score tensor"),
        (lambda: viz.bias_values(presets.alibi(2), 4, num_heads=0), "num_heads"),
    ],
)
def test_bad_mods_are_named(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_unknown_grid_option_is_named() -> None:
    with pytest.raises(TypeError, match=r"unknown grid options \['heads'\]"):
        viz.mask_picture(presets.causal(), 4, heads=1)  # type: ignore[call-arg]


def test_plot_masks_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.cli import main

    args = ["plot", "masks", "--out", str(tmp_path), "--mask-len", "24", "--block-size", "6"]
    assert main(args) == 0
    printed = {Path(p).name for p in capsys.readouterr().out.split()}
    names = ("causal", "sliding_window", "prefix_lm", "dilated", "document", "padding")
    assert printed == {f"mask_{n}.png" for n in names} | {"bias_alibi.png"}
    for name in printed:
        assert (tmp_path / name).read_bytes().startswith(PNG)
    assert main(["plot", "masks", "--out", str(tmp_path), "--block-size", "0"]) != 0
    assert "--block-size must be >= 1, got 0" in capsys.readouterr().err
