"""Structured attention: attnkit's blockwise kernel against dense-mask SDPA and FlexAttention.

Usage::

    python -m attnkit.bench.structured [--n 8192] [--window 256] [--docs 8] [--repeats 5]
        [--rows 32,64,128] [--flex] [--variants] [--bf16] [--json FILE]
        [--modes fwd,fwd+bwd] [--cases window,documents] [--memory 8192,32768] [--threads N]
        [--copies]
    python -m attnkit.bench.structured --crossover [--repeats 5] [--json FILE]

Every implementation runs in one process, interleaved round by round; the table reports the
median time and the ratio to dense-mask SDPA (``x dense``, higher is faster), the ratio of the
default blockwise tile height to FlexAttention when ``--flex`` is given, and the largest
difference from dense-mask SDPA (values, and with fwd+bwd the gradients). ``--variants`` also
times the alternative design the module docstring of ``attnkit.blockwise`` argues against:
each window tile as two pieces (an unmasked causal diagonal and a masked previous block)
merged by log-sum-exp.

``--bf16`` instead compares bfloat16 with float32: the speed-up of attnkit's window and
documents paths (forward, forward+backward) next to that of torch's own causal SDPA measured in
the same run (the ratio of ratios holds on CPUs with and without native bf16), and the error
against float64 of attnkit's bf16 output and gradients next to torch's fused kernel's (at
``--error-n`` positions, where the float64 reference fits in memory).

``--crossover`` instead times block-sparse against dense-mask SDPA over short lengths and
several window densities: where the block-sparse path starts to win (the measurement behind the
dispatch between them).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.bench.results import parse_with_threads, write_report
from attnkit.functional import block_sparse_attention
from attnkit.kernels.tuning import choose
from attnkit.sparse import structured_mask

Fn = Callable[[Tensor, Tensor, Tensor], Tensor]
#: The policy's choices a bf16 structured call follows (recorded in the --bf16 report).
_BF16_CHOICES = (
    "attention.bf16_structured",
    "attention.bf16_causal",
    "attention.bf16_backward",
    "attention.flash_bf16_products",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m attnkit.bench.structured",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--n", type=int, default=8192, help="sequence length")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64, help="head dim E")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--docs", type=int, default=8, help="documents packed in the sequence")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--rows", default="auto", help="comma-separated blockwise tile heights (auto: default)"
    )
    p.add_argument("--flex", action="store_true", help="also time compiled FlexAttention")
    p.add_argument("--variants", action="store_true", help="also time the two-piece LSE design")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--cases", default="window,documents")
    p.add_argument("--bf16", action="store_true", help="bf16 vs fp32 speed-up and error")
    p.add_argument(
        "--copies", action="store_true", help="with --bf16: also attnkit on float32 copies"
    )
    p.add_argument("--error-n", type=int, default=2048, help="length of the --bf16 error check")
    p.add_argument(
        "--memory",
        default=None,
        metavar="N,N",
        help="instead: peak memory of blockwise fwd+bwd at these lengths (documents of N/--docs"
        " at --n, so of equal length at every N)",
    )
    p.add_argument(
        "--crossover", action="store_true", help="instead: where block-sparse beats dense SDPA"
    )
    p.add_argument("--json", type=Path, help="write the rows here")
    a = parse_with_threads(p, argv)
    if a.crossover:
        _write(a.json, "structured_crossover.json", crossover(a.repeats))
        return 0
    if a.memory:
        _write(a.json, "structured_memory.json", _memory(a, [int(n) for n in a.memory.split(",")]))
        return 0
    rows = [None if r == "auto" else int(r) for r in a.rows.split(",")]
    results: list[dict[str, Any]] = []
    if a.bf16:
        rows_bf16 = _bf16(a)
        config = {"n": a.n, "heads": a.heads, "head_dim": a.dim, "window": a.window,
                  "documents": a.docs, "repeats": a.repeats, "error_n": a.error_n,
                  "kernels": {name: choose(name) for name in _BF16_CHOICES}}  # fmt: skip
        write_report({"config": config, "rows": rows_bf16}, a.json, "structured_bf16.json")
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, N={a.n}, "
          f"H={a.heads}, E={a.dim}; median of {a.repeats} interleaved rounds")  # fmt: skip
    for case in a.cases.split(","):
        fns, compile_s = _implementations(case, a, rows)
        for mode in a.modes.split(","):
            results += _time_case(case, mode, fns, a, compile_s, default=_name(rows[0]))
    _write(a.json, "structured.json", results)
    return 0


def _write(path: Path | None, name: str, rows: list[dict[str, Any]]) -> None:
    write_report({"rows": rows}, path, name)


def crossover(repeats: int = 5) -> list[dict[str, float]]:
    """Time ratio dense-mask SDPA / block-sparse over N and window density; prints a table."""
    rows = []
    print(f"{'N':>6} {'W':>6} {'density':>8} {'fwd x':>7} {'fwd+bwd x':>10}  (x > 1: sparse wins)")
    for n in (256, 512, 1024, 2048, 4096):
        for frac in (1 / 16, 1 / 4, 1 / 2, 3 / 4):
            row = _crossover_point(n, max(1, int(frac * n)), repeats)
            rows.append(row)
            print(
                f"{n:>6} {row['window']:>6} {row['density']:>8.3f} {row['fwd']:>7.2f} "
                f"{row['fwd+bwd']:>10.2f}"
            )
    return rows


def _crossover_point(n: int, w: int, repeats: int) -> dict[str, float]:
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
    mask = structured_mask(n, n, causal=True, window=w)
    fns = {
        "sparse": lambda: block_sparse_attention(q, k, v, causal=True, window=w),
        "dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    }
    row = {"seq_len": n, "window": w, "density": float(mask.float().mean())}
    for mode in ("fwd", "fwd+bwd"):
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeats + 1):  # the first round warms up
            for name, fn in fns.items():
                start = time.perf_counter()
                with torch.set_grad_enabled(mode == "fwd+bwd"):
                    o = fn()
                    if mode == "fwd+bwd":
                        o.sum().backward()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t[1:]) for name, t in times.items()}
        row[mode] = med["dense"] / med["sparse"]
    return row


def _name(rows: int | None) -> str:
    return "blockwise" if rows is None else f"blockwise/{rows}"


def _structure(case: str, a: argparse.Namespace) -> dict[str, Any]:
    if case == "window":
        return {"causal": True, "window": a.window}
    doc = torch.arange(a.n) // (a.n // a.docs)
    return {"causal": True, "segment_ids": doc.view(1, a.n)}


def _implementations(
    case: str, a: argparse.Namespace, rows: list[int | None]
) -> tuple[dict[str, Fn], float | None]:
    kw = _structure(case, a)
    mask = structured_mask(a.n, a.n, **kw)  # (1, 1, N, N)
    fns: dict[str, Fn] = {}
    for r in rows:
        fns[_name(r)] = functools.partial(_blockwise, block_size=r, kw=kw)
    fns["dense-mask SDPA"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if a.variants and case == "window":
        fns["two pieces + LSE"] = lambda q, k, v: _two_pieces(q, k, v, a.window)
    compile_s = None
    if a.flex:
        flex, compile_s = _flex(case, a, kw)
        if flex is not None:
            fns["FlexAttention (compiled)"] = flex
    return fns, compile_s


def _flex(case: str, a: argparse.Namespace, kw: dict[str, Any]) -> tuple[Fn | None, float | None]:
    """Compiled FlexAttention with the same mask, and its first-call (compile) time."""
    from attnkit.bench.flex import flex_or_reason

    q = torch.randn(1, a.heads, a.n, a.dim)
    flex, compile_s, why = flex_or_reason(q, q, **kw)
    if flex is None:
        print(why)
        return None, None
    print(f"FlexAttention: first call (compile + block mask) {compile_s:.1f} s")
    return flex, compile_s


def _time_case(
    case: str,
    mode: str,
    fns: dict[str, Fn],
    a: argparse.Namespace,
    compile_s: float | None,
    default: str,
) -> list[dict[str, Any]]:
    backward = mode == "fwd+bwd"
    if backward:  # FlexAttention has no CPU backward in torch 2.13
        fns = {n: f for n, f in fns.items() if not n.startswith("FlexAttention")}
    gen = torch.Generator().manual_seed(0)
    shape = (1, a.n, a.heads, a.dim)  # projections give (B, L, H, E) memory
    q, k, v = (
        torch.randn(shape, generator=gen).transpose(1, 2).requires_grad_(backward) for _ in range(3)
    )
    grad = torch.randn(1, a.heads, a.n, a.dim, generator=gen)

    def run(fn: Fn) -> tuple[Tensor, ...]:
        with torch.set_grad_enabled(backward):
            out = fn(q, k, v)
            if not backward:
                return (out,)
            return (out, *torch.autograd.grad(out, (q, k, v), grad))

    reference = run(fns["dense-mask SDPA"])
    errors = {n: max((x - y).abs().max().item() for x, y in zip(run(f), reference, strict=True))
              for n, f in fns.items()}  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(a.repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            run(fn)
            times[name].append(time.perf_counter() - start)
    med = {n: statistics.median(t) for n, t in times.items()}
    dense = med["dense-mask SDPA"]
    flex = med.get("FlexAttention (compiled)")
    print(f"\n{case} {mode}")
    print(f"{'implementation':<26} {'median ms':>10} {'x dense':>8} {'max err':>9}")
    rows = []
    for name in fns:
        print(f"{name:<26} {med[name] * 1e3:>10.1f} {dense / med[name]:>8.2f} {errors[name]:>9.1e}")
        row = {"case": case, "mode": mode, "impl": name, "median_s": med[name],
               "x_dense": dense / med[name], "max_err": errors[name]}  # fmt: skip
        if name.startswith("FlexAttention"):
            row["compile_s"] = compile_s
        rows.append(row)
    if flex is not None:
        print(f"{default} vs FlexAttention (compiled): {flex / med[default]:.2f}x")
    return rows


def _memory(a: argparse.Namespace, lengths: list[int]) -> list[dict[str, Any]]:
    """Extra peak memory of one blockwise forward+backward (``VmHWM``) per case and length."""
    from attnkit.profiling import peak_memory

    doc_len = a.n // a.docs
    print(f"peak memory of one blockwise fwd+bwd, fp32, H={a.heads}, E={a.dim}, W={a.window}, "
          f"documents of {doc_len}; inputs (q, k, v, grad) not counted")  # fmt: skip
    print(f"{'case':<10} {'N':>6} {'peak MiB':>9} {'inputs MiB':>11} {'peak/input':>11}")
    rows = []
    for case in ("window", "documents"):
        for n in lengths:
            kw: dict[str, Any] = {"causal": True, "window": a.window}
            if case == "documents":
                kw = {"causal": True, "segment_ids": (torch.arange(n) // doc_len).view(1, n)}
            q, k, v = (
                torch.randn(1, n, a.heads, a.dim).transpose(1, 2).requires_grad_() for _ in range(3)
            )
            grad = torch.randn(1, a.heads, n, a.dim)

            def step() -> None:
                out = block_sparse_attention(q, k, v, **kw)  # noqa: B023
                torch.autograd.grad(out, (q, k, v), grad)  # noqa: B023

            step()  # warm-up: one-time allocations are not counted
            peak = peak_memory(step) or 0
            one = q.numel() * q.element_size()
            print(f"{case:<10} {n:>6} {peak / 2**20:>9.1f} {one / 2**20:>11.1f} "
                  f"{peak / one:>11.2f}")  # fmt: skip
            rows.append({"case": case, "n": n, "peak_bytes": peak, "input_bytes": one})
    return rows


def _bf16(a: argparse.Namespace) -> list[dict[str, Any]]:
    """bf16/fp32 speed-ups of attnkit and of torch's causal SDPA, and bf16 errors vs float64."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, N={a.n}, H={a.heads}, "
          f"E={a.dim}, W={a.window}, {a.docs} documents; median of {a.repeats} rounds")  # fmt: skip
    cases: dict[str, Callable[[int], Fn]] = {
        "torch causal SDPA": lambda n: (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ),
        "attnkit window": lambda n: (
            lambda q, k, v: block_sparse_attention(q, k, v, causal=True, window=a.window)
        ),
        "attnkit documents": lambda n: (
            lambda q, k, v: block_sparse_attention(
                q, k, v, causal=True, segment_ids=(torch.arange(n) // (n // a.docs)).view(1, n)
            )
        ),
    }
    if a.copies:  # the other way to run bf16: float32 copies in, the result rounded
        for name in ("attnkit window", "attnkit documents"):
            cases[f"{name}, f32 copies"] = functools.partial(_copies, make=cases[name])
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(1, a.n, a.heads, a.dim, generator=gen).transpose(1, 2) for _ in range(4)]
    modes = a.modes.split(",")
    times: dict[tuple[str, str, torch.dtype], list[float]] = {}
    for _ in range(a.repeats):
        for name, make in cases.items():
            fn = make(a.n)
            for dtype in (torch.float32, torch.bfloat16):
                for mode in modes:
                    q, k, v = (t.to(dtype).detach().requires_grad_(mode != "fwd") for t in base[:3])
                    start = time.perf_counter()
                    with torch.set_grad_enabled(mode != "fwd"):
                        out = fn(q, k, v)
                        if mode != "fwd":
                            torch.autograd.grad(out, (q, k, v), base[3].to(dtype))
                    times.setdefault((name, mode, dtype), []).append(time.perf_counter() - start)
    rows: list[dict[str, Any]] = []
    print(f"\n{'implementation':<32} {'mode':<8} {'fp32 ms':>9} {'bf16 ms':>9} {'speed-up':>9} "
          f"{'bf16 err':>9}")  # fmt: skip
    n = a.error_n
    for name, make in cases.items():
        errors = _bf16_errors(make(n), n, a)
        for mode in modes:
            t32 = statistics.median(times[(name, mode, torch.float32)])
            t16 = statistics.median(times[(name, mode, torch.bfloat16)])
            err = errors[mode]
            print(f"{name:<32} {mode:<8} {t32 * 1e3:>9.0f} {t16 * 1e3:>9.0f} {t32 / t16:>9.2f} "
                  f"{err:>9.1e}")  # fmt: skip
            rows.append({"impl": name, "mode": mode, "fp32_s": t32, "bf16_s": t16,
                         "speedup": t32 / t16, "bf16_max_err": err})  # fmt: skip
    ref = {r["mode"]: r for r in rows if r["impl"] == "torch causal SDPA"}
    for r in rows:
        r["speedup_vs_torch"] = r["speedup"] / ref[r["mode"]]["speedup"]
    print("ratio of ratios (attnkit speed-up / torch's): " + ", ".join(
        f"{r['impl'].removeprefix('attnkit ')} {r['mode']} {r['speedup_vs_torch']:.2f}"
        for r in rows if r["impl"] != "torch causal SDPA"))  # fmt: skip
    return rows


