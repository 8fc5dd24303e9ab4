"""Encoder and decoder LM: order sensitivity, causality, cached decoding, GQA, conventions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnkit import masks as M
from attnkit.cache import KVCache
from attnkit.config import TransformerConfig
from attnkit.models import TransformerEncoder, TransformerLM, attention_mask_from_padding
from attnkit.positional import convert_rotary_convention
from tests.helpers import ROPE_LLAMA3 as LLAMA3

TOL = {"atol": 1e-5, "rtol": 1e-5}
POSITIONS = ["none", "sinusoidal", "learned", "rope"]


def _lm(position: str = "rope", **kw: object) -> TransformerLM:
    options = {"num_kv_heads": 2, "max_seq_len": 32, "position": position, **kw}
    return TransformerLM(40, 32, 2, 4, **options).eval()  # type: ignore[arg-type]


def _logits_and_hidden(lm: TransformerLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lm(ids)`` and the hidden states its output head reads (the final norm's output)."""
    seen: list[torch.Tensor] = []
    handle = lm.norm.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        logits = lm(ids)
    finally:
        handle.remove()
    assert len(seen) == 1
    return logits, seen[0]


# -------------------------------------------------------------------------- order and causality


@settings(max_examples=10, deadline=None)
@given(perm_seed=st.integers(0, 10_000))
def test_encoder_without_positions_is_permutation_equivariant(perm_seed: int) -> None:
    torch.manual_seed(0)
    enc = TransformerEncoder(30, 16, 2, 4, position="none", num_kv_heads=2).eval()
    ids = torch.randint(0, 30, (2, 7))
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(perm_seed))
    assert_close(enc(ids[:, perm]), enc(ids)[:, perm], **TOL)


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rope"])
def test_encoder_with_positions_is_not_permutation_equivariant(position: str) -> None:
    enc = TransformerEncoder(30, 16, 2, 4, position=position).eval()
    ids = torch.arange(7)[None]
    perm = torch.tensor([6, 5, 4, 3, 2, 1, 0])
    assert not torch.allclose(enc(ids[:, perm]), enc(ids)[:, perm], atol=1e-3)


@settings(max_examples=12, deadline=None)
@given(cut=st.integers(1, 9), position=st.sampled_from(POSITIONS))
def test_causal_outputs_ignore_future_tokens(cut: int, position: str) -> None:
    torch.manual_seed(0)
    lm = _lm(position)
    ids = torch.randint(0, 40, (2, 10))
    changed = ids.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % 40
    a, b = lm(ids), lm(changed)
    assert_close(a[:, :cut], b[:, :cut], **TOL)
    assert not torch.allclose(a[:, cut:], b[:, cut:])


def test_causal_encoder_ignores_future_tokens() -> None:
    enc = TransformerEncoder(30, 16, 2, 4, causal=True, position="rope").eval()
    ids = torch.randint(0, 30, (1, 8))
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 3) % 30
    assert_close(enc(ids)[:, :5], enc(changed)[:, :5], **TOL)


# ----------------------------------------------------------------------------- padding, heads


def test_encoder_padding_leaves_real_tokens_unchanged() -> None:
    enc = TransformerEncoder(30, 16, 2, 4, position="rope", num_outputs=3, pool="mean").eval()
    ids = torch.randint(1, 30, (2, 6))
    lengths = torch.tensor([6, 4])
    padded = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1)  # junk padding
    padded[1, 4:] = 7
    alone = torch.stack([enc(ids[:1]), enc(ids[1:, :4])])[:, 0]
    assert_close(enc(padded, lengths=lengths), alone, **TOL)
    real = torch.arange(9)[None] < lengths[:, None]
    assert_close(enc(padded, real), alone, **TOL)


def test_encoder_weights_heads_and_vector_inputs() -> None:
    enc = TransformerEncoder(None, 16, 3, 4, num_kv_heads=1, num_outputs=5).eval()
    x = torch.randn(2, 6, 16)
    out, weights = enc(x, return_weights=True)
    assert out.shape == (2, 6, 5)
    assert len(weights) == 3 and weights[0].shape == (2, 4, 6, 6)
    assert_close(weights[2].sum(-1), torch.ones(2, 4, 6))
    first = TransformerEncoder(30, 16, 1, 2, num_outputs=2, pool="first").eval()
    ids = torch.randint(0, 30, (3, 5))
    assert first(ids).shape == (3, 2)
    with pytest.raises(ValueError, match="alibi"):
        TransformerEncoder(30, 16, 1, 2, position="alibi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both"):
        attention_mask_from_padding(torch.ones(1, 2, dtype=torch.bool), torch.tensor([2]))


