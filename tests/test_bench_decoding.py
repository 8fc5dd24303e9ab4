"""attnkit.bench.decoding: the decoding rows against transformers and the kernel table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from attnkit import decoding, native
from attnkit.bench.decoding import (
    batched_rows,
    decode_rows,
    layout_kernels,
    layout_table,
    left_padded_prompts,
    prefill_rows,
    read_bandwidth,
    vs_rows,
)
from attnkit.bench.decoding.models import model_parser, model_report, random_lm, random_prompt
from attnkit.bench.decoding.rows import _ReadBandwidth, _targets, _weight_bytes
from attnkit.bench.peers import to_transformers
from attnkit.config import TransformerConfig
from attnkit.models import TransformerLM
from tests.helpers import LLAMA_OPTIONS

F32, BF16 = torch.float32, torch.bfloat16
TINY = {"tiny": (TransformerConfig(50, 24, 2, 4, max_seq_len=32, **LLAMA_OPTIONS), 6, 4)}


def _lm(**options: object) -> TransformerLM:
    return TransformerLM(TransformerConfig(50, 24, 2, 4, max_seq_len=32, **options)).eval()  # type: ignore[arg-type]


def test_transformers_copy_has_equal_logits() -> None:
    pytest.importorskip("transformers")
    lm = _lm(**LLAMA_OPTIONS)
    hf = to_transformers(lm)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, 50, (2, 9))
    assert_close(hf(ids).logits, lm(ids), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="Llama-shaped"):
        to_transformers(_lm())


def test_decode_rows_measure_a_tiny_model() -> None:
    pytest.importorskip("transformers")
    report = decode_rows(("tiny",), repeats=2, models=TINY)
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"transformers", "attnkit"}
    assert rows["attnkit"]["same_tokens_as_transformers"] is True
    config = TINY["tiny"][0]
    fuses = decoding.prepare(TransformerLM(config).eval()).fuses_steps()
    assert "fused_steps" not in rows["transformers"] and rows["attnkit"]["fused_steps"] is fuses
    assert rows["transformers"]["vs_transformers"] == 1.0
    for row in rows.values():  # the derived columns follow from the measured seconds
        assert row["tokens_per_s"] == pytest.approx(row["new_tokens"] / row["seconds"])
    ratio = rows["attnkit"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"]
    assert rows["attnkit"]["vs_transformers"] == pytest.approx(ratio)
    with pytest.raises(ValueError, match="unknown decode model"):
        decode_rows(("nope",))


def test_prefill_rows_time_both_libraries_per_dtype_and_prompt() -> None:
    pytest.importorskip("transformers")
    seen: list[str] = []
    report = prefill_rows("llama-tiny", prompts=(5, 12), repeats=2, progress=seen.append)
    rows = {(r["dtype"], r["prompt"]): r for r in report["rows"]}
    assert set(rows) == {(d, p) for d in ("float32", "bfloat16") for p in (5, 12)}
    assert len(seen) == 2 and report["notes"] == []
    for (dtype, _), row in rows.items():
        assert row["vs_transformers"] == pytest.approx(row["transformers_s"] / row["attnkit_s"])
        fp32 = rows[("float32", row["prompt"])]["attnkit_s"]
        assert row["vs_fp32"] == pytest.approx(fp32 / row["attnkit_s"])
        if dtype == "float32":  # the same greedy first token as transformers
            assert row["same_first_token"] is True
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        prefill_rows("nope")
    with pytest.raises(ValueError, match="at least 1"):
        prefill_rows("llama-tiny", prompts=(0,))


def test_vs_rows_compare_with_transformers() -> None:
    pytest.importorskip("transformers")
    rows = vs_rows(repeats=1, compile=False, names=("tiny",), models=TINY)
    assert [r["job"] for r in rows] == ["decode tiny"]
    assert rows[0]["peer"] == "transformers LlamaForCausalLM"
    assert "same tokens: True" in rows[0]["note"] and rows[0]["goal"] is None
    fuses = decoding.prepare(TransformerLM(TINY["tiny"][0]).eval()).fuses_steps()
    assert ("steps: the fused one-call step" in rows[0]["note"]) is fuses
    tok_s = float(rows[0]["note"].split(" tok/s")[0].rsplit(" ", 1)[1])
    assert tok_s == pytest.approx(4 / rows[0]["attnkit_s"], rel=0.05)  # 4 new tokens


def test_read_bandwidth_reads_the_asked_bytes_at_a_memory_rate() -> None:
    probe = _ReadBandwidth(1 << 22)
    assert probe.a.numel() * probe.a.element_size() == 1 << 22  # the bytes it divides by
    # bytes/s of any CPU memory or cache: a unit slip (bits, GB, elements) leaves this band
    assert 1e8 < read_bandwidth(1 << 22, repeats=3) < 1e13


def test_weight_bytes_count_a_tied_head_once() -> None:
    lm = _lm(**LLAMA_OPTIONS)
    params = {id(p): p for p in lm.parameters()}
    assert _weight_bytes(lm) == sum(p.numel() * 4 for p in params.values())
    assert _weight_bytes(lm.to(torch.bfloat16)) == _weight_bytes(_lm(**LLAMA_OPTIONS)) // 2


def test_layout_kernels_compute_the_linear_map() -> None:
    w, x = torch.randn(24, 16), torch.randn(3, 16)
    kernels = layout_kernels(w)
    assert {"F.linear", "transposed (addmm)"} <= set(kernels)
    for name, fn in kernels.items():
        assert_close(fn(x), F.linear(x, w), msg=name)
    for name, fn in layout_kernels(w.bfloat16()).items():
        assert_close(fn(x.bfloat16()), F.linear(x, w).bfloat16(), atol=0.05, rtol=0.02, msg=name)


def test_layout_table_times_every_kernel() -> None:
    rows = layout_table(dim=16, hidden=32, layers=1, vocab=64, kv_dim=8, repeats=1)
    # oneDNN's packed layout needs a torch build with oneDNN (and, for bf16, CPU support): a
    # row is timed only where the kernel exists, never silently replaced by another.
    packed = {d: "oneDNN packed" in layout_kernels(torch.randn(4, 4, dtype=d)) for d in (F32, BF16)}
    built = native.kernels_available()  # attnkit's own streaming kernel
    assert [r["kernel"] for r in rows] == [
        "f32 sum (read only)",
        "f32 F.linear",
        "f32 transposed (addmm)",
        *(["f32 oneDNN packed"] if packed[F32] else []),
        *(["f32 stream (attnkit)"] if built else []),
        "bf16 F.linear",
        *(["bf16 oneDNN packed"] if packed[BF16] else []),
        *(["bf16 stream (attnkit)"] if built else []),
    ]
    fp32_bytes = 4 * (1 * (32 * 16 + 16 * 16 + 64 * 16 + 16 * 32) + 64 * 16)
    for r in rows:
        nbytes = fp32_bytes // 2 if r["kernel"].startswith("bf16") else fp32_bytes
        assert r["bytes_per_s"] == pytest.approx(nbytes / r["seconds"])
    assert next(r for r in rows if r["kernel"] == "f32 F.linear")["vs_f32_linear"] == 1.0


def test_targets_report_the_shortfall() -> None:
    rows = {"attnkit": {"of_bound": 0.5, "vs_transformers": 1.3}}
    got = {t["what"]: t for t in _targets("llama-100m", rows)}
    assert set(got) == {"eager fp32 steps / bandwidth bound", "eager fp32 vs transformers"}
    bound = got["eager fp32 steps / bandwidth bound"]
    assert bound["met"] is False and bound["shortfall"] == pytest.approx(1 - 0.5 / 0.85)
    assert got["eager fp32 vs transformers"]["met"] is True


def test_left_padded_prompts_spread_their_lengths() -> None:
    ids, mask = left_padded_prompts(4, 12, 50)
    assert mask.sum(1).tolist() == [3, 6, 9, 12]
    assert mask[:, -1].all() and (ids[~mask] == 0).all() and (ids[mask] > 0).all()
    # Left padding: once real, real to the end.
    assert (mask.int().diff(dim=1) >= 0).all()
    with pytest.raises(ValueError, match="batch"):
        left_padded_prompts(0, 12, 50)


def test_batched_rows_agree_with_transformers() -> None:
    pytest.importorskip("transformers")
    tiny = {"tiny": (TransformerConfig(50, 24, 2, 4, max_seq_len=32, **LLAMA_OPTIONS), 12, 4)}
    report = batched_rows("tiny", batch=3, new=4, repeats=1, models=tiny)
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"transformers", "attnkit"}
    assert rows["attnkit"]["same_tokens_as_transformers"] is True
    assert rows["attnkit"]["tokens_per_s"] == pytest.approx(3 * 4 / rows["attnkit"]["seconds"])
    ratio = rows["attnkit"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"]
    assert rows["attnkit"]["vs_transformers"] == pytest.approx(ratio)
    assert rows["attnkit"]["met"] == (ratio >= report["target"])
    with pytest.raises(ValueError, match="unknown decode model"):
        batched_rows("nope")


def test_decode_rows_give_each_variant_its_share_of_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above the size threshold every row, transformers' too, gets the bandwidth bound of the
    bytes it reads: the bf16 weights half of fp32's."""
    pytest.importorskip("transformers")
    from attnkit.bench.decoding import rows as decoding_rows

    monkeypatch.setattr(decoding_rows, "BOUND_PARAMETERS", 0)
    report = decode_rows(("tiny",), repeats=1, models=TINY)
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"transformers", "attnkit", "attnkit bf16"}
    fp32 = rows["attnkit"]["weight_bytes"]
    assert rows["attnkit bf16"]["weight_bytes"] == fp32 // 2
    assert rows["transformers"]["weight_bytes"] == fp32 == rows["attnkit"]["fp32_weight_bytes"]
    for row in rows.values():
        want = row["step_tokens_per_s"] * row["weight_bytes"] / row["bandwidth_bytes_per_s"]
        assert row["of_bound"] == pytest.approx(want)
    bf16 = rows["attnkit bf16"]
    assert bf16["vs_fp32"] == pytest.approx(
        bf16["step_tokens_per_s"] / rows["attnkit"]["step_tokens_per_s"]
    )
    with pytest.raises(ValueError, match="eager or compile"):
        decode_rows(("tiny",), models=TINY, eager=False, compile=False)


def test_a_benchmark_model_its_prompt_and_report_are_the_same_every_time() -> None:
    a, b = random_lm("llama-tiny"), random_lm("llama-tiny")
    b_weights = b.state_dict()
    assert all(torch.equal(w, b_weights[k]) for k, w in a.state_dict().items())
    prompt = random_prompt(a, 7)
    assert prompt.shape == (1, 7) and torch.equal(prompt, random_prompt(b, 7))
    assert int(prompt.max()) < (a.config.vocab_size or 1)
    report = model_report("k", "llama-tiny", prompt=7, new=3, repeats=2, rows=[], extra=1)
    assert list(report) == [
        *("kind", "model", "shape", "prompt", "new_tokens", "repeats", "extra", "rows")
    ]
    assert report["shape"] == {"layers": 2, "dim": 64, "vocab": 256}


def test_a_benchmark_of_one_model_takes_its_options() -> None:
    args = model_parser("m", "First line.\nMore.", new=9).parse_args(["--model", "llama-tiny"])
    assert (args.model, args.new, args.repeats, args.out) == ("llama-tiny", 9, 3, None)
