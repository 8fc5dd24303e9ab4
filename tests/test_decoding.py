"""Cached decoding runs the model's own forward: prepared linears, the static cache, compiled steps,
and swapped modules (a LoRA-style linear) that generate must run, not bypass."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from attnkit import decoding
from attnkit.config import TransformerConfig
from attnkit.decoding import PreparedLinear
from attnkit.kernels import build, linear, policy, rows
from attnkit.models import TransformerLM
from tests.helpers import LLAMA_OPTIONS as LLAMA

TOL = {"atol": 1e-5, "rtol": 1e-5}

#: attnkit's kernels (where they do not build, the tests of their rules skip with the reason)
needs_kernels = pytest.mark.skipif(
    not build.kernels_available(),
    reason=f"attnkit's kernels do not build here: {build.kernels_unavailable()}",
)


def _plan(monkeypatch: pytest.MonkeyPatch, **fields: Any) -> policy.LinearPlan:
    """The policy's linear plan for the test: the kernels where they build, attnkit's stream for
    a step's rows, inductor's reduction for a compiled single row, torch's prompt GEMMs as they
    are; ``fields`` change it."""
    base = policy.LinearPlan(kernels=build.kernels_available(), with_compiled=True)
    plan = dataclasses.replace(base, **fields)
    monkeypatch.setattr(policy.linear, "_PLAN", plan)
    return plan


CONFIGS: dict[str, dict[str, Any]] = {
    "llama": LLAMA,
    "gpt-default": {},
    "mqa-window-sinusoidal": {"position": "sinusoidal", "num_kv_heads": 1, "window": 4},
    "learned-postnorm-relu": {"position": "learned", "norm_first": False, "activation": "relu"},
    "no-positions-untied": {"position": "none", "tie_embeddings": False, "activation": "silu"},
    "qkv-bias-only": {**LLAMA, "qkv_bias": True},
    "swiglu-bias-head-dim": {"activation": "swiglu", "head_dim": 6},
    # Gemma-like: qk-norm, soft-capping, alternating local/global layers with two rotary bases
    "gemma-like": {
        "norm": "rmsnorm_plus_one",
        "activation": "geglu_tanh",
        "bias": False,
        "qk_norm": True,
        "attn_softcap": 2.0,
        "logit_softcap": 5.0,
        "post_norms": True,
        "scale_embeddings": True,
        "attn_scale": 0.3,
        "window": 3,
        "layer_types": ("sliding_attention", "full_attention"),
        "rope_local_base": 50.0,
    },
}


def _lm(**options: Any) -> TransformerLM:
    return TransformerLM(TransformerConfig(50, 24, 2, 4, max_seq_len=32, **options)).eval()


def _cached_logits(lm: TransformerLM, ids: Tensor, prompt: int, *, static: bool) -> Tensor:
    """Logits after each of ``ids[:, prompt-1:]``: prefill, then one token per forward."""
    caches = lm.make_kv_caches(ids.shape[0], ids.shape[1])
    out = [lm(ids[:, :prompt], kv_caches=caches)[:, -1]]
    for t in range(prompt, ids.shape[1]):
        extra = {"cache_position": torch.tensor([t])} if static else {}
        out.append(lm(ids[:, t : t + 1], kv_caches=caches, **extra)[:, -1])
    return torch.stack(out, dim=1)


class LoRALinear(nn.Linear):
    """A LoRA-style linear: the frozen weight plus a low-rank delta ``B @ A``."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight, self.bias = base.weight, base.bias
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + x @ self.lora_a.T @ self.lora_b.T


def _greedy_loop(lm: TransformerLM, prompt: Tensor, n: int) -> Tensor:
    """The plain reference: argmax over the model's own cached forward, one token at a time."""
    caches = lm.make_kv_caches(prompt.shape[0], prompt.shape[1] + n)
    ids, step = prompt, prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = lm(step, kv_caches=caches)[:, -1].argmax(-1, keepdim=True)
            ids, step = torch.cat([ids, nxt], 1), nxt
    return ids


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("static", [False, True])
def test_cached_steps_equal_the_full_forward(name: str, static: bool) -> None:
    lm = _lm(**CONFIGS[name])
    ids = torch.randint(0, 50, (3, 13))
    assert_close(_cached_logits(lm, ids, 5, static=static), lm(ids)[:, 4:], **TOL)