def test_padding_helpers_live_in_masks() -> None:
    assert attention_mask_from_padding is M.attention_mask_from_padding
    lengths = torch.tensor([2, 4])
    expected = torch.tensor([[True, True, False, False], [True, True, True, True]])
    assert torch.equal(M.token_mask(None, lengths, 4, torch.device("cpu")), expected)
    assert torch.equal(M.token_mask(expected, None, 4, torch.device("cpu")), expected)
    assert M.token_mask(expected.float(), None, 4, torch.device("cpu")) is None
    assert M.token_mask(None, None, 4, torch.device("cpu")) is None
    padding = M.attention_mask_from_padding(None, lengths, seq_len=4)
    assert torch.equal(padding, M.attention_mask_from_padding(expected))
    assert padding.shape == (2, 1, 1, 4)
    # The encoder's mean pool uses the token mask: padded positions do not count.
    enc = TransformerEncoder(30, 16, 1, 2, num_outputs=3, pool="mean").eval()
    ids = torch.randint(0, 30, (2, 4))
    short = TransformerEncoder(30, 16, 1, 2, num_outputs=3, pool="mean").eval()
    short.load_state_dict(enc.state_dict())
    assert_close(enc(ids, lengths=lengths)[0], short(ids[:1, :2])[0], **TOL)


def test_lm_head_is_tied_and_gqa_runs_through_the_stack() -> None:
    lm = _lm()
    assert not any("head" in k for k in lm.state_dict())
    ids = torch.randint(0, 40, (2, 5))
    logits, h = _logits_and_hidden(lm, ids)
    assert_close(logits, h @ lm.embedding.weight.T)
    for block in lm.blocks:
        assert block.attention.num_kv_heads == 2
        assert block.attention.qkv_proj.out_features == 32 + 2 * 2 * 8
    caches = lm.make_kv_caches(2, 8)
    assert caches[0].k.shape == (2, 2, 8, 8)


# ------------------------------------------------------------------------------ cached decoding


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("norm_first", [True, False])
def test_cached_logits_equal_uncached(position: str, norm_first: bool) -> None:
    lm = _lm(position, norm_first=norm_first, activation="swiglu", norm="rmsnorm")
    ids = torch.randint(0, 40, (2, 12))
    full = lm(ids)
    caches = lm.make_kv_caches(2, 12)
    steps = [lm(ids[:, :5], kv_caches=caches)]
    steps += [lm(ids[:, t : t + 1], kv_caches=caches) for t in range(5, 12)]
    assert_close(torch.cat(steps, 1), full, **TOL)


@pytest.mark.parametrize("position", POSITIONS)
def test_generate_cached_equals_uncached_greedy(position: str) -> None:
    lm = _lm(position)
    prompt = torch.randint(0, 40, (2, 4))
    cached = lm.generate(prompt, 10)
    uncached = lm.generate(prompt, 10, use_cache=False)
    assert cached.shape == (2, 14)
    assert torch.equal(cached[:, :4], prompt)
    assert torch.equal(cached, uncached)
    # greedy = argmax of the full forward at each step
    logits = lm(cached[:, :-1])
    assert torch.equal(logits[:, 3:].argmax(-1), cached[:, 4:])


def test_sampling_is_reproducible_and_top_k_1_is_greedy() -> None:
    lm = _lm()
    prompt = torch.randint(0, 40, (1, 3))
    a = lm.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = lm.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert torch.equal(lm.generate(prompt, 6, temperature=0.7, top_k=1), lm.generate(prompt, 6))
    lm.train()
    lm.generate(prompt, 1)
    assert lm.training  # the mode is restored


