"""Decoding throughput of :class:`attnkit.TransformerLM` with and without the KV cache.

Default setting: prompt 512, 128 new tokens, 4 layers, dim 256, 8 query heads,
4 key/value heads, rotary positions, greedy decoding, fp32 on CPU. Both variants run side by side
in one process (the machine is shared; ratios are what matter) and must produce the same tokens.

Usage::

    python -m attnkit.bench.decoding [--prompt 512] [--new 128] [--threads N] [--out PATH]
    python -m attnkit.bench.decoding --vs-hf [--model DIR] [--dtype bfloat16]
    python -m attnkit.bench.decoding --rows [--models llama-3m llama-100m] [--no-compile]
    python -m attnkit.bench.decoding --kernels
    python -m attnkit.bench.decoding --batched [--models llama-3m llama-100m] [--no-compile]

Prints a table and writes JSON (default ``benchmarks/results/decode.json``, with ``--vs-hf``
``decode_vs_hf.json``; :func:`attnkit.bench.results.write_report`).

``--vs-hf`` compares attnkit with ``transformers`` (which must be installed) on the same Hugging
Face folder (``--model``, or a random Llama-shaped folder of the sizes above written to a
temporary folder): greedy decoding of ``--new`` tokens after a ``--prompt`` prefill (KV cache on
both sides; the tokens must agree), the prefill forward alone, in interleaved rounds with
medians; and the loading peak memory of each (RSS growth while loading, over the weights' bytes).

``--rows`` prints the decoding rows (:func:`attnkit.bench.decoding.decode_rows`): the
Llama-shaped 3M and 100M models against transformers' ``LlamaForCausalLM`` with copied weights,
eager and ``compile=True``, bf16 weights, the share of the read-bandwidth bound, and each target
with its shortfall (default ``benchmarks/results/decode_rows.json``). ``--kernels`` prints
the single-row product timings behind :mod:`attnkit.decoding`'s weight-layout rule.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from attnkit.bench.peers import import_quietly
from attnkit.bench.results import RESULTS, bench_parser, write_report
from attnkit.models import TransformerLM
from attnkit.profiling import peak_memory, time_call, time_interleaved


def _time_generate(
    model: TransformerLM, prompt: torch.Tensor, new: int, *, use_cache: bool, repeats: int
) -> tuple[float, torch.Tensor]:
    tokens = [prompt]

    def generate() -> None:
        tokens[0] = model.generate(prompt, new, use_cache=use_cache)

    best = min(time_call(generate, prompt.device) for _ in range(repeats))
    return best, tokens[0]


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("attnkit.bench.decoding", __doc__)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="best of N runs per variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice). On a loaded "
        "machine 1 avoids OpenMP barrier stalls that dominate per-token ops",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--vs-hf", action="store_true", help="compare with transformers on the same folder"
    )
    parser.add_argument("--model", type=Path, default=None, help="Hugging Face folder (--vs-hf)")
    parser.add_argument("--hidden", type=int, default=688, help="MLP size of the random folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--rows", action="store_true", help="decoding rows vs transformers")
    parser.add_argument(
        "--models", nargs="+", default=["llama-3m", "llama-100m"], help="models of --rows"
    )
    parser.add_argument("--no-compile", action="store_true", help="--rows without compile=True")
    parser.add_argument("--kernels", action="store_true", help="single-row product kernels")
    parser.add_argument(
        "--batched", action="store_true", help="8 left-padded prompts decoded together (--models)"
    )
    parser.add_argument("--shape", default="llama-135m", help="model of --prefill")
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="time to first token, fp32 and bf16, prompts 256 and 2048 (--shape)",
    )
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.vs_hf:
        return vs_hf(args)
    if args.rows:
        return decode_rows_table(args)
    if args.kernels:
        return kernels(args)
    if args.batched:
        return batched_table(args)
    if args.prefill:
        return prefill_table(args)
    if args.out is None:
        args.out = RESULTS / "decode.json"
    torch.manual_seed(0)
    model = (
        TransformerLM(
            args.vocab,
            args.dim,
            args.layers,
            args.heads,
            num_kv_heads=args.kv_heads,
            max_seq_len=args.prompt + args.new,
            position="rope",
        )
        .to(args.device)
        .eval()
    )
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), device=args.device)
    model.generate(prompt[:, :16], 4)  # warm up kernels and the rotary tables
    model.generate(prompt[:, :16], 4, use_cache=False)

    rows = []
    results = {}
    for name, use_cache in (("uncached", False), ("cached", True)):
        seconds, tokens = _time_generate(
            model, prompt, args.new, use_cache=use_cache, repeats=args.repeats
        )
        results[name] = tokens
        rows.append(
            {"variant": name, "seconds": seconds, "tokens_per_s": args.batch * args.new / seconds}
        )
    same = torch.equal(results["cached"], results["uncached"])
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]

    print(
        f"prompt {args.prompt}, new {args.new}, layers {args.layers}, dim {args.dim}, "
        f"heads {args.heads}/{args.kv_heads} kv, rope, batch {args.batch}, {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'variant':<10} {'seconds':>9} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['variant']:<10} {r['seconds']:>9.3f} {r['tokens_per_s']:>10.1f}")
    print(f"speedup cached/uncached: {speedup:.1f}x   same greedy tokens: {same}")

    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "speedup": speedup,
        "same_tokens": same,
    }
    return write_report(report, args.out, "decode.json")


def _random_llama_folder(args: argparse.Namespace, path: Path) -> None:
    transformers = import_quietly("transformers")
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def vs_hf(args: argparse.Namespace) -> dict[str, Any]:
    """attnkit vs transformers on one folder: decode tokens/s, prefill time, loading memory."""
    from attnkit.interop import hf

    transformers = import_quietly("transformers")

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            folder = Path(tmp) / "llama"
            _random_llama_folder(args, folder)
        files = sorted(folder.glob("*.safetensors"))
        weight_bytes = sum(
            info.nbytes for f in files for info in hf.read_safetensors_header(f).values()
        )

        def load_ours() -> Any:
            return TransformerLM.from_pretrained(folder, dtype=dtype)

        def load_hf() -> Any:
            return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

        load_ours(), load_hf()  # warm up imports and allocator
        # Weights in the checkpoint's dtype; loading into another dtype scales them.
        ckpt_dtype = next(iter(hf.read_safetensors_header(files[0]).values())).dtype
        loaded_bytes = weight_bytes * dtype.itemsize // ckpt_dtype.itemsize
        peaks = {"attnkit": peak_memory(load_ours), "transformers": peak_memory(load_hf)}
        ours, ref = load_ours(), load_hf()
        # Decode exactly --new tokens on both sides: no eos.
        ours.generation_config.pop("eos_token_id", None)
        ref.generation_config.eos_token_id = None
        gen = torch.Generator().manual_seed(0)
        vocab = ours.config.vocab_size
        prompt = torch.randint(0, vocab, (args.batch, args.prompt), generator=gen)
        results: dict[str, torch.Tensor] = {}

        def ours_decode() -> None:
            results["attnkit"] = ours.generate(prompt, args.new)

        def hf_decode() -> None:
            results["transformers"] = ref.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=args.new,
                do_sample=False,
                pad_token_id=0,
            )

        def ours_prefill() -> None:
            with torch.no_grad():
                ours(prompt)

        def hf_prefill() -> None:
            with torch.no_grad():
                ref(input_ids=prompt, use_cache=True)

        fns = {
            "attnkit decode": ours_decode,
            "transformers decode": hf_decode,
            "attnkit prefill": ours_prefill,
            "transformers prefill": hf_prefill,
        }
        for fn in fns.values():
            fn()  # warm up
        samples = time_interleaved(fns, repeats=args.repeats)
    med = {k: statistics.median(v) for k, v in samples.items()}
    same = torch.equal(results["attnkit"], results["transformers"])
    rows = []
    for lib in ("attnkit", "transformers"):
        decode_s = max(med[f"{lib} decode"] - med[f"{lib} prefill"], 1e-9)
        peak = peaks[lib]
        rows.append(
            {
                "library": lib,
                "prefill_s": med[f"{lib} prefill"],
                "generate_s": med[f"{lib} decode"],
                "decode_tokens_per_s": args.batch * args.new / decode_s,
                "load_peak_bytes": peak,
                "load_peak_over_weights": None if peak is None else peak / loaded_bytes,
            }
        )
    ratios = {
        "decode_tokens_per_s attnkit/transformers": rows[0]["decode_tokens_per_s"]
        / rows[1]["decode_tokens_per_s"],
        "prefill_s attnkit/transformers": rows[0]["prefill_s"] / rows[1]["prefill_s"],
    }
    print(
        f"{folder if args.model else 'random Llama'}: prompt {args.prompt}, new {args.new}, "
        f"batch {args.batch}, {args.dtype}, {torch.get_num_threads()} threads, "
        f"medians of {args.repeats} interleaved rounds; weights {loaded_bytes / 2**20:.1f} MiB"
    )
    print(f"{'library':<13} {'prefill s':>10} {'decode tok/s':>13} {'load peak/weights':>18}")
    for r in rows:
        ratio = r["load_peak_over_weights"]
        print(
            f"{r['library']:<13} {r['prefill_s']:>10.4f} {r['decode_tokens_per_s']:>13.1f} "
            f"{'n/a' if ratio is None else f'{ratio:.2f}x':>18}"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    print(f"same greedy tokens: {same}")
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "weight_bytes": loaded_bytes,
        "rows": rows,
        "ratios": ratios,
        "same_tokens": same,
    }
    return write_report(report, args.out, "decode_vs_hf.json")


_MEDIANS = "medians of interleaved runs"


def _cell(row: dict[str, Any], key: str, spec: str, *, scale: float = 1.0) -> str:
    """``row[key]`` (times ``scale``) formatted by ``spec`` for a table, or ``"-"`` where the row
    has no such entry."""
    return format(scale * row[key], spec) if key in row else "-"


def decode_rows_table(args: argparse.Namespace) -> dict[str, Any]:
    """``--rows``: the decoding rows and targets, printed and written as JSON."""
    from attnkit.bench.decoding.rows import decode_rows

    report = decode_rows(
        tuple(args.models),
        repeats=max(args.repeats, 3),
        compile=not args.no_compile,
        progress=lambda msg: print(f"  {msg}", flush=True),
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {_MEDIANS}")
    head = (
        f"{'model':<11} {'variant':<21} {'tok/s':>7} {'step tok/s':>10} {'x hf':>6} {'of bound':>8}"
    )
    print(head)
    for r in report["rows"]:
        bound = _cell(r, "of_fp32_bound", ".0%")
        vs = _cell(r, "vs_transformers", ".2f")
        print(
            f"{r['model']:<11} {r['variant']:<21} {r['tokens_per_s']:>7.1f} "
            f"{r['step_tokens_per_s']:>10.1f} {vs:>6} {bound:>8}"
        )
    for t in report["targets"]:
        verdict = "met" if t["met"] else f"MISSED by {t['shortfall']:.0%}"
        print(f"target {t['model']} {t['what']}: {t['measured']:.2f} (>= {t['target']}) {verdict}")
    return write_report(report, args.out, "decode_rows.json")


def batched_table(args: argparse.Namespace) -> dict[str, Any]:
    """``--batched``: 8 left-padded prompts of mixed lengths decoded together, vs transformers."""
    from attnkit.bench.decoding.batched import batched_rows

    reports = [
        batched_rows(
            name,
            batch=args.batch if args.batch > 1 else 8,
            new=64,
            repeats=max(args.repeats, 3),
            compile=not args.no_compile,
            progress=lambda msg: print(f"  {msg}", flush=True),
        )
        for name in args.models
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {_MEDIANS}")
    print(
        f"{'model':<11} {'variant':<16} {'batch':>5} {'tok/s':>8} {'x hf':>6} {'same':>5}  target"
    )
    for report in reports:
        for r in report["rows"]:
            vs = _cell(r, "vs_transformers", ".2f")
            verdict = ""
            if "met" in r:
                short = max(0.0, 1 - r["vs_transformers"] / r["target"])
                verdict = "met" if r["met"] else f"MISSED by {short:.0%}"
            print(
                f"{r['model']:<11} {r['variant']:<16} {r['batch']:>5} {r['tokens_per_s']:>8.1f} "
                f"{vs:>6} {r['same_tokens_as_transformers']!s:>5} {verdict}"
            )
        for note in report["notes"]:
            print(f"note: {note}")
    return write_report({"reports": reports}, args.out, "decode_batched.json")


def prefill_table(args: argparse.Namespace) -> dict[str, Any]:
    """``--prefill``: time to first token against transformers, per dtype and prompt length."""
    from attnkit.bench.decoding.prefill import prefill_rows

    result = prefill_rows(
        args.shape,
        repeats=max(args.repeats, 5),
        progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
    )
    print(
        f"{args.shape}: time to first token, medians of {max(args.repeats, 5)} interleaved "
        f"rounds, {result['threads']} threads"
    )
    print(f"{'dtype':<9} {'prompt':>6} {'attnkit ms':>11} {'hf ms':>8} {'x hf':>6} {'x fp32':>7}")
    for r in result["rows"]:
        hf_ms = _cell(r, "transformers_s", ".0f", scale=1e3)
        vs = _cell(r, "vs_transformers", ".2f")
        print(
            f"{r['dtype']:<9} {r['prompt']:>6} {1e3 * r['attnkit_s']:>11.0f} {hf_ms:>8} "
            f"{vs:>6} {r.get('vs_fp32', 1.0):>7.2f}"
        )
    return write_report(result, args.out, "decode_prefill.json")


def kernels(args: argparse.Namespace) -> dict[str, Any]:
    """``--kernels``: single-row products through a 100M model's weights, per kernel/layout."""
    from attnkit.bench.decoding.layouts import layout_table

    table = layout_table(repeats=max(args.repeats, 7))
    print(f"{'kernel':<24} {'ms':>8} {'GB/s':>6} {'x F.linear':>10}")
    for r in table:
        print(
            f"{r['kernel']:<24} {r['seconds'] * 1e3:>8.1f} {r['bytes_per_s'] / 1e9:>6.1f} "
            f"{r['vs_f32_linear']:>10.2f}"
        )
    return write_report({"rows": table}, args.out, "decode_kernels.json")


if __name__ == "__main__":
    main()
