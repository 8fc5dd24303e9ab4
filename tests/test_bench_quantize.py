"""The measurement code of ``python -m attnkit.bench.quantization``: the English corpus and its
split, the byte-level training run and folder, the quality numbers against a direct computation,
the loading peak in a child process, and torchao's int8 beside the model (when installed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from attnkit import native
from attnkit.bench import quantization as bq
from attnkit.bench.llamacpp import write_gguf
from attnkit.bench.quantization import quality
from attnkit.config import FAMILIES, TransformerConfig
from attnkit.models import TransformerLM
from attnkit.quantize import Int8Linear

TINY = TransformerConfig(256, 32, 1, 1, ffn_dim=64, max_seq_len=64, **FAMILIES["llama"])


def test_english_text_is_split_by_module_and_is_prose() -> None:
    train, held = bq.english_text()
    assert len(train) > 200_000 and len(held) > 20_000
    assert train.isascii() and held.isascii()
    # Whole modules go to one side: the held-out ones' docstrings are not in the training text.
    import zlib

    held_modules = [m for m in quality._MODULES.split() if zlib.crc32(m.encode()) % 7 == 0]
    assert len(held_modules) >= 5
    for name in held_modules:
        doc = quality._docstrings(name)[0]
        assert doc in held and doc not in train
    words = held.split()
    common = {"the", "of", "a", "is", "to", "and"}
    assert sum(w in common for w in words) / len(words) > 0.08  # English, not code


def test_byte_tokenizer_ids_are_the_bytes() -> None:
    pytest.importorskip("tokenizers")
    tok = quality.byte_tokenizer()
    text = "Tokens, weights; and wörds\n\tend."
    assert tok.encode(text, add_special_tokens=False).ids == list(text.encode())
    assert tok.decode(list(text.encode())) == text


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("safetensors")
    out = tmp_path_factory.mktemp("lm")
    record = bq.train_text_lm(out, config=TINY, max_steps=60, eval_every=20, batch=8, seq_len=32)
    return out, record


def test_training_lowers_the_held_out_loss_and_saves_the_best(trained: tuple[Path, dict]) -> None:
    out, record = trained
    losses = [h["held_out_loss"] for h in record["history"]]
    assert losses[-1] < math.log(256) - 1  # well below the uniform guess
    assert record["held_out_loss"] == min(losses)
    # The saved folder is the best evaluation's model: its held-out loss is recomputed here.
    lm = TransformerLM.from_pretrained(out)
    _, held = bq.english_text()
    rows = quality._windows(quality._byte_ids(held), 33, 64)
    with torch.no_grad():
        losses_here = [
            F.cross_entropy(lm(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).item()
            for x in rows.split(16)
        ]
    assert sum(losses_here) / len(losses_here) == pytest.approx(record["held_out_loss"], 1e-4)
    assert (out / "training.json").is_file()


def test_quality_rows_match_a_direct_computation(trained: tuple[Path, dict]) -> None:
    out, _ = trained
    _, held = bq.english_text()
    rows = bq.quality_rows(out, held, context=48, max_windows=8, batch=4, variants=("int8",))
    (row,) = rows
    ids = quality._byte_ids(held)[: 8 * 48].reshape(8, 48)
    ref = TransformerLM.from_pretrained(out)
    q = TransformerLM.from_pretrained(out, quantize="int8")
    with torch.no_grad():
        a, b = ref(ids).double()[:, :-1], q(ids).double()[:, :-1]
    agree = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    target = ids[:, 1:].flatten()
    ppl_ref = F.cross_entropy(a.flatten(0, 1), target).exp().item()
    ppl_q = F.cross_entropy(b.flatten(0, 1), target).exp().item()
    assert row["top1_agreement"] == pytest.approx(agree, abs=1e-6)
    assert row["reference_perplexity"] == pytest.approx(ppl_ref, rel=1e-4)
    assert row["perplexity_change"] == pytest.approx(ppl_q / ppl_ref - 1, abs=1e-4)
    assert row["tokens"] == 8 * 48


def test_quality_rows_reject_bad_arguments(trained: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = trained
    with pytest.raises(ValueError, match="int3"):
        bq.quality_rows(out, "text " * 100, variants=("int3",))
    with pytest.raises(ValueError, match="gives 0 windows of 48 tokens, fewer than 4"):
        bq.quality_rows(out, "short", context=48)
    TransformerLM(TINY.replace(vocab_size=300)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab_size 300"):
        bq.text_ids(tmp_path, "text")


@pytest.mark.slow
def test_load_peak_reports_the_model_bytes(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    config = TransformerConfig(4096, 256, 4, 4, ffn_dim=1024, max_seq_len=64, **FAMILIES["llama"])
    TransformerLM(config).save_pretrained(tmp_path)
    result = bq.load_peak(tmp_path, "int8")
    loaded = TransformerLM.from_pretrained(tmp_path, quantize="int8")
    tensors = [*loaded.parameters(), *loaded.buffers()]
    # fbgemm's prepacked int8 weights count too (the default's rule: the same in both processes).
    packed = sum(m.packed_bytes for m in loaded.modules() if isinstance(m, Int8Linear))
    assert result["packed_bytes"] == packed
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors if t.numel())
    assert result["model_bytes"] == tensor_bytes + result["packed_bytes"]
    int8pack = bq.load_peak(tmp_path, "int8", int8_kernel="int8pack")
    assert int8pack["int8_kernels"] == ["int8pack"] and int8pack["packed_bytes"] == 0
    if result["peak_bytes"] is None:
        pytest.skip("no /proc/self/clear_refs here")
    # At least the model itself was allocated while loading; the ratio is the benchmark's.
    assert result["peak_bytes"] >= 0.9 * result["model_bytes"]
    assert result["peak_over_model"] == result["peak_bytes"] / result["model_bytes"]
    with pytest.raises(RuntimeError, match="failed"):
        bq.load_peak(tmp_path / "missing", "int8")


def test_torchao_int8_matches_its_dequantized_weights() -> None:
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    lm = TransformerLM(TINY).eval()
    q = bq.torchao_int8(lm)
    assert lm.lm_head is None and q.lm_head is not None  # the copy got a head; lm is untouched
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want, got = lm(ids), q(ids)
    # int8 per-channel weights: close to the float model, not equal to it.
    assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert not torch.equal(got, want)


@pytest.mark.parametrize("precision", ["f32", "bf16", "q8_0"])
def test_llamacpp_benchmark_writes_gguf_that_computes_the_model(
    precision: str, tmp_path: Path
) -> None:
    """The GGUF files the llama.cpp benchmark writes (llama.cpp's names and rotary order) load
    back through attnkit's own GGUF reader as the same model, up to the precision's rounding."""
    pytest.importorskip("gguf")
    config = TransformerConfig(
        320, 64, 2, 4, num_kv_heads=2, ffn_dim=128, max_seq_len=64, **FAMILIES["llama"]
    )
    torch.manual_seed(0)
    lm = TransformerLM(config).eval()
    path = write_gguf(lm, tmp_path / f"m-{precision}.gguf", precision)
    loaded = TransformerLM.from_pretrained(path)
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        want, got = lm(ids), loaded(ids)
    tol = {"f32": 1e-5, "bf16": 2e-2, "q8_0": 3e-2}[precision]
    assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_model_matrices_are_the_models_linears() -> None:
    config = TransformerConfig(256, 64, 2, 4, num_kv_heads=2, ffn_dim=96, **FAMILIES["llama"])
    matrices = bq.model_matrices(config)
    lm = TransformerLM(config)
    for name, (i, o) in matrices.items():
        if name == "lm_head":  # the tied head: the embedding as a linear
            assert (i, o) == (lm.embedding.embedding_dim, lm.embedding.num_embeddings)
            continue
        linear = next(m for n, m in lm.named_modules() if n.endswith(name))
        assert (linear.in_features, linear.out_features) == (i, o)
    assert matrices["qkv_proj"] == (64, 64 + 2 * 2 * 16)


def test_kernel_rows_time_every_kernel_against_its_rounding() -> None:
    from attnkit.quantize import choose_int8_kernel

    rows = bq.kernel_rows({"a": (128, 64), "b": (96, 32)}, rounds=2)
    for name in ("a", "b"):
        mine = [r for r in rows if r["matrix"] == name]
        kernels = {r["kernel"] for r in mine}
        assert {"fp32 F.linear", "bf16 F.linear", "int4 g32 torch, bf16 activations"} <= kernels
        if native.kernels_available():
            assert "int4 g32 attnkit (int8 activations per 32)" in kernels
        assert sum(r["is_choice"] for r in mine) == 1
        assert mine[0]["chosen"] == choose_int8_kernel(*mine[0]["shape"])
        assert all(r["seconds"] > 0 and r["bytes_per_s"] > 0 for r in mine)
        fp32 = next(r for r in mine if r["kernel"] == "fp32 F.linear")
        assert fp32["vs_fp32"] == 1.0 and fp32["relative_error"] < 1e-5
        # Every kernel is its float64 reference up to the rounding of its output (bf16 at most).
        assert all(r["relative_error"] < 1e-2 for r in mine), mine
    # 96 inputs: int4 groups of 32 only (96 is no multiple of 64).
    assert not any(r["kernel"].startswith("int4 g64") for r in rows if r["matrix"] == "b")


def test_layout_rows_match_a_direct_computation(trained: tuple[Path, dict]) -> None:
    from attnkit.bench.quantization import layouts
    from attnkit.quantize import quantize

    out, _ = trained
    _, held = bq.english_text()
    rows = {r["variant"]: r for r in layouts.layout_rows(out, held, tokens=4 * 32, context=32)}
    assert set(rows) == set(layouts.LAYOUT_VARIANTS)
    ids = quality._byte_ids(held)[: 4 * 32].reshape(4, 32)
    ref = TransformerLM.from_pretrained(out)
    q = quantize(TransformerLM.from_pretrained(out), "int4", layout="q4_0")
    with torch.no_grad():
        a, b = ref(ids).double()[:, :-1], q(ids).double()[:, :-1]
    agree = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    target = ids[:, 1:].flatten()
    change = (
        F.cross_entropy(b.flatten(0, 1), target).exp()
        / F.cross_entropy(a.flatten(0, 1), target).exp()
    ).item() - 1
    row = rows["int4 q4_0"]
    assert row["top1_agreement"] == pytest.approx(agree, abs=1e-6)
    assert row["perplexity_change"] == pytest.approx(change, abs=1e-4)
    linears = sum(1 for m in q.modules() if hasattr(m, "layout"))
    assert row["layers"] == {"q4_0": linears} and row["tokens"] == 4 * 32


@pytest.mark.slow
def test_gguf_rows_compare_native_and_dequantized_files(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from attnkit.bench.quantization import layouts

    config = TransformerConfig(
        256, 64, 2, 2, num_kv_heads=1, ffn_dim=128, max_seq_len=64, **FAMILIES["llama"]
    )
    rows = layouts.gguf_rows("small", new=3, rounds=1, where=tmp_path, config=config)
    assert [r["precision"] for r in rows] == list(layouts.GGUF_TYPES)
    for r in rows:
        assert r["logits_relative_error"] <= 1e-3
        # (int8 activations: the activations' rounding on top of the weights')
        assert r["logits_relative_error"] < r["int8_activations_logits_relative_error"] < 0.1
        assert r["layers"].get(r["precision"], 0) > 0 and set(r["layers"]) == {r["precision"]}
        assert r["speedup"] == pytest.approx(r["native_tokens_per_s"] / r["fp32_tokens_per_s"])
