"""GGUF files on attnkit against transformers' own GGUF loading, and damaged files.

Every file is written here with ``gguf``'s writer: a tiny random Llama made with transformers,
its query/key rows permuted the way llama.cpp's converter does, its 2-D weights in one ggml type
(the 1-D norms in F32, as llama.cpp keeps them), and the byte-level BPE tokenizer of
:mod:`tests.chat_templates` with a chat template. transformers reads the same file with
``from_pretrained(folder, gguf_file=...)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from attnkit import TransformerLM
from attnkit.chat import format_chat
from attnkit.interop import gguf as ak_gguf
from attnkit.interop import hf
from tests.chat_templates import CONVERSATION, QWEN2, train_tokenizer
from tests.helpers import ROPE_LLAMA3

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

LLAMA: dict[str, Any] = {
    "hidden_size": 256,  # rows of 256 values: one K-quant super-block
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10_000.0,
}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves -> interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def random_k_blocks(qtype: Any, rows: int, cols: int, g: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes (gguf cannot quantize to these) with sane f16 scales."""
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    raw = g.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    scale = lambda: g.uniform(1e-3, 4e-3, raw.shape[0]).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == Q.Q4_K:
        raw[:, 0:2] = scale().reshape(-1, 2)  # d
        raw[:, 2:4] = scale().reshape(-1, 2)  # dmin
    else:
        raw[:, 208:210] = scale().reshape(-1, 2)  # d
    return raw.reshape(rows, -1)


