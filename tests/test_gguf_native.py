"""GGUF's Q8_0, Q4_0 and Q4_1 matrices load as they are into block-quantized linears."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from attnkit import TransformerLM
from attnkit.interop import gguf as ak_gguf
from attnkit.quantized import BlockLinear
from tests.test_gguf import write_gguf

pytest.importorskip("gguf")

NATIVE = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


@pytest.fixture(scope="module", params=list(NATIVE))
def native_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"native-{request.param}")
    return write_gguf(folder / "tiny.gguf", request.param, seed=3)


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))


def _quantized_bytes(model: nn.Module) -> int:
    return sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, BlockLinear)
        for t in (m.codes, m.scales, *([] if m.offsets is None else [m.offsets]))
    )


def test_native_layers_hold_the_files_blocks_and_give_its_logits(native_file: Path) -> None:
    lm = TransformerLM.from_pretrained(native_file)
    floats = TransformerLM.from_pretrained(native_file, dequantize=True)
    blocks = [m for m in lm.modules() if isinstance(m, BlockLinear)]
    assert blocks and not any(isinstance(m, BlockLinear) for m in floats.modules())
    layouts = {m.layout for m in blocks}
    assert len(layouts) == 1 and layouts <= set(NATIVE.values())
    assert not any(type(m) is nn.Linear for m in lm.modules())
    # Bytes held: the file's matrices (every linear is one of them, the head too).
    file = ak_gguf._open(native_file)
    matrices = sum(t.nbytes for n, t in file.tensors.items() if len(t.shape) == 2)
    embedding = file.tensors["token_embd.weight"].nbytes
    assert _quantized_bytes(lm) == matrices - embedding
    ids = _ids()
    with torch.no_grad():
        want, got = floats(ids), lm(ids)
        one = lm(ids[:, :1])  # a decoding-sized product runs the block kernel
    assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
    assert_close(one, want[:, :1], rtol=0, atol=1e-3 * want.abs().max().item())
    assert want.abs().max() > 0.05


def test_native_layers_equal_the_dequantized_weights(native_file: Path) -> None:
    lm = TransformerLM.from_pretrained(native_file)
    floats = TransformerLM.from_pretrained(native_file, dequantize=True)
    got = dict(lm.named_modules())
    for name, module in floats.named_modules():
        if type(module) is nn.Linear:
            layer = got[name]
            assert isinstance(layer, BlockLinear), name
            assert torch.equal(layer.dequantize(), module.weight.float()), name


def test_mixed_layouts_in_one_fused_linear_are_dequantized(tmp_path: Path) -> None:
    # q/k/v fill one fused projection: parts of different layouts cannot share its blocks.
    from attnkit.interop.loading import NativeBlocks, _concat

    q8 = NativeBlocks("q8_0", torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1).half(), None)
    q4 = NativeBlocks("q4_0", torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 1).half(), None)
    assert _concat([(0, q8), (2, q4)]) is None
    both = _concat([(2, q8), (0, q8)])
    assert both is not None and both.codes.shape == (4, 32)


def test_a_tied_head_multiplies_the_embeddings_blocks(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tied.gguf", "Q4_1", seed=5, tie=True)
    lm = TransformerLM.from_pretrained(path)
    floats = TransformerLM.from_pretrained(path, dequantize=True)
    assert isinstance(lm.lm_head, BlockLinear) and lm.lm_head.layout == "q4_1"
    assert floats.lm_head is None and lm.embedding.weight.dtype == torch.float32
    assert torch.equal(lm.lm_head.dequantize(), floats.embedding.weight)
    ids = _ids()
    with torch.no_grad():
        want = floats(ids)
        assert_close(lm(ids), want, rtol=0, atol=1e-3 * want.abs().max().item())
