"""Decoding speed of fp32, bf16, int8 and int4 weights side by side, with torchao's int8 beside
attnkit's, and the quality measures shared with :mod:`attnkit.bench.quantization.quality`.

:func:`quantize_rows` decodes the 135M Llama shape with each kind of weights (eager and compiled)
against transformers fp32, with each variant's share of the read-bandwidth bound (the bytes it
stores over the measured bandwidth). torchao is imported only by :func:`torchao_int8`.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import decoding
from attnkit.bench.decoding.models import QUANT_MODELS
from attnkit.bench.decoding.rows import _ReadBandwidth, _seconds
from attnkit.bench.peers import hf_greedy, import_quietly, to_transformers
from attnkit.models import TransformerLM

__all__ = [
    "minilm_cosines",
    "quantization_quality",
    "quantize_rows",
    "quantized_variants",
    "stored_bytes",
    "torchao_int8",
    "torchao_variants",
]


def stored_bytes(model: nn.Module) -> int:
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
        runners["transformers"] = hf_greedy(hf, prompt)
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
            stored = stored_bytes(variants[variant])
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


def torchao_int8(model: nn.Module) -> nn.Module:
    """``model`` (a copy) with torchao's ``Int8WeightOnlyConfig`` applied to its linears, the
    tied head included (as an untied copy, like :func:`attnkit.quantize.quantize`).

    Raises:
        ImportError: Without torchao.
    """
    torchao = import_quietly("torchao.quantization")

    model = copy.deepcopy(model)
    embedding = getattr(model, "embedding", None)
    if isinstance(embedding, nn.Embedding) and getattr(model, "lm_head", 0) is None:
        head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
        head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
        model.lm_head = head
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    model.__dict__.pop("_attnkit_step", None)
    return model


def torchao_variants(model: TransformerLM, *, compile: bool) -> dict[str, nn.Module]:
    """torchao int8 weight-only copies of ``model`` for the decoding rows (``"torchao int8"`` and,
    with ``compile``, ``"torchao int8 compile"``); empty without torchao."""
    try:
        quantized = torchao_int8(model)
    except ImportError:
        return {}
    out = {"torchao int8": quantized}
    if compile:
        out["torchao int8 compile"] = torchao_int8(model)
    return out
