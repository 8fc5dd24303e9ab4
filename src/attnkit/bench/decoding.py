"""Decoding benchmark rows: attnkit's cached decoding against transformers' ``LlamaForCausalLM``.

Used by ``benchmarks/bench_decode.py`` and ``attnkit bench --vs``. Everything is measured side by
side in one process, runs interleaved, medians reported; what matters are the ratios (the machine
may be shared). transformers is imported only when a row needs it; without it the rows against
it are skipped with a note. Measured results: ``benchmarks/RESULTS.md``.

Rows:

* ``llama-3m``: dim 256, 4 layers, 8/4 heads, SwiGLU 688, RMSNorm, vocab 1024, tied head;
  prompt 512, 128 new tokens, greedy. Target: >= 2x transformers end to end.
* ``llama-100m``: dim 768, 12 layers, 12/4 heads, SwiGLU 2048, vocab 32000, tied; prompt 128.
  Targets: decode steps at >= 85% of the read-bandwidth bound (every weight read once per token,
  :func:`read_bandwidth`), >= 1.3x transformers; bf16 weights >= 1.6x the fp32 tokens/s.
"""

from __future__ import annotations

import copy
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import decoding, native
from attnkit.config import FAMILIES, PRESETS, TransformerConfig
from attnkit.models import TransformerLM
from attnkit.positional import LearnedPositionalEmbedding
from attnkit.profiling import time_calls

__all__ = [
    "DECODE_MODELS",
    "bf16_gemm_speedup",
    "decode_rows",
    "layout_kernels",
    "layout_table",
    "llama_config",
    "prefill_rows",
    "read_bandwidth",
    "to_transformers",
    "vs_prefill_rows",
    "vs_rows",
]

_LLAMA = FAMILIES["llama"]
#: name -> (config, prompt length, new tokens); "llama-tiny" is for quick smoke runs.
DECODE_MODELS: dict[str, tuple[TransformerConfig, int, int]] = {
    "llama-tiny": (
        TransformerConfig(256, 64, 2, 4, num_kv_heads=2, ffn_dim=172, max_seq_len=64, **_LLAMA),
        32,
        8,
    ),
    "llama-3m": (
        TransformerConfig(1024, 256, 4, 8, num_kv_heads=4, ffn_dim=688, max_seq_len=1024, **_LLAMA),
        512,
        128,
    ),
    "llama-100m": (PRESETS["llama-100m"].replace(max_seq_len=1024), 128, 64),
}


def llama_config(name: str) -> TransformerConfig:
    """The config of a benchmark model (see :data:`DECODE_MODELS`).

    Raises:
        ValueError: For an unknown name.
    """
    if name not in DECODE_MODELS:
        raise ValueError(f"unknown decode model {name!r}; known: {sorted(DECODE_MODELS)}")
    return DECODE_MODELS[name][0]


def to_transformers(model: TransformerLM) -> Any:
    """A transformers ``LlamaForCausalLM`` computing the same function as a Llama-shaped ``model``.

    The model is written as a Hugging Face folder by :meth:`attnkit.TransformerLM.save_pretrained`
    (the config and weight-name mapping of :mod:`attnkit.interop.hf`) and read back by
    transformers, so the peer is exactly what a user converting the model would get.

    Raises:
        ImportError: Without transformers.
        ValueError: If ``model`` is not Llama-shaped (pre-norm RMSNorm, SwiGLU, rotary
            positions, no biases or window).
    """
    from transformers import AutoModelForCausalLM

    cfg = model.config
    llama_like = (
        cfg.norm == "rmsnorm"
        and cfg.activation == "swiglu"
        and cfg.norm_first
        and cfg.position == "rope"
        and cfg.window is None
        and not any(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Linear))
    )
    if not llama_like:
        raise ValueError(f"model is not Llama-shaped: {cfg}")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=model.embedding.weight.dtype)
    if type(hf).__name__ != "LlamaForCausalLM":
        raise ValueError(f"model is not Llama-shaped: saved as {type(hf).__name__}")
    return hf.eval()


class _ReadBandwidth:
    """Memory read bandwidth in bytes/s over ``nbytes`` of float32: the faster of a ``sum`` and a
    matrix-vector product, one pass each per :meth:`measure`."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        cols = 4096
        rows = max(nbytes // 4 // cols, 1)
        self.a = torch.ones(rows, cols)
        self.x = torch.ones(cols)

    def measure(self) -> float:
        best = 0.0
        for fn in (self.a.sum, lambda: self.a @ self.x):
            start = time.perf_counter()
            fn()
            best = max(best, self.a.numel() * 4 / (time.perf_counter() - start))
        return best


def read_bandwidth(nbytes: int = 1 << 30, *, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: the faster of a ``sum`` and a matrix-vector product over
    ``nbytes`` of float32, median of ``repeats`` passes (the bound of :func:`decode_rows`)."""
    probe = _ReadBandwidth(nbytes)
    return statistics.median(probe.measure() for _ in range(repeats))