@pytest.mark.parametrize("name", ["llama", "gpt-default", "no-positions-untied"])
@pytest.mark.parametrize("compiled", [False, True])
def test_prepare_swaps_plain_linears_and_keeps_outputs(name: str, compiled: bool) -> None:
    lm = _lm(**CONFIGS[name])
    ids = torch.randint(0, 50, (2, 9))
    want, names = lm(ids), list(lm.state_dict())
    want_step = lm(ids[:, :1])  # two rows: the kernels of decoding steps
    decoding.prepare(lm, compiled=compiled)
    linears = [m for m in lm.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is PreparedLinear for m in linears)
    norms = [m for m in lm.modules() if isinstance(m, nn.RMSNorm)]
    assert all(type(m) is decoding.PreparedRMSNorm for m in norms)
    assert bool(norms) == (CONFIGS[name].get("norm") == "rmsnorm")
    assert list(lm.state_dict()) == names  # same parameters under the same names
    assert_close(lm(ids), want, **TOL)
    assert_close(lm(ids[:, :1]), want_step, **TOL)
    layout = lm.blocks[0].attention.qkv_proj.layout
    without = "linear" if compiled else "transposed"
    streamed = policy.stream_rows(torch.float32, 2 if compiled else 1)
    assert layout == ("stream" if streamed else without)
    w = lm.blocks[0].attention.qkv_proj.weight
    # Eager fp32 without attnkit's kernels: column-major storage, same values.
    assert w.is_contiguous() == (layout != "transposed")


@pytest.mark.parametrize("eps", [1e-5, None])
def test_prepared_rmsnorm_equals_torch_and_keeps_gradients(eps: float | None) -> None:
    norm = nn.RMSNorm(16, eps=eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    fast = decoding.PreparedRMSNorm.from_norm(norm)
    assert fast.weight is norm.weight and list(fast.state_dict()) == list(norm.state_dict())
    x = torch.randn(3, 5, 16) * torch.logspace(-3, 3, 5)[:, None]  # tiny to large rows
    x[0, 0] = 0.0  # an all-zero row: eps alone
    wide = x.double()
    ref = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + (eps or 1.19209e-07))
    ref = ref * norm.weight.double()
    with torch.inference_mode():
        # several rows: attnkit's kernel where it runs, else torch's own forward
        exact = {} if policy.linear_plan().kernels else {"atol": 0, "rtol": 0}
        assert_close(fast(x), norm(x), **exact)
        assert_close(fast(x).double(), ref, atol=1e-7, rtol=2e-6)
        for i, j in itertools.product(range(3), range(5)):
            row = x[i, j].view(1, 1, 16)  # one decoding step's row: the one-row path
            assert_close(fast(row), norm(row), atol=1e-7, rtol=2e-6)
            assert_close(fast(row).double().view(16), ref[i, j], atol=1e-7, rtol=2e-6)
    # With gradients, torch's own forward runs: same gradients as the unprepared norm.
    xg = x.clone().requires_grad_()
    fast(xg).square().sum().backward()
    assert xg.grad is not None and norm.weight.grad is not None
    want = x.clone().requires_grad_()
    norm.weight.grad = None
    norm(want).square().sum().backward()
    assert_close(xg.grad, want.grad)
    # One row with gradients on: a trainable weight gets torch's gradient; a frozen one (a
    # fine-tuning adapter's base) takes the one-row path, outside the graph.
    row = x[1, 2].view(1, 1, 16)
    norm.weight.grad = None
    fast(row).sum().backward()
    got = norm.weight.grad.clone()
    norm.weight.grad = None
    norm(row).sum().backward()
    assert_close(got, norm.weight.grad)
    norm.weight.requires_grad_(False)
    out = fast(row)
    assert not out.requires_grad
    assert_close(out, norm(row), atol=1e-7, rtol=2e-6)


