"""``torch.compile(model, fullgraph=True)`` of the whole models: the graph has no break (no
Python branch on a tensor's value) and the compiled model computes what the eager one does.

``backend="eager"`` runs dynamo's capture, which is where a data-dependent check breaks the graph,
without inductor's code generation (seconds instead of tens of seconds on a 2-core CPU); one test
compiles with the default inductor backend end to end.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from attnkit.kernels import policy
from attnkit.models import TransformerEncoder, TransformerLM
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    reserved_rotary_tables,
)

POSITIONS = ["none", "sinusoidal", "learned", "rope"]
VOCAB, L = 32, 8


def _tiny(kind: str, position: str, **options: object) -> nn.Module:
    cls = TransformerLM if kind == "lm" else TransformerEncoder
    model = cls(
        vocab_size=VOCAB,
        dim=16,
        num_layers=2,
        num_heads=2,
        ffn_dim=32,
        position=position,
        max_seq_len=16,
        **options,
    )
    return model.eval()


def _compiled(model: nn.Module, backend: str = "eager") -> nn.Module:
    torch._dynamo.reset()  # each test captures afresh (no cache hits from another model)
    # The kernels' plan is decided eagerly (a trace reads the plan decided before it), so the
    # compiled model and the eager one it is compared with run the same kernels.
    policy.linear_plan()
    return torch.compile(model, fullgraph=True, backend=backend)  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["lm", "encoder"])
@pytest.mark.parametrize("position", POSITIONS)
def test_fullgraph_capture_equals_eager(kind: str, position: str) -> None:
    model = _tiny(kind, position)
    compiled = _compiled(model)
    x = torch.randint(0, VOCAB, (2, L))
    with torch.no_grad():
        assert_close(compiled(x), model(x), atol=0, rtol=0)
        y = torch.randint(0, VOCAB, (2, L))  # new values, same shapes: the graph is reused
        assert_close(compiled(y), model(y), atol=0, rtol=0)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_fullgraph_encoder_with_padding_and_positions(position: str) -> None:
    model = _tiny("encoder", position, pool="mean", num_outputs=3)
    compiled = _compiled(model)
    x = torch.randint(0, VOCAB, (2, L))
    real = torch.arange(L)[None, :] < torch.tensor([[L], [5]])  # (B, L): second text padded
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 2]])  # (B, L)
    with torch.no_grad():
        assert_close(compiled(x, mask=real), model(x, mask=real), atol=0, rtol=0)
        assert_close(compiled(x, positions=packed), model(x, positions=packed), atol=0, rtol=0)


def test_fullgraph_lm_with_window_gqa_and_padding() -> None:
    # causal + window + a padding mask: the structured-mask path of the kernel, captured whole
    model = _tiny("lm", "rope", num_kv_heads=1, window=4, norm_first=True)
    compiled = _compiled(model)
    x = torch.randint(0, VOCAB, (2, L))
    real = torch.arange(L)[None, :] < torch.tensor([[L], [6]])  # (B, L)
    with torch.no_grad():
        assert_close(compiled(x), model(x), atol=0, rtol=0)
        assert_close(compiled(x, mask=real), model(x, mask=real), atol=0, rtol=0)


def test_fullgraph_encoder_with_lengths() -> None:
    model = _tiny("encoder", "sinusoidal", pool="mean")
    compiled = _compiled(model)
    x, lengths = torch.randint(0, VOCAB, (3, L)), torch.tensor([L, 5, 1])
    with torch.no_grad():
        assert_close(compiled(x, lengths=lengths), model(x, lengths=lengths), atol=0, rtol=0)


def test_compiled_rotary_computes_the_table_rows() -> None:
    # compiled, RotaryEmbedding computes cos/sin per position instead of sizing a table by the
    # largest position: the same float64 angles, so the same rotation (up to a float32 rounding:
    # eager CPU inference rotates through attnkit's kernel, which fuses no multiply-add)
    rotary = RotaryEmbedding(8, interleaved=False)
    x = torch.randn(2, 3, 5, 8)
    positions = torch.tensor([[0, 7, 100, 3, 4096], [5, 6, 7, 8, 9]])
    want = rotary(x, positions)
    assert_close(_compiled(rotary)(x, positions), want, atol=1e-6, rtol=1e-6)


def test_compiled_rotary_gathers_the_rows_of_reserved_tables() -> None:
    # with tables reserved, the graph looks the rows up instead of computing cosines; the same
    # values as eager, which looks them up too (up to a float32 rounding: eager CPU inference
    # rotates through attnkit's kernel)
    rotary = RotaryEmbedding(8, interleaved=False)
    x = torch.randn(2, 3, 5, 8)
    positions = torch.tensor([[0, 7, 100, 3, 60], [5, 6, 7, 8, 9]])
    want = rotary(x, positions)
    graphs: list[str] = []

    def capture(gm: torch.fx.GraphModule, inputs: object) -> object:
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(rotary, fullgraph=True, backend=capture)
    assert_close(compiled(x, positions), want, atol=1e-6, rtol=1e-6)
    assert ".cos()" in graphs[-1]  # (no reservation: computed)
    with reserved_rotary_tables(rotary, 101):
        assert rotary._reserved == 128  # (the table's size: nearby lengths share a graph)
        assert_close(compiled(x, positions), want, atol=1e-6, rtol=1e-6)
        assert ".cos()" not in graphs[-1] and len(graphs) == 2
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
            compiled(x, positions + 100)  # past the reservation
    assert rotary._reserved == 0  # released: computed again
    assert_close(compiled(x, positions + 100), rotary(x, positions + 100), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="length must be non-negative, got -1"):
        rotary.reserve(-1)


def test_eager_still_checks_position_values() -> None:
    # the value checks are skipped only while compiling
    learned = LearnedPositionalEmbedding(4, 6)
    with pytest.raises(ValueError, match="needs 5 positions but max_seq_len is 4"):
        learned(torch.randn(1, 2, 6), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="needs 5 positions but max_seq_len is 4"):
        learned(torch.randn(1, 5, 6))
    with pytest.raises(ValueError, match="non-negative, got min -1"):
        RotaryEmbedding(4)(torch.randn(2, 4), torch.tensor([0, -1]))


@pytest.mark.slow
def test_inductor_compiles_lm_and_encoder() -> None:
    x = torch.randint(0, VOCAB, (2, L))
    for model in (_tiny("lm", "rope", norm_first=True), _tiny("encoder", "learned")):
        compiled = _compiled(model, backend="inductor")
        with torch.no_grad():
            assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
