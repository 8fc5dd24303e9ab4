"""The fused decoding step (every layer in one kernel call): the model's own forward's results,
rows alone or batched alike, a new plan where the model changed, and the model's forward
wherever the step does not serve.

References: the model's own layer-by-layer forward on the same weights (forced by a forward
hook, which the fused step leaves to the blocks), and the float64 forward of the whole sequence
without a cache.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

from attnkit import TransformerConfig, TransformerLM, decoding, fused, generation
from attnkit.kernels import build
from attnkit.quantize import quantize
from attnkit.quantized.block import set_activations
from attnkit.serving.paged import PagedKVCache, SequenceSlice
from tests.helpers import LLAMA_OPTIONS, VOCAB, padded_batch, randomize

pytestmark = pytest.mark.skipif(
    not build.kernels_available(), reason="attnkit's kernels are not built on this machine"
)

#: The weights the step multiplies: float32, per-channel int8, grouped int4, GGUF's blocks, and
#: a bf16 model (bf16 activations, caches and weights).
WEIGHTS = ["float", "int8", "int4", "q8_0", "q4_0", "q4_1", "q8_0-rounded", "bf16", "bf16-int4"]


#: Gemma 2's shape: norms scaling by 1 + weight (also of the attention's and feed-forward's
#: outputs), a tanh-GELU gate, scaled embeddings, soft-capped scores, sliding layers between
#: full ones.
GEMMA2: dict[str, object] = {
    "norm": "rmsnorm_plus_one",
    "post_norms": True,
    "scale_embeddings": True,
    "activation": "geglu_tanh",
    "attn_softcap": 3.0,
    "window": 3,
    "layer_types": ("sliding_attention", "full_attention"),
    "rope_base": 50_000.0,
}


def _lm(weights: str = "float", seed: int = 0, **options: object) -> TransformerLM:
    torch.manual_seed(seed)
    settings = {**LLAMA_OPTIONS, "head_dim": 16, "ffn_dim": 96, **options}
    config = TransformerConfig(VOCAB, 64, 2, 4, max_seq_len=64, **settings)  # type: ignore[arg-type]
    lm = TransformerLM(config).eval()
    randomize(lm, seed)
    if weights == "int8":
        quantize(lm, "int8", layout="channel", int8_kernel="attnkit")
    elif weights == "int4":
        quantize(lm, "int4", layout="grouped")
    elif weights == "bf16":
        lm.to(torch.bfloat16)
    elif weights == "bf16-int4":  # (a bf16 model's quantized copy: its self-draft)
        quantize(lm.to(torch.bfloat16), "int4", layout="grouped")
    elif weights != "float":
        quantize(lm, "int4" if weights.startswith("q4") else "int8", layout=weights[:4])  # type: ignore[arg-type]
        if weights.endswith("rounded"):
            set_activations(lm, "int8")
    # (laid out for steps of two sequences: row-major float weights on every machine, where a
    # single sequence's layout is the policy's measured choice)
    return decoding.prepare(lm, batch=2)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of :func:`attnkit.fused.run` from here on served its step."""
    calls: list[bool] = []
    run = fused.run

    def counted(*args: Any) -> Any:
        out = run(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused, "run", counted)
    return calls


def _steps(lm: TransformerLM, prompt: torch.Tensor, steps: torch.Tensor, *, fuse: bool) -> tuple:
    """Logits of ``steps`` fed one token at a time after ``prompt``, and the caches; the model's
    own forward where not ``fuse`` (a hooked block runs every layer's modules)."""
    caches = lm.make_kv_caches(1, 32)
    out = []
    hook = None if fuse else lm.blocks[0].register_forward_pre_hook(lambda m, args: None)
    try:
        with torch.inference_mode():
            lm(prompt, kv_caches=caches)
            for j in range(steps.shape[1]):
                out.append(lm(steps[:, j : j + 1], kv_caches=caches))
    finally:
        if hook is not None:
            hook.remove()
    return torch.cat(out, dim=1), caches