@pytest.mark.parametrize("eps", [1e-5, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_rmsnorm_runs_the_kernel_on_eager_rows(
    dtype: torch.dtype, eps: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not policy.linear_plan().kernels:
        pytest.skip(f"attnkit's kernels do not run here: {build.kernels_unavailable()}")
    norm = nn.RMSNorm(576, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    fast = decoding.PreparedRMSNorm.from_norm(norm)
    # rows of a wider tensor (strided), small enough for the default eps (float32's, also for
    # bf16 rows: torch's rule) to matter
    x = (torch.randn(2, 37, 600) * 1e-3).to(dtype)[..., 3:579]
    calls: list[tuple[int, ...]] = []
    kernel = rows.rms_norm
    monkeypatch.setattr(rows, "rms_norm", lambda x, *a: calls.append(x.shape) or kernel(x, *a))
    with torch.no_grad():
        got = fast(x)
        assert calls == [x.shape] and got.dtype == dtype and got.is_contiguous()
        wide = x.double()
        used = 1.1920928955078125e-07 if eps is None else eps
        ref = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + used)
        ref = ref * norm.weight.double()
        # float32: a few roundings; bf16: one rounding of the float32 result, as torch's
        tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {}
        assert_close(got.double(), ref if dtype == torch.float32 else ref.to(dtype).double(), **tol)
        assert_close(got, norm(x), **tol)
        _plan(monkeypatch, kernels=False)  # not built: torch's own forward
        assert_close(fast(x), norm(x), atol=0, rtol=0)
    assert len(calls) == 1
    unscaled = kernel(x, None, 1e-5)  # no weight; an empty batch
    assert_close(unscaled, F.rms_norm(x, (576,), None, 1e-5), **tol)
    assert kernel(x[:0], norm.weight, 1e-5).shape == (0, 37, 576)
    with pytest.raises(TypeError, match="float32 or bfloat16 tensors of one dtype"):
        rows.rms_norm(x.float(), norm.weight.half(), 1e-5)
    with pytest.raises(ValueError, match=r"weight \(D,\)"):
        rows.rms_norm(x, norm.weight[:5], 1e-5)


@pytest.mark.parametrize("kernels", [False, True])
def test_layouts_follow_the_measured_rule(kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _plan(monkeypatch, kernels=kernels)  # (one fp32 row through MKL: the test below)
    full, half = torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.bfloat16)
    assert decoding.layout_for(full) == ("stream" if kernels else "transposed")
    assert decoding.layout_for(half) == ("stream" if kernels else "linear")
    for weight in (full, half):  # compiled: row-major (the kernel's or inductor's reduction's)
        assert decoding.layout_for(weight, compiled=True) == ("stream" if kernels else "linear")
    assert decoding.layout_for(torch.zeros(4, 4, dtype=torch.float64)) == "linear"


@pytest.mark.parametrize("name", ["llama", "mqa-window-sinusoidal", "learned-postnorm-relu"])
def test_left_padded_generate_equals_each_row_alone(name: str) -> None:
    lm = _lm(**CONFIGS[name])
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 3))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :4] = False
    batch = lm.generate(ids, 6, attention_mask=mask, eos_token_id=[])
    assert torch.equal(batch[0], lm.generate(a, 6, eos_token_id=[])[0])
    assert torch.equal(batch[1, 4:], lm.generate(b, 6, eos_token_id=[])[0])
    uncached = lm.generate(ids, 6, attention_mask=mask, eos_token_id=[], use_cache=False)
    assert torch.equal(batch, uncached)


def test_interleaved_streams_do_not_share_a_cache() -> None:
    lm = _lm(**LLAMA)
    a, b = torch.randint(0, 50, (1, 5)), torch.randint(0, 50, (2, 3))
    want_a, want_b = lm.generate(a, 6)[:, 5:], lm.generate(b, 6)[:, 3:]
    got_a, got_b = [], []
    for ca, cb in zip(lm.stream(a, 6), lm.stream(b, 6), strict=True):
        got_a.append(ca)
        got_b.append(cb)
    assert torch.equal(torch.stack(got_a, 1), want_a)
    assert torch.equal(torch.stack(got_b, 1), want_b)


