"""Block layouts (q8_0, q4_0, q4_1): modules against float64 dequantized math, the default layout
choice, and the errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from attnkit import quantize as quantize_module
from attnkit.kernels.block_linear import (
    TILE_ROWS,
    BlockWeight,
    block_dot_linear,
    block_product,
    pack_nibbles,
    unpack_nibbles,
)
from attnkit.quantize import BlockLinear, Int4Linear, Int8Linear, layer_error, quantize


def _reference(weight: torch.Tensor, layout: str, group: int) -> torch.Tensor:
    """The dequantized weight of ``layout`` in float64, by the layout's definition."""
    w = weight.double().reshape(weight.shape[0], -1, group)
    if layout == "q8_0":
        d = (w.abs().amax(-1, keepdim=True) / 127).half().double()
        return (torch.where(d > 0, w / d, 0).round().clamp(-127, 127) * d).flatten(1)
    if layout == "q4_0":
        at = w.abs().argmax(-1, keepdim=True)
        d = (w.gather(-1, at) / -8).half().double()
        q = (torch.where(d != 0, w / d, 0).round() + 8).clamp(0, 15)
        return ((q - 8) * d).flatten(1)
    low = w.amin(-1, keepdim=True)
    d = ((w.amax(-1, keepdim=True) - low) / 15).half().double()
    m = low.half().double()
    q = torch.where(d > 0, (w - m) / d, 0).round().clamp(0, 15)
    return (q * d + m).flatten(1)


