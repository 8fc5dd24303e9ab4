"""``attnkit bench``: attnkit's block-sparse attention against torch SDPA and the textbook math.

Cases (all self-attention, ``L == S == N``):

* ``causal``: causal only;
* ``padding``: every batch row has ``N // 2`` real keys (encoder-style key padding);
* ``window``: causal sliding window of ``--window`` keys;
* ``documents``: causal attention inside packed documents of about ``--doc-len`` tokens.

Each case runs three implementations side by side in one process: ``block_sparse``
(:func:`attnkit.functional.block_sparse_attention`), ``torch_sdpa`` (torch's fused kernel given the
equivalent dense bool mask) and ``textbook`` (materialized ``softmax(QK^T * scale + mask) V``,
skipped above ``--textbook-max``). Times are medians of ``--repeats`` interleaved runs, for the
forward and for forward+backward. Peak memory is the extra resident memory during one call: on
CPU the kernel's high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs`` and the
resident size before the call is subtracted (memory the allocator keeps cached from earlier calls
is not counted again, so CPU numbers are lower bounds); on CUDA ``torch.cuda.max_memory_allocated``.

With ``--device cuda`` (bf16, N up to 32k by default) the table also shows the achieved TFLOP/s
counting useful FLOPs only (``4 * E`` per allowed (query, key) pair forward, 2.5x that backward)
and the ratio to a measured bf16 matmul rate. Without CUDA it says so and exits with 0.

``--flex`` adds torch's compiled FlexAttention (forward only: torch 2.13 has no FlexAttention
backward on CPU); its first call, which compiles, is reported separately.

Sizes: the default run (N = 1024 and 4096, textbook up to 2048) shows a progress bar (tqdm, on
stderr) and needs about 110 s of CPU time, about a minute on an idle 2-core CPU (3.6 min on the
shared one it was measured on); ``--full`` adds N = 8192 and the textbook up to 4096 (several
minutes). ``--vs`` instead prints one table of attnkit against what a user would
pick instead (dense-mask SDPA, compiled FlexAttention, sentence-transformers), see
:mod:`attnkit.commands.bench_vs`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CASES = ("causal", "padding", "window", "documents")
IMPLS = ("block_sparse", "torch_sdpa", "textbook")
DTYPES = ("float32", "bfloat16", "float16")


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


def run(args: argparse.Namespace) -> int:
    """Run the suite, print a table and optionally write JSON."""
    import torch

    cuda = str(args.device).startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("attnkit bench: CUDA is not available on this machine; skipping the GPU benchmark.")
        if args.out is not None:
            _write(args.out, {"skipped": "CUDA not available", "device": args.device})
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
    for name, value in (
        ("heads", heads),
        ("head-dim", head_dim),
        ("window", window),
        ("doc-len", doc_len),
        ("repeats", repeats),
        ("batch", args.batch),
    ):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if any(n < 1 for n in seq_lens):
        raise ValueError(f"--seq-len values must be >= 1, got {seq_lens}")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    device = torch.device(args.device)

    config = {
        "seq_lens": seq_lens,
        "batch": args.batch,
        "heads": heads,
        "head_dim": head_dim,
        "window": window,
        "doc_len": doc_len,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "repeats": repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": args.cases,
    }
    from attnkit.profiling import matmul_flops_per_second

    results: list[dict[str, Any]] = []
    matmul = matmul_flops_per_second(dtype, device) / 1e12
    modes = ["fwd"] if args.no_backward else ["fwd", "fwd+bwd"]
    textbook_max = args.textbook_max or (4096 if args.full else 2048)
    points = [(n, case, mode) for n in seq_lens for case in args.cases for mode in modes]
    for n, case, mode in _progress(points, enabled=not args.quick):
        kw = _case_kwargs(case, n, batch=args.batch, window=window, doc_len=doc_len, device=device)
        results += _bench_point(
            case,
            mode,
            n,
            kw,
            batch=args.batch,
            heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            repeats=repeats,
            textbook=n <= textbook_max,
            flex=args.flex and mode == "fwd",
            matmul=matmul,
        )
    report = {"config": config, "matmul_tflops": matmul, "results": results}
    print(format_table(report))
    if args.out is not None:
        _write(args.out, report)
        print(f"wrote {args.out}")
    return 0


def _run_vs(args: argparse.Namespace) -> int:
    """``--vs``: the table of attnkit against the alternatives, optionally as JSON."""
    from attnkit.commands import bench_vs

    if args.quick:
        config = bench_vs.VsConfig.quick(flex=args.flex)
    else:
        seq_len = args.seq_len[0] if args.seq_len else 8192
        job = bench_vs.AttentionJob(
            seq_len=seq_len, window=args.window, heads=args.heads, head_dim=args.head_dim
        )
        config = bench_vs.VsConfig(job, repeats=args.repeats, flex=True)
    rows = bench_vs.run_vs(config, progress=not args.quick)
    print(bench_vs.format_vs_table(rows, config))
    if args.out is not None:
        _write(args.out, bench_vs.rows_as_json(rows, config))
        print(f"wrote {args.out}")
    return 0


def _progress(points: list[tuple[int, str, str]], *, enabled: bool) -> Iterable[Any]:
    """The points wrapped in a tqdm progress bar on stderr (plain iteration without tqdm)."""
    if not enabled:
        return points
    try:
        from tqdm import tqdm
    except ImportError:
        print(
            f"attnkit bench: {len(points)} points (install tqdm for a progress bar)",
            file=sys.stderr,
        )
        return points
    return tqdm(points, desc="attnkit bench", file=sys.stderr, unit="point")


def format_table(report: dict[str, Any]) -> str:
    """Plain-text table of a report: one row per (N, case, mode), one column group per impl."""
    c = report["config"]
    head = (
        f"attnkit bench  device={c['device']} dtype={c['dtype']} B={c['batch']} H={c['heads']} "
        f"E={c['head_dim']} W={c['window']} doc~{c['doc_len']} threads={c['threads']} "
        f"median of {c['repeats']}  (x = torch_sdpa time / impl time)"
    )
    if report.get("matmul_tflops"):
        head += f"\nmeasured {c['dtype']} matmul: {report['matmul_tflops']:.2f} TFLOP/s"
    rows: dict[tuple[int, str, str], dict[str, dict[str, Any]]] = {}
    for r in report["results"]:
        rows.setdefault((r["seq_len"], r["case"], r["mode"]), {})[r["impl"]] = r
    impls = [i for i in (*IMPLS, "flex") if any(i in v for v in rows.values())]
    cols = ["N", "case", "mode", "density"] + [f"{i} ms (x) MiB" for i in impls]
    lines = [head, "  ".join(f"{x:>24}" if "ms" in x else f"{x:>9}" for x in cols)]
    for (n, case, mode), by_impl in rows.items():
        any_r = next(iter(by_impl.values()))
        cells = [f"{n:>9}", f"{case:>9}", f"{mode:>9}", f"{any_r['density']:>9.3f}"]
        for impl in impls:
            r = by_impl.get(impl)
            if r is None or r.get("time_s") is None:
                cells.append(f"{'-':>24}")
                continue
            ratio = r.get("speedup_vs_sdpa")
            mem = r.get("peak_mem_bytes")
            text = (
                f"{r['time_s'] * 1e3:.1f} ({ratio:.2f}x)" if ratio else f"{r['time_s'] * 1e3:.1f}"
            )
            text += f" {mem / 2**20:.0f}" if mem is not None else " ?"
            if r.get("tflops") is not None:
                text += f" {r['tflops']:.1f}TF"
            cells.append(f"{text:>24}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the suite


def _case_kwargs(
    case: str, n: int, *, batch: int, window: int, doc_len: int, device: torch.device
) -> dict[str, Any]:
    """Structural arguments of a case (as passed to ``block_sparse_attention``)."""
    import torch

    if case == "causal":
        return {"causal": True}
    if case == "padding":
        return {"key_lengths": torch.full((batch,), max(1, n // 2), device=device)}
    if case == "window":
        return {"causal": True, "window": window}
    if case == "documents":
        gen = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(batch):
            lengths, total = [], 0
            while total < n:
                d = int(
                    torch.randint(max(1, doc_len // 2), doc_len * 3 // 2 + 1, (), generator=gen)
                )
                lengths.append(min(d, n - total))
                total += lengths[-1]
            rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
        return {"causal": True, "segment_ids": torch.stack(rows).to(device)}
    raise ValueError(f"unknown case {case!r}, expected one of {CASES}")


def _bench_point(
    case: str,
    mode: str,
    n: int,
    kw: dict[str, Any],
    *,
    batch: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    textbook: bool,
    flex: bool,
    matmul: float | None,
) -> list[dict[str, Any]]:
    """Time and measure every implementation on one (case, mode, N) point."""
    import torch
    import torch.nn.functional as F

    from attnkit.functional import block_sparse_attention
    from attnkit.profiling import peak_memory, time_interleaved
    from attnkit.sparse import structured_mask

    gen = torch.Generator().manual_seed(n)
    shape = (batch, heads, n, head_dim)
    backward = mode == "fwd+bwd"
    q, k, v = (
        torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(backward)
        for _ in range(3)
    )
    mask = structured_mask(n, n, device=device, **kw)  # (B or 1, 1, N, N)
    pairs = int(mask.sum()) * (batch if mask.shape[0] == 1 else 1) * heads
    density = pairs / (batch * heads * n * n)
    scale = 1.0 / math.sqrt(head_dim)

    def textbook_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, N)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "block_sparse": lambda: block_sparse_attention(q, k, v, scale=scale, **kw),
        "torch_sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
    }
    if textbook:
        fns["textbook"] = lambda: textbook_attn(q, k, v)
    flex_first = None
    if flex:
        fn, flex_first = _flex_fn(q, k, v, kw, scale)
        if fn is not None:
            fns["flex"] = fn

    def step(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
            for t in (q, k, v):
                t.grad = None
        return out

    # Correctness check and warm-up, then interleaved timing, then memory (one call each).
    with torch.set_grad_enabled(backward):
        ref = step(fns["torch_sdpa"]).detach().float()
        errs = {
            name: float((step(fn).detach().float() - ref).abs().max()) for name, fn in fns.items()
        }
        steps = {name: functools.partial(step, fn) for name, fn in fns.items()}
        times = time_interleaved(steps, repeats=repeats, device=device)
        mems = {name: peak_memory(fn, device) for name, fn in steps.items()}

    print(
        f"  N={n} {case} {mode}: "
        + ", ".join(f"{k} {statistics.median(t) * 1e3:.1f} ms" for k, t in times.items()),
        file=sys.stderr,
    )
    flops = 4 * head_dim * pairs * (3.5 if backward else 1.0)
    sdpa_t = statistics.median(times["torch_sdpa"])
    out = []
    for name in fns:
        t = statistics.median(times[name])
        tflops = flops / t / 1e12 if device.type == "cuda" else None
        out.append(
            {
                "case": case,
                "mode": mode,
                "seq_len": n,
                "impl": name,
                "time_s": t,
                "times_s": times[name],
                "speedup_vs_sdpa": sdpa_t / t,
                "peak_mem_bytes": mems[name],
                "density": density,
                "useful_flops": flops,
                "tflops": tflops,
                "fraction_of_matmul": tflops / matmul if tflops and matmul else None,
                "max_abs_err_vs_sdpa": errs[name],
                **({"first_call_s": flex_first} if name == "flex" else {}),
            }
        )
    return out


def _flex_fn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, Any], scale: float
) -> tuple[Callable[[], torch.Tensor] | None, float | None]:
    """Compiled FlexAttention for a case and the seconds its first (compiling) call took."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnkit.profiling import time_call

    n = q.shape[-2]
    causal, window = kw.get("causal", False), kw.get("window")
    seg, lengths = kw.get("segment_ids"), kw.get("key_lengths")

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        ok = j >= 0
        if causal:
            ok = ok & (j <= i)
        if window is not None:
            ok = ok & (i - j < window) & (j - i < window)
        if lengths is not None:
            ok = ok & (j < lengths[b])
        if seg is not None:
            ok = ok & (seg[b, i] == seg[b, j])
        return ok

    try:
        block_mask = create_block_mask(mask_mod, q.shape[0], None, n, n, device=str(q.device))
        compiled = torch.compile(flex_attention)
        with torch.no_grad():
            first = time_call(
                lambda: compiled(q, k, v, block_mask=block_mask, scale=scale), q.device
            )
    except Exception as err:  # compilation needs a C++ toolchain; report and go on
        print(f"attnkit bench: FlexAttention unavailable: {err}", file=sys.stderr)
        return None, None
    return (lambda: compiled(q, k, v, block_mask=block_mask, scale=scale)), first


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
