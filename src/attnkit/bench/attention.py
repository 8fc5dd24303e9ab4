"""Causal multi-head self-attention: attnkit vs torch's fused SDPA, nn.MultiheadAttention, textbook.

Times are medians measured side by side in this process (interleaved rounds, so machine noise
hits every implementation alike); peak memory is the growth of the resident high-water mark in a
fresh child process per measurement (:func:`attnkit.profiling.peak_memory`: ``malloc_trim``, then
``/proc/self/clear_refs`` + ``VmHWM``), so allocator caches of one measurement never hide another's
peak.

Usage:
    python -m attnkit.bench.attention                    # N = 1024 .. 8192
    python -m attnkit.bench.attention --seq-lens 512 1024 --repeats 3 --out results.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit
from attnkit.bench.results import bench_parser, write_report
from attnkit.profiling import peak_memory, time_interleaved

DIM, HEADS, BATCH = 512, 8, 1
IMPLS = ("textbook", "torch_mha", "direct_sdpa", "attnkit")


class Textbook(nn.Module):
    """softmax(QK^T/sqrt(E)) V with the L x S score matrix materialized (the blog's math)."""

    def __init__(self) -> None:
        super().__init__()
        self.w_qkv = nn.Linear(DIM, 3 * DIM)
        self.output_map = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.w_qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS)  # (B, H, N, N)
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.output_map((weights @ v).transpose(1, 2).reshape(b, n, DIM))


class DirectSDPA(Textbook):
    """The same layer written directly on torch's fused kernel: the speed bar for attnkit."""

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.w_qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_map(out.transpose(1, 2).reshape(b, n, DIM))


class TorchMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        return self.mha(x, x, x, attn_mask=future, is_causal=True, need_weights=False)[0]


def make(impl: str) -> nn.Module:
    torch.manual_seed(0)
    if impl == "textbook":
        return Textbook()
    if impl == "direct_sdpa":
        return DirectSDPA()
    if impl == "torch_mha":
        return TorchMHA()
    if impl == "attnkit":
        return attnkit.MultiHeadSelfAttention(DIM, DIM, DIM, HEADS, causal=True)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def step_fn(model: nn.Module, x: Tensor, mode: str) -> Callable[[], None]:
    if mode == "forward":

        def run() -> None:
            with torch.no_grad():
                model(x)

        return run

    def run_backward() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    return run_backward


def peak_memory_child(impl: str, n: int, mode: str) -> None:
    """Run once in this (fresh) process and print the peak RSS growth in bytes."""
    model = make(impl)
    x = torch.randn(BATCH, n, DIM, requires_grad=mode != "forward")
    run = step_fn(model, x, mode)
    run()  # warm-up: one-time allocations (thread pools, kernels) are not the op's memory
    print(peak_memory(run))


def measure_peak(impl: str, n: int, mode: str) -> int | None:
    cmd = [sys.executable, "-m", "attnkit.bench.attention", "--child", impl, str(n), mode]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    return int(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None


def time_side_by_side(n: int, mode: str, impls: list[str], repeats: int) -> dict[str, float]:
    x = torch.randn(BATCH, n, DIM, requires_grad=mode != "forward")
    runs = {impl: step_fn(make(impl), x, mode) for impl in impls}
    for run in runs.values():
        run()  # warm-up
    samples = time_interleaved(runs, repeats=repeats)  # noise hits every implementation alike
    return {impl: statistics.median(s) for impl, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("attnkit.bench.attention", __doc__)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--textbook-backward-max",
        type=int,
        default=4096,
        help="skip the textbook forward+backward above this N (its memory is N^2)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    p.add_argument("--out", type=Path, help="default benchmarks/results/attention.json")
    p.add_argument("--child", nargs=3, metavar=("IMPL", "N", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        peak_memory_child(args.child[0], int(args.child[1]), args.child[2])
        return 0

    rows = []
    header = (
        f"{'N':>6} {'mode':<8} {'impl':<12} {'time ms':>9} {'vs direct':>9} "
        f"{'textbook/x':>10} {'peak MiB':>9}"
    )
    print(
        f"causal MHSA, fp32, B={BATCH}, dim {DIM}, {HEADS} heads, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(header)
    print("-" * len(header))
    for n in args.seq_lens:
        for mode in ("forward", "fwd+bwd"):
            impls = [
                i
                for i in IMPLS
                if not (i == "textbook" and mode == "fwd+bwd" and n > args.textbook_backward_max)
            ]
            times = time_side_by_side(n, mode, impls, args.repeats)
            for impl in impls:
                peak = None if args.no_memory else measure_peak(impl, n, mode)
                row = {
                    "N": n,
                    "mode": mode,
                    "impl": impl,
                    "time_s": times[impl],
                    "ratio_vs_direct_sdpa": times[impl] / times["direct_sdpa"],
                    "speedup_vs_textbook": (
                        times["textbook"] / times[impl] if "textbook" in times else None
                    ),
                    "peak_bytes": peak,
                }
                rows.append(row)
                speed = row["speedup_vs_textbook"]
                print(
                    f"{n:>6} {mode:<8} {impl:<12} {times[impl] * 1e3:>9.1f} "
                    f"{row['ratio_vs_direct_sdpa']:>9.2f} "
                    f"{'' if speed is None else f'{speed:.1f}x':>10} "
                    f"{'' if peak is None else f'{peak / 2**20:.0f}':>9}",
                    flush=True,
                )
    write_report({"rows": rows}, args.out, "attention.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