@pytest.mark.parametrize("layout", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_block_linear_equals_float64_dequantized_math(layout: str, group: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 128, generator=gen)
    bias = torch.randn(37, generator=gen)
    layer = BlockLinear.from_weight(weight, bias, layout=layout, group_size=group)  # type: ignore[arg-type]
    want_w = _reference(weight, layout, group)
    assert_close(layer.dequantize().double(), want_w, rtol=0, atol=1e-6)
    x = torch.randn(rows, 128, generator=gen)
    want = x.double() @ want_w.T + bias.double()
    with torch.no_grad():  # (few rows: the kernel; more: the dequantized product)
        got = layer(x)
    assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("layout", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("tile", TILE_ROWS)
def test_block_kernel_over_many_groups_and_a_partial_tile(
    layout: str, activations: str, tile: int
) -> None:
    from attnkit.kernels.linear import round_activations

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(7, 32 * 70, generator=gen)  # (more groups than a pass widens at once)
    layer = BlockLinear.from_weight(weight, layout=layout)  # type: ignore[arg-type]
    x = torch.randn(2, weight.shape[1], generator=gen)
    rounded = activations == "int8"
    prepared = BlockWeight(layer.codes, layer.scales, layer.offsets, layer.bits, tile)
    got = block_product(x, prepared, rounded)
    want = (round_activations(x) if rounded else x).double() @ _reference(weight, layout, 32).T
    assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("layout", ["q8_0", "q4_1"])
def test_the_kernel_follows_codes_loaded_or_replaced(layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    first, second, third = (
        BlockLinear.from_weight(torch.randn(9, 64, generator=gen), layout=layout)  # type: ignore[arg-type]
        for _ in range(3)
    )
    x = torch.randn(1, 64, generator=gen)
    with torch.no_grad():
        first(x)  # (prepares the kernel's weight)
        first.load_state_dict(second.state_dict())  # (copied into the same tensors)
        assert torch.equal(first(x), second(x))
        first.codes, first.scales = third.codes, third.scales  # (replaced)
        first.offsets = third.offsets
        assert torch.equal(first(x), third(x))


def test_block_kernel_checks_its_inputs() -> None:
    codes = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(TypeError, match="float16 scales"):
        block_dot_linear(torch.zeros(1, 64), codes, torch.ones(4, 2), None, 8)
    with pytest.raises(ValueError, match=r"needs x \(rows, n\)"):
        block_dot_linear(torch.zeros(1, 32), codes, torch.ones(4, 2).half(), None, 8)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        block_dot_linear(torch.zeros(1, 64), codes, torch.ones(4, 2).half(), None, 2)
    q = torch.randint(0, 16, (3, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)


def test_bad_group_sizes_and_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"group_size must be one of .* got 48"):
        BlockLinear(96, 8, layout="q4_1", group_size=48)
    with pytest.raises(ValueError, match="in_features=100 is not a multiple of group_size=32"):
        BlockLinear.from_weight(torch.randn(8, 100), layout="q8_0")
    with pytest.raises(ValueError, match=r"layout must be one of .* got 'q5_0'"):
        BlockLinear(64, 8, layout="q5_0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layout for int8 must be one of .* got 'q4_1'"):
        quantize(nn.Linear(64, 8), "int8", layout="q4_1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"group_size must be one of .* got 16"):
        quantize(nn.Linear(64, 8), "int4", group_size=16)
    with pytest.raises(ValueError, match=r"q4_1 needs torch.uint8 codes .* got codes torch.int8"):
        BlockLinear.from_codes(
            torch.zeros(2, 16, dtype=torch.int8), torch.ones(2, 1).half(), layout="q4_1"
        )


def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(256, 64), nn.Linear(100, 8))
    with torch.no_grad():
        model[1].weight[:, 3] *= 200  # an outlier column: one scale a row loses the rest
    return model


def test_auto_int8_keeps_per_channel_only_within_the_tolerance() -> None:
    model = _two_linears()
    weights = [m.weight.detach().clone() for m in model]
    quantize(model, "int8")
    assert isinstance(model[0], Int8Linear)  # (well-behaved rows: per channel is within it)
    assert isinstance(model[1], BlockLinear) and model[1].layout == "q8_0"
    assert isinstance(model[2], Int8Linear)  # (100 inputs: no block of 32 divides them)
    channel = quantize_module._channel_weight(weights[1])
    assert layer_error(weights[1], channel) > quantize_module.CHANNEL_TOLERANCE
    assert layer_error(weights[1], model[1].dequantize()) < layer_error(weights[1], channel)
    assert layer_error(weights[0], quantize_module._channel_weight(weights[0])) <= (
        quantize_module.CHANNEL_TOLERANCE
    )
    explicit = quantize(_two_linears(), "int8", layout="channel")
    assert all(isinstance(m, Int8Linear) for m in explicit)


@pytest.mark.parametrize(
    ("layout", "kind"),
    [("auto", Int4Linear), ("grouped", Int4Linear), ("q4_1", BlockLinear), ("q4_0", BlockLinear)],
)
def test_int4_layouts_and_the_default_group_of_32(layout: str, kind: type) -> None:
    model = quantize(nn.Sequential(nn.Linear(128, 16)), "int4", layout=layout)  # type: ignore[arg-type]
    assert isinstance(model[0], kind) and model[0].group_size == 32
    if layout.startswith("q4"):
        assert model[0].layout == layout


@pytest.mark.parametrize("layout", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 9])
def test_int8_activations_equal_the_rounded_activations_product(layout: str, rows: int) -> None:
    from attnkit.kernels.linear import round_activations
    from attnkit.quantized.block import set_activations

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(21, 96, generator=gen)
    model = nn.Sequential(BlockLinear.from_weight(weight, layout=layout))  # type: ignore[arg-type]
    x = torch.randn(rows, 96, generator=gen)
    with torch.no_grad():
        exact = model(x)
        set_activations(model, "int8")
        got = model(x)
    want = round_activations(x).double() @ _reference(weight, layout, 32).T
    assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())
    assert not torch.equal(got, exact)  # (the rounding shows)
    with pytest.raises(ValueError, match=r"activations must be one of \('float', 'int8'\)"):
        set_activations(model, "bf16")


@pytest.mark.slow
def test_compiled_generation_runs_the_block_layers_as_eager_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("FLOAT32", "FLOAT32_BATCH"):  # (the graph itself)
        monkeypatch.setenv(f"ATTNKIT_KERNEL_DECODING_COMPILED_STEP_{name}", "graph")
    from attnkit.config import FAMILIES, TransformerConfig
    from attnkit.models import TransformerLM

    torch.manual_seed(0)
    config = TransformerConfig(256, 64, 2, 2, ffn_dim=128, max_seq_len=64, **FAMILIES["llama"])
    lm = quantize(TransformerLM(config).eval(), "int4", layout="q4_1")
    assert isinstance(lm.lm_head, BlockLinear)
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    eager = lm.generate(prompt, 6, eos_token_id=[], compile=False)
    assert torch.equal(lm.generate(prompt, 6, eos_token_id=[], compile=True), eager)
