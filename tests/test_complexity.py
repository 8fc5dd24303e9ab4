"""Tests of attnkit.complexity and ``attnkit complexity``.

FLOPs are checked against torch's own ``FlopCounterMode`` on live attnkit modules (math SDPA
backend forced, or the meta device). The memory model is checked against measured peak memory in
``python -m attnkit.bench.memory`` (measurements are not tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from fractions import Fraction

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import attnkit
from attnkit import cli
from attnkit.complexity import (
    attention_cost,
    crossover_seq_len,
    dtype_size,
    evaluate_formula,
    transformer_cost,
)


def count_flops(module: nn.Module, *inputs: torch.Tensor, math_backend: bool = True) -> int:
    """What FlopCounterMode counts for one forward (math SDPA backend unless told otherwise)."""
    counter = FlopCounterMode(display=False)
    backend = sdpa_kernel(SDPBackend.MATH) if math_backend else contextlib.nullcontext()
    with torch.no_grad(), backend, counter:
        module(*inputs)
    return counter.get_total_flops()


# --- exact agreement with FlopCounterMode ------------------------------------------------------
# (B, L, S, D, H, K, E, causal, bias); S != L is cross-attention, K < H grouped-query.
SHAPES = [
    (1, 1, 1, 8, 1, 1, 8, False, True),
    (2, 7, 7, 24, 3, 3, 8, False, True),
    (2, 7, 7, 24, 3, 3, 8, True, True),
    (3, 5, 11, 16, 4, 2, 4, False, True),
    (1, 9, 4, 16, 4, 1, 6, True, False),
    (2, 6, 13, 12, 6, 3, 5, True, True),
    (1, 16, 16, 32, 8, 2, 4, False, False),
    (2, 3, 17, 20, 2, 1, 7, False, True),
]


@pytest.mark.parametrize(("B", "L", "S", "D", "H", "K", "E", "causal", "bias"), SHAPES)
def test_matmul_flops_equal_flop_counter(B, L, S, D, H, K, E, causal, bias):
    cost = attention_cost(
        L, D, H, batch=B, kv_len=S, head_dim=E, num_kv_heads=K, causal=causal, bias=bias
    )
    layer = attnkit.MultiHeadAttention(
        D, H, head_dim=E, num_kv_heads=K, causal=causal, bias=bias
    ).eval()
    query, kv = torch.randn(B, L, D), torch.randn(B, S, D)
    assert count_flops(layer, query, kv) == cost.matmul_flops
    meta = layer.to("meta")
    assert count_flops(meta, query.to("meta"), kv.to("meta"), math_backend=False) == (
        cost.matmul_flops
    )


@pytest.mark.parametrize(("B", "N", "D", "H", "causal"), [(1, 4, 8, 2, False), (2, 9, 24, 3, True)])
def test_blog_preset_matches_flop_counter(B, N, D, H, causal):
    layer = attnkit.MultiHeadSelfAttention(D, D, D, H, causal=causal).eval()
    assert count_flops(layer, torch.randn(B, N, D)) == attention_cost(N, D, H, batch=B).matmul_flops


def test_large_shapes_on_meta_device():
    # Realistic sizes cost nothing on the meta device (no data, same dispatch).
    for B, N, D, H, K in [(8, 2048, 1024, 16, 16), (4, 4096, 4096, 32, 8)]:
        with torch.device("meta"):
            layer = attnkit.MultiHeadAttention(D, H, num_kv_heads=K)
            x = torch.empty(B, N, D)
        expected = attention_cost(N, D, H, batch=B, num_kv_heads=K).matmul_flops
        assert count_flops(layer, x, math_backend=False) == expected


def test_gqa_counts_all_query_heads():
    # K/V heads are shared, not skipped: the attention matmuls run over H heads for any K.
    base = attention_cost(8, 32, 8, batch=2)
    gqa = attention_cost(8, 32, 8, batch=2, num_kv_heads=2)
    for name in ("scores", "weighted_sum", "q_proj", "out_proj"):
        assert _comp(gqa, name).flops == _comp(base, name).flops
    assert _comp(gqa, "k_proj").flops * 4 == _comp(base, "k_proj").flops


def test_transformer_block_matches_flop_counter():
    B, N, D, H, F = 2, 6, 16, 4, 40

    class Block(nn.Module):  # the seed's TransformerBlock, written out as the reference
        def __init__(self) -> None:
            super().__init__()
            self.attention = attnkit.MultiHeadSelfAttention(D, D, D, H)
            self.ff = nn.Sequential(nn.Linear(D, F), nn.ReLU(), nn.Linear(F, D))
            self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.norm1(x + self.attention(x))
            return self.norm2(x + self.ff(x))

    model = nn.Sequential(Block(), Block(), Block())
    cost = transformer_cost(N, D, H, ffn_dim=F, num_layers=3, batch=B)
    assert count_flops(model, torch.randn(B, N, D)) == cost.matmul_flops
    assert cost.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("D", "H", "K", "E", "bias"), [(24, 3, 3, 8, True), (16, 4, 2, 6, False)])
def test_params_equal_module_parameters(D, H, K, E, bias):
    layer = attnkit.MultiHeadAttention(D, H, head_dim=E, num_kv_heads=K, bias=bias)
    cost = attention_cost(5, D, H, head_dim=E, num_kv_heads=K, bias=bias)
    assert cost.params == sum(p.numel() for p in layer.parameters())


# --- hand-worked cases -----------------------------------------------------------------------
def _comp(cost, name):
    return next(c for c in cost.components if c.name == name)


def test_hand_worked_self_attention():
    # B=1, L=S=2, D=4, H=2, E=2. x (2x4) @ W (4x4): 2*2*4*4 = 64 FLOPs per projection.
    # Scores per head (2x2)@(2x2): 2*2*2*2 = 16, two heads: 32; same for weights @ V.
    cost = attention_cost(2, 4, 2, causal=True)
    flops = {c.name: c.flops for c in cost.components}
    assert flops == {
        "q_proj": 64,
        "k_proj": 64,
        "v_proj": 64,
        "scores": 32,
        "softmax": 40,  # 5 per score, 2 heads x 4 scores
        "weighted_sum": 32,
        "out_proj": 64,
    }
    assert cost.matmul_flops == 320
    # Causal: 3 of the 4 (query, key) pairs are allowed, so 3/4 of the L*S work is useful.
    assert _comp(cost, "scores").useful_flops == 24
    assert _comp(cost, "softmax").useful_flops == 30
    assert cost.useful_flops == 4 * 64 + 24 + 30 + 24
    assert _comp(cost, "q_proj").params == 4 * 4 + 4
    assert cost.attn_matrix_elements == 8
    assert cost.textbook_peak_attn_bytes == 2 * 8 * 4
    assert cost.fused_attn_elements == 4


def test_hand_worked_cross_attention_gqa():
    # L=1 query, S=3 keys, D=4, H=2, K=1, E=2: k_proj is x (3x4) @ W (4x2) = 2*3*4*2 = 48.
    cost = attention_cost(1, 4, 2, kv_len=3, num_kv_heads=1, batch=2)
    assert _comp(cost, "k_proj").flops == 2 * 48
    assert _comp(cost, "q_proj").flops == 2 * (2 * 1 * 4 * 4)
    assert _comp(cost, "scores").flops == 2 * (2 * 2 * 1 * 3 * 2)
    assert _comp(cost, "k_proj").params == 4 * 2 + 2


@pytest.mark.parametrize(("L", "S"), [(1, 1), (4, 4), (1, 5), (3, 7), (5, 2), (6, 6), (7, 3)])
def test_causal_pairs_match_attnkit_mask(L, S):
    cost = attention_cost(L, 8, 2, kv_len=S, causal=True)
    pairs = int(attnkit.masks.causal_mask(L, S).sum())
    assert cost.symbols["P"] == pairs
    assert _comp(cost, "scores").useful_flops == 2 * cost.num_heads * pairs * cost.head_dim
    assert _comp(cost, "scores").flops == 2 * cost.num_heads * L * S * cost.head_dim


def test_causal_dense_unchanged_useful_about_half():
    dense, causal = attention_cost(512, 64, 4), attention_cost(512, 64, 4, causal=True)
    assert causal.flops == dense.flops and causal.matmul_flops == dense.matmul_flops
    ratio = _comp(causal, "scores").useful_flops / _comp(causal, "scores").flops
    assert ratio == pytest.approx(0.5 * (1 + 1 / 512))


def test_formulas_evaluate_to_the_values():
    cost = transformer_cost(
        7, 24, 3, ffn_dim=50, batch=2, kv_len=9, num_kv_heads=1, head_dim=5, causal=True
    )
    for c in cost.components:
        assert evaluate_formula(c.flops_formula, cost.symbols) == c.flops
        assert evaluate_formula(c.useful_flops_formula, cost.symbols) == c.useful_flops
        assert evaluate_formula(c.params_formula, cost.symbols) == c.params
        assert evaluate_formula(c.activations_formula, cost.symbols) == c.activations
    assert set("".join(c.flops_formula for c in cost.components)) <= set("BLSDHKEF0123456789*")


def test_evaluate_formula_rejects_other_expressions():
    assert evaluate_formula("L*(L+1)/2", {"L": 5}) == 15
    with pytest.raises(ValueError, match="not an integer"):
        evaluate_formula("L/2", {"L": 5})
    with pytest.raises(ValueError, match="unsupported"):
        evaluate_formula("__import__('os')", {})
    with pytest.raises(ValueError, match="unsupported"):
        evaluate_formula("X*2", {"L": 1})


def test_totals_dominant_and_layers():
    short, long = attention_cost(64, 512, 8), attention_cost(8192, 512, 8)
    assert short.dominant_term == "n*d^2" and short.dominant in {"q_proj", "k_proj", "v_proj"}
    assert long.dominant_term == "n^2" and long.dominant in {"scores", "weighted_sum"}
    one = transformer_cost(32, 16, 2, num_layers=1)
    four = transformer_cost(32, 16, 2, num_layers=4)
    assert four.flops == 4 * one.flops and four.params == 4 * one.params
    assert four.crossover_seq_len == one.crossover_seq_len
    assert one.ffn_dim == 64
    assert sum(r["flops_share"] for r in one.rows()) == pytest.approx(1.0)
    json.dumps(one.to_dict())  # JSON-serialisable


def test_to_dict_config_is_every_configuration_field():
    cost = transformer_cost(
        7, 24, 3, ffn_dim=50, num_layers=2, batch=2, kv_len=9, num_kv_heads=1, dtype="bf16"
    )
    assert cost.to_dict()["config"] == {
        "batch": 2,
        "seq_len": 7,
        "kv_len": 9,
        "dim": 24,
        "num_heads": 3,
        "num_kv_heads": 1,
        "head_dim": 8,
        "ffn_dim": 50,
        "num_layers": 2,
        "causal": False,
        "bias": True,
        "dtype": "bfloat16",
        "bytes_per_element": 2,
    }
    assert cost.to_dict()["components"][0] == {
        **dataclasses.asdict(cost.components[0]),
        "flops_share": cost.components[0].flops / sum(c.flops for c in cost.components),
    }


def test_dtype_sizes():
    assert dtype_size("bf16") == 2 and dtype_size(torch.float64) == 8 and dtype_size("fp32") == 4
    cost = attention_cost(16, 32, 4, dtype="bfloat16")
    assert cost.dtype == "bfloat16" and cost.param_bytes == 2 * cost.params
    with pytest.raises(ValueError, match="int8"):
        attention_cost(16, 32, 4, dtype="int8")


# --- crossover ---------------------------------------------------------------------------------
@pytest.mark.parametrize("D", [64, 96, 512, 1024])
@pytest.mark.parametrize("H", [1, 4, 8])
def test_crossover_is_twice_dim_for_standard_self_attention(D, H):
    n, exact = crossover_seq_len(D, H)
    assert n == 2 * D and exact == 2 * D
    # At n*, the L*S matmuls equal the projections; above they win, below they lose.
    for m, relation in ((n - 1, -1), (n, 0), (n + 1, 1)):
        c = attention_cost(m, D, H, batch=3)
        quad = sum(x.flops for x in c.components if x.matmul and x.quadratic)
        lin = sum(x.flops for x in c.components if x.matmul and not x.quadratic)
        assert (quad > lin) - (quad < lin) == relation


@pytest.mark.parametrize(
    ("D", "H", "K", "E", "F"),
    [(64, 8, 2, 8, None), (48, 4, 4, 7, None), (64, 4, 4, 16, 256), (30, 6, 3, 4, 50)],
)
def test_crossover_solves_the_equation(D, H, K, E, F):
    n, exact = crossover_seq_len(D, H, num_kv_heads=K, head_dim=E, ffn_dim=F)
    # Closed form from the formulas: a = 2*D*H*E*2 + 2*D*K*E*2 (+ 4*D*F), b = 4*H*E.
    a = 4 * D * H * E + 4 * D * K * E + (4 * D * F if F else 0)
    assert exact == Fraction(a, 4 * H * E) and n == math.ceil(exact)
    cost = (transformer_cost if F else attention_cost)(
        n, D, H, num_kv_heads=K, head_dim=E, **({"ffn_dim": F} if F else {})
    )
    quad = sum(x.flops for x in cost.components if x.matmul and x.quadratic)
    assert quad >= cost.matmul_flops - quad
    assert crossover_seq_len(512, 8, ffn_dim=2048)[0] == 6 * 512  # 4*D feed-forward: 6*D


def test_memory_crossover():
    c = attention_cost(1, 512, 8)
    assert c.memory_crossover_exact == Fraction(3 * 512 + 512 + 512, 8)
    at = attention_cost(320, 512, 8)
    assert at.attn_matrix_elements == at.linear_activation_elements


# --- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len=0"),
        ({"dim": -8}, ValueError, "dim=-8"),
        ({"batch": 0}, ValueError, "batch=0"),
        ({"kv_len": -1}, ValueError, "kv_len=-1"),
        ({"head_dim": 0}, ValueError, "head_dim=0"),
        ({"num_heads": 0}, ValueError, "num_heads=0"),
        ({"dim": 30, "num_heads": 4}, ValueError, r"dim \(30\).*num_heads \(4\)"),
        ({"num_kv_heads": 3}, ValueError, r"num_heads \(8\).*num_kv_heads \(3\)"),
        ({"seq_len": 2.5}, TypeError, "seq_len"),
        ({"seq_len": True}, TypeError, "seq_len"),
    ],
)
def test_bad_input_names_the_values(kwargs, error, match):
    args = {"seq_len": 16, "dim": 64, "num_heads": 8, **kwargs}
    with pytest.raises(error, match=match):
        attention_cost(args.pop("seq_len"), args.pop("dim"), args.pop("num_heads"), **args)


def test_bad_block_input():
    with pytest.raises(ValueError, match="ffn_dim=0"):
        transformer_cost(8, 16, 2, ffn_dim=0)
    with pytest.raises(ValueError, match="num_layers=-1"):
        transformer_cost(8, 16, 2, num_layers=-1)


# --- CLI -------------------------------------------------------------------------------------
@pytest.fixture
def main(monkeypatch):
    # Only this command's parser: the test must not depend on the other commands importing.
    monkeypatch.setattr(cli, "COMMANDS", {"complexity": cli.COMMANDS["complexity"]})
    return lambda *argv: cli.main(["complexity", *argv])


@pytest.mark.parametrize(("B", "N", "D", "H"), [(1, 16, 32, 4), (3, 37, 48, 6), (2, 300, 64, 1)])
def test_cli_json_matmul_flops_equal_flop_counter(main, capsys, B, N, D, H):
    assert (
        main("--seq-len", str(N), "--dim", str(D), "--heads", str(H), "--batch", str(B), "--json")
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    layer = attnkit.MultiHeadSelfAttention(D, D, D, H).eval()
    assert out["matmul_flops"] == count_flops(layer, torch.randn(B, N, D))
    with torch.device("meta"):
        meta_layer, x = attnkit.MultiHeadSelfAttention(D, D, D, H), torch.empty(B, N, D)
    assert out["matmul_flops"] == count_flops(meta_layer, x, math_backend=False)
    assert out["crossover_seq_len"] == 2 * D


def test_cli_json_gqa_cross_attention(main, capsys):
    argv = [
        "--seq-len",
        "5",
        "--kv-len",
        "9",
        "--dim",
        "24",
        "--heads",
        "6",
        "--kv-heads",
        "2",
        "--head-dim",
        "3",
        "--batch",
        "2",
        "--causal",
        "--json",
    ]
    assert main(*argv) == 0
    out = json.loads(capsys.readouterr().out)
    layer = attnkit.MultiHeadAttention(24, 6, head_dim=3, num_kv_heads=2, causal=True)
    assert out["matmul_flops"] == count_flops(layer, torch.randn(2, 5, 24), torch.randn(2, 9, 24))
    assert out["useful_flops"] < out["flops"]
    assert "MultiHeadAttention(24, 6, head_dim=3, num_kv_heads=2" in out["layer"]


def test_cli_table(main, capsys):
    assert (
        main(
            "--seq-len",
            "1024",
            "--dim",
            "512",
            "--heads",
            "8",
            "--causal",
            "--ffn-dim",
            "2048",
            "--layers",
            "2",
        )
        == 0
    )
    text = capsys.readouterr().out
    for piece in (
        "2*B*H*L*S*E",
        "2*B*H*P*E",
        "5*B*H*L*S",
        "B*H*L*S",
        "n* = 1024",
        "n* = 3072",
        "logsumexp",
        "ffn_up",
        "2*B*L*D*F",
        "useful",
    ):
        assert piece in text, piece


def test_cli_bad_input(main, capsys):
    assert main("--seq-len", "8", "--dim", "30", "--heads", "4") == 2
    assert "dim (30)" in capsys.readouterr().err
    assert main("--seq-len", "0", "--dim", "32", "--heads", "4") == 2
    assert "seq_len=0" in capsys.readouterr().err
    assert main("--seq-len", "8", "--dim", "32", "--heads", "4", "--kv-heads", "3") == 2
    assert "num_kv_heads (3)" in capsys.readouterr().err


def test_cli_plot(main, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "cost.png"
    assert main("--seq-len", "256", "--dim", "64", "--heads", "4", "--plot", str(target)) == 0
    import matplotlib.image

    for path in (target, tmp_path / "cost_memory.png"):  # two real pictures, not empty files
        pixels = matplotlib.image.imread(path)
        assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 200, (path, pixels.shape)
        assert pixels.reshape(-1, pixels.shape[-1]).std(0).max() > 0.05  # more than one colour
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_measure(main, capsys):
    assert main("--seq-len", "64", "--dim", "32", "--heads", "4", "--measure", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    m = out["measured"]
    assert m["gflops"] == pytest.approx(out["matmul_flops"] / m["seconds"] / 1e9)
    assert m["fraction_of_matmul_peak"] == pytest.approx(m["gflops"] / m["machine_matmul_gflops"])
    assert m["flop_counter_math_backend"] == out["matmul_flops"]
    projections = sum(c["flops"] for c in out["components"] if c["matmul"] and not c["quadratic"])
    # torch 2.13 on CPU: the counter does not see the fused SDPA kernel (projections only).
    assert m["flop_counter_default_kernel"] in {projections, out["matmul_flops"]}
    assert main("--seq-len", "64", "--dim", "32", "--heads", "4", "--measure") == 0
    text = capsys.readouterr().out
    assert "GFLOP/s" in text and "peak memory" in text and "FlopCounterMode" in text
