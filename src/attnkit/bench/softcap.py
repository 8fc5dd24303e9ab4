"""Soft-capped attention (Gemma 2's ``tanh(s / c) * c``) vs torch's fused kernel without a cap.

torch's fused kernels cannot modify scores, so ``attnkit.functional.attend(..., softcap=c)``
runs attnkit's own kernels (:mod:`attnkit.softcap`). The goal is a ratio <= 1.2 against the
fused kernel without the cap, at a causal prefill (``L = S``) and at a decode step (``L = 1``),
and a sliding window whose cost follows the allowed pairs (the time per query stays flat as
``L`` grows). Two bars are timed: ``ratio`` is against attnkit's own call without the cap
(``fused``: since float32 causal/window calls run attnkit's flash kernels, the same loop without
the cap), ``x torch`` against torch's ``scaled_dot_product_attention`` without the cap
(``is_causal`` on the square, no mask for a decode step, the dense mask for a window). The
``attend`` columns include its checks and NaN guards; the ``textbook`` column is the
full-matrix math the capped call ran before (``functional._explicit_attention``, L x S scores
and a dense mask).

Times are medians of interleaved rounds in this process, so machine noise hits every column
alike.

``--flex`` adds the route of a fused kernel that takes a score modification: torch's
FlexAttention, compiled, with the cap as its ``score_mod`` and the causal/window structure as its
block mask (compiled once per shape before the timed rounds).

``--baseline REV`` adds a ``before`` column: the capped call of an earlier commit (its
``softcap.py`` and ``functional.py``, loaded beside the current ones), timed in the same rounds.

Usage:
    python -m attnkit.bench.softcap                      # prefill, decode, window
    python -m attnkit.bench.softcap --threads 1 --repeats 9 --json results.json
    python -m attnkit.bench.softcap --baseline HEAD~3    # before/after in one process
    python -m attnkit.bench.softcap --flex --decode      # and compiled FlexAttention
    python -m attnkit.bench.softcap --rows 16 32 64 128  # sweep the chunk height
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from attnkit import functional, masks, softcap
from attnkit.bench.flex import compiled_flex
from attnkit.bench.results import bench_parser, parse_with_threads, write_report
from attnkit.profiling import time_interleaved

CAP = 50.0  # Gemma 2's attn_logit_softcapping
HEADS = 8


def _inputs(L: int, S: int, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, L, E, generator=g)
    k = torch.randn(1, HEADS, S, E, generator=g)
    v = torch.randn(1, HEADS, S, E, generator=g)
    return q, k, v


def load_baseline(rev: str) -> ModuleType:
    """``attnkit.functional`` as of git revision ``rev``, calling that revision's softcap kernel.

    Both files are loaded as extra modules (``attnkit._baseline_*``); everything else they
    import is the current package.
    """
    root = Path(__file__).resolve().parent  # (git show takes paths from the top level)
    modules = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("softcap", "functional"):
            text = subprocess.run(
                ["git", "show", f"{rev}:src/attnkit/{name}.py"],
                cwd=root, check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            path = Path(tmp, f"{name}.py")
            path.write_text(text)
            spec = importlib.util.spec_from_file_location(f"attnkit._baseline_{name}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            modules[name] = module
    modules["functional"].capped = modules["softcap"]  # type: ignore[attr-defined]
    return modules["functional"]


def _time(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    with torch.no_grad():
        for fn in fns.values():
            fn()  # warm-up: allocation, kernel selection, cached masks
        samples = time_interleaved(fns, repeats=repeats)
    return {name: statistics.median(s) for name, s in samples.items()}


def _capped(score: torch.Tensor, *index: object) -> torch.Tensor:
    """FlexAttention's ``score_mod`` of the cap."""
    return torch.tanh(score / CAP) * CAP


def case(
    kind: str,
    L: int,
    S: int,
    E: int,
    *,
    window: int | None,
    repeats: int,
    textbook: bool,
    baseline: ModuleType | None = None,
    flex: bool = False,
) -> dict[str, object]:
    """Time one shape: fused without cap, attnkit with cap (and optionally the textbook and
    compiled FlexAttention with the cap)."""
    q, k, v = _inputs(L, S, E)
    structure: dict[str, object] = {"causal": True}
    if window is not None:
        structure["window"] = window
    # torch's own fused kernel without a cap: is_causal on the square, no mask for one query at
    # the end (it sees every key), the window's dense mask
    dense = None if window is None else masks.Structure(**structure).mask(L, S)[0, 0]  # type: ignore[arg-type]
    square = window is None and L == S
    fns: dict[str, Callable[[], object]] = {
        "fused": lambda: functional.attend(q, k, v, **structure),  # type: ignore[arg-type]
        "softcap": lambda: functional.attend(q, k, v, softcap=CAP, **structure),  # type: ignore[arg-type]
        "torch": lambda: F.scaled_dot_product_attention(q, k, v, dense, is_causal=square),
    }
    if baseline is not None:
        fns["before"] = lambda: baseline.attend(q, k, v, softcap=CAP, **structure)
    if flex:
        run, _ = compiled_flex(q, k, score_mod=_capped, **structure)  # type: ignore[arg-type]
        with torch.no_grad():
            got = run(q, k, v)
            want, _ = functional.attend(q, k, v, softcap=CAP, **structure)  # type: ignore[arg-type]
        err = float((got - want).abs().max())
        if not err < 1e-4:
            raise AssertionError(f"FlexAttention with the cap differs from attend by {err:.2e}")
        fns["flex"] = lambda: run(q, k, v)
    if textbook:
        mask = masks.Structure(**structure).mask(L, S)[0, 0]  # type: ignore[arg-type]
        scale = 1 / math.sqrt(E)
        fns["textbook"] = lambda: functional._explicit_attention(
            q, k, v, mask, scale=scale, dropout_p=0.0, softcap=CAP
        )
    med = _time(fns, repeats)
    pairs = sum(
        min(S, i + S - L + 1) - (0 if window is None else max(0, i + S - L - window + 1))
        for i in range(L)
    )
    return {
        "kind": kind,
        "L": L,
        "S": S,
        "E": E,
        "window": window,
        "pairs": pairs,
        "fused_s": med["fused"],
        "softcap_s": med["softcap"],
        "ratio": med["softcap"] / med["fused"],
        "torch_s": med["torch"],
        "torch_ratio": med["softcap"] / med["torch"],
        "textbook_s": med.get("textbook"),
        "before_ratio": med["before"] / med["fused"] if "before" in med else None,
        "flex_ratio": med["flex"] / med["fused"] if "flex" in med else None,
    }


