"""The serving engine: continuous batching equals each request run alone, preemption, prefix
caching, aborts, the background loop and bad input."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from attnkit import TransformerLM
from attnkit.config import FAMILIES, TransformerConfig
from attnkit.serving import Engine, SamplingParams, TokenEvent

GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def lm() -> TransformerLM:
    torch.manual_seed(1)
    config = TransformerConfig(
        211, 48, 2, 6, num_kv_heads=2, ffn_dim=96, max_seq_len=96, **FAMILIES["llama"]
    )
    return TransformerLM(config).eval()


def alone(lm: TransformerLM, prompt: list[int], n: int) -> list[int]:
    """The request's greedy tokens from the model's own generate, nothing else running."""
    out = lm.generate(torch.tensor([prompt]), n)
    return out[0, len(prompt) :].tolist()


def prompts(lengths: list[int], vocab: int = 211) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,)).tolist() for n in lengths]


@pytest.mark.parametrize(("block_size", "chunk"), [(4, 8), (16, 256), (3, 5)])
def test_concurrent_greedy_equals_alone(lm: TransformerLM, block_size: int, chunk: int) -> None:
    ps = prompts([5, 17, 1, 30, 9, 12, 23])
    engine = Engine(lm, max_batch=4, block_size=block_size, prefill_chunk=chunk)
    assert engine.generate(ps, GREEDY) == [alone(lm, p, 10) for p in ps]


def test_requests_arriving_mid_run_join_and_match(lm: TransformerLM) -> None:
    ps = prompts([7, 26, 3, 14, 40])
    lengths = [12, 3, 9, 6, 5]
    engine = Engine(lm, max_batch=3, block_size=4, prefill_chunk=6)
    got: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}

    def collect(event: TokenEvent) -> None:
        got[event.request_id].append(event.token_id)
        finish[event.request_id] = event.finish_reason

    rids: list[str] = []
    for step in range(200):
        if step % 3 == 0 and len(rids) < len(ps):  # a new request every third step
            i = len(rids)
            rid = f"r{i}"
            got[rid] = []
            params = SamplingParams(max_tokens=lengths[i], temperature=0)
            rids.append(engine.add_request(ps[i], params, request_id=rid, on_event=collect))
        if not engine.has_work() and len(rids) == len(ps):
            break
        engine.step()
    assert [got[r] for r in rids] == [alone(lm, p, n) for p, n in zip(ps, lengths, strict=True)]
    assert all(finish[r] == "length" for r in rids)
    assert engine.stats().kv_blocks_used == 0


def test_chunked_prefill_keeps_decoding_others(lm: TransformerLM) -> None:
    engine = Engine(lm, max_batch=4, block_size=4, prefill_chunk=4)
    short, long = prompts([3, 37])
    a = engine.add_request(short, SamplingParams(max_tokens=20, temperature=0))
    engine.step()  # the short prompt is read
    b = engine.add_request(long, SamplingParams(max_tokens=2, temperature=0))
    events = [engine.step() for _ in range(5)]
    # While the long prompt is read 4 tokens a step, the short request gets a token every step.
    assert all([e.request_id for e in step] == [a] for step in events)
    rest = []
    while engine.has_work():
        rest += engine.step()
    long_tokens = [e.token_id for e in rest if e.request_id == b]
    assert long_tokens == alone(lm, long, 2)


def test_preemption_with_a_tiny_pool_keeps_outputs(lm: TransformerLM) -> None:
    ps = prompts([9, 14, 6, 11, 20])
    engine = Engine(lm, max_batch=5, block_size=4, prefill_chunk=8, kv_cache_tokens=40)
    assert engine.generate(ps, GREEDY) == [alone(lm, p, 10) for p in ps]
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == 10


def test_prefix_cache_reuses_blocks_and_matches(lm: TransformerLM) -> None:
    system = prompts([21])[0]
    engine = Engine(lm, block_size=4, prefill_chunk=64)
    first = engine.generate([[*system, 5, 6]], GREEDY)[0]
    before = engine.stats()
    events: list[TokenEvent] = []
    engine.add_request([*system, 7], GREEDY, on_event=events.append)
    while engine.has_work():
        engine.step()
    after = engine.stats()
    # 21 shared tokens: 5 full blocks of 4 are found again (the 6th differs).
    assert after.prefix_cache_hits - before.prefix_cache_hits == 5
    assert events[0].cached_tokens == 20 and events[0].prompt_tokens == 22
    assert [e.token_id for e in events] == alone(lm, [*system, 7], 10)
    assert first == alone(lm, [*system, 5, 6], 10)
    off = Engine(lm, block_size=4, prefix_caching=False)
    off.generate([system, system], GREEDY)
    assert off.stats().prefix_cache_hits == 0


def test_prefix_blocks_shared_while_running(lm: TransformerLM) -> None:
    system = prompts([16])[0]
    engine = Engine(lm, block_size=4, prefill_chunk=64)
    engine.add_request([*system, 1, 2], SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    used = engine.stats().kv_blocks_used  # 16 + 2 tokens (+ the first new one): 5 blocks
    engine.add_request([*system, 3], SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    # The second request holds the 4 shared blocks and one of its own.
    assert engine.stats().kv_blocks_used == used + 1


def test_abort_frees_blocks_and_emits_abort(lm: TransformerLM) -> None:
    engine = Engine(lm, block_size=4, prefix_caching=False)
    events: list[TokenEvent] = []
    rid = engine.add_request(prompts([30])[0], GREEDY, on_event=events.append)
    engine.step()
    assert engine.stats().kv_blocks_used == 8
    engine.abort(rid)
    assert engine.stats().kv_blocks_used == 0 and not engine.has_work()
    assert events[-1].finish_reason == "abort" and events[-1].token_id == -1
    engine.abort(rid)  # after the end: ignored
    waiting = engine.add_request([1, 2], GREEDY)
    engine.abort(waiting)  # before its first step
    assert not engine.has_work() and engine.step() == []


def test_abort_during_a_step_ends_the_request_when_the_step_does(lm: TransformerLM) -> None:
    engine = Engine(lm, block_size=4, prefix_caching=False)
    victim = engine.add_request(prompts([9])[0], GREEDY)

    def abort_victim(event: TokenEvent) -> None:  # runs inside the step
        engine.abort(victim)

    engine.add_request(prompts([5])[0], GREEDY, on_event=abort_victim)
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events][-1] == (victim, "abort")
    assert engine.stats().running == 1 and engine.stats().kv_blocks_used == 2


def test_stop_tokens_end_a_request(lm: TransformerLM) -> None:
    p = prompts([8])[0]
    ref = alone(lm, p, 10)
    engine = Engine(lm)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(ref[3],))
    events: list[TokenEvent] = []
    engine.add_request(p, params, on_event=events.append)
    while engine.has_work():
        engine.step()
    stop_at = ref.index(ref[3])
    assert [e.token_id for e in events] == ref[: stop_at + 1]
    assert events[-1].finish_reason == "stop"
    assert [e.completion_tokens for e in events] == list(range(1, stop_at + 2))
    ignoring = SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=(ref[3],), ignore_eos=True
    )
    assert engine.generate([p], ignoring)[0] == ref


def test_context_end_finishes_with_length(lm: TransformerLM) -> None:
    p = prompts([90])[0]
    engine = Engine(lm, block_size=8)
    events: list[TokenEvent] = []
    engine.add_request(p, SamplingParams(max_tokens=50, temperature=0), on_event=events.append)
    while engine.has_work():
        engine.step()
    assert len(events) == 6 and events[-1].finish_reason == "length"


def test_seeded_sampling_repeats_whatever_runs_beside(lm: TransformerLM) -> None:
    p = prompts([6])[0]
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=3, logprobs=2)
    engine = Engine(lm)
    solo = engine.generate([p], params)[0]
    crowd = engine.generate([p, *prompts([4, 9])], [params, GREEDY, GREEDY])[0]
    assert solo == crowd
    events: list[TokenEvent] = []
    engine.add_request(p, params, on_event=events.append)
    while engine.has_work():
        engine.step()
    with torch.no_grad():
        logits = lm(torch.tensor([p]))[0, -1].double()
    expected = torch.log_softmax(logits, -1)
    first = events[0]
    assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-4)
    top = expected.topk(2)
    assert [t for t, _ in first.top_logprobs or ()] == top.indices.tolist()


def test_logits_processor_constrains_its_request_only(lm: TransformerLM) -> None:
    p, q = prompts([5, 7])
    allowed = torch.full((211,), float("-inf"))
    allowed[[11, 12]] = 0.0
    seen: list[list[int]] = []

    def only_11_or_12(generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(generated))
        return logits + allowed

    engine = Engine(lm)
    engine.add_request(p, GREEDY, request_id="c", logits_processor=only_11_or_12)
    other = engine.add_request(q, GREEDY)
    out: dict[str, list[int]] = {"c": [], other: []}
    while engine.has_work():
        for e in engine.step():
            out[e.request_id].append(e.token_id)
    assert set(out["c"]) <= {11, 12} and out[other] == alone(lm, q, 10)
    assert seen[0] == [] and seen[-1] == out["c"][:-1]


def test_a_failing_logits_processor_ends_only_its_request(lm: TransformerLM) -> None:
    def broken(generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("grammar error")

    engine = Engine(lm)
    bad = engine.add_request([1, 2], GREEDY, logits_processor=broken)
    good = engine.add_request([3, 4], GREEDY)
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [(bad, "abort"), (good, None)]
    assert engine.generate([[3, 4]], GREEDY)[0] == alone(lm, [3, 4], 10)


def test_background_loop_sleeps_when_idle_and_streams(lm: TransformerLM) -> None:
    engine = Engine(lm)
    engine.start()
    try:
        ps = prompts([4, 11, 8])
        assert engine.generate(ps, GREEDY) == [alone(lm, p, 10) for p in ps]
        rid = engine.add_request(ps[0], SamplingParams(max_tokens=40, temperature=0))
        events = engine.subscribe(rid)
        assert events.get(timeout=10).request_id == rid
        engine.abort(rid)
        while (e := events.get(timeout=10)).finish_reason is None:
            pass
        assert e.finish_reason == "abort"
        thread = engine._thread
        assert thread is not None
        time.sleep(0.05)
        cpu = time.process_time()  # every thread of this process, the loop's included
        before = engine.stats()
        time.sleep(0.3)
        assert engine.stats() == before and not engine.has_work() and thread.is_alive()
        assert time.process_time() - cpu < 0.05  # the loop sleeps on its condition
    finally:
        engine.stop()
    assert not engine.running


def test_stop_cancels_running_requests(lm: TransformerLM) -> None:
    engine = Engine(lm)
    done = threading.Event()
    reasons: list[str | None] = []

    def on_event(event: TokenEvent) -> None:
        if event.finish_reason is not None:
            reasons.append(event.finish_reason)
            done.set()

    engine.add_request([1, 2, 3], SamplingParams(max_tokens=80, temperature=0), on_event=on_event)
    engine.start()
    engine.stop(cancel=True, timeout=10)
    assert done.wait(10) and reasons == ["abort"] and not engine.has_work()


def test_bad_requests_and_params(lm: TransformerLM) -> None:
    engine = Engine(lm, kv_cache_tokens=64, block_size=16)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"96 tokens, the context holds 96"):
        engine.add_request([1] * 96, GREEDY)
    with pytest.raises(ValueError, match=r"\[211\] are outside the vocabulary \[0, 211\)"):
        engine.add_request([1, 211], GREEDY)
    with pytest.raises(ValueError, match=r"needs up to 90 tokens \(6 blocks\).*holds 4 blocks"):
        engine.add_request([1] * 80, GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1], {"max_tokens": 3})  # type: ignore[arg-type]
    engine.add_request([1], GREEDY, request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request([2], GREEDY, request_id="x")
    with pytest.raises(ValueError, match=r"max_batch.*0"):
        Engine(lm, max_batch=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(lm, prefill_chunk=-1)
    for field, value, pattern in [
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
        ("temperature", -0.5, "temperature must be >= 0, got -0.5"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("logprobs", 21, r"logprobs must be in \[0, 20\], got 21"),
        ("logprobs", -1, r"logprobs must be in \[0, 20\], got -1"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            SamplingParams(**{field: value})
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        SamplingParams(max_tokens=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stop_token_ids must be a tuple"):
        SamplingParams(stop_token_ids=[1])  # type: ignore[arg-type]