def encode(array: np.ndarray, type_name: str, g: np.random.Generator) -> tuple[np.ndarray, Any]:
    """``array`` (float32) as the bytes of ggml type ``type_name``."""
    qtype = Q[type_name]
    if type_name == "F32":
        return array.astype(np.float32), None
    if type_name == "F16":
        return array.astype(np.float16), None
    if type_name in ("Q4_K", "Q6_K"):
        return random_k_blocks(qtype, array.shape[0], array.shape[1], g), qtype
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf(
    path: Path,
    type_name: str,
    *,
    seed: int = 0,
    tie: bool = False,
    chat_template: str | None = QWEN2,
    tokenizer_model: str = "gpt2",
    arch: str = "llama",
    rope_scaling: dict[str, Any] | None = None,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """A tiny random Llama GGUF file whose 2-D weights are of ``type_name``, with a byte-level
    BPE vocabulary (``tokenizer_model="gpt2"``) or a SentencePiece one (``"llama"``).

    With a llama3 ``rope_scaling`` the file holds ``rope_freqs.weight`` as llama.cpp's converter
    writes it (``rope_freqs`` overrides those divisors)."""
    if tokenizer_model == "llama":
        tokens, types, scores = sentencepiece_vocab()
        merges: list[str] = []
    else:
        tok = train_tokenizer()
        data = json.loads(tok.to_str())
        tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
        specials = {a["content"] for a in data["added_tokens"]}
        types = [3 if t in specials else 1 for t in tokens]
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        scores = []
    vocab = len(tokens)
    model = tiny_llama(vocab, tie=tie, seed=seed, rope_scaling=rope_scaling, arch=arch)
    g = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(LLAMA["max_position_embeddings"])
    w.add_embedding_length(LLAMA["hidden_size"])
    w.add_block_count(LLAMA["num_hidden_layers"])
    w.add_feed_forward_length(LLAMA["intermediate_size"])
    w.add_head_count(LLAMA["num_attention_heads"])
    w.add_head_count_kv(LLAMA["num_key_value_heads"])
    head_dim = (
        getattr(model.config, "head_dim", None)
        or LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    )
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(LLAMA["rms_norm_eps"])
    w.add_rope_freq_base(LLAMA["rope_theta"])
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if tokenizer_model == "llama":
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_eot_token_id(tokens.index("<|eot_id|>"))
        w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if rope_scaling is not None and rope_freqs is None:
        head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
        rope_freqs = llama_cpp_rope_freqs(head_dim, LLAMA["rope_theta"], rope_scaling)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    heads = {"q_proj": LLAMA["num_attention_heads"], "k_proj": LLAMA["num_key_value_heads"]}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and tie:
            continue
        array = p.numpy()
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            part, kind = rest.rsplit(".", 1)
            target = f"blk.{i}.{LAYER[part]}.{kind}"
            proj = part.rsplit(".", 1)[-1]
            if proj in heads and arch == "llama":  # the qwen graphs rotate halves: no permute
                array = llama_cpp_permute(array, heads[proj])
        else:
            target = TO_GGUF[name]
        if array.ndim == 1:
            w.add_tensor(target, array.astype(np.float32))
        elif type_name == "BF16":
            raw = torch.from_numpy(array).bfloat16().view(torch.uint8).numpy()
            w.add_tensor(target, raw, raw_dtype=Q.BF16)
        else:
            raw, qtype = encode(array, type_name, g)
            w.add_tensor(target, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


#: GGUF architecture -> the transformers classes written under it (other names: a Llama).
MODELS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def tiny_llama(
    vocab: int,
    *,
    tie: bool,
    seed: int,
    rope_scaling: dict[str, Any] | None = None,
    arch: str = "llama",
) -> Any:
    """The random transformers model that :func:`write_gguf` writes (same seed: same weights):
    a Llama, or for ``arch`` qwen2/qwen3 that family (Qwen2: q/k/v biases; Qwen3: qk-norm)."""
    extra: dict[str, Any] = {} if rope_scaling is None else {"rope_scaling": dict(rope_scaling)}
    config_cls, model_cls = MODELS.get(arch, ("LlamaConfig", "LlamaForCausalLM"))
    config = getattr(transformers, config_cls)(
        **LLAMA, vocab_size=vocab, tie_word_embeddings=tie, **extra
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p)
            )
    return model


def llama_cpp_rope_freqs(head_dim: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter for Llama 3.1: one divisor per rotary frequency."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * base ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-style vocabulary: unk/bos/eos, the 256 byte tokens, pieces with the
    \u2581 word marker learned here, scores falling with the merge order."""
    import tokenizers

    sp = tokenizers.SentencePieceBPETokenizer()
    sp.train_from_iterator(
        ["the cat sat on the mat", "attention is all you need", "Explain attention briefly"] * 20,
        vocab_size=120,
        special_tokens=[],
        show_progress=False,
    )
    learned = sorted(sp.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [t for t, _ in learned if t not in tokens]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, types, scores


@pytest.fixture(scope="module", params=TYPES)
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    tie = request.param in ("F16", "Q4_K")  # tied and untied heads both covered
    return write_gguf(folder / "tiny.gguf", request.param, seed=TYPES.index(request.param), tie=tie)


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def test_logits_equal_transformers_gguf_loading(gguf_file: Path) -> None:
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    lm = TransformerLM.from_pretrained(gguf_file)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    assert_close(lm(ids), want, atol=2e-3, rtol=0)
    assert want.abs().max() > 0.05  # the weights are not vanishing: a wrong mapping shows
    assert lm.config.tie_embeddings == ("output.weight" not in ak_gguf._open(gguf_file).tensors)


def test_generation_config_and_hf_loader_dispatch(gguf_file: Path) -> None:
    lm = hf.from_pretrained(gguf_file, cls=TransformerLM, dtype=torch.bfloat16)
    assert next(lm.parameters()).dtype == torch.bfloat16
    tok = ak_gguf.read_tokenizer(gguf_file).tokenizer
    eos = lm.generation_config["eos_token_id"]
    assert [tok.id_to_token(i) for i in eos] == ["<|im_end|>", "<|eot_id|>"]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "BF16"])
def test_dequantize_equals_gguf(type_name: str) -> None:
    g = np.random.default_rng(1)
    values = g.standard_normal((4, 512)).astype(np.float32)
    if type_name == "BF16":
        raw = torch.from_numpy(values).bfloat16().view(torch.uint8).numpy()
        qtype = Q.BF16
    else:
        raw, qtype = encode(values, type_name, g)
        qtype = qtype or Q.F16
        raw = raw.view(np.uint8)
    want = gguf.quants.dequantize(raw, qtype)
    got = ak_gguf.dequantize(torch.from_numpy(raw.copy()), int(qtype), (4, 512))
    assert_close(got, torch.from_numpy(np.asarray(want, dtype=np.float32)), atol=1e-6, rtol=1e-6)
    assert got.std() > 0.01


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("chat") / "chat.gguf", "F16")


def test_tokenizer_and_chat_equal_transformers(chat_file: Path) -> None:
    gguf_file = chat_file
    ref = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tok = ak_gguf.read_tokenizer(gguf_file).tokenizer
    for text in ["Explain attention in one sentence.", "Ça marche ✓  <|im_start|>x\n\n 42"]:
        assert tok.encode(text).ids == ref(text)["input_ids"]
    want = ref.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    assert format_chat(gguf_file, CONVERSATION) == list(want)


# --------------------------------------------------------------------------------------------
# Damaged and hostile files
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("small") / "small.gguf", "Q8_0", chat_template=None)


def _patch(src: Path, dest: Path, name: str, **changes: Any) -> Path:
    """Copy ``src`` with tensor ``name``'s description changed (dims, type or offset)."""
    raw = bytearray(src.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = raw.index(key) + len(key)
    n_dims = int.from_bytes(raw[at : at + 4], "little")
    dims_at, type_at = at + 4, at + 4 + 8 * n_dims
    if "dims" in changes:
        for i, d in enumerate(changes["dims"]):
            raw[dims_at + 8 * i : dims_at + 8 * i + 8] = d.to_bytes(8, "little")
    if "type" in changes:
        raw[type_at : type_at + 4] = changes["type"].to_bytes(4, "little")
    if "offset" in changes:
        raw[type_at + 4 : type_at + 12] = changes["offset"].to_bytes(8, "little")
    dest.write_bytes(raw)
    return dest


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"offset": 10**12}, r"'blk\.1\.ffn_up\.weight'.*past the end of the file"),
        ({"dims": [2**40, 2**20]}, r"'blk\.1\.ffn_up\.weight'.*1152921504606846976 values.*past"),
        ({"type": 999}, r"'blk\.1\.ffn_up\.weight' has unknown type 999"),
        ({"type": int(Q.Q5_K)}, r"'blk\.1\.ffn_up\.weight' has type Q5_K.*supported: F32"),
        ({"dims": [100, 512]}, r"'blk\.1\.ffn_up\.weight': rows of 100 values .* blocks of 32"),
    ],
)
def test_hostile_tensor_descriptions(
    small_file: Path, tmp_path: Path, changes: dict[str, Any], match: str
) -> None:
    bad = _patch(small_file, tmp_path / "bad.gguf", "blk.1.ffn_up.weight", **changes)
    with pytest.raises(ValueError, match=rf"bad\.gguf: tensor {match}"):
        TransformerLM.from_pretrained(bad)