def test_generate_runs_swapped_modules() -> None:
    """A LoRA-style subclass is kept by prepare and run by generate, cached or not."""
    torch.manual_seed(0)
    lm = _lm(**LLAMA)
    plain = copy.deepcopy(lm)
    for block in lm.blocks:
        block.attention.qkv_proj = LoRALinear(block.attention.qkv_proj)
        block.feed_forward.gate_up = LoRALinear(block.feed_forward.gate_up)
    decoding.prepare(lm)
    assert type(lm.blocks[0].attention.qkv_proj) is LoRALinear  # not swapped
    assert type(lm.blocks[0].attention.out_proj) is PreparedLinear
    prompt = torch.randint(0, 50, (2, 5))
    want = _greedy_loop(lm, prompt, 8)
    assert not torch.equal(want, _greedy_loop(plain, prompt, 8))  # the delta matters
    assert torch.equal(lm.generate(prompt, 8, eos_token_id=[]), want)
    assert torch.equal(lm.generate(prompt, 8, eos_token_id=[], use_cache=False), want)


def test_sampling_with_a_generator_equals_uncached() -> None:
    lm = _lm(**LLAMA)
    prompt = torch.randint(0, 50, (2, 4))
    options: dict[str, Any] = {"temperature": 1.0, "top_k": 10}
    a = lm.generate(prompt, 8, generator=torch.Generator().manual_seed(3), **options)
    b = lm.generate(
        prompt, 8, use_cache=False, generator=torch.Generator().manual_seed(3), **options
    )
    assert torch.equal(a, b)


def test_bf16_weights_follow_the_float64_model() -> None:
    lm = _lm(**LLAMA)
    ids = torch.randint(0, 50, (2, 10))
    want = copy.deepcopy(lm).double()(ids)[:, 3:].float()
    half = decoding.prepare(copy.deepcopy(lm).to(torch.bfloat16))
    got = _cached_logits(half, ids, 4, static=False)  # type: ignore[arg-type]
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 0.05, err


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("rows", [1, decoding.UPCAST_ROWS])
def test_bf16_products_run_in_float32_where_bf16_is_emulated(
    native: bool, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill's bf16 products run upcast where the policy found bf16 GEMMs slower (CPUs
    without bf16 dot products), and stay bf16 for a single row or where the CPU has them; every
    way rounds the float64 product to bf16."""
    _plan(monkeypatch, kernels=False, bf16_upcast=not native)  # (the kernel: the test below)
    seen: list[torch.dtype] = []
    real = torch.nn.functional.linear

    def spy(x: Tensor, *args: Any) -> Tensor:
        seen.append(x.dtype)
        return real(x, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    x = torch.randn(rows, 3, 40).bfloat16()
    w, b = torch.randn(24, 40).bfloat16(), torch.randn(24).bfloat16()
    got = decoding.linear(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 3, 24)
    assert_close(got.double(), want, atol=0.05, rtol=0.02)
    upcast = rows * 3 >= decoding.UPCAST_ROWS and not native
    assert seen == [torch.float32 if upcast else torch.bfloat16]


@needs_kernels
@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_steps_stream_through_attnkits_kernel(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepared bf16 linear runs the float_dot_linear kernel for a few rows without gradients
    (as the op in compiled graphs) and F.linear otherwise, with the same results."""
    _plan(monkeypatch)
    calls: list[int] = []
    real = linear.float_dot_linear

    def spy(x: Tensor, *args: Any) -> Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(decoding, "float_dot_linear", spy)
    torch.manual_seed(0)
    plain = nn.Linear(40, 24).bfloat16()
    layer = PreparedLinear.from_linear(copy.deepcopy(plain), compiled=compiled)
    assert layer.layout == "stream"
    step, prompt = torch.randn(2, 1, 40).bfloat16(), torch.randn(2, 8, 40).bfloat16()
    with torch.no_grad():
        if compiled:  # the op calls the kernel (not through this module's name)
            got = torch.compile(layer, fullgraph=True)(step)
            assert not calls and torch.equal(got, real(step, layer.weight, layer.bias))
            one = torch.compile(layer, fullgraph=True)(step[:1])  # (the op or inductor's sum)
            assert_close(one, plain(step[:1]), atol=0.02, rtol=0.02)
        else:
            got = layer(step)
            assert calls == [2]
        assert_close(got, plain(step), atol=0.02, rtol=0.02)
        assert_close(layer(prompt), plain(prompt), atol=0, rtol=0)  # F.linear: 16 rows
    trained = step.clone().requires_grad_()
    layer(trained).sum().backward()  # gradients: F.linear
    assert trained.grad is not None and layer.weight.grad is not None
    assert calls == ([] if compiled else [2])