def _weight_bytes(model: TransformerLM) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied head counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    pos = model.position
    if isinstance(pos, LearnedPositionalEmbedding):  # one row per token is read
        total -= pos.weight.numel() * pos.weight.element_size()
    return total


def _hf_greedy(hf: Any, prompt: Tensor) -> Callable[[int], Tensor]:
    """transformers' greedy ``generate`` of exactly ``n`` new tokens (no eos)."""

    def run(n: int) -> Tensor:
        return hf.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )

    return run


def _runner(
    model: TransformerLM, prompt: Tensor, *, compile: bool = False
) -> Callable[[int], Tensor]:
    """Greedy ``generate`` of a copy of ``model`` whose linears :func:`attnkit.decoding.prepare`
    laid out for one-row products (eager, or for the compiled step)."""
    prepared = decoding.prepare(copy.deepcopy(model), compiled=compile)

    def run(new: int) -> Tensor:
        return prepared.generate(prompt, new, compile=compile)

    return run


# The targets of the rows: (model, what, row, key, at least).
TARGETS: list[tuple[str, str, str, str, float]] = [
    ("llama-3m", "eager vs transformers", "attnkit", "vs_transformers", 1.3),
    ("llama-3m", "compiled vs transformers", "attnkit compile", "vs_transformers", 2.0),
    ("llama-100m", "eager fp32 vs transformers", "attnkit", "vs_transformers", 1.3),
    ("llama-100m", "eager fp32 steps / bandwidth bound", "attnkit", "of_fp32_bound", 0.85),
    ("llama-100m", "eager bf16 steps vs fp32", "attnkit bf16", "vs_fp32", 1.6),
    ("llama-100m", "compiled fp32 vs transformers", "attnkit compile", "vs_transformers", 1.3),
    (
        "llama-100m",
        "compiled fp32 steps / bandwidth bound",
        "attnkit compile",
        "of_fp32_bound",
        0.85,
    ),
    ("llama-100m", "compiled bf16 steps vs fp32", "attnkit bf16 compile", "vs_fp32", 1.6),
]


