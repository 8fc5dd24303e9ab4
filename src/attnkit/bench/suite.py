"""The suite of ``attnkit bench``: block-sparse attention against torch SDPA and the textbook math.

Cases (all self-attention, ``L == S == N``):

* ``causal``: causal only;
* ``padding``: every batch row has ``N // 2`` real keys (encoder-style key padding);
* ``window``: causal sliding window of ``window`` keys;
* ``documents``: causal attention inside packed documents of about ``doc_len`` tokens.

Each case runs three implementations side by side in one process: ``block_sparse``
(:func:`attnkit.functional.block_sparse_attention`), ``torch_sdpa`` (torch's fused kernel given the
equivalent dense bool mask) and ``textbook`` (materialized ``softmax(QK^T * scale + mask) V``,
skipped above ``textbook_max``), and optionally compiled FlexAttention (forward only: torch 2.13
has no FlexAttention backward on CPU; its first, compiling call is reported separately). Times
are medians of ``repeats`` interleaved runs, for the forward and for forward+backward. Peak
memory is the extra resident memory during one call: on CPU the kernel's high-water mark
(``VmHWM``) is reset through ``/proc/self/clear_refs`` and the resident size before the call is
subtracted (memory the allocator keeps cached from earlier calls is not counted again, so CPU
numbers are lower bounds); on CUDA ``torch.cuda.max_memory_allocated``. On CUDA the table also
shows the achieved TFLOP/s counting useful FLOPs only (``4 * E`` per allowed (query, key) pair
forward, 2.5x that backward) and the ratio to a measured matmul rate.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CASES = ("causal", "padding", "window", "documents")
IMPLS = ("block_sparse", "torch_sdpa", "textbook")
DTYPES = ("float32", "bfloat16", "float16")

__all__ = ["CASES", "DTYPES", "IMPLS", "SuiteConfig", "format_table", "run_suite"]


@dataclass(frozen=True)
class SuiteConfig:
    """What ``attnkit bench`` measures.

    Attributes:
        seq_lens: Sequence lengths ``N`` (self-attention, ``L == S == N``).
        cases: Cases of :data:`CASES`.
        batch: Batch ``B``.
        heads: Heads ``H``.
        head_dim: Head dim ``E``.
        window: Sliding window of the ``window`` case.
        doc_len: Mean document length of the ``documents`` case.
        dtype: Name of a torch float dtype.
        device: Device name.
        repeats: Timed interleaved rounds per point (medians).
        textbook_max: Largest ``N`` for the textbook implementation.
        backward: Also time forward+backward.
        flex: Add compiled FlexAttention (forward only).
        progress: Show a progress bar on stderr.
    """

    seq_lens: tuple[int, ...] = (1024, 4096)
    cases: tuple[str, ...] = CASES
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    window: int = 256
    doc_len: int = 1024
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    textbook_max: int = 2048
    backward: bool = True
    flex: bool = False
    progress: bool = True

    def check(self) -> None:
        """Raise ``ValueError`` naming the first size that is not positive."""
        for name, value in (
            ("heads", self.heads),
            ("head-dim", self.head_dim),
            ("window", self.window),
            ("doc-len", self.doc_len),
            ("repeats", self.repeats),
            ("batch", self.batch),
        ):
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        if any(n < 1 for n in self.seq_lens):
            raise ValueError(f"--seq-len values must be >= 1, got {list(self.seq_lens)}")


def run_suite(config: SuiteConfig) -> dict[str, Any]:
    """Measure every (N, case, mode) point of ``config``.

    Returns:
        ``{"config": ..., "matmul_tflops": ..., "results": [...]}``, one result per
        implementation and point (see :func:`format_table`).

    Raises:
        ValueError: For sizes that are not positive or an unknown case.
    """
    import torch

    from attnkit.profiling import matmul_flops_per_second

    config.check()
    dtype = getattr(torch, config.dtype)
    device = torch.device(config.device)
    summary = {
        "seq_lens": list(config.seq_lens),
        "batch": config.batch,
        "heads": config.heads,
        "head_dim": config.head_dim,
        "window": config.window,
        "doc_len": config.doc_len,
        "dtype": config.dtype,
        "device": str(device),
        "repeats": config.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": list(config.cases),
    }
    results: list[dict[str, Any]] = []
    matmul = matmul_flops_per_second(dtype, device) / 1e12
    modes = ["fwd", "fwd+bwd"] if config.backward else ["fwd"]
    points = [(n, case, mode) for n in config.seq_lens for case in config.cases for mode in modes]
    for n, case, mode in _progress(points, enabled=config.progress):
        kw = _case_kwargs(
            case, n, batch=config.batch, window=config.window, doc_len=config.doc_len, device=device
        )
        results += _bench_point(
            case,
            mode,
            n,
            kw,
            batch=config.batch,
            heads=config.heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
            repeats=config.repeats,
            textbook=n <= config.textbook_max,
            flex=config.flex and mode == "fwd",
            matmul=matmul,
        )
    return {"config": summary, "matmul_tflops": matmul, "results": results}


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
        from attnkit.bench.flex import flex_or_reason

        flex_fn, first_s, why = flex_or_reason(q, k, scale=scale, **kw)
        if flex_fn is None:
            print(f"attnkit bench: {why}", file=sys.stderr)
        else:
            flex_first = first_s
            fns["flex"] = functools.partial(flex_fn, q, k, v)

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