def _blockwise(
    q: Tensor, k: Tensor, v: Tensor, *, block_size: int | None, kw: dict[str, Any]
) -> Tensor:
    return block_sparse_attention(q, k, v, block_size=block_size, **kw)


def _copies(n: int, *, make: Callable[[int], Fn]) -> Fn:
    return _via_float32(make(n))


def _via_float32(fn: Fn) -> Fn:
    """``fn`` on float32 copies of bf16 inputs, the result rounded to bf16."""

    def wide(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.dtype != torch.bfloat16:
            return fn(q, k, v)
        return fn(q.float(), k.float(), v.float()).to(q.dtype)

    return wide


def _bf16_errors(fn: Fn, n: int, a: argparse.Namespace) -> dict[str, float]:
    """Largest error of ``fn`` in bf16 against ``fn`` in float64 (output; output and grads)."""
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(1, a.heads, n, a.dim, generator=gen, dtype=torch.float64) for _ in range(4)]

    def run(dtype: torch.dtype) -> list[Tensor]:
        q, k, v = (t.to(dtype).requires_grad_() for t in base[:3])
        out = fn(q, k, v)
        return [out, *torch.autograd.grad(out, (q, k, v), base[3].to(dtype))]

    exact, low = run(torch.float64), run(torch.bfloat16)
    errs = [(x.double() - y).abs().max().item() for x, y in zip(low, exact, strict=True)]
    with torch.no_grad():  # the forward alone may take another path (a bf16 kernel)
        fwd = fn(*(t.bfloat16() for t in base[:3]))
    return {"fwd": (fwd.double() - exact[0]).abs().max().item(), "fwd+bwd": max(errs)}