def test_truncated_and_foreign_files(small_file: Path, tmp_path: Path) -> None:
    raw = small_file.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(raw[:-1000])  # inside the last tensor's data
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor '.*'.*past the end of the file"):
        TransformerLM.from_pretrained(bad)
    bad.write_bytes(raw[:3000])  # inside the metadata
    with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
        TransformerLM.from_pretrained(bad)
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
        TransformerLM.from_pretrained(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TransformerLM.from_pretrained(tmp_path / "none.gguf")


def test_sentencepiece_tokenizer_equals_transformers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "sp.gguf", "F16", tokenizer_model="llama", chat_template=None)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tok = ak_gguf.read_tokenizer(path).tokenizer
    texts = ["the cat sat on the mat", " Explain  attention!", "Ça marche ✓\n<s>x</s>", "a"]
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    assert tok.encode("the cat").ids[0] == 1  # bos added, as llama.cpp does
    # bos, the word marker, and the two UTF-8 bytes of Ç as byte-fallback tokens <0xC3> <0x87>
    assert tok.encode("Ç").ids == [1, tok.token_to_id("\u2581"), 3 + 0xC3, 3 + 0x87]


def test_llama3_rope_freqs_equal_the_hf_model_with_that_scaling(tmp_path: Path) -> None:
    # transformers' GGUF loader ignores rope_freqs.weight, so the reference is the transformers
    # model the file was written from, with the same llama3 rope_scaling.
    path = write_gguf(tmp_path / "l31.gguf", "F32", rope_scaling=ROPE_LLAMA3, chat_template=None)
    lm = TransformerLM.from_pretrained(path)
    assert lm.config.rope_scaling == ROPE_LLAMA3
    vocab = lm.config.vocab_size
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny_llama(vocab, tie=False, seed=0, rope_scaling=ROPE_LLAMA3)(ids).logits
        plain = tiny_llama(vocab, tie=False, seed=0)(ids).logits
        got = lm(ids)
    assert_close(got, want, atol=2e-3, rtol=0)
    assert (got - plain).abs().max() > 50 * 2e-3  # the scaling shows at these positions