def test_cache_capacity_and_max_seq_len_errors() -> None:
    lm = _lm()
    with pytest.raises(ValueError, match=r"\(30\).*\(5\) = 35 exceeds max_seq_len 32"):
        lm.generate(torch.zeros(1, 30, dtype=torch.long), 5)
    with pytest.raises(ValueError, match=r"40.*32"):
        lm.make_kv_caches(1, 40)
    caches = lm.make_kv_caches(1, 4)
    lm(torch.zeros(1, 3, dtype=torch.long), kv_caches=caches)
    with pytest.raises(ValueError, match="capacity"):
        lm(torch.zeros(1, 2, dtype=torch.long), kv_caches=caches)
    with pytest.raises(ValueError, match="per layer"):
        lm(torch.zeros(1, 2, dtype=torch.long), kv_caches=[KVCache(1, 2, 4, 8)])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 2.5}, TypeError, r"max_new_tokens must be an int, got 2.5"),
        ({"max_new_tokens": True}, TypeError, r"max_new_tokens must be an int, got True"),
        ({"max_new_tokens": -1}, ValueError, r"max_new_tokens must be >= 0, got -1"),
        ({"temperature": "hot"}, TypeError, r"temperature must be a number, got 'hot'"),
        ({"temperature": float("nan")}, ValueError, r"finite number >= 0, got nan"),
        ({"temperature": -0.5}, ValueError, r"finite number >= 0, got -0.5"),
        ({"top_k": 2.0}, TypeError, r"top_k must be an int or None, got 2.0"),
        ({"top_k": 0}, ValueError, r"top_k must be positive, got 0"),
        ({"use_cache": "yes"}, TypeError, r"use_cache must be a bool, got 'yes'"),
        ({"generator": 3}, TypeError, r"generator must be a torch.Generator or None, got 3"),
        ({"input_ids": [[1, 2]]}, TypeError, r"input_ids must be a tensor of token ids, got list"),
        ({"input_ids": torch.ones(1, 2)}, TypeError, r"integer token ids, got dtype torch.float32"),
        ({"input_ids": torch.ones(3, dtype=torch.long)}, ValueError, r"\(B, P\) .* got \(3,\)"),
    ],
)
def test_generate_validates_its_arguments(kwargs: dict, error: type, match: str) -> None:
    args = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "max_new_tokens": 2} | kwargs
    with pytest.raises(error, match=match):
        _lm().generate(**args)


def test_generate_accepts_numpy_style_integers() -> None:
    np = pytest.importorskip("numpy")
    lm = _lm()
    prompt = torch.zeros(1, 2, dtype=torch.long)
    assert torch.equal(lm.generate(prompt, np.int64(3), top_k=np.int32(1)), lm.generate(prompt, 3))


# --------------------------------------------------------------------------- rotary conventions


def test_lm_convention_conversion_matches_split_halves_model() -> None:
    inter = _lm(rope_interleaved=True)
    ids = torch.randint(0, 40, (2, 9))
    expected = inter(ids)
    split = _lm(rope_interleaved=False)
    assert not torch.allclose(split(ids), expected)
    convert_rotary_convention(inter, to="split")  # permutes every layer's q/k weights
    assert inter.rotary is not None and inter.rotary.interleaved is False
    split.load_state_dict(inter.state_dict(), strict=True)
    assert_close(split(ids), expected, **TOL)


# ----------------------------------------------- checkpoint options against transformers' models


def _hf_causal_lm(kind: str, cfg: TransformerConfig) -> torch.nn.Module:
    """A transformers Llama/Qwen2 model with the same options as ``cfg`` (random weights)."""
    transformers = pytest.importorskip("transformers")
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_base}
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
    }
    if kind == "llama":
        hf_cfg = transformers.LlamaConfig(
            **common, head_dim=cfg.attn_head_dim, attention_bias=cfg.bias, mlp_bias=cfg.bias
        )
        model = transformers.LlamaForCausalLM(hf_cfg)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    model.config._attn_implementation = "eager"
    return model.eval()