@pytest.mark.parametrize("mkl_row", [False, True])
def test_the_kernels_take_a_steps_products_as_the_policy_says(
    mkl_row: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attnkit's kernels take a step's products wherever they build, but a single fp32 row where
    the policy measured MKL over a column-major weight faster (the eager layout for one
    sequence; a batch's eager layout streams)."""
    built = build.kernels_available()
    _plan(monkeypatch, kernels=built, fp32_row="transposed" if mkl_row else "stream")
    w = torch.randn(24, 40)
    fp32 = built and not mkl_row
    assert decoding.layout_for(w) == ("stream" if fp32 else "transposed")
    assert decoding.layout_for(w, batch=8) == ("stream" if built else "transposed")
    assert decoding.layout_for(w, compiled=True) == ("stream" if built else "linear")
    assert decoding.layout_for(w.bfloat16()) == ("stream" if built else "linear")
    assert decoding.layout_for(w.bfloat16(), compiled=True) == ("stream" if built else "linear")
    x = torch.randn(2, 40)
    with torch.no_grad():
        assert decoding._streams(x, w, None, False) is built  # (two rows)
        assert decoding._streams(x[:1], w, None, False) is fp32
        assert decoding._streams(x.bfloat16(), w.bfloat16(), None, False) is built


def test_prepare_lays_a_batch_out_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the policy gives one fp32 row to MKL, an eager fp32 model prepared for several
    sequences streams through the kernel (row-major), for one through MKL (column-major); both
    decode the same."""
    _plan(monkeypatch, fp32_row="transposed")
    lm = _lm(**LLAMA)
    ids = torch.randint(0, 50, (3, 9))
    one = decoding.prepare(copy.deepcopy(lm))
    many = decoding.prepare(copy.deepcopy(lm), batch=3)
    want = "stream" if build.kernels_available() else "transposed"
    assert many.blocks[0].attention.qkv_proj.layout == want
    assert one.blocks[0].attention.qkv_proj.layout == "transposed"
    with torch.no_grad():
        assert_close(many.generate(ids, 4), one.generate(ids, 4), rtol=0, atol=0)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="batch must be a positive int"):
            decoding.prepare(copy.deepcopy(lm), batch=bad)  # type: ignore[arg-type]


@needs_kernels
@pytest.mark.parametrize("batch_stream", [False, True])
def test_a_full_batch_step_streams_as_the_policy_says(
    batch_stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continuous batch of PROMPT_ROWS or more sequences is laid out as a smaller one (its
    steps drain to a few rows, which stream); a step of PROMPT_ROWS float32 rows streams where
    the policy chose it (``linear.fp32_batch``), else runs the GEMM; more rows always do."""
    _plan(monkeypatch, kernels=True, fp32_row="transposed", fp32_batch_stream=batch_stream)
    w = torch.randn(24, 40)
    full = policy.PROMPT_ROWS
    assert decoding.layout_for(w, batch=full) == decoding.layout_for(w, batch=2) == "stream"
    assert decoding.layout_for(w, batch=4 * full) == "stream"
    assert policy.most_stream_rows(torch.float32) == (full if batch_stream else full - 1)
    assert policy.most_stream_rows(torch.bfloat16) == full - 1
    layer = decoding.PreparedLinear.from_linear(nn.Linear(40, 24), batch=full)
    calls: list[int] = []
    monkeypatch.setattr(
        decoding, "float_dot_linear", lambda x, w, b: calls.append(len(x)) or F.linear(x, w, b)
    )
    with torch.no_grad():
        for n in (1, full - 1, full, full + 1):
            x = torch.randn(n, 40)
            assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
            streams = 1 < n < full or (n == full and batch_stream)  # (one row: fp32_row)
            assert decoding._streams(x, w, None, False) is streams
    assert calls == ([1, full - 1, full] if batch_stream else [1, full - 1])


@needs_kernels
@pytest.mark.parametrize("row_kernel", [False, True])
def test_a_compiled_bf16_row_runs_the_kernel_as_the_policy_says(
    row_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a compiled graph one bf16 row runs the kernel's op where the policy chose it (the same
    bits as the eager kernel, so a row is the same alone or batched); fp32 rows, and bf16 ones
    elsewhere, inductor's reduction."""
    _plan(monkeypatch, compiled_row=frozenset({torch.bfloat16} if row_kernel else ()))
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, 1, 96, generator=gen).to(dtype)
        w = torch.randn(40, 96, generator=gen).to(dtype)
        b = torch.randn(40, generator=gen).to(dtype)
        with torch.no_grad():
            got = torch.compile(decoding.linear, fullgraph=True)(x, w, b)
            kernel = linear.float_dot_linear(x, w, b)
        want = x.double() @ w.double().T + b.double()
        step = torch.finfo(dtype).eps * want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= step + 1e-5
        assert torch.equal(got, kernel) or not (row_kernel and dtype == torch.bfloat16)
    torch._dynamo.reset()


def test_a_compiled_graph_never_traces_the_kernels_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling before anything asked the policy gives F.linear's graph (no build or
    measurement inside the trace, no graph break); the next eager call asks."""
    monkeypatch.setattr(policy.linear, "_PLAN", None)
    x, w = torch.randn(2, 1, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    with torch.no_grad():
        got = torch.compile(decoding.linear, fullgraph=True)(x, w)
    assert policy.linear._PLAN is None
    assert_close(got, torch.nn.functional.linear(x, w), atol=0, rtol=0)
    decoding.linear(x, w)
    assert policy.linear._PLAN is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_rows_reduction_is_the_product(dtype: torch.dtype) -> None:
    """One row inside a compiled graph is the product summed in float32: within one rounding to
    the dtype of float64's."""
    torch._dynamo.reset()
    x, w, b = torch.randn(1, 1, 96), torch.randn(40, 96), torch.randn(40)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    with torch.no_grad():
        got = torch.compile(decoding._row, fullgraph=True)(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert got.dtype == dtype and got.shape == (1, 1, 40)
    step = torch.finfo(dtype).eps * want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= step + 1e-5


def test_compiled_step_loads_the_ops_before_it_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """So that the graph's op calls run their C++ implementations where those build."""
    _plan(monkeypatch)  # (decided: no measurement, which loads them itself)
    calls: list[int] = []
    monkeypatch.setattr(build, "load_ops", lambda: calls.append(1) or False)
    lm = _lm(**LLAMA)
    step = decoding.compiled_step(lm)
    assert calls == [1] and decoding.compiled_step(lm) is step and calls == [1]


def test_cache_position_needs_caches() -> None:
    lm = _lm(**LLAMA)
    with pytest.raises(ValueError, match="cache_position needs kv_caches"):
        lm(torch.zeros(1, 1, dtype=torch.long), cache_position=torch.tensor([0]))


@pytest.mark.slow
def test_compiled_step_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Also where generate's steps after the first check only the differentiating guards: the
    module swap of prepare between two calls is caught by the next call's first step."""
    for name in ("FLOAT32", "FLOAT32_BATCH"):  # (the graph itself)
        monkeypatch.setenv(f"ATTNKIT_KERNEL_DECODING_COMPILED_STEP_{name}", "graph")
    skipped: list[int] = []
    real = decoding.differentiating_guards_only

    def spy() -> Any:
        skipped.append(1)
        return real()

    monkeypatch.setattr(decoding, "differentiating_guards_only", spy)
    lm = _lm(**LLAMA, window=5)
    prompt = torch.randint(0, 50, (2, 4))
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, :2] = False
    options: dict[str, Any] = {"attention_mask": mask, "eos_token_id": []}
    want = lm.generate(prompt, 8, use_cache=False, **options)
    assert torch.equal(lm.generate(prompt, 8, compile=True, **options), want)
    assert len(skipped) == 6  # steps 2-7: the prefill is eager, step 1 checks every guard
    streamed = torch.stack(list(lm.stream(prompt, 8, compile=True, **options)), 1)
    assert torch.equal(streamed, want[:, 4:]) and len(skipped) == 6  # stream: every guard
    # Another length fits the same (rounded-up) cache capacity: the same graph, no recompile.
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(lm.generate(prompt, 5, compile=True, **options), want[:, :9])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert lm.rotary is not None and lm.rotary._reserved == 0  # (reserved for a call's steps)
    # Prepared for compiled steps (one row: the weights' streaming reduction), batch of one.
    decoding.prepare(lm, compiled=True)
    one = prompt[:1]
    assert torch.equal(
        lm.generate(one, 8, compile=True, eos_token_id=[]),
        lm.generate(one, 8, use_cache=False, eos_token_id=[]),
    )


