"""``attnkit tour``: the whole tour passes and writes its files; every check can fail."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")  # the figures
pytest.importorskip("tqdm")  # the lab's training (claim 10)

from torch import nn

from attnkit import (
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    PositionalTransformerBlock,
    ScaleDotProductAttention,
    SinusoidalPositionalEncoding,
    TransformerEncoder,
)
from attnkit import tour as T
from attnkit.commands import tour as tour_command


@pytest.mark.slow
def test_tour_writes_report_claims_figures_and_explorer(tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    tour_command.add_arguments(parser)
    assert tour_command.run(parser.parse_args(["--out", str(tmp_path)])) == 0
    printed = capsys.readouterr().out
    assert "15 of 15 claims pass" in printed
    claims = json.loads((tmp_path / "claims.json").read_text(encoding="utf-8"))
    assert [c["id"] for c in claims] == list(range(1, 16))
    for c in claims:
        assert {"id", "claim", "passed", "measured", "figure"} <= set(c)
        assert c["claim"] == T.CLAIMS[c["id"]][1]
        assert c["passed"] is True, (c["id"], c.get("verdict"))
        assert isinstance(c["measured"], dict) and c["measured"]
        figure = tmp_path / c["figure"]
        assert not Path(c["figure"]).is_absolute()
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (tmp_path / "report.html").read_text(encoding="utf-8")
    order = [int(m) for m in re.findall(r'<section class="claim" id="claim-(\d+)"', report)]
    assert order == list(T.BLOG_ORDER)  # the blog's order
    assert report.count('data-passed="true"') == 15
    assert 'href="explorer.html"' in report and (tmp_path / "explorer.html").is_file()


# --------------------------------------------------------------------------- each check passes...


@pytest.mark.parametrize(
    "check",
    [
        T.check_scaled_scores,
        T.check_saturation,
        T.check_permutation,
        T.check_sinusoidal_shift,
        T.check_frequencies,
        T.check_rope_norm,
        T.check_rope_relative,
        T.check_causal,
        T.check_softcap,
        T.check_qk_norm,
        T.check_prefix_lm,
        T.check_window_cost,
    ],
)
def test_fast_checks_pass_on_attnkit(check) -> None:
    result = check()
    assert result.passed, result.verdict
    assert T.draw(result).axes  # something was drawn
    json.dumps(result.to_dict("f.png"))  # measured is JSON-serialisable


# --------------------------------------------------------------------------- ... and can fail


def test_claim_1_fails_without_the_scale() -> None:
    result = T.check_scaled_scores(attention=lambda d: ScaleDotProductAttention(d_k=1))
    assert not result.passed
    last = result.measured["per_dim"][-1]
    assert last["scaled_std"] == pytest.approx(math.sqrt(last["d"]), rel=0.1)


def test_claim_2_fails_when_the_unscaled_module_scales_anyway() -> None:
    result = T.check_saturation(unscaled=lambda d: ScaleDotProductAttention(d_k=d))
    assert not result.passed
    assert result.measured["per_dim"][-1]["unscaled_max_weight"] < 0.5
    # the blog's example is measured through the module: softmax([1, 2]) and softmax([10, 20])
    blog = T.check_saturation().measured["blog_example_softmax"]
    torch.testing.assert_close(torch.tensor(blog["[1.0, 2.0]"]), torch.tensor([1, 2.0]).softmax(0))
    assert blog["[10.0, 20.0]"][1] > 0.9999


def test_claim_3_fails_when_the_counted_flops_differ_from_the_formula() -> None:
    from attnkit import MultiHeadAttention

    quick = {"timed_lengths": (256, 512), "repeats": 1}
    wide = MultiHeadAttention(64, 4, head_dim=32)  # twice the head dim of the formula's layer
    result = T.check_cost(wide, **quick)
    assert not result.passed
    row = result.measured["flops"][0]
    assert row["counted_quadratic"] == 2 * row["predicted_quadratic"]
    assert T.check_cost(**quick).measured["flops"][0]["counted_linear"] == row["predicted_linear"]


def test_claim_4_fails_with_positions() -> None:
    block = PositionalTransformerBlock(32, 64, 4, position_type="sinusoidal")
    result = T.check_permutation(block)
    assert not result.passed and result.measured["max_error"] > 1e-2


def test_claims_5_and_6_fail_on_a_learned_table() -> None:
    torch.manual_seed(0)
    learned = LearnedPositionalEmbedding(512, 64).weight.detach()
    assert not T.check_sinusoidal_shift(learned).passed
    assert not T.check_frequencies(learned).passed
    # pairs in the wrong order: still rotations, but the high dimensions now turn fastest
    pe = SinusoidalPositionalEncoding(64, 512).pe
    flipped = pe.reshape(512, 32, 2).flip(1).reshape(512, 64)
    assert T.check_sinusoidal_shift(flipped).passed
    assert not T.check_frequencies(flipped).passed


def test_claims_7_and_8_fail_on_broken_rotations() -> None:
    def stretch(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x * (1 + 1e-3 * positions.to(x.dtype))[:, None]  # rescales with the position

    def nothing(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x  # no positions at all: relative, trivially, but blind to the offset

    assert not T.check_rope_norm(stretch).passed
    assert not T.check_rope_relative(stretch).passed
    result = T.check_rope_relative(nothing)
    assert not result.passed and result.measured["varies_with_offset"] is False


def test_claim_9_fails_on_a_bidirectional_model() -> None:
    torch.manual_seed(0)
    encoder = TransformerEncoder(32, 32, 2, 4, position="rope", num_outputs=32)
    result = T.check_causal(encoder)
    assert not result.passed
    assert result.measured["max_weight_above_diagonal"] > 0
    assert result.measured["max_past_change"] > 1e-3


def test_claim_10_fails_on_an_untrained_model() -> None:
    from attnkit.lab.train import LabConfig, build_model

    config = LabConfig(task="reverse", seq_len=10, dim=32, ffn_dim=64, eval_size=64)
    torch.manual_seed(0)
    result = T.check_interpretable(build_model(config).eval(), config)
    assert not result.passed
    assert result.measured["best_share"] < 0.5
    assert result.explorer is not None and len(result.explorer[0]) == 10
    with pytest.raises(ValueError, match="LabConfig"):
        T.check_interpretable(build_model(config))


def test_claim_11_fails_when_the_layer_does_not_cap() -> None:
    result = T.check_softcap(lambda: MultiHeadAttention(32, 4))  # no softcap
    assert not result.passed
    rows = result.measured["per_gain"]
    assert rows[-1]["capped_range"] > 2 * result.measured["cap"]
    # ... and a cap too large to be reached within the gains fails too (the claim needs it met)
    assert not T.check_softcap(lambda: MultiHeadAttention(32, 4, softcap=1e4)).passed


def test_claim_11_bounds_hold_at_another_cap() -> None:
    result = T.check_softcap(cap=1.0)
    assert result.passed, result.verdict
    bound = result.measured["max_weight_bound"]
    assert bound == pytest.approx(1 / (1 + 31 * math.exp(-2.0)))
    assert all(r["capped_largest_weight"] <= bound for r in result.measured["per_gain"])


def test_claim_12_fails_without_the_norms() -> None:
    result = T.check_qk_norm(lambda: MultiHeadAttention(64, 4, bias=False))
    assert not result.passed
    assert result.measured["normed_relative_change"] > 10  # grows like the plain layer
    # A norm on the queries only leaves the keys' growth in the scores: fails as well.
    half = T.check_qk_norm(lambda: MultiHeadAttention(64, 4, bias=False, q_norm=nn.RMSNorm(16)))
    assert not half.passed


@pytest.fixture
def one_thread():
    """One torch thread, as the tour runs (tiny training steps stall on shared cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_claim_13_fails_without_alibi(one_thread) -> None:
    result = T.check_alibi_extrapolation(score_mod=None, steps=10)  # both models lack positions
    assert not result.passed
    assert result.measured["accuracy"]["48"] < 0.9


def test_claim_13_task_targets_the_most_recent_signal() -> None:
    tokens, targets = T.recency_batch(torch.Generator().manual_seed(0), 4, 30)
    for row, want in zip(tokens.tolist(), targets.tolist(), strict=True):
        last = -100
        for token, target in zip(row, want, strict=True):
            last = token if token < 8 else last
            assert target == last


def test_claim_14_fails_on_a_causal_and_on_a_bidirectional_model() -> None:
    from attnkit import TransformerConfig, TransformerLM

    def causal(prefix: int) -> nn.Module:
        return TransformerLM(TransformerConfig(32, 32, 2, 4, ffn_dim=64, max_seq_len=16))

    result = T.check_prefix_lm(causal)  # the prefix does not see its future
    assert not result.passed and result.measured["change_at_0"] == 0

    def bidirectional(prefix: int) -> nn.Module:
        encoder = TransformerEncoder(32, 32, 2, 4, position="rope", num_outputs=32)
        return encoder

    result = T.check_prefix_lm(bidirectional)  # the tokens after the prefix see the future
    assert not result.passed and result.measured["max_change_before_it"] > 1e-6


def test_claim_15_fails_when_the_window_is_causal_attention() -> None:
    from attnkit.flex import presets

    result = T.check_window_cost(lambda window: presets.causal())
    assert not result.passed
    assert result.measured["window_slope"] == pytest.approx(result.measured["causal_slope"])