@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_fused_step_gives_the_models_own_logits_and_cache(weights: str) -> None:
    lm = _lm(weights)
    step = fused.plan_of(lm)
    assert step is not None and step.takes(1)  # (so every one-token step below is fused)
    prompt, steps = torch.randint(0, VOCAB, (1, 7)), torch.randint(0, VOCAB, (1, 4))
    got, caches = _steps(lm, prompt, steps, fuse=True)
    want, want_caches = _steps(lm, prompt, steps, fuse=False)
    # (int8-rounded activations: float32 rounding of the layers' sums may move one activation
    # across a rounding step; the layers otherwise run the same kernels)
    tolerance = 1e-4 if weights in ("float", "q8_0", "q4_0", "q4_1") else 2e-2
    if weights.startswith("bf16"):  # (a bf16 step of a logit near 4 is 0.016-0.03)
        tolerance = 6e-2
    got, want = got.float(), want.float()  # (bf16: the same kernels, one rounding apart)
    assert_close(got, want, rtol=tolerance, atol=tolerance)
    for mine, theirs in zip(caches, want_caches, strict=True):
        assert mine.length == theirs.length == 11
        for a, b in ((mine.k, theirs.k), (mine.v, theirs.v)):
            assert_close(a[:, :, :11].float(), b[:, :, :11].float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "options",
    [
        {"window": 4},
        {"attn_softcap": 2.0},
        {"window": 3, "attn_softcap": 2.0},
        {"qk_norm": True},
        GEMMA2,
        {**GEMMA2, "qk_norm": True, "rope_local_base": 500.0},  # Gemma 3: local tables too
    ],
    ids=["window", "softcap", "both", "qk_norm", "gemma2", "gemma3"],
)
def test_windows_soft_caps_and_head_norms_run_fused(options: dict[str, object]) -> None:
    lm = _lm(**options)
    assert fused.plan(lm) is not None
    prompt, steps = torch.randint(0, VOCAB, (1, 7)), torch.randint(0, VOCAB, (1, 4))
    got, caches = _steps(lm, prompt, steps, fuse=True)
    want, _ = _steps(lm, prompt, steps, fuse=False)
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    exact = copy.deepcopy(lm).double()  # (the whole sequence, its window and cap as a mask)
    with torch.no_grad():
        whole = exact(torch.cat([prompt, steps], dim=1))[:, 7:]
    assert_close(got.double(), whole, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():  # several new tokens at once: each within its own window
        caches = lm.make_kv_caches(1, 32)
        lm(prompt, kv_caches=caches)
        together = lm(steps, kv_caches=caches)
    assert_close(together, got, rtol=1e-5, atol=1e-5)


def test_a_fused_step_equals_the_float64_forward_of_the_whole_sequence() -> None:
    lm = _lm()
    ids = torch.randint(0, VOCAB, (1, 12))
    got, _ = _steps(lm, ids[:, :8], ids[:, 8:], fuse=True)
    exact = copy.deepcopy(lm).double()
    with torch.no_grad():
        want = exact(ids)[:, 8:]
    assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["float", "int4", "q4_1", "bf16", "bf16-int4"])
def test_rows_alone_or_together_give_the_same_bits(weights: str) -> None:
    """A speculative round's check (several new tokens) computes each as a step of its own
    would: the greedy tokens of speculation are plain decoding's."""
    lm = _lm(weights)
    prompt, new = torch.randint(0, VOCAB, (1, 6)), torch.randint(0, VOCAB, (1, 4))
    with torch.inference_mode():
        together_caches = lm.make_kv_caches(1, 32)
        lm(prompt, kv_caches=together_caches)
        h = lm.embedding(new)
        together = fused.run(lm, h, None, together_caches)
        alone_caches = lm.make_kv_caches(1, 32)
        lm(prompt, kv_caches=alone_caches)
        alone = [fused.run(lm, h[:, j : j + 1], None, alone_caches) for j in range(4)]
    assert together is not None and all(a is not None for a in alone)
    assert torch.equal(torch.cat(alone, dim=1), together)  # type: ignore[arg-type]
    for a, b in zip(alone_caches, together_caches, strict=True):
        assert torch.equal(a.k[:, :, :10], b.k[:, :, :10])
        assert torch.equal(a.v[:, :, :10], b.v[:, :, :10])


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_greedy_generation_with_fused_steps_matches_the_models_forward(
    weights: str, served: list[bool]
) -> None:
    lm = _lm(weights)
    prompt = torch.randint(0, VOCAB, (1, 5))
    calls = []
    handle = lm.blocks[0].register_forward_pre_hook(lambda m, args: calls.append(1))
    try:  # (a hooked block: every step runs the blocks)
        want = lm.generate(prompt, 12)
    finally:
        handle.remove()
    assert len(calls) == 12  # the prompt and 11 steps, through the blocks
    assert served == [False] * 12  # (declined: a hooked block)
    served.clear()
    got = lm.generate(prompt, 12)
    assert served == [True] * 12  # (the prompt and every step)
    assert torch.equal(got, want)