def _two_pieces(q: Tensor, k: Tensor, v: Tensor, W: int) -> Tensor:
    """Causal window (L == S, multiple of W) as two pieces per W-row tile merged by LSE."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    B, H, N, E = q.shape
    T = N // W
    qt = q.reshape(B, H, T, W, E).transpose(1, 2).reshape(B * T, H, W, E)
    kt = k.reshape(B, H, T, W, E).transpose(1, 2).reshape(B * T, H, W, E)
    vt = v.reshape(B, H, T, W, E).transpose(1, 2).reshape(B * T, H, W, E)
    o_diag, l_diag = flash(qt, kt, vt, 0.0, True)
    kp = torch.roll(kt, 1, 0)  # the previous tile's keys (tile 0's are masked out below)
    vp = torch.roll(vt, 1, 0)
    i = torch.arange(W).view(W, 1)
    ok = i < torch.arange(W).view(1, W)  # previous block: j > i
    mask = torch.zeros(W, W).masked_fill(~ok, float("-inf"))
    o_prev, l_prev = flash(qt, kp, vp, 0.0, False, attn_mask=mask)
    l_prev = l_prev.masked_fill(~ok.any(-1), float("-inf"))  # the kernel gives 0 for none
    l_prev[0::T] = float("-inf")
    lse = torch.logaddexp(l_diag, l_prev)
    out = o_diag * (l_diag - lse).exp().unsqueeze(-1) + o_prev * (l_prev - lse).exp().unsqueeze(-1)
    return out.view(B, T, H, W, E).transpose(1, 2).reshape(B, H, N, E)


if __name__ == "__main__":
    sys.exit(main())
