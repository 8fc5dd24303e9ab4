"""Decoding throughput of :class:`attnkit.TransformerLM` with and without the KV cache.

Default setting (issue 3): prompt 512, 128 new tokens, 4 layers, dim 256, 8 query heads,
4 key/value heads, rotary positions, greedy decoding, fp32 on CPU. Both variants run side by side
in one process (the machine is shared; ratios are what matter) and must produce the same tokens.

Usage::

    python benchmarks/bench_decode.py [--prompt 512] [--new 128] [--threads N] [--out PATH]

Prints a table and writes JSON (default ``benchmarks/results/bench_decode.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from attnkit.models import TransformerLM
from attnkit.profiling import time_call


def _time_generate(
    model: TransformerLM, prompt: torch.Tensor, new: int, *, use_cache: bool, repeats: int
) -> tuple[float, torch.Tensor]:
    tokens = [prompt]

    def generate() -> None:
        tokens[0] = model.generate(prompt, new, use_cache=use_cache)

    best = min(time_call(generate, prompt.device) for _ in range(repeats))
    return best, tokens[0]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_decode.json"
    )
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
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
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "speedup": speedup,
        "same_tokens": same,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