def sweep_rows(rows: list[int], L: int, E: int, repeats: int) -> list[dict[str, float]]:
    """The chunk height: the capped kernel at each ``rows`` vs the fused kernel, causal L=S."""
    q, k, v = _inputs(L, L, E)
    rules = masks.Structure(causal=True)
    scale = 1 / math.sqrt(E)
    fns: dict[str, Callable[[], object]] = {
        "fused": lambda: functional.attend(q, k, v, causal=True)
    }
    for r in rows:
        fns[str(r)] = lambda r=r: softcap.capped_attention(  # type: ignore[misc]
            q, k, v, None, rules, softcap=CAP, scale=scale, rows=r
        )
    med = _time(fns, repeats)
    out = []
    for r in rows:
        ratio = med[str(r)] / med["fused"]
        out.append({"L": L, "E": E, "rows": r, "ratio": ratio, "time_s": med[str(r)]})
        print(f"L={L:>5} E={E:>4} rows={r:>5}: {med[str(r)] * 1e3:8.2f} ms  x{ratio:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("attnkit.bench.softcap", __doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prefill", type=int, nargs="*", default=[256, 512, 1024, 2048])
    p.add_argument("--decode", type=int, nargs="*", default=[128, 512, 2048])
    p.add_argument("--windowed", type=int, nargs="*", default=[2048, 4096, 8192])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--textbook", action="store_true", help="also time the full-matrix math")
    p.add_argument("--rows", type=int, nargs="*", help="sweep the chunk height instead")
    p.add_argument("--baseline", metavar="REV", help="also time the capped call of git REV")
    p.add_argument("--flex", action="store_true", help="also time compiled FlexAttention")
    p.add_argument("--json", type=Path, help="default benchmarks/results/softcap.json")
    args = parse_with_threads(p, argv)
    print(
        f"soft-capped attention (c={CAP}) vs fused without cap: fp32, B=1, {HEADS} heads, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of "
        f"{args.repeats} interleaved rounds"
    )
    result: dict[str, object] = {}
    baseline = None if args.baseline is None else load_baseline(args.baseline)
    result["baseline"] = args.baseline
    if args.rows:
        result["rows"] = [
            row for L in args.prefill for E in args.head_dims
            for row in sweep_rows(args.rows, L, E, args.repeats)
        ]  # fmt: skip
    else:
        header = (
            f"{'case':<8} {'L':>5} {'S':>5} {'E':>4} {'window':>6} {'fused ms':>9} "
            f"{'softcap ms':>10} {'ratio':>6} {'torch ms':>9} {'x torch':>7} {'before':>6} "
            f"{'flex':>6} {'textbook ms':>11} {'ns/pair':>8}"
        )
        print(header)
        print("-" * len(header))
        shapes = [("prefill", n, n, None) for n in args.prefill]
        shapes += [("decode", 1, n, None) for n in args.decode]
        shapes += [("window", n, n, args.window) for n in args.windowed]
        rows = []
        for kind, L, S, window in shapes:
            for E in args.head_dims:
                reps = args.repeats * (20 if kind == "decode" else 1)
                textbook = args.textbook and kind != "window" and L <= 2048
                flex = args.flex and kind != "decode"  # (compiles a graph per step length)
                row: dict[str, Any] = case(
                    kind, L, S, E, window=window, repeats=reps, textbook=textbook,
                    baseline=baseline, flex=flex,
                )  # fmt: skip
                rows.append(row)
                tb, before, fx = row["textbook_s"], row["before_ratio"], row["flex_ratio"]
                per_pair = row["softcap_s"] / row["pairs"] * 1e9
                print(
                    f"{kind:<8} {L:>5} {S:>5} {E:>4} {window or '':>6} "
                    f"{row['fused_s'] * 1e3:>9.3f} {row['softcap_s'] * 1e3:>10.3f} "
                    f"{row['ratio']:>6.2f} {row['torch_s'] * 1e3:>9.3f} "
                    f"{row['torch_ratio']:>7.2f} {'' if before is None else f'{before:.2f}':>6} "
                    f"{'' if fx is None else f'{fx:.2f}':>6} "
                    f"{'' if tb is None else f'{tb * 1e3:.2f}':>11} "
                    f"{per_pair:>8.2f}",
                    flush=True,
                )
        result["cases"] = rows
    write_report(result, args.json, "softcap.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
