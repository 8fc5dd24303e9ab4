"""Weight-only quantization: quality on real weights, loading peak memory, and speed beside torchao.

Usage::

    python -m attnkit.bench.quantization                     # everything below
    python -m attnkit.bench.quantization --model DIR [--model DIR2]  # also real decoder folders
    python -m attnkit.bench.quantization --skip speed --skip memory  # quality only

Sections (``--skip NAME`` leaves one out):

* ``quality``: a byte-level Llama-shaped decoder trained on English text until its held-out loss
  converges (:func:`attnkit.bench.quantization.train_text_lm`; kept in ``--lm-dir`` and reused),
  and every ``--model`` folder, loaded as fp32, bf16, int8, int4 and torchao int8: top-1
  agreement with fp32 and perplexity change on held-out English text. Targets: int8 top-1
  agreement >= 97%, perplexity within +2%; int4 top-1 agreement >= 90%.
* ``minilm``: all-MiniLM-L6-v2's int8/int4 embeddings of held-out English sentences, lowest cosine
  to fp32 (target: int8 >= 0.99); needs the ``models`` extra.
* ``memory``: peak memory of ``from_pretrained(..., quantize="int8")`` (and int4) in a child
  process over the loaded model's bytes, on a random ``--shape`` folder and every ``--model``
  (target: <= 1.2x), and the resident memory of int8 models loaded with each int8 kernel
  this machine offers (target: fbgemm <= 1.1x int8pack).
* ``kernels``: every candidate way to multiply one row by each weight matrix of the ``--shape``
  model (fp32/bf16 ``F.linear``, attnkit's int8 kernel, fbgemm's dynamic int8 linear,
  ``torch._weight_int8pack_mm`` with bf16 and fp32 activations, dequantizing into a buffer,
  ``torch._int_mm``, torch's int4 kernel per group size), each call after a cache flush,
  interleaved, medians; the error against the float64 product of the dequantized weight, and
  the int8 kernel the run-time choice takes.
* ``speed``: decode-step tokens/s on the ``--shape`` model: fp32, bf16, attnkit int8/int4 and
  torchao's ``Int8WeightOnlyConfig``, eager and compiled, against transformers fp32, in
  interleaved rounds (medians). Targets: int8 >= 3.0x transformers fp32 and >= 1.8x attnkit
  bf16; int4 >= 1.5x int8.

Prints tables and writes JSON (default ``benchmarks/results/quantization.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from attnkit.bench import quantization as bq
from attnkit.bench.decoding.models import QUANT_MODELS
from attnkit.bench.results import RESULTS, bench_parser, write_report
from attnkit.models import TransformerLM
from attnkit.quantize import default_int8_kernel, int8_kernels, quantize

SECTIONS = ("kernels", "quality", "minilm", "memory", "speed")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _target(what: str, measured: float, goal: float, *, at_most: bool = False) -> dict[str, Any]:
    met = measured <= goal if at_most else measured >= goal
    short = (measured / goal - 1) if at_most else (1 - measured / goal)
    return {"what": what, "measured": measured, "target": goal, "met": met, "short": max(0, short)}


def quality_section(args: argparse.Namespace, held_out: str) -> dict[str, Any]:
    folders: list[tuple[str, Path]] = []
    lm_dir = Path(args.lm_dir)
    if not (lm_dir / "training.json").is_file() or args.retrain:
        _say(f"training the byte-level English decoder into {lm_dir} (until convergence)")
        bq.train_text_lm(lm_dir, max_steps=args.max_steps, progress=_say)
    training = json.loads((lm_dir / "training.json").read_text())
    folders.append(("trained byte-level decoder", lm_dir))
    folders += [(str(m), Path(m)) for m in args.model]
    out: dict[str, Any] = {"training": {k: v for k, v in training.items() if k != "history"}}
    out["models"] = {}
    for label, folder in folders:
        _say(f"quality: {label}")
        # The trained decoder is scored at the context it was trained on.
        context = training.get("seq_len", args.context) if folder == lm_dir else args.context
        windows = args.windows * args.context // context
        rows = bq.quality_rows(folder, held_out, context=context, max_windows=windows)
        out["models"][label] = rows
    return out


def print_quality(result: dict[str, Any]) -> list[dict[str, Any]]:
    t = result["training"]
    print(
        f"\ntrained decoder: {t['steps']} steps, converged={t['converged']}, held-out "
        f"{t['held_out_bits_per_byte']:.3f} bits/byte"
    )
    print(f"{'model':<34} {'variant':<14} {'top-1 agree':>11} {'ppl':>9} {'ppl change':>10}")
    targets = []
    for label, rows in result["models"].items():
        for row in rows:
            print(
                f"{label[-34:]:<34} {row['variant']:<14} {row['top1_agreement']:>10.2%} "
                f"{row['perplexity']:>9.4f} {row['perplexity_change']:>+10.2%}"
            )
            if row["variant"] == "int8":
                targets.append(_target(f"{label}: int8 top-1", row["top1_agreement"], 0.97))
                targets.append(
                    _target(f"{label}: int8 ppl", row["perplexity_change"], 0.02, at_most=True)
                )
            if row["variant"] == "int4":
                targets.append(_target(f"{label}: int4 top-1", row["top1_agreement"], 0.90))
    return targets


def minilm_section(held_out: str) -> dict[str, Any]:
    sentences = [s.strip() for s in held_out.replace("\n", " ").split(". ") if len(s) > 40][:64]
    try:
        cosines = bq.minilm_cosines(sentences)
    except (ImportError, FileNotFoundError) as err:
        return {"skipped": f"{type(err).__name__}: {err}"}
    return {"sentences": len(sentences), "lowest_cosine": cosines}


def _random_folder(shape: str, where: Path) -> Path:
    config, _, _ = QUANT_MODELS[shape]
    torch.manual_seed(0)
    TransformerLM(config).save_pretrained(where / shape)
    return where / shape


def memory_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = [(f"random {args.shape}", _random_folder(args.shape, Path(tmp)))]
        folders += [(str(m), Path(m)) for m in args.model]
        usable = int8_kernels(64)
        loads = [("int8", "default"), *(("int8", kernel) for kernel in usable)]
        loads += [("int4", "default"), ("fp32", "default")]
        for label, folder in folders:
            for mode, kernel in loads:
                if kernel != "default" and kernel not in usable:
                    continue
                _say(f"memory: {label} {mode} {kernel}")
                rows.append({"model": label, **bq.load_peak(folder, mode, int8_kernel=kernel)})
    return rows


def print_memory(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    print(
        f"\n{'model':<30} {'mode':<6} {'int8 kernel':<11} {'peak MB':>9} {'resident MB':>11} "
        f"{'model MB':>9} {'peak/model':>10}"
    )
    targets = []
    resident: dict[tuple[str, str], float] = {}
    for r in rows:
        ratio = r["peak_over_model"]
        kernel = ",".join(r["int8_kernels"]) or "-"
        print(
            f"{r['model'][-30:]:<30} {r['mode']:<6} {kernel[:11]:<11} "
            f"{(r['peak_bytes'] or 0) / 1e6:>9.1f} {(r['resident_bytes'] or 0) / 1e6:>11.1f} "
            f"{r['model_bytes'] / 1e6:>9.1f} {ratio if ratio is not None else float('nan'):>10.2f}"
        )
        if r["mode"] == "int8" and r["int8_kernel"] == "default" and ratio is not None:
            targets.append(_target(f"{r['model']}: int8 load peak", ratio, 1.2, at_most=True))
        if r["mode"] == "int8" and r["int8_kernel"] != "default" and r["resident_bytes"]:
            resident[r["model"], r["int8_kernel"]] = r["resident_bytes"]
    for (model, kernel), fb in resident.items():
        if kernel == "fbgemm" and (model, "int8pack") in resident:
            ratio = fb / resident[model, "int8pack"]
            targets.append(_target(f"{model}: fbgemm / int8pack memory", ratio, 1.1, at_most=True))
    return targets


def print_kernels(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'matrix':<10} {'in x out':>11} {'kernel':<42} {'us':>8} {'vs fp32':>7} "
        f"{'GB/s':>6} {'rel err':>8}"
    )
    for r in rows:
        mark = " <- chosen" if r["is_choice"] else ""
        print(
            f"{r['matrix']:<10} {r['shape'][0]:>5}x{r['shape'][1]:<5} {r['kernel']:<42} "
            f"{r['seconds'] * 1e6:>8.1f} {r['vs_fp32']:>7.2f} {r['bytes_per_s'] / 1e9:>6.2f} "
            f"{r['relative_error']:>8.1e}{mark}"
        )


def _extra_variants(model: TransformerLM, args: argparse.Namespace) -> dict[str, Any]:
    """torchao's int8, and int8 with every linear on ``torch._weight_int8pack_mm`` (eager and,
    unless ``--no-compile``, compiled: a single row is then inductor's reduction over the int8
    bytes) and on fbgemm's dynamic linear, beside the default kernel (attnkit's own where it is
    built)."""
    out: dict[str, Any] = dict(bq.torchao_variants(model, compile=not args.no_compile))
    int8pack = quantize(copy.deepcopy(model), "int8", int8_kernel="int8pack")
    out["before: int8pack"] = int8pack
    if not args.no_compile:
        out["before: int8pack compile"] = copy.deepcopy(int8pack)
    if "fbgemm" in int8_kernels(64):
        out["before: fbgemm"] = quantize(copy.deepcopy(model), "int8", int8_kernel="fbgemm")
    return out


def speed_section(args: argparse.Namespace) -> dict[str, Any]:
    result = bq.quantize_rows(
        args.shape,
        repeats=args.repeats,
        compile=not args.no_compile,
        progress=_say,
        extra=lambda m: _extra_variants(m, args),
        only=tuple(args.only) if args.only else None,
    )
    matrices = bq.model_matrices(QUANT_MODELS[args.shape][0]).values()
    result["int8_kernel_choice"] = {f"{i}x{o}": default_int8_kernel(i) for i, o in matrices}
    return result


def print_speed(result: dict[str, Any]) -> list[dict[str, Any]]:
    print(f"\nread bandwidth {result['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print(
        f"{'variant':<28} {'tok/s':>8} {'vs hf fp32':>10} {'vs bf16 c':>10} {'vs int8 c':>10} "
        f"{'of bound':>9}"
    )
    rows = {r["variant"]: r for r in result["rows"]}
    for v, r in rows.items():
        cells = [
            f"{r[k]:>10.2f}" if k in r else f"{'-':>10}"
            for k in ("vs_transformers", "vs_bf16_compile", "vs_int8_compile")
        ]
        bound = f"{r['of_bound']:>9.0%}" if "of_bound" in r else f"{'-':>9}"
        print(f"{v:<28} {r['step_tokens_per_s']:>8.1f} {' '.join(cells)} {bound}")
    print(f"int8 kernel per matrix (in x out, the default): {result['int8_kernel_choice']}")
    for note in result["notes"]:
        print(f"note: {note}")
    targets = []
    best8 = max(
        (r for v, r in rows.items() if v.startswith("int8")),
        key=lambda r: r["step_tokens_per_s"],
        default=None,
    )
    if best8 is not None and "vs_transformers" in best8:
        targets.append(_target("int8 vs transformers fp32", best8["vs_transformers"], 3.0))
    if best8 is not None and "vs_bf16_compile" in best8:
        targets.append(_target("int8 vs attnkit bf16 (compiled)", best8["vs_bf16_compile"], 1.8))
    best4 = max(
        (r for v, r in rows.items() if v.startswith("int4")),
        key=lambda r: r["step_tokens_per_s"],
        default=None,
    )
    if best4 is not None and best8 is not None:
        ratio = best4["step_tokens_per_s"] / best8["step_tokens_per_s"]
        targets.append(_target("int4 vs int8", ratio, 1.5))
    ao = [r for v, r in rows.items() if v.startswith("torchao")]
    if ao and best8 is not None:
        best_ao = max(ao, key=lambda r: r["step_tokens_per_s"])
        ratio = best8["step_tokens_per_s"] / best_ao["step_tokens_per_s"]
        targets.append(_target("attnkit int8 vs torchao int8 (best of each)", ratio, 1.0))
    return targets


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("attnkit.bench.quantization", __doc__)
    parser.add_argument("--model", action="append", default=[], help="a decoder folder")
    parser.add_argument("--lm-dir", default=str(RESULTS / "quantize_lm"))
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--max-steps", type=int, default=2500)
    parser.add_argument(
        "--context", type=int, default=256, help="tokens per scored window (--model folders)"
    )
    parser.add_argument("--windows", type=int, default=32, help="scored windows of --context")
    parser.add_argument("--shape", default="llama-135m", choices=sorted(QUANT_MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--kernel-rounds", type=int, default=5)
    parser.add_argument(
        "--only", action="append", default=[], help="speed: only this variant (repeatable)"
    )
    args = bq.parse_sections(parser, argv, SECTIONS, RESULTS / "quantization.json")
    _, held_out = bq.english_text()
    result: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    if "kernels" not in args.skip:
        config = QUANT_MODELS[args.shape][0]
        matrices = bq.model_matrices(config)
        result["kernels"] = bq.kernel_rows(matrices, rounds=args.kernel_rounds, progress=_say)
        print_kernels(result["kernels"])
    if "quality" not in args.skip:
        result["quality"] = quality_section(args, held_out)
        targets += print_quality(result["quality"])
    if "minilm" not in args.skip:
        result["minilm"] = minilm_section(held_out)
        print(f"\nall-MiniLM-L6-v2: {result['minilm']}")
        for mode, cos in result["minilm"].get("lowest_cosine", {}).items():
            if mode == "int8":
                targets.append(_target("MiniLM int8 lowest cosine", cos, 0.99))
    if "memory" not in args.skip:
        result["memory"] = memory_section(args)
        targets += print_memory(result["memory"])
    if "speed" not in args.skip:
        result["speed"] = speed_section(args)
        targets += print_speed(result["speed"])
    result["targets"] = targets
    print(f"\n{'target':<52} {'measured':>9} {'goal':>6}  status")
    for t in targets:
        status = "met" if t["met"] else f"{t['short']:.0%} short"
        print(f"{t['what'][-52:]:<52} {t['measured']:>9.4f} {t['target']:>6}  {status}")
    return write_report(json.loads(json.dumps(result, default=str)), args.out, "quantization.json")


if __name__ == "__main__":
    main()
