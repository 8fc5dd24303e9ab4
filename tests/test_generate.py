"""Generation: left padding, eos, sampling filters, streaming, sliding windows in the cache.

References: ``transformers``' ``generate`` and logits processors on the same folder / logits,
and attnkit's own uncached decoding and unpadded single prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnkit import TransformerConfig, TransformerLM
from attnkit.generation import GenerationOptions, positions_from_mask, process_logits
from tests.helpers import VOCAB, build_hf, hf_greedy, padded_batch, randomize

transformers = pytest.importorskip("transformers")
logits_process = pytest.importorskip("transformers.generation.logits_process")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, TransformerLM]:
    folder = tmp_path_factory.mktemp("gen-llama")
    ref = build_hf("llama-gqa-untied", folder, seed=3)
    return ref, TransformerLM.from_pretrained(folder)


def _small_lm(*, peaked: bool = True, **options: Any) -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(VOCAB, 32, 2, 4, max_seq_len=64, **options)
    lm = TransformerLM(config).eval()
    if peaked:  # clear greedy choices (else nearly uniform logits, good for sampling)
        randomize(lm, 0)
    return lm


def test_positions_from_mask_as_transformers() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]).bool()
    expected = torch.tensor([[1, 1, 0, 1], [0, 1, 2, 3], [1, 1, 1, 0]])
    assert torch.equal(positions_from_mask(mask), expected)


def test_eos_ids_end_rows_and_pad_them(pair: Any) -> None:
    ref, lm = pair
    ids, mask = padded_batch(4)
    P = ids.shape[1]
    free = hf_greedy(ref, ids, mask, 10, eos_token_id=None)
    eos = [int(free[0, P + 1]), int(free[1, P + 3])]
    expected = hf_greedy(ref, ids, mask, 10, eos_token_id=eos)
    got = lm.generate(ids, 10, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected)
    row0 = got[0, P:].tolist()
    end = next(i for i, t in enumerate(row0) if t in eos)
    assert end <= 1 and all(t == 0 for t in row0[end + 1 :])
    assert len(row0) > end + 1  # another row went on after row 0 ended


def test_generation_stops_when_every_row_ended(pair: Any) -> None:
    ref, lm = pair
    ids, mask = padded_batch(5)
    first = lm.generate(ids, 1, attention_mask=mask)[:, -1].tolist()
    got = lm.generate(ids, 10, attention_mask=mask, eos_token_id=first)
    assert got.shape == (3, ids.shape[1] + 1)
    expected = hf_greedy(ref, ids, mask, 10, eos_token_id=first)
    assert torch.equal(got, expected)


def test_repetition_penalty_greedy_equals_transformers(pair: Any) -> None:
    ref, lm = pair
    ids, mask = padded_batch(6)
    expected = hf_greedy(ref, ids, mask, 8, repetition_penalty=1.7, eos_token_id=None)
    got = lm.generate(ids, 8, attention_mask=mask, repetition_penalty=1.7, eos_token_id=None)
    assert torch.equal(got, expected)
    assert not torch.equal(got, lm.generate(ids, 8, attention_mask=mask, eos_token_id=None))


@pytest.mark.parametrize(
    ("options", "processors"),
    [
        ({"temperature": 0.7}, [("TemperatureLogitsWarper", 0.7)]),
        ({"temperature": 1.0, "top_k": 5}, [("TopKLogitsWarper", 5)]),
        ({"temperature": 1.0, "top_p": 0.8}, [("TopPLogitsWarper", 0.8)]),
        (
            {"temperature": 1.3, "top_k": 20, "top_p": 0.6, "repetition_penalty": 1.2},
            [
                ("RepetitionPenaltyLogitsProcessor", 1.2),
                ("TemperatureLogitsWarper", 1.3),
                ("TopKLogitsWarper", 20),
                ("TopPLogitsWarper", 0.6),
            ],
        ),
    ],
)
def test_logits_processing_equals_transformers(
    options: dict[str, Any], processors: list[tuple[str, float]]
) -> None:
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, VOCAB, generator=g)
    ids = torch.randint(0, VOCAB, (4, 7), generator=g)
    expected = logits.clone()
    for name, value in processors:
        expected = getattr(logits_process, name)(value)(ids, expected)
    got = process_logits(logits, ids, GenerationOptions(**options))
    assert torch.equal(got.isinf(), expected.isinf())
    kept = int((~got.isinf()).sum())
    assert kept > 0 and (kept < got.numel()) == ("top_k" in options or "top_p" in options)
    assert_close(got[~got.isinf()], expected[~expected.isinf()])


def test_sampling_is_reproducible_and_cache_independent() -> None:
    lm = _small_lm(peaked=False)
    ids, mask = padded_batch(7)

    def sample(**kw: Any) -> torch.Tensor:
        return lm.generate(
            ids,
            8,
            attention_mask=mask,
            temperature=1.5,
            top_p=0.9,
            top_k=30,
            generator=torch.Generator().manual_seed(11),
            **kw,
        )

    a = sample()
    assert torch.equal(a, sample())
    assert torch.equal(a, sample(use_cache=False))
    other = lm.generate(
        ids, 8, attention_mask=mask, temperature=1.5, generator=torch.Generator().manual_seed(12)
    )
    assert not torch.equal(a, other)
    greedy = lm.generate(ids, 8, attention_mask=mask)
    assert torch.equal(lm.generate(ids, 8, attention_mask=mask, temperature=2.0, top_k=1), greedy)
    tiny_p = lm.generate(ids, 8, attention_mask=mask, temperature=2.0, top_p=1e-6)
    assert torch.equal(tiny_p, greedy)


@pytest.mark.parametrize("window", [None, 3])
def test_padded_rows_generate_as_alone(window: int | None) -> None:
    """The padding mask and the mask-derived positions make each row independent of the
    others; with a window shorter than the prompt, cached decoding still sees ``window`` keys."""
    lm = _small_lm(window=window, norm="rmsnorm", activation="swiglu", rope_interleaved=False)
    ids, mask = padded_batch(8)
    batch = lm.generate(ids, 7, attention_mask=mask)
    assert torch.equal(batch, lm.generate(ids, 7, attention_mask=mask, use_cache=False))
    for b in range(3):
        alone = lm.generate(ids[b : b + 1, mask[b].bool()], 7)
        assert torch.equal(batch[b, -7:], alone[0, -7:]), b
    assert len(set(batch[0, -7:].tolist())) > 2  # not a model that repeats one token
    # The window decides: without it the same weights give other logits.
    if window is not None:
        wide = TransformerLM(lm.config.replace(window=None)).eval()
        wide.load_state_dict(lm.state_dict())
        full = torch.cat([mask, torch.ones(3, 7, dtype=torch.long)], 1).bool()
        pos = positions_from_mask(full)
        with torch.no_grad():
            diff = (wide(batch, full, positions=pos) - lm(batch, full, positions=pos))[full]
        assert diff.abs().max() > 0.1


def test_a_left_padded_prefill_runs_each_prompt_from_its_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs of prompts, each from its first real token (10 and 7 together, their padding below a
    quarter, then 2 alone): the same caches (at the real slots) and tokens as the padded
    batch's prefill, the short prompt's padding never computed."""
    from attnkit import generation
    from attnkit.cache import KVCache

    lm = _small_lm(norm="rmsnorm", activation="swiglu", rope_interleaved=False)
    ids, mask = padded_batch(5)  # lengths 10, 7, 2 of 10: 37% padding
    lengths: list[int] = []
    forward = lm.forward

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        lengths.append(x.shape[1])
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(lm, "forward", spy)
    caches: dict[str, list[KVCache]] = {}
    make = lm.make_kv_caches

    def keep(*args: Any, **kwargs: Any) -> list[KVCache]:
        made = make(*args, **kwargs)
        caches["split" if "split" not in caches else "batched"] = made
        return made

    monkeypatch.setattr(lm, "make_kv_caches", keep)
    split = lm.generate(ids, 1, attention_mask=mask)
    assert lengths == [10, 2]
    monkeypatch.setattr(generation, "SPLIT_PREFILL_PADDING", 0.5)  # (37% is too little now)
    batched = lm.generate(ids, 1, attention_mask=mask)
    assert lengths == [10, 2, 10]
    assert torch.equal(split, batched)
    real = mask.bool()
    for one, other in zip(caches["split"], caches["batched"], strict=True):
        assert one.length == other.length == 10
        for a, b in ((one.k, other.k), (one.v, other.v)):  # (B, K, C, E): prompt slots
            a, b = a[:, :, :10].transpose(1, 2), b[:, :, :10].transpose(1, 2)
            assert_close(a[real], b[real])
            assert not a[2, :8].any()  # (the short prompt's padded slots: never written)