@torch.no_grad()
def _copy_hf_weights(hf: torch.nn.Module, lm: TransformerLM) -> None:
    """Copy a Llama-family checkpoint's weights (split rotary halves) into ``lm``."""
    sd = hf.state_dict()
    lm.embedding.weight.copy_(sd["model.embed_tokens.weight"])
    lm.norm.weight.copy_(sd["model.norm.weight"])
    if lm.lm_head is not None:
        lm.lm_head.weight.copy_(sd["lm_head.weight"])
    for i, block in enumerate(lm.blocks):
        p = f"model.layers.{i}."
        attn, ff = block.attention, block.feed_forward
        for suffix in ("weight", "bias"):
            parts = [sd.get(f"{p}self_attn.{n}_proj.{suffix}") for n in "qkv"]
            target = getattr(attn.qkv_proj, suffix)
            assert (target is None) == (parts[0] is None), f"{suffix} of q/k/v"
            if target is not None:
                target.copy_(torch.cat(parts))  # type: ignore[arg-type]
            gate_up = [sd.get(f"{p}mlp.{n}_proj.{suffix}") for n in ("gate", "up")]
            target = getattr(ff.gate_up, suffix)
            assert (target is None) == (gate_up[0] is None), f"{suffix} of gate/up"
            if target is not None:
                target.copy_(torch.cat(gate_up))  # type: ignore[arg-type]
            for ours, theirs in [
                (attn.out_proj, "self_attn.o_proj"),
                (ff.linear2, "mlp.down_proj"),
            ]:
                target = getattr(ours, suffix)
                assert (target is None) == (f"{p}{theirs}.{suffix}" not in sd), theirs
                if target is not None:
                    target.copy_(sd[f"{p}{theirs}.{suffix}"])
        block.norm1.weight.copy_(sd[f"{p}input_layernorm.weight"])
        block.norm2.weight.copy_(sd[f"{p}post_attention_layernorm.weight"])


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("llama", {}),
        ("llama", {"head_dim": 12, "tie_embeddings": False}),  # E != D / H, untied head
        ("llama", {"rope_scaling": {"type": "linear", "factor": 4.0}, "bias": True}),
        ("llama", {"rope_scaling": LLAMA3, "head_dim": 12}),
        ("qwen2", {"qkv_bias": True, "tie_embeddings": False}),  # biases on q/k/v only
    ],
)
def test_llama_family_options_equal_transformers(kind: str, options: dict[str, object]) -> None:
    llama_like: dict[str, object] = {
        "num_kv_heads": 2,
        "ffn_dim": 40,
        "max_seq_len": 256,
        "norm": "rmsnorm",
        "activation": "swiglu",
        "eps": 1e-6,
        "bias": False,
        "rope_interleaved": False,
        "rope_base": 500.0,
    }
    cfg = TransformerConfig(50, 32, 2, 4, **(llama_like | options))  # type: ignore[arg-type]
    hf = _hf_causal_lm(kind, cfg)
    lm = TransformerLM(cfg).eval()
    _copy_hf_weights(hf, lm)
    # Long enough for the low rotary frequencies (and hence the scaling) to matter.
    ids = torch.randint(0, 50, (2, 150))
    with torch.no_grad():
        expected = hf(ids).logits
    assert_close(lm(ids), expected, atol=1e-4, rtol=1e-4)
    cached = lm.generate(ids[:, :5], 6)
    assert_close(cached, lm.generate(ids[:, :5], 6, use_cache=False))


def test_untied_head_is_a_separate_linear() -> None:
    lm = _lm(tie_embeddings=False)
    assert isinstance(lm.lm_head, torch.nn.Linear) and lm.lm_head.bias is None
    assert "lm_head.weight" in lm.state_dict() and "lm_head.weight" not in _lm().state_dict()
    ids = torch.randint(0, 40, (2, 5))
    logits, h = _logits_and_hidden(lm, ids)
    assert_close(logits, h @ lm.lm_head.weight.T)
    assert not torch.equal(lm.lm_head.weight, lm.embedding.weight)


def test_head_dim_different_from_dim_over_heads() -> None:
    lm = _lm(head_dim=6)  # H * E = 24 != D = 32
    attn = lm.blocks[0].attention
    assert attn.qkv_proj.weight.shape == (24 + 2 * 2 * 6, 32)
    assert attn.out_proj.weight.shape == (32, 24)
    ids = torch.randint(0, 40, (2, 7))
    assert lm(ids).shape == (2, 7, 40)
    caches = lm.make_kv_caches(2, 8)
    assert caches[0].k.shape[-1] == 6
    # Cached decoding of the new shape equals the full forward.
    full = lm(ids)
    step = torch.cat([lm(ids[:, :4], kv_caches=caches), lm(ids[:, 4:], kv_caches=caches)], 1)
    assert_close(step, full, **TOL)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"bias": False, "qkv_bias": True}, (True, False, False)),
        ({"out_bias": False}, (True, False, True)),
        ({"bias": False, "mlp_bias": True}, (False, False, True)),
    ],
)
def test_per_projection_biases(options: dict[str, bool], expected: tuple[bool, ...]) -> None:
    for block in _lm(**options).blocks:
        attn, ff = block.attention, block.feed_forward
        has = (attn.qkv_proj.bias is not None, attn.out_proj.bias is not None)
        assert has == expected[:2]
        assert all((lin.bias is not None) == expected[2] for lin in (ff.linear1, ff.linear2))