def test_compiled_generation_steps_a_fused_stack_by_its_one_call(
    served: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile=True`` on a stack the fused step serves runs that call (no graph is compiled,
    the same tokens); the policy's ``graph`` option, or a hooked block, leaves it to the graph."""
    monkeypatch.setenv("ATTNKIT_KERNEL_DECODING_COMPILED_STEP_FLOAT32", "fused")
    lm = _lm()
    prompt = torch.randint(0, VOCAB, (1, 5))
    want = lm.generate(prompt, 6, eos_token_id=[])
    served.clear()
    assert lm.fuses_steps()
    assert torch.equal(lm.generate(prompt, 6, eos_token_id=[], compile=True), want)
    assert served == [True] * 6 and "_attnkit_step" not in lm.__dict__
    compiled: list[object] = []  # (the graph's stand-in: the model's forward, uncompiled)
    monkeypatch.setattr(decoding, "compiled_step", lambda model: compiled.append(model) or model)
    monkeypatch.setenv("ATTNKIT_KERNEL_DECODING_COMPILED_STEP_FLOAT32", "graph")
    served.clear()
    assert torch.equal(lm.generate(prompt, 6, eos_token_id=[], compile=True), want)
    assert compiled == [lm] and served == [True]  # (the prompt; steps by cache_position: blocks)
    monkeypatch.setenv("ATTNKIT_KERNEL_DECODING_COMPILED_STEP_FLOAT32", "fused")
    handle = lm.blocks[0].register_forward_pre_hook(lambda m, args: None)
    try:
        assert not lm.fuses_steps() and not generation.compiled_steps_fuse(lm)
    finally:
        handle.remove()


@pytest.mark.parametrize("graph", ["FLOAT32", "BFLOAT16", "FLOAT32_BATCH", "BFLOAT16_BATCH"])
def test_compiled_steps_ask_the_choice_of_their_dtype_and_batch(
    graph: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile=True`` asks ``decoding.compiled_step.<dtype>`` for one sequence and
    ``...<dtype>_batch`` for several: with only one of the four set to ``graph``, only its
    steps leave the fused call."""
    for name in ("FLOAT32", "BFLOAT16", "FLOAT32_BATCH", "BFLOAT16_BATCH"):
        option = "graph" if name == graph else "fused"
        monkeypatch.setenv(f"ATTNKIT_KERNEL_DECODING_COMPILED_STEP_{name}", option)
    for weights, dtype in (("float", "FLOAT32"), ("bf16", "BFLOAT16")):
        lm = _lm(weights)
        for batch, suffix in ((1, ""), (2, "_BATCH")):
            assert generation.compiled_steps_fuse(lm, batch) is (dtype + suffix != graph)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "batch"), [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 3)]
)
def test_the_timed_steps_are_one_step_by_the_call_and_by_the_graph(
    dtype: torch.dtype, batch: int, served: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The candidates the policy times for ``decoding.compiled_step.*`` (a small stack here; a
    batch left-padded): the fused call serves its step, the graph does not, and both give the
    logits of the uncached forward at the same position; repeated calls give the same logits
    (each writes the same slot) and the global random state is untouched."""
    from attnkit import models
    from attnkit.kernels import timing

    config = TransformerConfig(VOCAB, 64, 2, 4, max_seq_len=32, **LLAMA_OPTIONS)  # type: ignore[arg-type]
    monkeypatch.setattr(models, "_TIMED_STACK", config)
    monkeypatch.setattr(models, "_TIMED_PROMPT", 12)
    state = torch.get_rng_state()
    calls = timing.compiled_step(dtype, batch)
    assert torch.equal(torch.get_rng_state(), state) and set(calls) == {"fused", "graph"}
    served.clear()
    by_call = calls["fused"]()
    assert served == [True]
    by_graph = calls["graph"]()
    assert served == [True]  # (the graph ran no fused step)
    assert torch.equal(calls["fused"](), by_call) and torch.equal(calls["graph"](), by_graph)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm = decoding.prepare(TransformerLM(config).to(dtype).eval(), compiled=True)
    ids = torch.arange(batch * 12).reshape(batch, 12) % VOCAB
    ids = torch.cat([ids, ids[:, -1:]], 1)
    real = torch.arange(13)[None] >= (torch.arange(batch) * 12 // (2 * batch))[:, None]
    with torch.no_grad():
        want = lm(ids, real, positions=generation.positions_from_mask(real))[:, -1:].float()
    assert by_call.shape == want.shape == (batch, 1, VOCAB)
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4  # (bf16: each op rounds where it runs)
    assert_close(by_call.float(), want, atol=tol, rtol=tol)
    assert_close(by_graph.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("weights", ["float", "int4", "window"])
def test_a_left_padded_batch_decodes_fused(weights: str, served: list[bool]) -> None:
    """Three sequences of a left-padded batch: one token of each a step, the padding left out by
    the key mask; the same tokens as the blocks' batch decoding, and as each prompt alone."""
    lm = _lm("float", window=4) if weights == "window" else _lm(weights)
    ids, mask = padded_batch()
    hook = lm.blocks[0].register_forward_pre_hook(lambda m, args: None)
    try:
        want = lm.generate(ids, 8, attention_mask=mask, pad_token_id=0, eos_token_id=[])
    finally:
        hook.remove()
    served.clear()
    got = lm.generate(ids, 8, attention_mask=mask, pad_token_id=0, eos_token_id=[])
    assert served[-7:] == [True] * 7  # (each step after the prompts')
    assert torch.equal(got, want)
    for row in range(3):  # (each prompt alone, without its padding: a batch of one)
        alone = ids[row : row + 1, mask[row].bool()]
        assert torch.equal(lm.generate(alone, 8, eos_token_id=[])[0, -8:], got[row, -8:])


@pytest.mark.parametrize("weights", ["float", "int4", "window"])
def test_a_serving_engines_decoding_step_runs_fused_over_its_pool(weights: str) -> None:
    """One token of each of three sequences, each over its own block table of a paged pool,
    against each sequence's whole forward without a cache."""
    lm = _lm("float", window=4) if weights == "window" else _lm(weights)
    pool = PagedKVCache(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=16)
    seqs = [torch.randint(0, VOCAB, (1, n)) for n in (6, 9, 3)]
    tables = [[5, 1], [0, 7, 3], [2]]
    ids = torch.cat([s[:, -1:] for s in seqs], dim=1)
    positions = torch.tensor([[s.shape[1] - 1 for s in seqs]])
    step = [SequenceSlice(t, s.shape[1] - 1, 1) for s, t in zip(seqs, tables, strict=True)]
    with torch.inference_mode():
        for s, t in zip(seqs, tables, strict=True):  # each prompt but its last token
            n = s.shape[1] - 1
            pool.plan([SequenceSlice(t, 0, n)])
            lm(s[:, :n], positions=torch.arange(n)[None], kv_caches=pool.layers())
        pool.plan(step)
        assert fused.run(lm, lm.embedding(ids), positions, pool.layers()) is not None
        pool.plan(step)  # (the same step again through the model: the same slots written)
        at = torch.arange(3)
        packed = lm(ids, positions=positions, kv_caches=pool.layers(), logits_at=at)[0]
        separate = torch.stack([lm(s)[0, -1] for s in seqs])
    tolerance = 2e-2 if weights == "int4" else 1e-4
    assert_close(packed, separate, rtol=tolerance, atol=tolerance)


def test_a_changed_weight_makes_a_new_plan() -> None:
    lm = _lm()
    prompt, steps = torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 2))
    _steps(lm, prompt, steps, fuse=True)
    first = fused.plan_of(lm)
    proj = lm.blocks[1].feed_forward.linear2
    proj.weight.data = proj.weight.data * 2  # new storage: the kept pointer is stale
    got, _ = _steps(lm, prompt, steps, fuse=True)
    want, _ = _steps(lm, prompt, steps, fuse=False)
    assert fused.plan_of(lm) is not first
    assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_changed_setting_or_added_norm_makes_a_new_plan() -> None:
    lm = _lm()
    prompt, steps = torch.randint(0, VOCAB, (1, 9)), torch.randint(0, VOCAB, (1, 3))
    _steps(lm, prompt, steps, fuse=True)
    first = fused.plan_of(lm)
    for block in lm.blocks:
        block.attention.window = 2  # (set by hand after the plan was made)
    assert fused.plan_of(lm) is not first
    got, _ = _steps(lm, prompt, steps, fuse=True)
    want, _ = _steps(lm, prompt, steps, fuse=False)
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    before, _ = _steps(_lm(), prompt, steps, fuse=True)
    assert not torch.allclose(got, before, atol=1e-3)  # (the window changed the logits)
    second = fused.plan_of(lm)
    lm.blocks[0].post_attn_norm = torch.nn.RMSNorm(64)  # (a module where None was)
    assert fused.plan_of(lm) is not second
    got, _ = _steps(lm, prompt, steps, fuse=True)
    want, _ = _steps(lm, prompt, steps, fuse=False)
    assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_model_that_ran_fused_steps_still_copies_and_pickles(tmp_path: object) -> None:
    lm = _lm()
    _steps(lm, torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 2)), fuse=True)
    assert fused.plan_of(lm) is not None
    twin = copy.deepcopy(lm)
    prompt, steps = torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 2))
    assert torch.equal(
        _steps(twin, prompt, steps, fuse=True)[0], _steps(lm, prompt, steps, fuse=True)[0]
    )
    assert pickle.loads(pickle.dumps(lm)).dim == 64