def _targets(name: str, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of ``name`` whose rows were measured, with the shortfall when missed."""
    out = []
    for model, what, variant, key, goal in TARGETS:
        if model != name or key not in rows.get(variant, {}):
            continue
        value = rows[variant][key]
        out.append(
            {
                "model": model,
                "what": what,
                "target": goal,
                "measured": value,
                "met": value >= goal,
                "shortfall": max(0.0, 1 - value / goal),
            }
        )
    return out


def _seconds(run: Callable[[int], Any], new: int) -> float:
    start = time.perf_counter()
    run(new)
    return time.perf_counter() - start


def decode_rows(
    names: tuple[str, ...] = ("llama-3m", "llama-100m"),
    *,
    repeats: int = 3,
    bf16: bool = True,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
    models: dict[str, tuple[TransformerConfig, int, int]] | None = None,
) -> dict[str, Any]:
    """Measure the decoding rows; returns ``{"rows": [...], "notes": [...], ...}``.

    Each row has ``model``, ``variant``, ``seconds`` (median end-to-end ``generate``),
    ``tokens_per_s`` (new tokens / seconds), ``step_tokens_per_s`` (decode phase only: the
    median of ``(t(new) - t(1)) / (new - 1)``) and ratios against the transformers row of the
    same model (``vs_transformers``) and, for ``llama-100m``, against the bandwidth bound.

    Args:
        names: Models of :data:`DECODE_MODELS` to run.
        repeats: Interleaved runs per variant (median).
        bf16: Add a bf16-weights attnkit row for models above 50M parameters.
        compile: Add an attnkit ``compile=True`` row (compiles once per model; the compile time
            is reported, not counted in the timings).
        progress: Called with a short message before each measurement.
        models: Table to take the names from instead of :data:`DECODE_MODELS`.

    Raises:
        ValueError: For unknown model names.
    """
    table = DECODE_MODELS if models is None else models
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown decode model(s) {unknown}; known: {sorted(table)}")
    say = progress or (lambda _msg: None)
    notes: list[str] = []
    try:
        import transformers  # noqa: F401

        have_hf = True
    except ImportError:
        have_hf = False
        notes.append("transformers is not installed: rows against it skipped")
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for name in names:
        config, P, new = table[name]
        torch.manual_seed(0)
        model = TransformerLM(config).eval()
        prompt = torch.randint(0, model.embedding.num_embeddings, (1, P))
        runners: dict[str, Callable[[int], Tensor]] = {}
        if have_hf:
            hf = to_transformers(model)

            runners["transformers"] = _hf_greedy(hf, prompt)
        runners["attnkit"] = _runner(model, prompt)
        if compile:
            runners["attnkit compile"] = _runner(model, prompt, compile=True)
        big = sum(p.numel() for p in model.parameters()) > 50e6
        if bf16 and big:
            model16 = TransformerLM(config).eval()
            model16.load_state_dict(model.state_dict())
            model16.to(torch.bfloat16)
            runners["attnkit bf16"] = _runner(model16, prompt)
            if compile:
                runners["attnkit bf16 compile"] = _runner(model16, prompt, compile=True)
        # Warm up (and compile), check greedy agreement.
        outputs: dict[str, Tensor] = {}
        compile_s: dict[str, float] = {}
        for variant, run in runners.items():
            say(f"{name}: warm-up {variant}")
            start = time.perf_counter()
            outputs[variant] = run(new)
            compile_s[variant] = time.perf_counter() - start
        # Interleaved: every repeat runs each variant for `new` tokens and for 1 (the prefill);
        # the decode phase of a repeat is their difference. The bandwidth is probed in the same
        # rounds, so the bound sees the machine's load of the moment too.
        times: dict[str, list[float]] = {v: [] for v in runners}
        steps: dict[str, list[float]] = {v: [] for v in runners}
        probe = _ReadBandwidth() if big else None
        bandwidths: list[float] = []
        for r in range(repeats):
            for variant, run in runners.items():
                say(f"{name}: run {r + 1}/{repeats} {variant}")
                t = _seconds(run, new)
                times[variant].append(t)
                steps[variant].append(max(t - _seconds(run, 1), 1e-9) / (new - 1))
            if probe is not None:
                say(f"{name}: read bandwidth {r + 1}/{repeats}")
                bandwidths.append(probe.measure())
        del probe
        # The bound is the best the machine showed (the fastest probe), not the median.
        bandwidth = max(bandwidths) if bandwidths else None
        bytes_per_token = _weight_bytes(model)
        ref = outputs.get("transformers")
        model_rows: dict[str, dict[str, Any]] = {}
        for variant in runners:
            t = statistics.median(times[variant])
            row: dict[str, Any] = {
                "model": name,
                "variant": variant,
                "prompt": P,
                "new_tokens": new,
                "seconds": t,
                "tokens_per_s": new / t,
                "step_tokens_per_s": 1 / statistics.median(steps[variant]),
                "same_tokens_as_transformers": None
                if ref is None or "bf16" in variant
                else bool(torch.equal(outputs[variant], ref)),
            }
            if variant.endswith("compile"):
                row["first_call_seconds"] = compile_s[variant]  # includes the compilation
            if bandwidth is not None:
                row["bandwidth_bytes_per_s"] = bandwidth
                row["fp32_weight_bytes"] = bytes_per_token
                row["of_fp32_bound"] = row["step_tokens_per_s"] * bytes_per_token / bandwidth
            model_rows[variant] = row
        base = model_rows.get("transformers")
        for row in model_rows.values():
            if base is not None:
                row["vs_transformers"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["step_vs_transformers"] = row["step_tokens_per_s"] / base["step_tokens_per_s"]
        for suffix in ("", " compile"):
            if f"attnkit bf16{suffix}" in model_rows:
                model_rows[f"attnkit bf16{suffix}"]["vs_fp32"] = (
                    model_rows[f"attnkit bf16{suffix}"]["step_tokens_per_s"]
                    / model_rows[f"attnkit{suffix}"]["step_tokens_per_s"]
                )
        rows.extend(model_rows.values())
        targets.extend(_targets(name, model_rows))
    return {
        "rows": rows,
        "targets": targets,
        "notes": notes,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def layout_kernels(weight: Tensor) -> dict[str, Callable[[Tensor], Tensor]]:
    """Ways to compute ``F.linear(x, weight)`` for one row, each with the weight prepared once.

    ``"F.linear"`` uses the weight as is; ``"transposed (addmm)"`` keeps a contiguous
    ``(in, out)`` copy multiplied with ``torch.mm``; ``"oneDNN packed"`` reorders it into
    oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) applied with
    ``torch.ops.mkldnn._linear_pointwise``, the kernel inductor uses for frozen CPU linears
    (absent from torch builds without oneDNN); ``"stream"`` is attnkit's own kernel over the
    weight as is (:func:`attnkit.native.float_dot_linear`, where it is built).

    Args:
        weight: ``(out, in)`` weight.

    Returns:
        Name -> ``fn(x)`` with ``x`` of shape ``(N, in)`` -> ``(N, out)``.
    """
    weight = weight.detach()
    transposed = weight.t().contiguous()
    kernels: dict[str, Callable[[Tensor], Tensor]] = {
        "F.linear": lambda x: F.linear(x, weight),
        "transposed (addmm)": lambda x: torch.mm(x, transposed),
    }
    if native.kernels_available():
        kernels["stream"] = lambda x: native.float_dot_linear(x, weight)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    except (AttributeError, RuntimeError):  # a torch build without the op
        return kernels
    kernels["oneDNN packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
        x, packed, None, "none", [], ""
    )
    return kernels


def layout_table(
    *,
    dim: int = 768,
    hidden: int = 2048,
    layers: int = 12,
    vocab: int = 32000,
    kv_dim: int = 256,
    repeats: int = 7,
) -> list[dict[str, Any]]:
    """Single-row products through every weight of a Llama-shaped model, per kernel and layout.

    The measurement behind the weight layouts of cached decoding: one pass multiplies a row by
    each matrix of ``layers`` blocks (fused q/k/v, output, fused gate/up, down) and the head, with
    each kernel of :func:`layout_kernels` in fp32 (and bf16 where it converts nothing per call);
    passes of every variant are interleaved ``repeats`` times (medians). A ``sum`` over the fp32
    weights gives the pure read for reference.

    Returns:
        Rows with ``kernel``, ``seconds``, ``bytes_per_s`` and ``vs_f32_linear`` (speed ratio).
    """
    shapes = [(dim + 2 * kv_dim, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)] * layers
    shapes.append((vocab, dim))
    weights = [torch.randn(n, d) * 0.02 for n, d in shapes]
    rows32 = {d: torch.randn(1, d) for d in (dim, hidden)}
    rows16 = {d: x.bfloat16() for d, x in rows32.items()}
    per_weight = {
        torch.float32: [layout_kernels(w) for w in weights],
        torch.bfloat16: [layout_kernels(w.bfloat16()) for w in weights],
    }
    variants: dict[str, tuple[list[Callable[[Tensor], Tensor]], dict[int, Tensor]]] = {}
    for name, dtype, kernel in (
        ("f32 F.linear", torch.float32, "F.linear"),
        ("f32 transposed (addmm)", torch.float32, "transposed (addmm)"),
        ("f32 oneDNN packed", torch.float32, "oneDNN packed"),
        ("f32 stream (attnkit)", torch.float32, "stream"),
        ("bf16 F.linear", torch.bfloat16, "F.linear"),
        ("bf16 oneDNN packed", torch.bfloat16, "oneDNN packed"),
        ("bf16 stream (attnkit)", torch.bfloat16, "stream"),
    ):
        fns = [kernels[kernel] for kernels in per_weight[dtype] if kernel in kernels]
        if len(fns) == len(weights):
            variants[name] = (fns, rows16 if dtype == torch.bfloat16 else rows32)
    fp32_bytes = sum(w.numel() * 4 for w in weights)

    def run(name: str) -> None:
        if name == "f32 sum (read only)":
            for w in weights:
                w.sum()
            return
        fns, xs = variants[name]
        for w, fn in zip(weights, fns, strict=True):
            fn(xs[w.shape[1]])

    names = ["f32 sum (read only)", *variants]
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        run(n)
    for _ in range(repeats):
        for n in names:
            start = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - start)
    base = statistics.median(times["f32 F.linear"])
    out = []
    for n in names:
        t = statistics.median(times[n])
        nbytes = fp32_bytes // 2 if n.startswith("bf16") else fp32_bytes
        out.append(
            {"kernel": n, "seconds": t, "bytes_per_s": nbytes / t, "vs_f32_linear": base / t}
        )
    return out


def vs_rows(
    *,
    repeats: int = 3,
    compile: bool = True,
    names: tuple[str, ...] = ("llama-3m", "llama-100m"),
    progress: Callable[[str], None] | None = None,
    models: dict[str, tuple[TransformerConfig, int, int]] | None = None,
) -> list[dict[str, Any]]:
    """The decoding rows of ``attnkit bench --vs``: one dict per (job, peer).

    Keys: ``job``, ``peer``, ``attnkit_s`` and ``peer_s`` (median seconds of the same work:
    end-to-end generate against transformers, decode-phase seconds per token against attnkit
    fp32 for the bf16 rows), ``note`` and ``goal`` (the speedup :data:`TARGETS` asks for, or
    None; the bandwidth goal is in the note). Without transformers, its rows carry
    ``peer_s=None`` and a note.

    Args:
        repeats: Interleaved runs per variant.
        compile: Also measure ``generate(..., compile=True)``.
        names: Models of :data:`DECODE_MODELS`.
        progress: Called with a short message before each measurement.
        models: Table to take the names from instead of :data:`DECODE_MODELS`.
    """
    report = decode_rows(names, repeats=repeats, compile=compile, progress=progress, models=models)
    table = DECODE_MODELS if models is None else models
    speedup_goals = {(t[0], t[2]): t[4] for t in TARGETS if t[3] != "of_fp32_bound"}
    bound_goals = {(t[0], t[2]): t[4] for t in TARGETS if t[3] == "of_fp32_bound"}
    out: list[dict[str, Any]] = []
    for name in names:
        rows = {r["variant"]: r for r in report["rows"] if r["model"] == name}
        _config, P, new = table[name]
        size = f"prompt {P}, {new} new, greedy, batch 1, {report['threads']} threads"
        hf = rows.get("transformers")
        for variant, row in rows.items():
            if variant == "transformers":
                continue
            notes = [size, f"{row['tokens_per_s']:.1f} tok/s"]
            if "of_fp32_bound" in row:
                bound = f"{row['of_fp32_bound']:.0%} of the read-bandwidth bound"
                if (name, variant) in bound_goals:
                    bound += f" (goal {bound_goals[name, variant]:.0%})"
                notes.append(bound)
            if row.get("first_call_seconds") is not None:
                notes.append(f"first call incl. compile {row['first_call_seconds']:.0f} s")
            if row.get("same_tokens_as_transformers") is not None:
                notes.append(f"same tokens: {row['same_tokens_as_transformers']}")
            goal = speedup_goals.get((name, variant))
            if "bf16" in variant:
                fp32 = rows[variant.replace(" bf16", "")]
                out.append(
                    {
                        "job": f"decode {name} bf16 weights{variant.replace('attnkit bf16', '')}",
                        "peer": "attnkit fp32 weights",
                        "attnkit_s": 1 / row["step_tokens_per_s"],
                        "peer_s": 1 / fp32["step_tokens_per_s"],
                        "note": "; ".join([notes[0], "seconds per decoded token"]),
                        "goal": goal,
                    }
                )
                continue
            out.append(
                {
                    "job": f"decode {name}{variant.replace('attnkit', '')}",
                    "peer": "transformers LlamaForCausalLM",
                    "attnkit_s": row["seconds"],
                    "peer_s": None if hf is None else hf["seconds"],
                    "note": "; ".join(notes if hf is not None else [*notes, *report["notes"]]),
                    "goal": goal,
                }
            )
    return out


# --------------------------------------------------------------------------------------------
# Weight-only quantization rows: fp32, bf16, int8 and int4 weights side by side.

#: The real-checkpoint shape of the quantization rows: a 135M Llama (30 layers, D576, 9/3 heads,
#: head_dim 64, SwiGLU 1536, vocab 49152, tied, rope_theta 1e5); prompt 40, 96 new tokens.
QUANT_MODELS: dict[str, tuple[TransformerConfig, int, int]] = {
    "llama-135m": (
        TransformerConfig(
            49152,
            576,
            30,
            9,
            num_kv_heads=3,
            ffn_dim=1536,
            max_seq_len=256,
            rope_base=1e5,
            **_LLAMA,
        ),
        40,
        96,
    ),
    "llama-tiny": DECODE_MODELS["llama-tiny"],
}


def _stored_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: parameters and buffers once each (int8/int4 codes, scales)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        inner = _plain_tensors(t)
        for part in inner:
            if part.numel() and part.data_ptr() not in seen:
                seen.add(part.data_ptr())
                total += part.numel() * part.element_size()
    # fbgemm's prepacked int8 weights (outside the module's tensors)
    total += sum(int(getattr(m, "packed_bytes", 0)) for m in model.modules())
    embedding = getattr(model, "embedding", None)
    if isinstance(embedding, nn.Embedding) and getattr(model, "lm_head", None) is not None:
        w = embedding.weight  # a lookup reads one row; the quantized head reads the table
        total -= w.numel() * w.element_size()
    return total


def _plain_tensors(t: Tensor) -> list[Tensor]:
    """The plain tensors holding ``t``'s data: ``t`` itself, or a tensor subclass's parts
    (torchao's quantized weights keep their int8 codes and scales as inner tensors)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (Tensor, nn.Parameter):
        return [t]
    names, _ = flatten()
    return [p for name in names for p in _plain_tensors(getattr(t, name))]


def quantized_variants(model: TransformerLM, *, compile: bool) -> dict[str, TransformerLM]:
    """``model`` as fp32, bf16, int8 and int4 (eager and, with ``compile``, compiled), each
    prepared for decoding as ``attnkit generate`` prepares it (:func:`attnkit.decoding.prepare`:
    the quantized linears kept, the norms and the embedding table prepared)."""
    from attnkit.quantize import quantize

    out: dict[str, TransformerLM] = {}
    for suffix, compiled in (("", False), (" compile", True)) if compile else (("", False),):
        out[f"fp32{suffix}"] = decoding.prepare(copy.deepcopy(model), compiled=compiled)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        out[f"bf16{suffix}"] = decoding.prepare(bf16, compiled=compiled)
        for mode in ("int8", "int4"):
            quantized = copy.deepcopy(model)
            quantize(quantized, mode)  # type: ignore[arg-type]
            out[f"{mode}{suffix}"] = decoding.prepare(quantized, compiled=compiled)
    return out


@torch.no_grad()
def quantization_quality(
    reference: nn.Module, quantized: nn.Module, ids: Tensor
) -> dict[str, float]:
    """Top-1 agreement of the next-token logits and the perplexity change on ``ids`` ``(B, T)``.

    Returns ``{"top1_agreement", "perplexity", "reference_perplexity", "perplexity_change"}``
    (the change is relative: 0.01 is +1%).
    """
    ref = reference(ids).float()[:, :-1]
    got = quantized(ids).float()[:, :-1]
    target = ids[:, 1:]
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()

    def perplexity(logits: Tensor) -> float:
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        )
        return float(loss.exp())

    p_ref, p_got = perplexity(ref), perplexity(got)
    return {
        "top1_agreement": agree,
        "perplexity": p_got,
        "reference_perplexity": p_ref,
        "perplexity_change": p_got / p_ref - 1,
    }


