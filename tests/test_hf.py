"""Hugging Face decoder folders on attnkit: logits, greedy generation, saving, dtypes, errors.

Every case builds a tiny random model with ``transformers`` (a test-only dependency), saves it,
loads the folder into :class:`attnkit.TransformerLM` and compares with ``transformers``' own
model of the same folder on a left-padded batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from attnkit import TransformerConfig, TransformerLM
from attnkit.interop import hf, safetensors_io
from tests.helpers import CASES, VOCAB, build_hf, hf_greedy, padded_batch, randomize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


def hf_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_hf(request.param, folder)


def test_logits_equal_transformers_on_left_padded_batch(case: Any) -> None:
    _kind, folder, ref = case
    lm = TransformerLM.from_pretrained(folder)
    assert not lm.training
    ids, mask = padded_batch()
    expected = hf_logits(ref, ids, mask)
    got = lm(ids, mask.bool(), positions=(mask.cumsum(-1) - 1).clamp_min(0))
    real = mask.bool()
    assert expected[real].abs().max() > 0.5  # the weights are not trivially small
    assert_close(got[real], expected[real], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_greedy_generation_equals_transformers(case: Any) -> None:
    _kind, folder, ref = case
    lm = TransformerLM.from_pretrained(folder)
    ids, mask = padded_batch(1)
    expected = hf_greedy(ref, ids, mask, 8, eos_token_id=2)
    got = lm.generate(ids, 8, attention_mask=mask, pad_token_id=0)  # eos 2 from the folder
    assert torch.equal(got, expected)
    assert torch.equal(lm.generate(ids, 8, attention_mask=mask, use_cache=False), expected)


def test_save_pretrained_round_trip(case: Any, tmp_path: Path) -> None:
    _kind, folder, ref = case
    lm = TransformerLM.from_pretrained(folder)
    out = lm.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # Phi-3's fused checkpoint is the Llama architecture with fused tensors: saved as Llama.
    same = {"Phi3ForCausalLM": "LlamaForCausalLM"}
    assert type(back).__name__ == same.get(type(ref).__name__, type(ref).__name__)
    ids, mask = padded_batch(2)
    real = mask.bool()
    assert_close(
        hf_logits(back, ids, mask)[real], hf_logits(ref, ids, mask)[real], atol=1e-5, rtol=1e-5
    )
    again = TransformerLM.from_pretrained(out)
    assert again.config == lm.config
    for (name, p), q in zip(lm.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert (
        again.generation_config
        == lm.generation_config
        == {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
    )


def test_bf16_loads_straight_into_bf16(case: Any) -> None:
    _kind, folder, _ = case
    lm32 = TransformerLM.from_pretrained(folder)
    lm16 = TransformerLM.from_pretrained(folder, dtype=torch.bfloat16)
    for (name, p), q in zip(lm32.named_parameters(), lm16.parameters(), strict=True):
        assert q.dtype == torch.bfloat16, name
        assert torch.equal(p.to(torch.bfloat16), q), name
    ids, mask = padded_batch()
    real = mask.bool()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    ref = lm32(ids, real, positions=pos)[real]
    got = lm16(ids, real, positions=pos)[real].float()
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize(("kind", "prefix"), [("gpt2", "transformer."), ("qwen2-bias", "model.")])
def test_base_model_checkpoints_without_prefix(kind: str, prefix: str, tmp_path: Path) -> None:
    """Checkpoints saved from the base model (the original gpt2 on the Hub) lack the prefix."""
    ref = build_hf(kind, tmp_path)
    path = tmp_path / "model.safetensors"
    lm = TransformerLM.from_pretrained(tmp_path)
    tensors = {}
    with safetensors.safe_open(path, "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            tensors[key.removeprefix(prefix)] = f.get_tensor(key)
    assert not any(k.startswith(prefix) for k in tensors)
    safetensors_io.write_safetensors(path, tensors)
    stripped = TransformerLM.from_pretrained(tmp_path)
    for (name, p), q in zip(lm.named_parameters(), stripped.parameters(), strict=True):
        assert torch.equal(p, q), name
    ids, mask = padded_batch()
    real = mask.bool()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    assert_close(
        stripped(ids, real, positions=pos)[real],
        hf_logits(ref, ids, mask)[real],
        atol=1e-4,
        rtol=1e-4,
    )


def test_loading_in_blocks_of_rows(case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors above the block size are read a few rows at a time (here: every tensor)."""
    _kind, folder, _ = case
    whole = TransformerLM.from_pretrained(folder, dtype=torch.float16)
    monkeypatch.setattr(safetensors_io, "_CHUNK_BYTES", 100)
    blocks = TransformerLM.from_pretrained(folder, dtype=torch.float16)
    for (name, p), q in zip(whole.named_parameters(), blocks.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", ["llama-gqa-untied", "gpt2"])
def test_sharded_folders_load_and_save(kind: str, tmp_path: Path) -> None:
    ref = build_hf(kind, tmp_path / "single")
    ref.save_pretrained(tmp_path / "hf-sharded", max_shard_size="40KB")
    assert (tmp_path / "hf-sharded" / hf.INDEX_NAME).is_file()
    lm = TransformerLM.from_pretrained(tmp_path / "hf-sharded")
    ids, mask = padded_batch()
    real = mask.bool()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    assert_close(
        lm(ids, real, positions=pos)[real], hf_logits(ref, ids, mask)[real], atol=1e-4, rtol=1e-4
    )
    out = lm.save_pretrained(tmp_path / "ours-sharded", max_shard_size=30_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_close(hf_logits(back, ids, mask)[real], hf_logits(ref, ids, mask)[real])
    # Saving again into the same folder, unsharded, replaces the shards and keeps other files.
    (out / "tokenizer.json").write_text("{}")
    lm.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert not list(tmp_path.glob(".ours-sharded*"))  # no temporary folder left behind
    assert_close(
        TransformerLM.from_pretrained(out)(ids, real, positions=pos), lm(ids, real, positions=pos)
    )


def test_save_pretrained_is_atomic(
    llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails half-way leaves the previous folder as it was, and no temp folder."""
    lm = TransformerLM.from_pretrained(llama_folder)
    out = lm.save_pretrained(tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls: list[Path] = []

    def fail_second(path: Path, tensors: dict[str, torch.Tensor]) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(path, tensors)

    real_write = hf.write_safetensors
    monkeypatch.setattr(hf, "write_safetensors", fail_second)
    with torch.no_grad():
        lm.embedding.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        lm.save_pretrained(out, max_shard_size=20_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(OSError, match="disk full"):  # a new folder is not created either
        calls.clear()
        lm.save_pretrained(tmp_path / "new", max_shard_size=20_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_attnkit_trained_models_save_when_they_map(tmp_path: Path) -> None:
    """Configs built in attnkit (not loaded) map onto the architectures too."""
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, ffn_dim=40, max_seq_len=64)
    llama = dict(norm="rmsnorm", activation="swiglu", bias=False, rope_interleaved=False)
    configs = [
        (
            "LlamaForCausalLM",
            TransformerConfig(**base, **llama, num_kv_heads=2, tie_embeddings=False),
        ),
        # attnkit's own rotary pairing (adjacent channels): saved with permuted q/k channels.
        (
            "LlamaForCausalLM",
            TransformerConfig(
                **base,
                **llama | {"rope_interleaved": True},
                rope_scaling={"type": "linear", "factor": 2.0},
            ),
        ),
        ("LlamaForCausalLM", TransformerConfig(**base, **llama | {"bias": True})),
        ("Qwen2ForCausalLM", TransformerConfig(**base, **llama, qkv_bias=True)),
        ("Qwen2ForCausalLM", TransformerConfig(**base, **llama, qkv_bias=True, window=5)),
        ("MistralForCausalLM", TransformerConfig(**base, **llama, window=4)),
        ("GPT2LMHeadModel", TransformerConfig(**base, position="learned", activation="gelu_tanh")),
        (
            "GPT2LMHeadModel",
            TransformerConfig(**base, position="learned", activation="gelu", tie_embeddings=False),
        ),
    ]
    ids, mask = padded_batch()
    real = mask.bool()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    for i, (arch, config) in enumerate(configs):
        lm = TransformerLM(config).eval()
        randomize(lm, i)
        folder = lm.save_pretrained(tmp_path / f"{arch}-{i}")
        back = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert type(back).__name__ == arch
        with torch.no_grad():
            assert_close(
                lm(ids, real, positions=pos)[real],
                hf_logits(back.eval(), ids, mask)[real],
                atol=1e-4,
                rtol=1e-4,
            )


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({}, "norm='layernorm'.*activation='gelu'"),  # attnkit's defaults
        ({"norm": "rmsnorm"}, "activation"),
        ({"position": "learned", "bias": False}, "bias"),
        ({"position": "sinusoidal"}, "position"),
        ({"position": "learned", "norm_first": False}, "norm_first"),
        ({"position": "learned", "num_kv_heads": 2}, "num_kv_heads"),
        (
            {
                "norm": "rmsnorm",
                "activation": "swiglu",
                "rope_interleaved": False,
                "bias": False,
                "out_bias": True,
            },
            "out_bias",
        ),
    ],
)
def test_save_pretrained_names_options_without_counterpart(
    changes: dict[str, Any], option: str, tmp_path: Path
) -> None:
    lm = TransformerLM(TransformerConfig(VOCAB, 16, 1, 4, **changes))
    with pytest.raises(ValueError, match=option):
        lm.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------
# Bad folders: one clear error each
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama-base")
    build_hf("llama-gqa-untied", folder)
    return folder


def _copy(folder: Path, dest: Path, **config_changes: Any) -> Path:
    dest.mkdir()
    for p in folder.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    if config_changes:
        data = json.loads((dest / "config.json").read_text())
        for k, v in config_changes.items():
            if v is None:
                data.pop(k, None)
            else:
                data[k] = v
        (dest / "config.json").write_text(json.dumps(data))
    return dest


def test_missing_files_are_named(llama_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TransformerLM.from_pretrained(tmp_path / "nowhere")
    d = _copy(llama_folder, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks config\.json"):
        TransformerLM.from_pretrained(d)
    d = _copy(llama_folder, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        TransformerLM.from_pretrained(d)
    d = _copy(llama_folder, tmp_path / "noshard")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (d / hf.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        TransformerLM.from_pretrained(d)


def test_unsupported_architecture_lists_supported(llama_folder: Path, tmp_path: Path) -> None:
    d = _copy(llama_folder, tmp_path / "bert", architectures=["BertForMaskedLM"], model_type="bert")
    with pytest.raises(
        ValueError,
        match=r"BertForMaskedLM.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        r"Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
        r"GPT2LMHeadModel",
    ):
        TransformerLM.from_pretrained(d)


def test_shapes_that_do_not_match_the_config(llama_folder: Path, tmp_path: Path) -> None:
    d = _copy(llama_folder, tmp_path / "shape", intermediate_size=50)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape \[(48, 32|32, 48)\]"):
        TransformerLM.from_pretrained(d)
    d = _copy(llama_folder, tmp_path / "layers", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"lack tensors for.*blocks\.2"):
        TransformerLM.from_pretrained(d)
    d = _copy(llama_folder, tmp_path / "extra", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"no place.*model\.layers\.1\."):
        TransformerLM.from_pretrained(d)


def test_truncated_safetensors(llama_folder: Path, tmp_path: Path) -> None:
    d = _copy(llama_folder, tmp_path / "trunc")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated"):
        TransformerLM.from_pretrained(d)
    (d / "model.safetensors").write_bytes(raw[:50])
    with pytest.raises(ValueError, match="truncated"):
        TransformerLM.from_pretrained(d)


# A GPT-2 config.json small enough for the rejection cases below.
TINY_GPT2_JSON = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 16,
    "n_layer": 1,
    "n_head": 2,
    "n_positions": 8,
}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        (
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized.*gptq"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        (
            TINY_GPT2_JSON | {"scale_attn_by_inverse_layer_idx": True},
            "scale_attn_by_inverse_layer_idx",
        ),
        (
            TINY_GPT2_JSON | {"activation_function": "tanh"},
            "activation_function",
        ),
    ],
)
def test_options_that_change_the_numbers_are_rejected(
    llama_folder: Path, tmp_path: Path, changes: dict[str, Any], match: str
) -> None:
    d = _copy(llama_folder, tmp_path / "opt", **changes)
    with pytest.raises(ValueError, match=match):
        TransformerLM.from_pretrained(d)


def test_legacy_rope_keys_and_bad_dtype(llama_folder: Path, tmp_path: Path) -> None:
    """Older configs carry rope_theta/rope_scaling at the top level."""
    d = _copy(
        llama_folder,
        tmp_path / "legacy",
        rope_parameters=None,
        rope_theta=500.0,
        rope_scaling={"type": "linear", "factor": 3.0},
    )
    lm = TransformerLM.from_pretrained(d)
    assert lm.config.rope_base == 500.0
    assert lm.config.rope_scaling == {"rope_type": "linear", "factor": 3.0}
    with pytest.raises(TypeError, match="dtype"):
        TransformerLM.from_pretrained(llama_folder, dtype=torch.int64)


def test_safetensors_header_matches_the_tensors(llama_folder: Path) -> None:
    header = hf.read_safetensors_header(llama_folder / "model.safetensors")
    raw = (llama_folder / "model.safetensors").read_bytes()
    with safetensors.safe_open(llama_folder / "model.safetensors", "pt") as f:
        assert sorted(header) == sorted(f.keys())
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            t = f.get_tensor(key)
            dtype, shape, nbytes, offset = header[key]
            assert (dtype, shape, nbytes) == (t.dtype, tuple(t.shape), t.nbytes)
            # The offset is where the tensor's bytes are (block reads start there).
            assert offset is not None
            at = torch.frombuffer(bytearray(raw[offset : offset + nbytes]), dtype=t.dtype)
            assert torch.equal(at.reshape(t.shape), t)


def test_to_transformers_computes_the_same_function(case: Any) -> None:
    """The transformers peer built from the mapping (no folder in between) equals the model."""
    _kind, folder, _ = case
    lm = TransformerLM.from_pretrained(folder)
    peer = hf.to_transformers(lm)
    ids, mask = padded_batch()
    real = mask.bool()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        assert_close(hf_logits(peer, ids, mask)[real], lm(ids, real, positions=pos)[real])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        torch.device("cpu"),
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_device_loads_straight_to_the_device(llama_folder: Path, device: Any) -> None:
    lm = hf.from_pretrained(llama_folder, cls=TransformerLM, dtype=torch.float16, device=device)
    assert {p.device.type for p in lm.parameters()} == {torch.device(device).type}
    cpu = TransformerLM.from_pretrained(llama_folder, dtype=torch.float16)
    for (name, p), q in zip(lm.named_parameters(), cpu.parameters(), strict=True):
        assert torch.equal(p.cpu(), q), name
    with pytest.raises(TypeError, match="device"):
        hf.from_pretrained(llama_folder, cls=TransformerLM, device="warp-drive")
    with pytest.raises(TypeError, match=r"from_pretrained takes cls .* got \['cls', 'devce'\]"):
        hf.from_pretrained(llama_folder, cls=TransformerLM, devce="cpu")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="takes cls"):
        hf.from_pretrained(llama_folder)  # type: ignore[call-arg]