@pytest.mark.parametrize(
    ("freqs", "scaling"),
    [
        (np.full(32, 2.0), {"rope_type": "linear", "factor": 2.0}),
        (np.ones(32), None),
        (
            llama_cpp_rope_freqs(64, 10_000.0, ROPE_LLAMA3 | {"factor": 3.0}),
            ROPE_LLAMA3 | {"factor": 3.0},
        ),
    ],
)
def test_rope_freqs_map_to_the_scaling_that_gives_them(freqs, scaling, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "f.gguf", "F16", rope_freqs=freqs, chat_template=None)
    assert TransformerLM.from_pretrained(path).config.rope_scaling == scaling


def test_rope_freqs_that_no_scaling_gives_are_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "odd.gguf", "F16", rope_freqs=np.linspace(1, 3, 32))
    with pytest.raises(ValueError, match=r"odd\.gguf: tensor 'rope_freqs\.weight' holds divisors"):
        TransformerLM.from_pretrained(path)
    path = write_gguf(tmp_path / "short.gguf", "F16", rope_freqs=np.ones(5))
    with pytest.raises(ValueError, match=r"'rope_freqs\.weight' must hold 32 positive divisors"):
        TransformerLM.from_pretrained(path)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_files_equal_transformers_gguf_loading(arch: str, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    path = write_gguf(tmp_path / f"{arch}.gguf", "Q8_0", arch=arch, chat_template=None)
    names = set(ak_gguf._open(path).tensors)
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in names) == (arch == "qwen3")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    assert type(ref).__name__ == MODELS[arch][1]
    lm = TransformerLM.from_pretrained(path)
    assert lm.config.qk_norm == (arch == "qwen3")
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    assert_close(lm(ids), want, atol=2e-3, rtol=0)
    assert want.abs().max() > 0.05


def test_unsupported_metadata_is_named(small_file: Path, tmp_path: Path) -> None:
    other = write_gguf(tmp_path / "phi.gguf", "F16", arch="phi3")
    with pytest.raises(ValueError, match=r"phi\.gguf: GGUF architecture 'phi3' is not supp"):
        TransformerLM.from_pretrained(other)
    with pytest.raises(ValueError, match="no chat template"):
        format_chat(small_file, CONVERSATION)


def test_generate_command_reads_gguf(chat_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.cli import main

    lm = TransformerLM.from_pretrained(chat_file)
    found = ak_gguf.read_tokenizer(chat_file)
    prompt = "Explain attention"
    args = ["generate", "--model", str(chat_file), "--prompt", prompt, "--max-new-tokens", "5"]
    assert main([*args, "--quiet"]) == 0
    ids = found.tokenizer.encode(prompt).ids
    full = lm.generate(torch.tensor([ids]), 5)[0].tolist()
    assert capsys.readouterr().out == found.tokenizer.decode(full) + "\n"
    assert main([*args, "--chat", "--quiet"]) == 0
    ids = format_chat(chat_file, [{"role": "user", "content": prompt}])
    assert isinstance(ids, list)
    reply = lm.generate(torch.tensor([ids]), 5, eos_token_id=list(found.stop_ids))[0, len(ids) :]
    assert capsys.readouterr().out == found.tokenizer.decode(reply.tolist()) + "\n"


def test_llama_cpp_names_invert_the_loaders_names() -> None:
    from attnkit.interop.gguf import hf_name, llama_cpp_name

    for name in [*TO_GGUF.values(), *(f"blk.7.{n}.weight" for n in LAYER.values())]:
        assert llama_cpp_name(hf_name(name)) == name
    assert llama_cpp_name("model.layers.2.self_attn.q_proj.bias") == "blk.2.attn_q.bias"
    assert llama_cpp_name("not.a.weight") == "not.a.weight"