def test_guards_are_skipped_only_under_torchs_default_stance() -> None:
    def stance() -> Any:
        return torch._dynamo.eval_frame._stance

    before = stance()
    with decoding.differentiating_guards_only():
        assert stance().stance == "default" and stance().skip_guard_eval_unsafe
    assert stance() == before and not before.skip_guard_eval_unsafe
    with torch.compiler.set_stance("force_eager"):  # the user's: left as it is
        user = stance()
        with decoding.differentiating_guards_only():
            assert stance() == user


def test_prepare_keeps_quantized_linears_and_their_outputs() -> None:
    from attnkit.quantize import Int8Linear, quantize

    lm = quantize(_lm(**LLAMA), "int8")
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        want = lm(ids)
        decoding.prepare(lm)
        got = lm(ids)
    assert isinstance(lm.blocks[0].attention.qkv_proj, Int8Linear)
    assert not any(type(m) is PreparedLinear for m in lm.modules())
    assert_close(got, want, atol=1e-5, rtol=1e-5)  # (the prepared norms' rounding)


def test_training_after_generate_and_inference_mode() -> None:
    """generate runs its steps under inference_mode; nothing it leaves behind (rotary tables,
    remembered rows) may break a later training step, even with the same positions tensor."""
    lm = _lm(**LLAMA)
    ids = torch.randint(0, 50, (2, 6))
    positions = torch.arange(6)
    lm.generate(ids, 3)
    with torch.inference_mode():
        lm(ids, positions=positions)
    lm.train()
    loss = lm(ids, positions=positions).logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in lm.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def _ops_run(call: Any) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    return {e.key for e in prof.key_averages()}