def minilm_cosines(texts: list[str]) -> dict[str, float]:
    """Lowest cosine between all-MiniLM-L6-v2's fp32 and quantized embeddings of ``texts``
    (needs the ``models`` extra)."""
    from attnkit.interop import SentenceEncoder
    from attnkit.quantize import quantize

    encoder = SentenceEncoder.from_pretrained()
    want = encoder.encode(texts)
    out = {}
    for mode in ("int8", "int4"):
        quantized = copy.deepcopy(encoder)
        quantize(quantized, mode)  # type: ignore[arg-type]
        got = quantized.encode(texts)
        out[mode] = float((got * want).sum(-1).min())
    return out


def quantize_rows(
    name: str = "llama-135m",
    *,
    repeats: int = 3,
    compile: bool = True,
    progress: Callable[[str], None] | None = None,
    extra: Callable[[TransformerLM], dict[str, nn.Module]] | None = None,
    only: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Decode-step tokens/s of fp32, bf16, int8 and int4 weights against transformers (fp32).

    ``extra(model)`` adds variants (another library's quantization of the same model; a name
    ending in ``compile`` runs compiled); ``only`` keeps just the named variants (transformers
    always runs).

    Random weights (speed does not depend on their values). Rounds are interleaved: each repeat
    runs every variant for ``new`` tokens and for 1, the decode phase being the difference, and
    probes the read bandwidth. Rows carry ``step_tokens_per_s``, ``time_to_first_token_s``,
    ``vs_transformers``, ``vs_fp32_compile``, ``vs_bf16_compile`` and ``of_bound`` (the step rate
    times the bytes the variant stores over the bandwidth). The ranges over repeats are kept.

    Raises:
        ValueError: For an unknown ``name``.
    """
    if name not in QUANT_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(QUANT_MODELS)}")
    say = progress or (lambda _msg: None)
    config, P, new = QUANT_MODELS[name]
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    prompt = torch.randint(0, config.vocab_size or 2, (1, P))
    variants: dict[str, nn.Module] = dict(quantized_variants(model, compile=compile))
    added = extra(model) if extra is not None else {}
    variants |= added
    if only is not None:
        variants = {k: v for k, v in variants.items() if k in only}
    runners: dict[str, Callable[[int], Any]] = {}
    notes: list[str] = []
    try:
        hf = to_transformers(model)
        runners["transformers"] = _hf_greedy(hf, prompt)
    except ImportError:
        notes.append("transformers is not installed: rows against it skipped")
    for variant, lm in variants.items():
        compiled = variant.endswith("compile")

        def run_attnkit(n: int, lm: Any = lm, c: bool = compiled) -> Any:
            return lm.generate(prompt, n, eos_token_id=[], compile=c)

        runners[variant] = run_attnkit
    for variant, run in list(runners.items()):
        say(f"{name}: warm-up {variant}")
        try:
            run(new)
        except Exception as err:  # another library's variant that does not run here
            if variant not in added:
                raise
            notes.append(f"{variant} failed and was left out: {type(err).__name__}: {err}")
            del runners[variant]
    steps: dict[str, list[float]] = {v: [] for v in runners}
    firsts: dict[str, list[float]] = {v: [] for v in runners}
    bandwidths: list[float] = []
    probe = _ReadBandwidth()  # (1 GB, as decode_rows measures the bound)
    for r in range(repeats):
        for variant, run in runners.items():
            say(f"{name}: run {r + 1}/{repeats} {variant}")
            t = _seconds(run, new)
            t1 = _seconds(run, 1)
            firsts[variant].append(t1)
            steps[variant].append(max(t - t1, 1e-9) / (new - 1))
        bandwidths.append(probe.measure())
    bandwidth = max(bandwidths)  # (the fastest probe, as decode_rows)
    rows: dict[str, dict[str, Any]] = {}
    for variant in runners:
        rate = [1 / s for s in steps[variant]]
        row: dict[str, Any] = {
            "model": name,
            "variant": variant,
            "step_tokens_per_s": statistics.median(rate),
            "step_tokens_per_s_range": [min(rate), max(rate)],
            "time_to_first_token_s": statistics.median(firsts[variant]),
        }
        if variant in variants:
            stored = _stored_bytes(variants[variant])
            row["weight_bytes"] = stored
            row["of_bound"] = row["step_tokens_per_s"] * stored / bandwidth
        rows[variant] = row
    for row in rows.values():
        for key, base in (
            ("vs_transformers", "transformers"),
            ("vs_fp32_compile", "fp32 compile"),
            ("vs_bf16_compile", "bf16 compile"),
            ("vs_int8_compile", "int8 compile"),
        ):
            if base in rows:
                row[key] = row["step_tokens_per_s"] / rows[base]["step_tokens_per_s"]
    return {
        "rows": list(rows.values()),
        "bandwidth_bytes_per_s": bandwidth,
        "notes": notes,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def prefill_rows(
    name: str = "llama-135m",
    *,
    prompts: tuple[int, ...] = (256, 2048),
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time to first token: attnkit's eager prefill (the model prepared as ``attnkit generate``
    prepares it) against transformers' ``generate`` of one token, per dtype and prompt length.

    Random weights, one prompt, both libraries in the same dtype and process, rounds interleaved,
    medians. Rows carry ``attnkit_s``, ``transformers_s``, ``vs_transformers`` (transformers'
    time over attnkit's), ``vs_fp32`` (attnkit's fp32 time over this dtype's) and whether the
    two first tokens agree. Targets (bf16, prompt 2048): >= 1.0x transformers, and >= 2.5x
    attnkit fp32 where torch's bf16 GEMM is >= 4x its fp32 one.

    Raises:
        ValueError: For an unknown ``name`` or a prompt shorter than 1.
    """
    if name not in QUANT_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(QUANT_MODELS)}")
    if not prompts or min(prompts) < 1:
        raise ValueError(f"prompt lengths must be at least 1, got {prompts}")
    say = progress or (lambda _msg: None)
    config = QUANT_MODELS[name][0].replace(max_seq_len=max(prompts) + 1)
    torch.manual_seed(0)
    base = TransformerLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size or 2, (1, max(prompts)), generator=gen)
    runners: dict[tuple[str, str, int], Callable[[], Tensor]] = {}
    for dtype in dtypes:
        kind = str(dtype).removeprefix("torch.")
        ours = decoding.prepare(copy.deepcopy(base).to(dtype))
        try:
            theirs = to_transformers(base).to(dtype)
        except ImportError:
            theirs = None
        for P in prompts:
            prompt = ids[:, :P]
            runners[("attnkit", kind, P)] = functools.partial(
                ours.generate, prompt, 1, eos_token_id=[]
            )
            if theirs is not None:
                runners[("transformers", kind, P)] = functools.partial(
                    _hf_greedy(theirs, prompt), 1
                )
    firsts = {key: run() for key, run in runners.items()}  # (warm-up)
    seconds: dict[tuple[str, str, int], list[float]] = {key: [] for key in runners}
    for r in range(repeats):
        say(f"{name}: prefill round {r + 1}/{repeats}")
        for key, run in runners.items():
            start = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - start)
    med = {key: statistics.median(v) for key, v in seconds.items()}
    rows = []
    for dtype in dtypes:
        kind = str(dtype).removeprefix("torch.")
        for P in prompts:
            ours_s = med[("attnkit", kind, P)]
            row: dict[str, Any] = {"dtype": kind, "prompt": P, "attnkit_s": ours_s}
            hf_key = ("transformers", kind, P)
            if hf_key in med:
                row["transformers_s"] = med[hf_key]
                row["vs_transformers"] = med[hf_key] / ours_s
                row["same_first_token"] = bool(
                    torch.equal(firsts[("attnkit", kind, P)][:, -1], firsts[hf_key][:, -1])
                )
            if ("attnkit", "float32", P) in med:
                row["vs_fp32"] = med[("attnkit", "float32", P)] / ours_s
            rows.append(row)
    notes = [] if any(k[0] == "transformers" for k in runners) else ["transformers not installed"]
    return {"rows": rows, "notes": notes, "threads": torch.get_num_threads()}


