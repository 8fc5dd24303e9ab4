"""Decoding rows: attnkit's cached greedy decoding against transformers' ``LlamaForCausalLM``.

Everything is measured side by side in one process, runs interleaved, medians reported; what
matters are the ratios (the machine may be shared). transformers is imported only when a row
needs it; without it the rows against it are skipped with a note.

Models (:data:`attnkit.bench.decoding.models.DECODE_MODELS`) and targets (:data:`TARGETS`):

* ``llama-3m``: dim 256, 4 layers, 8/4 heads, SwiGLU 688, RMSNorm, vocab 1024, tied head;
  prompt 512, 128 new tokens, greedy. Targets: eager >= 1.3x, compiled >= 2x transformers.
* ``llama-100m``: dim 768, 12 layers, 12/4 heads, SwiGLU 2048, vocab 32000, tied; prompt 128.
  Targets: decode steps at >= 85% of the read-bandwidth bound (every weight read once per token,
  :func:`read_bandwidth`), >= 1.3x transformers; bf16 weights >= 1.6x the fp32 tokens/s.
* ``llama-135m``: the shape of real small checkpoints (30 layers, D576); compiled fp32 and bf16,
  each with its share of its own bandwidth bound (its weights' bytes per step over the measured
  read bandwidth). Same targets as ``llama-100m``'s compiled rows.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit import decoding, generation
from attnkit.bench.decoding.models import DECODE_MODELS
from attnkit.bench.peers import hf_greedy, to_transformers
from attnkit.config import TransformerConfig
from attnkit.models import TransformerLM
from attnkit.positional import LearnedPositionalEmbedding

__all__ = ["BOUND_PARAMETERS", "TARGETS", "decode_rows", "read_bandwidth", "vs_rows"]

#: Models above this many parameters get bf16 rows and the read-bandwidth bound (smaller ones
#: fit in the caches, where a step is not bound by the memory's bandwidth).
BOUND_PARAMETERS = 50e6


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


def _runner(
    model: TransformerLM, prompt: Tensor, *, compile: bool = False
) -> tuple[Callable[[int], Tensor], bool]:
    """Greedy ``generate`` of a copy of ``model`` whose linears :func:`attnkit.decoding.prepare`
    laid out for one-row products (eager, or for the compiled step), and whether its steps run
    the fused one-call step (``compile=True`` too, where the policy's compiled step is it)."""
    prepared = decoding.prepare(copy.deepcopy(model), compiled=compile)

    def run(new: int) -> Tensor:
        return prepared.generate(prompt, new, compile=compile)

    fused = generation.compiled_steps_fuse(prepared) if compile else prepared.fuses_steps()
    return run, fused


# The targets of the rows: (model, what, row, key, at least).
TARGETS: list[tuple[str, str, str, str, float]] = [
    ("llama-3m", "eager vs transformers", "attnkit", "vs_transformers", 1.3),
    ("llama-3m", "compiled vs transformers", "attnkit compile", "vs_transformers", 2.0),
    ("llama-100m", "eager fp32 vs transformers", "attnkit", "vs_transformers", 1.3),
    ("llama-100m", "eager fp32 steps / bandwidth bound", "attnkit", "of_bound", 0.85),
    ("llama-100m", "eager bf16 steps vs fp32", "attnkit bf16", "vs_fp32", 1.6),
    ("llama-100m", "compiled fp32 vs transformers", "attnkit compile", "vs_transformers", 1.3),
    ("llama-100m", "compiled fp32 steps / bandwidth bound", "attnkit compile", "of_bound", 0.85),
    ("llama-100m", "compiled bf16 steps vs fp32", "attnkit bf16 compile", "vs_fp32", 1.6),
    ("llama-135m", "compiled fp32 steps / bandwidth bound", "attnkit compile", "of_bound", 0.85),
    ("llama-135m", "compiled bf16 steps vs fp32", "attnkit bf16 compile", "vs_fp32", 1.6),
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
    eager: bool = True,
    progress: Callable[[str], None] | None = None,
    models: dict[str, tuple[TransformerConfig, int, int]] | None = None,
) -> dict[str, Any]:
    """Measure the decoding rows; returns ``{"rows": [...], "notes": [...], ...}``.

    Each row has ``model``, ``variant``, ``seconds`` (median end-to-end ``generate``),
    ``tokens_per_s`` (new tokens / seconds), ``step_tokens_per_s`` (decode phase only: the
    median of ``(t(new) - t(1)) / (new - 1)``) and ratios against the transformers row of the
    same model (``vs_transformers``); attnkit's rows say whether their steps ran the fused
    one-call step (``fused_steps``: ``compile=True`` runs it where the policy's
    ``decoding.compiled_step.<dtype>`` says so). Models above :data:`BOUND_PARAMETERS` also get the
    read-bandwidth bound: ``weight_bytes`` (what one step of the variant reads), ``of_bound``
    (the step rate times those bytes over the fastest bandwidth probe of the same rounds) and
    ``of_fp32_bound`` (the same with the fp32 weights' bytes).

    Args:
        names: Models of :data:`DECODE_MODELS` to run.
        repeats: Interleaved runs per variant (median).
        bf16: Add a bf16-weights attnkit row for models above :data:`BOUND_PARAMETERS`.
        compile: Add an attnkit ``compile=True`` row (compiles once per model; the compile time
            is reported, not counted in the timings).
        eager: Keep the eager attnkit rows (without them only the compiled ones run).
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
    if not eager and not compile:
        raise ValueError("decode_rows needs eager or compile (or both)")
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for name in names:
        config, P, new = table[name]
        torch.manual_seed(0)
        model = TransformerLM(config).eval()
        prompt = torch.randint(0, model.embedding.num_embeddings, (1, P))
        runners: dict[str, Callable[[int], Tensor]] = {}
        fused: dict[str, bool] = {}  # (attnkit's variants: steps by the one-call step)
        try:
            runners["transformers"] = hf_greedy(to_transformers(model), prompt)
        except ImportError:
            if not notes:
                notes.append("transformers is not installed: rows against it skipped")
        kinds = [""] * eager + [" compile"] * compile
        weights = {"attnkit": model}
        big = sum(p.numel() for p in model.parameters()) > BOUND_PARAMETERS
        if bf16 and big:
            weights["attnkit bf16"] = copy.deepcopy(model).to(torch.bfloat16)
        for label, lm in weights.items():
            for kind in kinds:
                runners[label + kind], fused[label + kind] = _runner(lm, prompt, compile=bool(kind))
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
        variant_bytes = {label: _weight_bytes(lm) for label, lm in weights.items()}
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
            if variant in fused:
                row["fused_steps"] = fused[variant]
            if bandwidth is not None:
                row["bandwidth_bytes_per_s"] = bandwidth
                row["fp32_weight_bytes"] = bytes_per_token
                row["of_fp32_bound"] = row["step_tokens_per_s"] * bytes_per_token / bandwidth
                # (transformers reads the fp32 weights)
                own = variant_bytes.get(variant.removesuffix(" compile"), bytes_per_token)
                row["weight_bytes"] = own
                row["of_bound"] = row["step_tokens_per_s"] * own / bandwidth
            model_rows[variant] = row
        base = model_rows.get("transformers")
        for row in model_rows.values():
            if base is not None:
                row["vs_transformers"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["step_vs_transformers"] = row["step_tokens_per_s"] / base["step_tokens_per_s"]
        for suffix in kinds:
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


def vs_rows(
    *,
    repeats: int = 3,
    compile: bool = True,
    names: tuple[str, ...] = ("llama-3m", "llama-100m"),
    eager: bool = True,
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
        eager: Keep the eager rows.
        progress: Called with a short message before each measurement.
        models: Table to take the names from instead of :data:`DECODE_MODELS`.
    """
    report = decode_rows(
        names, repeats=repeats, compile=compile, eager=eager, progress=progress, models=models
    )
    table = DECODE_MODELS if models is None else models
    speedup_goals = {(t[0], t[2]): t[4] for t in TARGETS if t[3] != "of_bound"}
    bound_goals = {(t[0], t[2]): t[4] for t in TARGETS if t[3] == "of_bound"}
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
            bound = []
            if "of_bound" in row:
                share = f"{row['of_bound']:.0%} of the read-bandwidth bound"
                if (name, variant) in bound_goals:
                    share += f" (goal {bound_goals[name, variant]:.0%})"
                bound.append(share)
            notes += bound
            if row.get("fused_steps"):
                notes.append("steps: the fused one-call step")
            elif row.get("first_call_seconds") is not None:
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
                        "note": "; ".join([size, "seconds per decoded token", *bound]),
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
