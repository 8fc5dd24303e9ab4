"""Speculative decoding: the same tokens as plain greedy decoding, the same distribution when
sampling, the cache rolled back exactly, adaptive proposal lengths and the input checks.

References: attnkit's plain ``generate`` / ``stream`` on the same model, the model's uncached
forward, and the exact distribution of short continuations enumerated from the model's logits.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from attnkit import TransformerConfig, TransformerLM, speculative
from attnkit.cache import KVCache
from attnkit.generation import GenerationOptions, process_logits, stream
from attnkit.speculative import AdaptiveLength, SpeculationStats, lookup
from tests.helpers import LLAMA_OPTIONS, VOCAB, padded_batch, randomize


def _lm(seed: int = 0, *, vocab: int = VOCAB, dim: int = 32, peaked: bool = True) -> TransformerLM:
    torch.manual_seed(seed)
    config = TransformerConfig(vocab, dim, 2, 4, max_seq_len=128, **LLAMA_OPTIONS)
    lm = TransformerLM(config).eval()
    if peaked:  # clear greedy choices
        randomize(lm, seed)
    return lm


@pytest.fixture(scope="module")
def lm() -> TransformerLM:
    return _lm()


def _repetitive(seed: int = 0, length: int = 12, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(3, VOCAB, (batch, length), generator=g)
    return torch.cat([part, part, part[:, : length // 2]], dim=1)  # (batch, 2.5 * length)


def _speculative_options(kind: str) -> dict[str, Any]:
    if kind == "lookup":
        return {"prompt_lookup_num_tokens": 4}
    if kind == "draft":
        return {"assistant_model": _lm(seed=5)}  # another model: drafts often rejected
    return {"assistant_model": kind}


KINDS = ["lookup", "int8", "int4", "draft"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_greedy(lm: TransformerLM, kind: str) -> None:
    ids = _repetitive()
    stats = SpeculationStats()
    got = lm.generate(ids, 40, speculation_stats=stats, **_speculative_options(kind))
    assert torch.equal(got, lm.generate(ids, 40))
    assert stats.proposed > 0 and 0 <= stats.accepted <= stats.proposed
    assert stats.rounds < 40  # proposals were kept: fewer model forwards than tokens


def test_self_draft_reads_the_models_cache(lm: TransformerLM) -> None:
    # The prompt and the kept tokens are in the model's cache: the self-draft feeds one token a
    # forward (never the prompt), and the output is still plain greedy decoding's.
    ids = _repetitive(seed=7)
    draft = lm.self_draft("int8")
    lengths: list[int] = []
    hook = draft.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    try:
        got = lm.generate(ids, 30, assistant_model="int8")
    finally:
        hook.remove()
    assert torch.equal(got, lm.generate(ids, 30))
    assert lengths and set(lengths) == {1}


@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_repetition_penalty_sees_the_proposed_tokens(lm: TransformerLM, kind: str) -> None:
    ids = _repetitive(seed=6)
    options = {"repetition_penalty": 1.5, "top_k": 5}
    got = lm.generate(ids, 30, **options, **_speculative_options(kind))
    assert torch.equal(got, lm.generate(ids, 30, **options))


@pytest.mark.parametrize("kind", ["lookup", "int8", "draft"])
def test_left_padded_batch_equals_plain(lm: TransformerLM, kind: str) -> None:
    ids, mask = padded_batch(seed=1)
    ids = torch.cat([ids, ids[:, -5:]], dim=1)  # each row repeats its last tokens
    mask = torch.cat([mask, mask[:, -5:]], dim=1)
    mask[1, :3] = 0  # (keep the padding on the left)
    mask[2, :13] = 0
    ids = ids.masked_fill(mask == 0, 0)
    expected = lm.generate(ids, 24, attention_mask=mask)
    got = lm.generate(ids, 24, attention_mask=mask, **_speculative_options(kind))
    assert torch.equal(got, expected)
    for row in range(3):  # each row as it would come alone
        alone = ids[row : row + 1, mask[row].bool()]
        n = alone.shape[1]
        assert torch.equal(got[row, -24 - n :], lm.generate(alone, 24)[0])


@pytest.mark.parametrize("kind", ["lookup", "int8"])
def test_eos_ends_rows_as_plain(lm: TransformerLM, kind: str) -> None:
    ids = _repetitive(batch=2, seed=3)
    ids[1] = _repetitive(seed=4)[0]
    plain = lm.generate(ids, 30, eos_token_id=[])
    eos = int(plain[0, ids.shape[1] + 6])  # a token row 0 writes as its seventh
    expected = lm.generate(ids, 30, eos_token_id=eos, pad_token_id=0)
    got = lm.generate(ids, 30, eos_token_id=eos, pad_token_id=0, **_speculative_options(kind))
    assert torch.equal(got, expected)
    assert (expected[0, ids.shape[1] + 7 :] == 0).all()  # row 0 ended there


def test_streaming_yields_the_plain_columns(lm: TransformerLM) -> None:
    ids = _repetitive(seed=2)
    plain = list(stream(lm, ids, 20))
    columns = list(stream(lm, ids, 20, prompt_lookup_num_tokens=6))
    assert len(columns) == 20
    assert torch.equal(torch.stack(columns, 1), torch.stack(plain, 1))
    steps = stream(lm, ids, 20, assistant_model="int8")
    first = [next(steps) for _ in range(3)]
    steps.close()  # stopping early gives the model its mode back
    assert torch.equal(torch.stack(first, 1), torch.stack(plain[:3], 1))
    assert not lm.training


def test_max_new_tokens_bounds_and_zero(lm: TransformerLM) -> None:
    ids = _repetitive()
    for n in (0, 1, 2, 7):
        got = lm.generate(ids, n, prompt_lookup_num_tokens=10, eos_token_id=[])
        assert torch.equal(got, lm.generate(ids, n, eos_token_id=[]))


def test_cache_truncate_then_update_matches_a_fresh_cache() -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 9, 4, generator=g), torch.randn(2, 2, 9, 4, generator=g)
    cache, fresh = KVCache(2, 2, 12, 4), KVCache(2, 2, 12, 4)
    cache.update(k[:, :, :7], v[:, :, :7])
    cache.truncate(4)
    assert cache.length == 4
    got = cache.update(k[:, :, 4:9], v[:, :, 4:9])
    want = fresh.update(k, v)
    assert_close(got[0], want[0], rtol=0, atol=0)
    assert_close(got[1], want[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"truncate to 0\.\.9 filled slots, got 10"):
        cache.truncate(10)
    with pytest.raises(ValueError, match="got -1"):
        cache.truncate(-1)


def test_rolled_back_model_cache_gives_the_uncached_logits(lm: TransformerLM) -> None:
    ids = _repetitive()  # (1, 30)
    caches = lm.make_kv_caches(1, 64)
    with torch.no_grad():
        lm(ids[:, :20], kv_caches=caches)
        lm(torch.randint(3, VOCAB, (1, 5)), kv_caches=caches)  # a rejected proposal
        speculative.truncate_caches(caches, 20)
        got = lm(ids[:, 20:], kv_caches=caches)
        want = lm(ids)[:, 20:]
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lookup_takes_the_most_recent_longest_ngram_and_loops_a_short_one() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # no earlier "5 2 3"; "2 3" was most recently followed by 7 8
    assert lookup(tokens, 2) == [7, 8]
    assert lookup([4, 5, 6, 4, 5], 3) == [6, 4, 5]
    assert lookup([1, 2, 3], 4) == []
    # no occurrence with a full continuation: the nearest one's continuation, looped on
    assert lookup([1, 2, 3, 1, 2, 3], 4, max_ngram=3) == [1, 2, 3, 1]
    assert lookup([1, 2, 9, 1, 2], 5) == [9, 1, 2, 9, 1]
    assert lookup([8, 5, 5], 4) == [5, 5, 5, 5]
    assert lookup([6, 5, 5, 5, 5, 5, 5], 3) == [5, 5, 5]  # a full continuation over the nearest
    assert lookup([1, 2, 9, 1, 2], 3) == [9, 1, 2]
    assert lookup([7], 4) == []


def test_adaptive_length_grows_and_shrinks() -> None:
    length = AdaptiveLength(3, 8)
    length.update(3, 3)
    assert length.k == 5
    length.update(5, 5)
    length.update(7, 7)
    assert length.k == 8  # capped
    length.update(2, 8)
    assert length.k == 7
    pauses = []
    for _ in range(5):  # nothing kept, again and again
        length.update(0, length.propose())
        pauses.append(length.pause)
        while length.pause:  # plain steps
            assert length.propose() == 0
    assert length.k == 2
    assert pauses == [0, 2, 6, 14, 30]  # ever longer pauses
    for _ in range(6):
        length.update(0, length.propose())
        while length.pause:
            length.propose()
    assert length.k == 1 and length.failures == 11  # at least one token
    length.update(0, 0)  # nothing proposed: unchanged
    assert length.k == 1 and length.pause == 0
    length.update(1, 1)  # a kept token ends the pauses
    assert length.k == 3 and length.failures == 0
    with pytest.raises(ValueError, match="start=0, maximum=4"):
        AdaptiveLength(0, 4)


def test_failing_proposals_shrink_to_one_token(lm: TransformerLM) -> None:
    draft = _lm(seed=9)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    stats = SpeculationStats()
    got = lm.generate(ids, 40, assistant_model=draft, speculation_stats=stats)
    assert torch.equal(got, lm.generate(ids, 40))
    assert stats.acceptance_rate < 0.5
    # after the first rounds one token at a time, and ever fewer rounds propose at all
    assert stats.proposed - stats.accepted <= speculative.DRAFT_START + 12


def test_self_draft_is_built_once_and_stays_out_of_the_state_dict() -> None:
    lm = _lm(seed=2)
    keys = set(lm.state_dict())
    draft = lm.self_draft("int8")
    assert lm.self_draft("int8") is draft
    assert set(lm.state_dict()) == keys
    assert draft is not lm and not any(p is q for p in draft.parameters() for q in lm.parameters())
    with torch.no_grad():
        lm.embedding.weight.mul_(1.5)  # changed weights: a new draft
    assert lm.self_draft("int8") is not draft
    with pytest.raises(ValueError, match="'int2'"):
        lm.self_draft("int2")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# sampling: the distribution of the first 4 tokens, checked against the model's own


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, minimum: float = 5.0) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (cells expecting fewer than
    ``minimum`` merged into one)."""
    n = counts.sum()
    expected = probs * n
    small = expected < minimum
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