def test_float32_prompts_run_onednn_where_the_policy_measured_it_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 20, 48, generator=gen), torch.randn(40, 48, generator=gen)
    b = torch.randn(40, generator=gen)
    want = (x.double() @ w.double().T + b.double()).float()
    layer = PreparedLinear.from_linear(nn.Linear(48, 40))
    layer.weight.data, layer.bias.data = w.clone(), b.clone()
    for faster in (True, False):
        _plan(monkeypatch, fp32_prompt_onednn=faster)
        with torch.no_grad():
            assert_close(decoding.linear(x, w, b), want)
            assert_close(layer(x), want)
            for call in (lambda: decoding.linear(x, w, b), lambda: layer(x)):
                assert ("mkldnn::_linear_pointwise" in _ops_run(call)) is faster
        # the layer's parameters want gradients: torch's product, whatever was measured
        assert "mkldnn::_linear_pointwise" not in _ops_run(lambda: layer(x))
    _plan(monkeypatch, fp32_prompt_onednn=True)
    # only eager float32 prompts without gradients
    assert decoding._onednn_prompt(x, w, b)
    assert not decoding._onednn_prompt(x[:, :1], w, b)  # a decoding step: the stream kernel's
    assert not decoding._onednn_prompt(x.bfloat16(), w.bfloat16(), None)
    assert not decoding._onednn_prompt(x.requires_grad_(), w, b)
    monkeypatch.setattr(policy.linear, "_PLAN", None)
    assert policy.fp32_prompt_onednn() is (policy.choose("linear.fp32_prompt") == "onednn")