def test_a_flop_counter_counts_every_layers_products() -> None:
    lm = _lm()
    block_weights = sum(
        m.weight.numel() for m in lm.blocks.modules() if isinstance(m, torch.nn.Linear)
    )
    with FlopCounterMode(display=False) as counter:
        _steps(lm, torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 3)), fuse=True)
    assert counter.get_total_flops() >= 2 * block_weights * 8  # (8 tokens through the blocks)


def test_a_hook_declines_steps_but_keeps_the_plan() -> None:
    """A hooked model's steps run the blocks without the plan being made again each step."""
    lm = _lm()
    first = fused.plan_of(lm)
    handle = lm.blocks[1].register_forward_hook(lambda m, i, o: None)
    try:
        assert fused.plan_of(lm) is None
        _steps(lm, torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 2)), fuse=True)
        assert fused.plan_of(lm) is None
    finally:
        handle.remove()
    assert fused.plan_of(lm) is first


def test_a_forward_hook_still_runs() -> None:
    lm = _lm()
    seen: list[tuple[int, ...]] = []
    handle = lm.blocks[0].register_forward_hook(lambda m, i, o: seen.append(tuple(o[0].shape)))
    try:
        _steps(lm, torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 3)), fuse=True)
    finally:
        handle.remove()
    assert seen == [(1, 5, 64), (1, 1, 64), (1, 1, 64), (1, 1, 64)]