#: The prefill targets: bf16 time to first token at the longest prompt against transformers bf16,
#: and against attnkit's own fp32 where torch's bf16 GEMM is at least 4x its fp32 one.
PREFILL_GOALS = {"transformers": 1.0, "fp32": 2.5}


def bf16_gemm_speedup(rows: int = 2048, inputs: int = 576, outputs: int = 1536) -> float:
    """How many times faster torch's bf16 GEMM is than its float32 one on this CPU (a prompt's
    product of the 135M Llama shape, medians of interleaved rounds)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, inputs, generator=gen), torch.randn(outputs, inputs, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    with torch.no_grad():
        seconds = time_calls({"fp32": lambda: x @ w.T, "bf16": lambda: xb @ wb.T}, rounds=5)
    return seconds["fp32"] / seconds["bf16"]


def vs_prefill_rows(
    name: str = "llama-135m",
    *,
    prompts: tuple[int, ...] = (256, 2048),
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The time-to-first-token rows of ``attnkit bench --vs`` (see :func:`prefill_rows`): each
    dtype and prompt against transformers in the same dtype, and bf16 against attnkit fp32. The
    longest prompt's bf16 rows carry :data:`PREFILL_GOALS` (the fp32 one only where
    :func:`bf16_gemm_speedup` is at least 4)."""
    report = prefill_rows(name, prompts=prompts, repeats=repeats, progress=progress)
    fast_bf16 = bf16_gemm_speedup()
    longest = max(prompts)
    out: list[dict[str, Any]] = []
    for row in report["rows"]:
        P, kind = row["prompt"], row["dtype"]
        size = f"prompt {P}, {kind}, batch 1, {report['threads']} threads"
        goal = PREFILL_GOALS["transformers"] if kind == "bfloat16" and longest == P else None
        same = row.get("same_first_token")
        out.append(
            {
                "job": f"first token {name} {kind} P={P}",
                "peer": "transformers LlamaForCausalLM",
                "attnkit_s": row["attnkit_s"],
                "peer_s": row.get("transformers_s"),
                "note": size if same is None else f"{size}; same first token: {same}",
                "goal": goal,
            }
        )
        if kind == "bfloat16" and "vs_fp32" in row:
            fp32 = row["attnkit_s"] * row["vs_fp32"]
            goal = PREFILL_GOALS["fp32"] if longest == P and fast_bf16 >= 4 else None
            out.append(
                {
                    "job": f"first token {name} bf16 weights P={P}",
                    "peer": "attnkit fp32 weights",
                    "attnkit_s": row["attnkit_s"],
                    "peer_s": fp32,
                    "note": f"{size}; torch's bf16 GEMM {fast_bf16:.1f}x its fp32 here",
                    "goal": goal,
                }
            )
    return out