SPREAD = [384, 330, 275, 220, 165, 110, 55, 0]  # (8 prompts of 128-512 tokens)


@pytest.mark.parametrize(
    ("starts", "width", "groups"),
    [
        # 8 prompts of 32-128 tokens: 3 (23% padding; a fourth would make 28%), then 2 and 2
        # (within 256 real tokens), then the last alone
        ([96, 83, 69, 55, 42, 28, 14, 0], 128, [(0, 3, 69), (3, 5, 42), (5, 7, 14), (7, 8, 0)]),
        # 8 prompts of 128-512 tokens: each alone (two would pass 256 real tokens)
        (SPREAD, 512, [(r, r + 1, start) for r, start in enumerate(SPREAD)]),
        ([0, 3, 8], 10, [(0, 2, 0), (2, 3, 8)]),
        ([8, 0, 8], 10, [(0, 1, 8), (1, 2, 0), (2, 3, 8)]),  # (only neighbours run together)
        ([8, 0, 8], 128, [(0, 2, 0), (2, 3, 8)]),  # (3% padding; a third: 368 tokens)
        ([5], 10, [(0, 1, 5)]),
    ],
)
def test_prompts_fill_in_in_runs_of_little_padding(
    starts: list[int], width: int, groups: list[tuple[int, int, int]]
) -> None:
    from attnkit import generation

    got = generation._prefill_groups(starts, width)
    assert got == groups
    covered = [row for first, end, _ in got for row in range(first, end)]
    assert covered == list(range(len(starts)))