@pytest.mark.parametrize(
    "options",
    [
        {"norm": "layernorm"},
        {"activation": "gelu"},
        {"position": "learned"},
    ],
    ids=lambda o: next(iter(o)),
)
def test_stacks_the_step_does_not_describe_run_their_blocks(options: dict[str, object]) -> None:
    lm = _lm(**options)
    assert fused.plan(lm) is None
    prompt, steps = torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 2))
    got, _ = _steps(lm, prompt, steps, fuse=True)
    want, _ = _steps(lm, prompt, steps, fuse=False)
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_calls_it_does_not_serve_are_left_to_the_blocks() -> None:
    lm = _lm()
    prompt = torch.randint(0, VOCAB, (1, 5))
    caches = lm.make_kv_caches(1, 32)
    with torch.inference_mode():
        lm(prompt, kv_caches=caches)
        h = lm.embedding(torch.randint(0, VOCAB, (1, 1)))
        assert fused.run(lm, h.double(), None, caches) is None  # float64
        assert fused.run(lm, h.expand(2, 1, 64), None, caches) is None  # two sequences
        many = lm.embedding(torch.randint(0, VOCAB, (1, fused.MOST_ROWS + 1)))
        assert fused.run(lm, many, None, caches) is None  # a prompt
    assert caches[0].length == 5
    with torch.enable_grad():
        assert fused.run(lm, h, None, caches) is None  # gradients


def test_a_non_finite_score_is_left_to_the_models_rules() -> None:
    lm = _lm()
    prompt = torch.randint(0, VOCAB, (1, 5))
    caches = lm.make_kv_caches(1, 32)
    with torch.inference_mode():
        lm(prompt, kv_caches=caches)
        caches[0].k[0, :, 2] = float("inf")  # a cached key whose scores are infinite
        h = lm.embedding(torch.randint(0, VOCAB, (1, 1)))
        assert fused.run(lm, h, None, caches) is None
    assert all(c.length == 5 for c in caches)  # nothing counted


def test_step_rows_take_one_sequence_or_one_token_of_each() -> None:
    lm = _lm()
    assert lm.rotary is not None
    cos, sin = lm.rotary.step_rows(torch.tensor([[3, 4, 5]]))
    assert cos.shape == sin.shape == (3, 16) and cos.is_contiguous()
    cos, sin = lm.rotary.step_rows(torch.tensor([[3], [9]]))  # (a batch's step)
    assert cos.shape == sin.shape == (2, 16)
    with pytest.raises(ValueError, match=r"or \(B, 1\), got \(2, 3\)"):
        lm.rotary.step_rows(torch.zeros(2, 3, dtype=torch.long))
