"""Quantization layouts: quality per layout, and GGUF block files loaded natively.

Usage::

    python -m attnkit.bench.quantization.layouts              # both sections
    python -m attnkit.bench.quantization.layouts --skip gguf  # quality per layout only

Sections (``--skip NAME`` leaves one out):

* ``layouts``: the byte-level decoder :func:`attnkit.bench.quantization.train_text_lm` trains on
  English text (a few hundred steps by default; kept in ``--lm-dir`` and reused), quantized in each
  layout of :func:`attnkit.quantize.quantize` (int8 per channel, ``q8_0`` blocks and the per-layer
  choice; int4 groups with int8 activations, ``q4_1`` and ``q4_0``, and the former default of
  groups of 128): top-1 agreement with its fp32 logits and perplexity change on ``--tokens``
  held-out tokens. Targets: the default int8 top-1 >= 97% and perplexity within +1%; the default
  int4 top-1 >= 90% and perplexity within +10%.
* ``gguf``: a ``--shape`` model with random weights written as ``Q8_0``, ``Q4_0`` and ``Q4_1``
  GGUF files; each loaded natively (block layers) and with ``dequantize=True`` (fp32): the
  largest logit difference relative to the largest dequantized logit (target: <= 1e-3) and
  decode-step tokens/s side by side in interleaved rounds, medians (target: native >= 2x fp32);
  the native layers with float32 activations (exact) and with int8 ones (faster, less exact).

Writes JSON (default ``benchmarks/results/quantization-layouts.json``).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit.bench.decoding.models import QUANT_MODELS
from attnkit.bench.quantization import parse_sections
from attnkit.bench.quantization.quality import _windows, english_text, text_ids, train_text_lm
from attnkit.bench.quantization.speed import quantization_quality
from attnkit.bench.results import RESULTS, bench_parser, write_report
from attnkit.config import TransformerConfig
from attnkit.models import TransformerLM
from attnkit.quantize import quantize
from attnkit.quantized.block import set_activations

__all__ = ["LAYOUT_VARIANTS", "gguf_rows", "layout_counts", "layout_rows"]

SECTIONS = ("layouts", "gguf")
#: label -> (mode, layout, group size): the variants the ``layouts`` section scores; the labels
#: ``int8`` and ``int4`` are :func:`attnkit.quantize.quantize`'s defaults.
LAYOUT_VARIANTS: dict[str, tuple[str, str, int]] = {
    "int8": ("int8", "auto", 32),
    "int8 channel": ("int8", "channel", 32),
    "int8 q8_0": ("int8", "q8_0", 32),
    "int4": ("int4", "auto", 32),
    "int4 q4_1": ("int4", "q4_1", 32),
    "int4 q4_0": ("int4", "q4_0", 32),
    "int4 grouped g128": ("int4", "grouped", 128),
}
GGUF_TYPES = ("q8_0", "q4_0", "q4_1")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def layout_counts(model: nn.Module) -> dict[str, int]:
    """How many linears of ``model`` hold each layout (by class and layout)."""
    names: Counter[str] = Counter()
    for m in model.modules():
        layout = getattr(m, "layout", None)
        if layout is not None:
            names[str(layout)] += 1
        elif type(m).__name__ in ("Int8Linear", "Int4Linear"):
            names["channel" if type(m).__name__ == "Int8Linear" else "grouped"] += 1
    return dict(names)


@torch.no_grad()
def layout_rows(
    folder: str | Path, text: str, *, tokens: int = 1024, context: int = 64, batch: int = 4
) -> list[dict[str, Any]]:
    """Top-1 agreement with fp32 and perplexity change of each :data:`LAYOUT_VARIANTS` of the
    decoder in ``folder`` on the first ``tokens`` tokens of ``text`` (windows of ``context``).

    Returns:
        One row per variant: ``variant``, ``mode``, ``layout``, ``group_size``,
        ``top1_agreement``, ``perplexity``, ``reference_perplexity``, ``perplexity_change``,
        ``tokens``, ``layers`` (:func:`layout_counts`).

    Raises:
        ValueError: If the text gives fewer than ``batch`` windows.
    """
    rows = _windows(text_ids(folder, text), context, max(tokens // context, 1))
    if len(rows) < batch:
        raise ValueError(f"the text gives {len(rows)} windows of {context}, fewer than {batch}")
    rows = rows[: len(rows) // batch * batch]
    reference = TransformerLM.from_pretrained(folder)
    ref_logits = [reference(rows[i : i + batch]) for i in range(0, len(rows), batch)]
    out = []
    for label, (mode, layout, group) in LAYOUT_VARIANTS.items():
        model = quantize(copy.deepcopy(reference), mode, layout=layout, group_size=group)  # type: ignore[arg-type]
        logits = torch.cat([model(rows[i : i + batch]) for i in range(0, len(rows), batch)])
        scores = quantization_quality(_Fixed(torch.cat(ref_logits)), _Fixed(logits), rows)
        out.append(
            {
                "variant": label,
                "mode": mode,
                "layout": layout,
                "group_size": group,
                **scores,
                "tokens": rows.numel(),
                "layers": layout_counts(model),
            }
        )
    return out


class _Fixed(nn.Module):
    """Logits computed beforehand, returned for any input (the quality score's model)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits


def _rate(lm: nn.Module, prompt: torch.Tensor, new: int) -> float:
    """Decode steps per second: ``new`` tokens minus one token, over ``new - 1``."""
    start = time.perf_counter()
    lm.generate(prompt, new, eos_token_id=[], compile=False)  # type: ignore[operator]
    mid = time.perf_counter()
    lm.generate(prompt, 1, eos_token_id=[], compile=False)  # type: ignore[operator]
    end = time.perf_counter()
    return (new - 1) / max((mid - start) - (end - mid), 1e-9)


@torch.no_grad()
def gguf_rows(
    shape: str = "llama-135m",
    *,
    new: int = 16,
    rounds: int = 5,
    where: Path | None = None,
    config: TransformerConfig | None = None,
) -> list[dict[str, Any]]:
    """For each of :data:`GGUF_TYPES`: the ``shape`` model (random weights) as a GGUF file,
    loaded natively and with ``dequantize=True``; their logits' largest difference over the
    largest dequantized logit, bytes held by the linears, and decode-step rates side by side
    (interleaved rounds, medians); ``config`` replaces the shape's (``shape`` labels it). Needs
    the ``gguf`` package."""
    from attnkit.bench.llamacpp import write_gguf

    config, prompt_len, _ = QUANT_MODELS[shape] if config is None else (config, 8, 0)
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    prompt = torch.randint(0, int(config.vocab_size or 2), (1, min(prompt_len, 32)))
    out = []
    with tempfile.TemporaryDirectory(dir=where) as folder:
        for precision in GGUF_TYPES:
            _say(f"gguf: writing {precision}")
            path = write_gguf(model, Path(folder) / f"{precision}.gguf", precision)
            native = TransformerLM.from_pretrained(path)
            floats = TransformerLM.from_pretrained(path, dequantize=True)
            errors = {"float": 0.0, "int8": 0.0}
            for activations in errors:
                set_activations(native, activations)
                for ids in (prompt, prompt[:, :1]):  # (a prompt's GEMM path, one row's kernel)
                    want, got = floats(ids), native(ids)
                    error = float((got - want).abs().max() / want.abs().max())
                    errors[activations] = max(errors[activations], error)
            rates: dict[str, list[float]] = {"native": [], "native int8": [], "fp32": []}
            for _ in range(rounds):  # (interleaved)
                set_activations(native, "float")
                rates["native"].append(_rate(native, prompt, new))
                set_activations(native, "int8")
                rates["native int8"].append(_rate(native, prompt, new))
                rates["fp32"].append(_rate(floats, prompt, new))
            set_activations(native, "float")
            median = {k: statistics.median(v) for k, v in rates.items()}
            out.append(
                {
                    "precision": precision,
                    "shape": shape,
                    "file_bytes": path.stat().st_size,
                    "logits_relative_error": errors["float"],
                    "int8_activations_logits_relative_error": errors["int8"],
                    "native_tokens_per_s": median["native"],
                    "native_int8_activations_tokens_per_s": median["native int8"],
                    "fp32_tokens_per_s": median["fp32"],
                    "speedup": median["native"] / median["fp32"],
                    "int8_activations_speedup": median["native int8"] / median["fp32"],
                    "layers": layout_counts(native),
                }
            )
            _say(f"gguf {precision}: error {error:.2e}, {median}")
            del native, floats
    return out


def _target(what: str, measured: float, goal: float, *, at_most: bool = False) -> dict[str, Any]:
    met = measured <= goal if at_most else measured >= goal
    return {"what": what, "measured": measured, "target": goal, "met": met}


def _targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    for row in result.get("layouts", {}).get("rows", []):
        if row["variant"] == "int8":
            targets.append(_target("int8 top-1", row["top1_agreement"], 0.97))
            targets.append(_target("int8 ppl", row["perplexity_change"], 0.01, at_most=True))
        if row["variant"] == "int4":
            targets.append(_target("int4 top-1", row["top1_agreement"], 0.90))
            targets.append(_target("int4 ppl", row["perplexity_change"], 0.10, at_most=True))
    for row in result.get("gguf", []):
        p = row["precision"]
        targets.append(_target(f"{p} logits", row["logits_relative_error"], 1e-3, at_most=True))
        targets.append(_target(f"{p} native vs fp32", row["speedup"], 2.0))
    return targets


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("attnkit.bench.quantization.layouts", __doc__)
    parser.add_argument("--lm-dir", default=str(RESULTS / "quantize_lm_layouts"))
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=1024, help="held-out tokens scored")
    parser.add_argument("--shape", default="llama-135m", choices=sorted(QUANT_MODELS))
    parser.add_argument("--new", type=int, default=16, help="gguf: tokens per timed decode")
    parser.add_argument("--rounds", type=int, default=5)
    args = parse_sections(parser, argv, SECTIONS, RESULTS / "quantization-layouts.json")
    result: dict[str, Any] = {}
    if "layouts" not in args.skip:
        lm_dir = Path(args.lm_dir)
        if not (lm_dir / "training.json").is_file() or args.retrain:
            _say(f"training the byte-level English decoder into {lm_dir}")
            train_text_lm(lm_dir, max_steps=args.max_steps, progress=_say)
        training = json.loads((lm_dir / "training.json").read_text())
        _, held_out = english_text()
        rows = layout_rows(lm_dir, held_out, tokens=args.tokens, context=training["seq_len"])
        result["layouts"] = {
            "training": {k: v for k, v in training.items() if k != "history"},
            "rows": rows,
        }
        print(f"{'variant':<20} {'layers':<28} {'top-1 agree':>11} {'ppl change':>10}")
        for row in rows:
            layers = ", ".join(f"{k} {v}" for k, v in row["layers"].items())
            print(
                f"{row['variant']:<20} {layers:<28} {row['top1_agreement']:>10.2%} "
                f"{row['perplexity_change']:>+10.2%}"
            )
    if "gguf" not in args.skip:
        result["gguf"] = gguf_rows(args.shape, new=args.new, rounds=args.rounds)
    result["targets"] = _targets(result)
    for t in result["targets"]:
        status = "met" if t["met"] else "missed"
        print(f"{t['what']:<28} {t['measured']:>10.4g} {t['target']:>6}  {status}")
    return write_report(
        json.loads(json.dumps(result, default=str)), args.out, "quantization-layouts.json"
    )


if __name__ == "__main__":
    main()