_PROPERTY_LM: dict[str, TransformerLM] = {}


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True)  # no flaky near-ties
@given(
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    window=st.sampled_from([None, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_left_padding_never_changes_a_row(
    lengths: list[int], window: int | None, seed: int
) -> None:
    """For any lengths: each row of a left-padded batch decodes (cached) as it does alone."""
    if window not in _PROPERTY_LM:
        _PROPERTY_LM[window] = _small_lm(window=window, rope_interleaved=False)
    lm = _PROPERTY_LM[window]
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), P), generator=g)
    mask = torch.arange(P)[None, :] >= P - torch.tensor(lengths)[:, None]  # left padding
    batch = lm.generate(ids.masked_fill(~mask, 0), 4, attention_mask=mask, eos_token_id=[])
    for b, n in enumerate(lengths):
        alone = lm.generate(ids[b : b + 1, P - n :], 4, eos_token_id=[])
        assert torch.equal(batch[b, P:], alone[0, n:]), (b, lengths)


def test_cached_decoding_sees_at_most_window_keys() -> None:
    lm = _small_lm(window=3, rope_interleaved=False)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    caches = lm.make_kv_caches(2, 12)
    with torch.no_grad():
        _, prefill = lm(ids, kv_caches=caches, return_weights=True)
        assert all(int((w > 0).sum(-1).max()) == 3 for w in prefill)
        for step in range(3):
            _, weights = lm(ids[:, step : step + 1], kv_caches=caches, return_weights=True)
            for w in weights:  # (B, H, 1, S): the last 3 of the 10 + step cached keys
                assert w.shape[-1] == 10 + step
                assert int((w > 0).sum(-1).max()) == 3
                assert torch.all(w[..., : 10 + step - 3] == 0)


def test_stream_yields_the_columns_of_generate(pair: Any) -> None:
    _, lm = pair
    ids, mask = padded_batch(9)
    lm.train()
    it = lm.stream(ids, 6, attention_mask=mask, eos_token_id=None)
    first = next(it)
    assert first.shape == (3,)
    assert not lm.training  # eval while streaming
    cols = [first, *it]
    assert lm.training  # mode restored when exhausted
    closed = lm.stream(ids, 6, attention_mask=mask)
    next(closed)
    closed.close()  # a consumer that stops early
    assert lm.training
    lm.eval()
    expected = lm.generate(ids, 6, attention_mask=mask, eos_token_id=None)
    assert torch.equal(torch.stack(cols, 1), expected[:, ids.shape[1] :])


def test_generation_config_defaults(pair: Any) -> None:
    _, lm = pair
    assert lm.generation_config["eos_token_id"] == 2
    ids, mask = padded_batch(10)
    lm.generation_config = {"eos_token_id": [int(t) for t in range(VOCAB)], "pad_token_id": 0}
    try:
        assert lm.generate(ids, 5, attention_mask=mask).shape == (3, ids.shape[1] + 1)
        # [] turns the default off; a tensor of ids works as a list.
        assert lm.generate(ids, 5, attention_mask=mask, eos_token_id=[]).shape[1] == 15
        ended = lm.generate(ids, 5, attention_mask=mask, eos_token_id=torch.arange(VOCAB))
        assert ended.shape[1] == 11
    finally:
        lm.generation_config = {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"attention_mask": torch.tensor([[1, 1, 0]])}, ValueError, "left-padded"),
        ({"attention_mask": torch.tensor([[1, 0, 1]])}, ValueError, "left-padded"),
        ({"attention_mask": torch.ones(1, 2)}, ValueError, "shape of input_ids"),
        ({"attention_mask": torch.tensor([[2, 1, 1]])}, ValueError, "0 and 1"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
        ({"eos_token_id": "2"}, TypeError, "eos_token_id"),
        ({"eos_token_id": [2, 2.5]}, TypeError, "eos_token_id"),
        ({"temprature": 0.5}, TypeError, r"unknown generation options \['temprature'\]"),
        ({"use_cache": 1}, TypeError, "use_cache must be a bool"),
    ],
)
def test_bad_generation_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    lm = _small_lm()
    with pytest.raises(error, match=match):
        lm.generate(torch.tensor([[3, 4, 5]]), 2, **kwargs)


def test_bad_ids() -> None:
    lm = _small_lm()
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\).*max {VOCAB}"):
        lm.generate(torch.tensor([[3, VOCAB]]), 2)
    with pytest.raises(TypeError, match="integer"):
        lm.generate(torch.tensor([[3.0]]), 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        lm.generate(torch.tensor([[3]]), 64)


def test_old_arguments_still_work(tmp_path: Path) -> None:
    lm = _small_lm()
    prompt = torch.tensor([[3, 4, 5]])
    out = lm.generate(
        prompt,
        4,
        temperature=0.8,
        top_k=5,
        use_cache=False,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape == (1, 7) and torch.equal(out[:, :3], prompt)
