"""attnkit.decoding: the prepared-weight, static-cache decoder equals the model's own forward."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from attnkit import decoding
from attnkit.config import TransformerConfig
from attnkit.decoding import Decoder, decoder_for
from attnkit.models import TransformerLM

TOL = {"atol": 1e-5, "rtol": 1e-5}

LLAMA = {
    "norm": "rmsnorm",
    "activation": "swiglu",
    "bias": False,
    "rope_interleaved": False,
    "num_kv_heads": 2,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": LLAMA,
    "gpt-default": {},
    "mqa-window-sinusoidal": {"position": "sinusoidal", "num_kv_heads": 1, "window": 4},
    "learned-postnorm-relu": {"position": "learned", "norm_first": False, "activation": "relu"},
    "no-positions-untied": {"position": "none", "tie_embeddings": False, "activation": "silu"},
    "qkv-bias-only": {**LLAMA, "qkv_bias": True},
    "swiglu-bias-head-dim": {"activation": "swiglu", "head_dim": 6},
    "rope-llama3-scaling": {
        **LLAMA,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    },
}


def _lm(**options: Any) -> TransformerLM:
    return TransformerLM(TransformerConfig(50, 24, 2, 4, max_seq_len=32, **options)).eval()


def _decode(dec: Decoder, ids: Tensor, prompt: int, **prefill: Any) -> Tensor:
    """Logits after each of ``ids[:, prompt-1:]`` (prefill, then steps): ``(B, L-prompt+1, V)``."""
    out = [dec.prefill(ids[:, :prompt], **prefill)]
    for t in range(prompt, ids.shape[1]):
        out.append(dec.step(ids[:, t : t + 1]))
    return torch.stack(out, dim=1)


Tensor = torch.Tensor


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_and_steps_equal_the_full_forward(name: str) -> None:
    lm = _lm(**CONFIGS[name])
    ids = torch.randint(0, 50, (3, 13))
    got = _decode(Decoder(lm), ids, 5, capacity=20)
    assert_close(got, lm(ids)[:, 4:], **TOL)


@pytest.mark.parametrize("layout", ["linear", "transposed", "packed", "reduce"])
@pytest.mark.parametrize("name", ["llama", "gpt-default", "learned-postnorm-relu"])
def test_every_weight_layout_equals_the_full_forward(
    name: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if layout == "packed" and not torch.backends.mkldnn.is_available():
        layout = "linear"  # the packed layout falls back to it; still checked below
    monkeypatch.setattr(decoding, "_layout", lambda weight, compiled: layout)
    lm = _lm(**CONFIGS[name])
    dec = Decoder(lm)
    assert {dec.layers[0].qkv.layout, dec.layers[1].down.layout, dec.head.layout} == {layout}
    ids = torch.randint(0, 50, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, :3] = False
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    want = lm(ids, mask, positions=positions)[:, 4:]
    got = _decode(dec, ids, 5, mask=mask[:, :5], capacity=12)
    real = mask[:, 4:]
    assert_close(got[real], want[real], **TOL)


def test_layouts_follow_the_measured_rule() -> None:
    dec = Decoder(_lm(**LLAMA))
    assert dec.layers[0].qkv.layout == "transposed" and dec.head.layout == "transposed"
    assert dec.layers[0].qkv.weight.shape == (24, 4 * 6 + 2 * 2 * 6)  # (in, out)
    dec16 = Decoder(_lm(**LLAMA).to(torch.bfloat16))
    want = "packed" if torch.backends.mkldnn.is_available() else "linear"
    assert dec16.layers[0].up.layout == want
    assert Decoder(_lm(**LLAMA).double()).layers[0].out.layout == "linear"
    assert Decoder(_lm(**LLAMA).to(torch.bfloat16), compile=True).head.layout == "reduce"
    assert Decoder(_lm(**LLAMA).double(), compile=True).head.layout == "linear"


@pytest.mark.parametrize("name", ["llama", "mqa-window-sinusoidal", "learned-postnorm-relu"])
def test_left_padded_batch_equals_the_masked_forward(name: str) -> None:
    lm = _lm(**CONFIGS[name])
    ids = torch.randint(0, 50, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[0, :4] = False
    mask[2, :1] = False
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    want = lm(ids, mask, positions=positions)[:, 5:]
    got = _decode(Decoder(lm), ids, 6, mask=mask[:, :6], capacity=12)
    real = mask[:, 5:]  # rows of pad tokens are not compared (the prompt's pads are left)
    assert_close(got[real], want[real], **TOL)


def test_explicit_positions_are_used() -> None:
    lm = _lm(**LLAMA)
    ids = torch.randint(0, 50, (2, 6))
    positions = torch.arange(3, 9)
    dec = Decoder(lm)
    got = dec.prefill(ids[:, :4], positions=positions[:4], capacity=10)
    assert_close(got, lm(ids[:, :4], positions=positions[:4])[:, -1], **TOL)
    got = dec.step(ids[:, 4:5], torch.tensor([7, 7]))
    assert_close(got, lm(ids[:, :5], positions=positions[:5])[:, -1], **TOL)


def test_greedy_generate_equals_uncached_generate() -> None:
    lm = _lm(**LLAMA)
    prompt = torch.randint(0, 50, (2, 5))
    cached = lm.generate(prompt, 12)
    assert torch.equal(cached, lm.generate(prompt, 12, use_cache=False))
    # The decoder is reused across calls and reset by prefill.
    assert decoder_for(lm) is decoder_for(lm)
    assert torch.equal(lm.generate(prompt, 12), cached)


def test_interleaved_streams_do_not_share_a_cache() -> None:
    lm = _lm(**LLAMA)
    a, b = torch.randint(0, 50, (1, 5)), torch.randint(0, 50, (2, 3))
    want_a, want_b = lm.generate(a, 6)[:, 5:], lm.generate(b, 6)[:, 3:]
    sa, sb = lm.stream(a, 6), lm.stream(b, 6)
    got_a, got_b = [], []
    for ca, cb in zip(sa, sb, strict=True):
        got_a.append(ca)
        got_b.append(cb)
    assert torch.equal(torch.stack(got_a, 1), want_a)
    assert torch.equal(torch.stack(got_b, 1), want_b)
    assert not decoder_for(lm).in_use  # released when the streams ended


def test_decoders_do_not_keep_their_model_alive() -> None:
    lm = _lm(**LLAMA)
    lm.generate(torch.zeros(1, 2, dtype=torch.long), 2)
    dec = decoder_for(lm)
    assert dec.model is lm and len(decoding._DECODERS) >= 1
    n = len(decoding._DECODERS)
    del lm
    gc.collect()
    assert len(decoding._DECODERS) == n - 1
    with pytest.raises(RuntimeError, match="no longer exists"):
        dec.prefill(torch.zeros(1, 2, dtype=torch.long))


def test_sampling_with_a_generator_equals_uncached() -> None:
    lm = _lm(**LLAMA)
    prompt = torch.randint(0, 50, (2, 4))
    a = lm.generate(
        prompt, 8, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(3)
    )
    b = lm.generate(
        prompt,
        8,
        temperature=1.0,
        top_k=10,
        use_cache=False,
        generator=torch.Generator().manual_seed(3),
    )
    assert torch.equal(a, b)


def test_weights_changed_in_place_are_prepared_again() -> None:
    lm = _lm(**LLAMA)
    ids = torch.randint(0, 50, (1, 6))
    dec = Decoder(lm)
    dec.prefill(ids, capacity=8)
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(1.5)
        lm.blocks[0].feed_forward.gate.weight = torch.nn.Parameter(torch.randn(96, 24) * 0.1)
    assert_close(dec.prefill(ids, capacity=8), lm(ids)[:, -1], **TOL)


def test_bf16_weights_follow_the_float64_model() -> None:
    lm = _lm(**LLAMA)
    ids = torch.randint(0, 50, (2, 10))
    want = copy.deepcopy(lm).double()(ids)[:, 3:].float()
    got = _decode(Decoder(copy.deepcopy(lm).to(torch.bfloat16)), ids, 4, capacity=10)
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 0.05, err
    fp32 = _decode(Decoder(lm), ids, 4, capacity=10)
    assert (fp32 - want).abs().max() / want.abs().max() < 1e-5


def test_errors_name_the_offending_values() -> None:
    lm = _lm(**LLAMA)
    with pytest.raises(TypeError, match="TransformerLM"):
        Decoder(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    dec = Decoder(lm)
    with pytest.raises(RuntimeError, match="prefill"):
        dec.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        dec.prefill(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        dec.prefill(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"capacity \(40\).*max_seq_len \(32\)"):
        dec.prefill(torch.zeros(1, 3, dtype=torch.long), capacity=40)
    with pytest.raises(ValueError, match=r"capacity \(2\).*prompt \(3\)"):
        dec.prefill(torch.zeros(1, 3, dtype=torch.long), capacity=2)
    with pytest.raises(ValueError, match=r"mask must be \(1, 3\)"):
        dec.prefill(torch.zeros(1, 3, dtype=torch.long), mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions must lie in"):
        dec.prefill(
            torch.zeros(1, 3, dtype=torch.long), positions=torch.tensor([0, 1, 9]), capacity=4
        )
    dec.prefill(torch.zeros(2, 3, dtype=torch.long), capacity=4)
    with pytest.raises(ValueError, match=r"next_ids must be \(2, 1\)"):
        dec.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions must be \(2,\)"):
        dec.step(torch.zeros(2, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    dec.step(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"full \(4 slots\)"):
        dec.step(torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.slow
def test_compiled_step_equals_eager() -> None:
    # One row: the compiled step's products are inductor's fused multiply-sums.
    lm = _lm(**LLAMA, window=5)
    ids = torch.randint(0, 50, (1, 11))
    dec = Decoder(lm, compile=True)
    assert dec.head.layout == "reduce"
    got = _decode(dec, ids, 6, capacity=12)
    want = _decode(Decoder(lm), ids, 6, capacity=12)
    assert_close(got, want, **TOL)
    assert_close(got, lm(ids)[:, 5:], **TOL)
    assert list(dec.compile_seconds) == [(1, 12)]
    # Same shape again: no new compilation, same results.
    assert_close(_decode(dec, ids, 6, capacity=12), want, **TOL)
    assert list(dec.compile_seconds) == [(1, 12)]
    # A left-padded batch through generate (the batched products are F.linear).
    prompt = torch.randint(0, 50, (2, 4))
    assert torch.equal(
        lm.generate(prompt, 6, compile=True), lm.generate(prompt, 6, use_cache=False)
    )