V_SMALL, SAMPLES, TOKENS = 3, 1200, 4
SAMPLING = {"temperature": 1.5, "top_p": 0.97}


def _exact_probabilities(lm: TransformerLM, prompt: torch.Tensor) -> torch.Tensor:
    """Probability of each of the ``V^4`` continuations, from the model's uncached forward and
    the same logits processing (``(V^4,)`` in lexicographic order)."""
    options = GenerationOptions(**SAMPLING)
    seqs = torch.tensor(list(itertools.product(range(V_SMALL), repeat=TOKENS)))  # (V^4, 4)
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    P = prompt.shape[1]
    with torch.no_grad():
        logits = lm(full).double()
    total = torch.zeros(len(seqs), dtype=torch.float64)
    for j in range(TOKENS):
        processed = process_logits(logits[:, P - 1 + j], full[:, : P + j], options).double()
        logp = processed.log_softmax(-1).gather(-1, seqs[:, j : j + 1])[:, 0]
        total += logp
    return total.exp()


def _sampled_counts(lm: TransformerLM, prompt: torch.Tensor, **options: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    out = lm.generate(
        prompt.expand(SAMPLES, -1), TOKENS, generator=g, eos_token_id=[], **SAMPLING, **options
    )[:, prompt.shape[1] :]
    index = sum(out[:, j] * V_SMALL ** (TOKENS - 1 - j) for j in range(TOKENS))
    return torch.bincount(index, minlength=V_SMALL**TOKENS).double()


@pytest.fixture(scope="module")
def small_pair() -> tuple[TransformerLM, TransformerLM, torch.Tensor, torch.Tensor]:
    lm = _lm(seed=11, vocab=V_SMALL, dim=16, peaked=False)
    draft = _lm(seed=12, vocab=V_SMALL, dim=16)  # peaked: a distribution far from the model's
    prompt = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1]])
    return lm, draft, prompt, _exact_probabilities(lm, prompt)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "lookup", "draft"])
