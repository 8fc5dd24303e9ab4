"""``attnkit bench``: attnkit's block-sparse attention against torch SDPA and the textbook math.

The command line of :mod:`attnkit.bench`: the default run is the suite of
:mod:`attnkit.bench.suite` (cases ``causal``, ``padding``, ``window``, ``documents``; N = 1024
and 4096, the textbook up to 2048, a progress bar on stderr);
``--full`` adds N = 8192 and the textbook up to 4096 (several minutes). With ``--device cuda``
(bf16, N up to 32k by default) the table also shows the achieved TFLOP/s; without CUDA it says so
and exits with 0. ``--flex`` adds torch's compiled FlexAttention (forward only). ``--vs`` instead
prints one table of attnkit against what a user would pick instead (dense-mask SDPA, compiled
FlexAttention, sentence-transformers, transformers' decoding), see :mod:`attnkit.bench.vs`.
``attnkit bench serve --url URL --model M --concurrency N --requests R`` loads an
OpenAI-compatible server instead (:mod:`attnkit.bench.serve`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.bench import serve as bench_serve
from attnkit.bench.suite import CASES, DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser``."""
    parser.add_argument(
        "--seq-len",
        type=int,
        nargs="+",
        metavar="N",
        help="sequence lengths (default 1024 4096, --full 1024 4096 8192, --vs 8192; "
        "cuda: 4096 8192 16384 32768)",
    )
    parser.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim E (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    parser.add_argument("--window", type=int, default=256, help="sliding window W (default 256)")
    parser.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--dtype", choices=DTYPES, help="default float32 (cuda: bfloat16)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    parser.add_argument(
        "--textbook-max",
        type=int,
        metavar="N",
        help="skip the textbook implementation above this N (it materializes B*H*N*N scores; "
        "default 2048, --full 4096)",
    )
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--flex", action="store_true", help="add compiled FlexAttention (fwd)")
    parser.add_argument(
        "--out", "--json", type=Path, metavar="FILE.json", help="write results as JSON"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    parser.add_argument("--full", action="store_true", help="the whole sweep (several minutes)")
    parser.add_argument(
        "--vs",
        action="store_true",
        help="one table of attnkit against the alternatives (dense-mask SDPA, compiled "
        "FlexAttention, sentence-transformers), side by side",
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="serve")
    serve_help = "load an OpenAI-compatible server: throughput, time to first token, latencies"
    serve = sub.add_parser("serve", help=serve_help, description=serve_help)
    bench_serve.add_arguments(serve)


def run(args: argparse.Namespace) -> int:
    """Run the suite (or ``--vs``, or ``serve``), print a table and optionally write JSON."""
    if getattr(args, "bench_command", None) == "serve":
        return bench_serve.run_from_args(args)
    import torch

    from attnkit.bench import suite
    from attnkit.bench.results import write_json

    cuda = str(args.device).startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("attnkit bench: CUDA is not available on this machine; skipping the GPU benchmark.")
        if args.out is not None:
            write_json(args.out, {"skipped": "CUDA not available", "device": args.device})
        return 0
    if args.vs:
        return _run_vs(args)
    if args.quick:
        seq_lens, heads, head_dim, window, doc_len = [256], 2, 16, 32, 64
        repeats = min(args.repeats, 2)
    else:
        cpu_lens = [1024, 4096, 8192] if args.full else [1024, 4096]
        seq_lens = args.seq_len or ([4096, 8192, 16384, 32768] if cuda else cpu_lens)
        heads, head_dim, window, doc_len = args.heads, args.head_dim, args.window, args.doc_len
        repeats = args.repeats
    config = suite.SuiteConfig(
        seq_lens=tuple(seq_lens),
        cases=tuple(args.cases),
        batch=args.batch,
        heads=heads,
        head_dim=head_dim,
        window=window,
        doc_len=doc_len,
        dtype=args.dtype or ("bfloat16" if cuda else "float32"),
        device=args.device,
        repeats=repeats,
        textbook_max=args.textbook_max or (4096 if args.full else 2048),
        backward=not args.no_backward,
        flex=args.flex,
        progress=not args.quick,
    )
    report = suite.run_suite(config)
    print(suite.format_table(report))
    if args.out is not None:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


def _run_vs(args: argparse.Namespace) -> int:
    """``--vs``: the table of attnkit against the alternatives, optionally as JSON."""
    from attnkit.bench import vs
    from attnkit.bench.results import write_json

    if args.quick:
        config = vs.VsConfig.quick(flex=args.flex)
    else:
        seq_len = args.seq_len[0] if args.seq_len else 8192
        job = vs.AttentionJob(
            seq_len=seq_len, window=args.window, heads=args.heads, head_dim=args.head_dim
        )
        config = vs.VsConfig(job, repeats=args.repeats, flex=True)
    rows = vs.run_vs(config, progress=not args.quick)
    print(vs.format_vs_table(rows, config))
    if args.out is not None:
        write_json(args.out, vs.rows_as_json(rows, config))
        print(f"wrote {args.out}")
    return 0
