"""attnkit.decoding_bench: the decoding rows against transformers and the kernel table."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from attnkit.config import TransformerConfig
from attnkit.decoding_bench import (
    _targets,
    decode_rows,
    layout_table,
    read_bandwidth,
    to_transformers,
    vs_rows,
)
from attnkit.models import TransformerLM
from tests.test_decoding import LLAMA


def _lm(**options: object) -> TransformerLM:
    return TransformerLM(TransformerConfig(50, 24, 2, 4, max_seq_len=32, **options)).eval()  # type: ignore[arg-type]


def test_transformers_copy_has_equal_logits() -> None:
    pytest.importorskip("transformers")
    lm = _lm(**LLAMA)
    hf = to_transformers(lm)
    ids = torch.randint(0, 50, (2, 9))
    assert_close(hf(ids).logits, lm(ids), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="Llama-shaped"):
        to_transformers(_lm())


def test_decode_rows_measure_a_tiny_model() -> None:
    pytest.importorskip("transformers")
    models = {"tiny": (TransformerConfig(50, 24, 2, 4, max_seq_len=32, **LLAMA), 6, 4)}
    report = decode_rows(("tiny",), repeats=1, models=models)
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"transformers", "attnkit"}
    assert rows["attnkit"]["same_tokens_as_transformers"] is True
    assert rows["transformers"]["vs_transformers"] == 1.0
    assert rows["attnkit"]["tokens_per_s"] > 0
    with pytest.raises(ValueError, match="unknown decode model"):
        decode_rows(("nope",))


def test_vs_rows_compare_with_transformers() -> None:
    pytest.importorskip("transformers")
    models = {"tiny": (TransformerConfig(50, 24, 2, 4, max_seq_len=32, **LLAMA), 6, 4)}
    rows = vs_rows(repeats=1, compile=False, names=("tiny",), models=models)
    assert [r["job"] for r in rows] == ["decode tiny"]
    assert rows[0]["peer"] == "transformers LlamaForCausalLM"
    assert rows[0]["attnkit_s"] > 0 and rows[0]["peer_s"] > 0
    assert "same tokens: True" in rows[0]["note"] and rows[0]["goal"] is None


def test_read_bandwidth_is_positive() -> None:
    assert read_bandwidth(1 << 20, repeats=1) > 0


def test_layout_table_times_every_kernel() -> None:
    rows = layout_table(dim=16, hidden=32, layers=1, vocab=64, kv_dim=8, repeats=1)
    assert [r["kernel"] for r in rows] == [
        "f32 sum (read only)",
        "f32 F.linear",
        "f32 transposed (addmm)",
        "f32 oneDNN packed",
        "bf16 F.linear",
        "bf16 oneDNN packed",
    ]
    assert all(r["bytes_per_s"] > 0 for r in rows)
    assert next(r for r in rows if r["kernel"] == "f32 F.linear")["vs_f32_linear"] == 1.0


def test_targets_report_the_shortfall() -> None:
    rows = {"attnkit": {"of_fp32_bound": 0.5, "vs_transformers": 1.3}}
    got = {t["what"]: t for t in _targets("llama-100m", rows)}
    assert set(got) == {"eager fp32 steps / bandwidth bound", "eager fp32 vs transformers"}
    bound = got["eager fp32 steps / bandwidth bound"]
    assert bound["met"] is False and bound["shortfall"] == pytest.approx(1 - 0.5 / 0.85)
    assert got["eager fp32 vs transformers"]["met"] is True