def test_sampling_matches_the_models_distribution(small_pair: Any, kind: str) -> None:
    lm, draft, prompt, probs = small_pair
    options: dict[str, Any] = {}
    if kind == "lookup":
        options = {"prompt_lookup_num_tokens": 3}
    elif kind == "draft":
        options = {"assistant_model": draft}
    counts = _sampled_counts(lm, prompt, **options)
    assert _chi2_pvalue(counts, probs) > 0.01


@pytest.mark.slow
def test_chi_square_rejects_a_wrong_acceptance_rule(
    small_pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm, draft, prompt, probs = small_pair
    # keeping every proposed token gives the draft's distribution, not the model's
    monkeypatch.setattr(speculative, "acceptance_ratio", lambda p, q: torch.ones_like(p))
    counts = _sampled_counts(lm, prompt, assistant_model=draft)
    assert _chi2_pvalue(counts, probs) < 1e-6


# --------------------------------------------------------------------------------------------
# bad input


def test_bad_speculative_options(lm: TransformerLM) -> None:
    ids = _repetitive()
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens \(3\) or assistant_model"):
        lm.generate(ids, 5, prompt_lookup_num_tokens=3, assistant_model="int8")
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        lm.generate(ids, 5, prompt_lookup_num_tokens=0)
    with pytest.raises(TypeError, match=r"must be an int, got 2\.5"):
        lm.generate(ids, 5, prompt_lookup_num_tokens=2.5)  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match="'int2'"):
        lm.generate(ids, 5, assistant_model="int2")
    other = TransformerLM(TransformerConfig(VOCAB + 1, 32, 1, 4, max_seq_len=128))
    with pytest.raises(ValueError, match=f"vocab_size {VOCAB + 1} != {VOCAB}"):
        lm.generate(ids, 5, assistant_model=other)
    short = TransformerLM(TransformerConfig(VOCAB, 32, 1, 4, max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len 16 is shorter than the 35 positions"):
        lm.generate(ids, 5, assistant_model=short)
    with pytest.raises(TypeError, match="assistant_model must be a decoder, got int"):
        lm.generate(ids, 5, assistant_model=3)
    with pytest.raises(ValueError, match="use_cache=False"):
        lm.generate(ids, 5, prompt_lookup_num_tokens=3, use_cache=False)
    with pytest.raises(ValueError, match="compile=True"):
        lm.generate(ids, 5, prompt_lookup_num_tokens=3, compile=True)
    with pytest.raises(TypeError, match="speculation_stats must be a SpeculationStats"):
        lm.generate(ids, 5, prompt_lookup_num_tokens=3, speculation_stats={})  # type: ignore[typeddict-item]
