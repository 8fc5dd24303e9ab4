"""``attnkit complexity``: FLOPs and memory of multi-head attention, per component, with formulas.

The numbers come from :mod:`attnkit.complexity`. ``--json``'s ``matmul_flops`` equals what
``torch.utils.flop_counter.FlopCounterMode`` counts for one forward of the layer when torch's math
SDPA backend is forced or the input is on the meta device. On a plain CPU run (torch 2.13) the
counter does not see the fused SDPA kernel at all and reports only the projections; ``--measure``
prints both counts so the gap is visible.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnkit.complexity import CostBreakdown

DTYPES = ("float32", "float64", "float16", "bfloat16")
SYMBOLS_HELP = (
    "B batch, L query length, S key length, D model dim, H query heads, K key/value heads, "
    "E head dim, F feed-forward width, P allowed (query, key) pairs under the causal mask"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``complexity`` options to ``parser``."""
    parser.add_argument("--seq-len", type=int, required=True, metavar="N", help="query length L")
    parser.add_argument("--dim", type=int, required=True, metavar="D", help="model dim D")
    parser.add_argument("--heads", type=int, required=True, metavar="H", help="query heads H")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="batch B (default 1)")
    parser.add_argument("--kv-len", type=int, metavar="S", help="key length S (cross-attention)")
    parser.add_argument("--kv-heads", type=int, metavar="K", help="key/value heads K (GQA)")
    parser.add_argument("--head-dim", type=int, metavar="E", help="head dim E (default D/H)")
    parser.add_argument("--ffn-dim", type=int, metavar="F", help="add a feed-forward of width F")
    parser.add_argument("--layers", type=int, default=1, help="blocks, with --ffn-dim (default 1)")
    parser.add_argument("--causal", action="store_true", help="causal mask: dense vs useful FLOPs")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="element type")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="plot FLOPs and memory against N")
    parser.add_argument("--measure", action="store_true", help="run the layer and compare")
    parser.add_argument("--device", default="cpu", help="device for --measure (default cpu)")


def run(args: argparse.Namespace) -> int:
    """Print the breakdown (table or JSON); optionally plot and measure."""
    from attnkit.complexity import CostOptions, attention_cost, transformer_cost

    common: CostOptions = {
        "batch": args.batch,
        "kv_len": args.kv_len,
        "head_dim": args.head_dim,
        "num_kv_heads": args.kv_heads,
        "causal": args.causal,
        "dtype": args.dtype,
    }
    cost = attention_cost(args.seq_len, args.dim, args.heads, **common)
    block = None
    if args.ffn_dim is not None:
        block = transformer_cost(
            args.seq_len,
            args.dim,
            args.heads,
            ffn_dim=args.ffn_dim,
            num_layers=args.layers,
            **common,
        )
    elif args.layers != 1:
        raise ValueError(f"--layers {args.layers} needs --ffn-dim (a block, not bare attention)")

    measured = measure(cost, device=args.device) if args.measure else None
    plots = plot(cost, args.plot, kv_len_given=args.kv_len is not None) if args.plot else []

    if args.json:
        out = cost.to_dict()
        out["layer"] = layer_description(cost)
        if block is not None:
            out["block"] = block.to_dict()
        if measured is not None:
            out["measured"] = measured
        if plots:
            out["plots"] = [str(p) for p in plots]
        print(json.dumps(out, indent=2))
        return 0

    print(format_table(cost))
    if block is not None:
        print()
        print(format_table(block))
    if measured is not None:
        print()
        print(format_measurement(cost, measured))
    for p in plots:
        print(f"wrote {p}")
    return 0


# --- text ------------------------------------------------------------------------------------
def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def layer_description(cost: CostBreakdown) -> str:
    """The attnkit module whose forward the numbers describe."""
    D, H, K, E = cost.dim, cost.num_heads, cost.num_kv_heads, cost.head_dim
    causal = ", causal=True" if cost.causal else ""
    if K == H and H * E == D and cost.kv_len == cost.seq_len:
        x = f"({cost.batch}, {cost.seq_len}, {D})"
        return f"MultiHeadSelfAttention({D}, {D}, {D}, {H}{causal}) on x {x}"
    kv = f", key/value ({cost.batch}, {cost.kv_len}, {D})" if cost.kv_len != cost.seq_len else ""
    return (
        f"MultiHeadAttention({D}, {H}, head_dim={E}, num_kv_heads={K}{causal}) on query "
        f"({cost.batch}, {cost.seq_len}, {D}){kv}"
    )


def format_table(cost: CostBreakdown) -> str:
    """Readable text: a FLOPs table, a memory table and the totals, with formulas."""
    sym = cost.symbols
    values = ", ".join(f"{k}={v}" for k, v in sym.items() if k != "P" or cost.causal)
    what = (
        f"{cost.num_layers} transformer block(s), F={cost.ffn_dim}"
        if cost.ffn_dim is not None
        else layer_description(cost)
    )
    lines = [
        f"attnkit complexity: {what}",
        f"  {values}; {cost.dtype} ({cost.bytes_per_element} B)",
    ]
    if cost.causal:
        lines.append("  P = L*(L+1)/2 + L*(S-L) allowed pairs (causal, queries aligned to the end)")
    lines.append(f"  symbols: {SYMBOLS_HELP}")
    lines.append("")

    header = ["component", "computes", "FLOPs formula", "FLOPs", "share"]
    if cost.causal:
        header += ["useful formula", "useful FLOPs"]
    rows = []
    total = sum(c.flops for c in cost.components) or 1
    for c in cost.components:
        row = [
            c.name + ("" if c.matmul else " *"),
            c.description,
            c.flops_formula,
            _si(c.flops),
            f"{100 * c.flops / total:.1f}%",
        ]
        if cost.causal:
            row += [c.useful_flops_formula, _si(c.useful_flops)]
        rows.append(row)
    per_layer = " per layer" if cost.num_layers > 1 else ""
    total_row = ["total" + per_layer, "", "", _si(total), "100.0%"]
    if cost.causal:
        total_row += ["", _si(sum(c.useful_flops for c in cost.components))]
    rows.append(total_row)
    lines += _table(header, rows, right={3, 4, 6})
    lines.append("  * not a matmul: elementwise work at a fixed FLOPs-per-element convention")
    lines.append("")

    header = ["component", "params formula", "params", "output formula", "output (textbook)"]
    rows = [
        [
            c.name,
            c.params_formula,
            f"{c.params:,}",
            c.activations_formula,
            _bytes(c.activations * cost.bytes_per_element),
        ]
        for c in cost.components
    ]
    lines += _table(header, rows, right={2, 4})
    lines.append("")

    layers = f" x {cost.num_layers} layers" if cost.num_layers > 1 else ""
    lines += [
        f"FLOPs{layers}: {cost.flops:,} dense ({_si(cost.flops)})"
        + (f", {cost.useful_flops:,} useful ({_si(cost.useful_flops)})" if cost.causal else ""),
        f"matmul FLOPs (what torch's FlopCounterMode counts, math SDPA): {cost.matmul_flops:,}",
        f"dominant component: {cost.dominant}; L*S terms {_si(cost.quadratic_flops)} vs "
        f"linear terms {_si(cost.linear_flops)} -> {cost.dominant_term} dominates",
        f"crossover (L = S = n, matmuls): n* = {cost.crossover_exact} "
        f"(linear-term FLOPs per token / L*S-term FLOPs per pair); here n = {cost.seq_len} is "
        + (
            "above"
            if cost.seq_len > cost.crossover_exact
            else "below"
            if cost.seq_len < cost.crossover_exact
            else "at"
        )
        + " it",
        f"params{layers}: {cost.params:,} ({_bytes(cost.param_bytes)})",
        f"attention matrix B*H*L*S = {cost.attn_matrix_elements:,} elements "
        f"({_bytes(cost.attn_matrix_elements * cost.bytes_per_element)}) per layer",
        f"  textbook path: forward peak 2*B*H*L*S (scores + weights while softmax runs) = "
        f"{_bytes(cost.textbook_peak_attn_bytes)}; kept for backward: the weights, "
        f"{_bytes(cost.textbook_saved_attn_bytes)}{' (all layers)' if cost.num_layers > 1 else ''}",
        f"  fused path: no L x S matrix; keeps B*H*L logsumexp = "
        f"{cost.fused_attn_elements:,} elements per layer, linear in L",
        f"other activations (outputs listed above, not L x S): "
        f"{_bytes(cost.linear_activation_elements * cost.bytes_per_element)}; one L x S matrix "
        f"outgrows them at n = {float(cost.memory_crossover_exact):g} (L = S = n)",
    ]
    return "\n".join(lines)


# --- plot ------------------------------------------------------------------------------------
def plot(cost: CostBreakdown, path: str, *, kv_len_given: bool) -> list[Path]:
    """Write FLOPs and memory (per component, log-log against n) to ``path`` and ``*_memory``.

    With ``--kv-len`` the key length stays fixed and only L varies; otherwise L = S = n and the
    crossover is marked.
    """
    from attnkit import viz
    from attnkit.complexity import attention_cost

    top = max(4 * cost.seq_len, 8 * cost.crossover_seq_len)
    seq_lens = [2**i for i in range(4, max(5, math.ceil(math.log2(top))) + 1)]
    costs = [
        attention_cost(
            n,
            cost.dim,
            cost.num_heads,
            batch=cost.batch,
            kv_len=cost.kv_len if kv_len_given else None,
            head_dim=cost.head_dim,
            num_kv_heads=cost.num_kv_heads,
            causal=cost.causal,
            dtype=cost.dtype,
            bias=cost.bias,
        )
        for n in seq_lens
    ]
    names = [c.name for c in cost.components]
    flops = {name: [c.components[i].flops for c in costs] for i, name in enumerate(names)}
    flops["total"] = [c.flops for c in costs]
    bpe = cost.bytes_per_element
    memory = {
        f"{name} output": [c.components[i].activations * bpe for c in costs]
        for i, name in enumerate(names)
        if name not in ("softmax",)  # same size as scores: one line for the L x S matrix
    }
    memory["textbook peak (2*B*H*L*S)"] = [c.textbook_peak_attn_bytes for c in costs]
    memory["fused logsumexp (B*H*L)"] = [c.fused_attn_elements * bpe for c in costs]
    memory["params"] = [c.param_bytes for c in costs]
    shape = (
        f"B={cost.batch}, D={cost.dim}, H={cost.num_heads}, K={cost.num_kv_heads}, "
        f"E={cost.head_dim}"
    )
    x = "L (S fixed)" if kv_len_given else "L = S = n"
    out = Path(path)
    mem_path = out.with_name(f"{out.stem}_memory{out.suffix or '.png'}")
    written = []
    plots = (
        (flops, "FLOPs", out, cost.crossover_exact),
        (memory, "bytes", mem_path, cost.memory_crossover_exact),
    )
    for series, ylabel, target, crossover in plots:
        fig = viz.complexity_curves(
            seq_lens,
            series,
            crossover=None if kv_len_given else float(crossover),
            ylabel=ylabel,
            title=f"{ylabel}, {x}: {shape}",
        )
        written.append(viz.save_figure(fig, target))
    return written


# --- measure ---------------------------------------------------------------------------------
def build_layer(cost: CostBreakdown) -> torch.nn.Module:
    """The attnkit module that :func:`layer_description` names (random weights)."""
    import attnkit

    D, H, K, E = cost.dim, cost.num_heads, cost.num_kv_heads, cost.head_dim
    if K == H and H * E == D and cost.kv_len == cost.seq_len:
        return attnkit.MultiHeadSelfAttention(D, D, D, H, causal=cost.causal)
    return attnkit.MultiHeadAttention(
        D, H, head_dim=E, num_kv_heads=K, causal=cost.causal, bias=cost.bias
    )


def measure(cost: CostBreakdown, *, device: str = "cpu") -> dict[str, Any]:
    """Run the layer's forward on ``device``; time it, count its FLOPs and measure peak memory.

    Returns a dict with the best time of several runs, achieved GFLOP/s (matmul FLOPs / time),
    this machine's matmul throughput (a square matmul in the same dtype) and the fraction
    reached, the measured peak memory growth of one forward (VmHWM on CPU,
    ``max_memory_allocated`` on CUDA), and what
    ``FlopCounterMode`` counts with the default kernel and with the math backend forced.

    Raises:
        ValueError: If the layer, its inputs or its forward do not fit in ``device``'s memory.
    """
    import torch

    try:
        return _measure(cost, device)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        text = str(err)
        if not isinstance(err, torch.OutOfMemoryError | MemoryError) and not re.search(
            r"allocate memory|not enough memory|out of memory", text, flags=re.I
        ):
            raise  # not an allocation failure: a bug, keep its traceback
        tried = re.search(r"tried to allocate ([\d.]+ ?[A-Za-z]+)", text, flags=re.I)
        raise ValueError(
            f"--measure: the layer does not fit in {device} memory at B={cost.batch}, "
            f"L={cost.seq_len}, S={cost.kv_len}, D={cost.dim}, {cost.dtype}"
            + (f" (it tried to allocate {tried.group(1)})" if tried else "")
            + "; measure a smaller size, or drop --measure for the predictions alone"
        ) from None


def _measure(cost: CostBreakdown, device: str) -> dict[str, Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from attnkit.profiling import best_time, matmul_flops_per_second, peak_memory

    dev = torch.device(device)
    dtype = getattr(torch, cost.dtype)
    torch.manual_seed(0)
    layer = build_layer(cost).to(device=dev, dtype=dtype).eval()
    B, L, S, D = cost.batch, cost.seq_len, cost.kv_len, cost.dim
    x = torch.randn(B, L, D, device=dev, dtype=dtype)
    kv = torch.randn(B, S, D, device=dev, dtype=dtype) if S != L else None
    inputs = (x,) if kv is None else (x, kv)

    def forward() -> None:
        with torch.no_grad():
            layer(*inputs)

    counts = {}
    for label, forced in (("default_kernel", False), ("math_backend", True)):
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            if forced:
                with sdpa_kernel(SDPBackend.MATH):
                    layer(*inputs)
            else:
                layer(*inputs)
        counts[label] = counter.get_total_flops()

    seconds = best_time(forward, dev)
    peak_gflops = matmul_flops_per_second(dtype, dev) / 1e9

    forward()  # warm the allocator's caches out of the measurement as far as possible
    peak = peak_memory(forward, dev)
    achieved = cost.matmul_flops / seconds / 1e9
    return {
        "device": str(dev),
        "seconds": seconds,
        "gflops": achieved,
        "machine_matmul_gflops": peak_gflops,
        "fraction_of_matmul_peak": achieved / peak_gflops,
        "peak_memory_bytes": peak,
        "predicted_fused_bytes": (cost.linear_activation_elements + cost.fused_attn_elements)
        * cost.bytes_per_element,
        "predicted_textbook_bytes": cost.linear_activation_elements * cost.bytes_per_element
        + cost.textbook_peak_attn_bytes,
        "flop_counter_default_kernel": counts["default_kernel"],
        "flop_counter_math_backend": counts["math_backend"],
        "predicted_matmul_flops": cost.matmul_flops,
    }


def format_measurement(cost: CostBreakdown, m: dict[str, Any]) -> str:
    """The measurement next to the predictions, as text."""
    peak = m["peak_memory_bytes"]
    lines = [
        f"measured on {m['device']} ({cost.dtype}, forward, no grad, best of several runs):",
        f"  time {m['seconds'] * 1e3:.3f} ms -> {m['gflops']:.2f} GFLOP/s of matmul FLOPs "
        f"({_si(cost.matmul_flops)} predicted)",
        f"  this machine's matmul: {m['machine_matmul_gflops']:.2f} GFLOP/s -> "
        f"{100 * m['fraction_of_matmul_peak']:.1f}% of it",
        "  peak memory growth: "
        + (_bytes(peak) if peak is not None else "unavailable (no /proc/self/clear_refs)")
        + f"; predicted fused {_bytes(m['predicted_fused_bytes'])}, "
        f"textbook {_bytes(m['predicted_textbook_bytes'])} (outputs + attention matrices; "
        "the allocator may reuse or keep memory)",
        f"  FlopCounterMode: {m['flop_counter_math_backend']:,} with the math SDPA backend "
        f"(predicted {m['predicted_matmul_flops']:,}), {m['flop_counter_default_kernel']:,} "
        "with the default kernel",
    ]
    if m["flop_counter_default_kernel"] != m["flop_counter_math_backend"]:
        lines.append(
            "  note: FlopCounterMode does not see torch's fused SDPA kernel on this device "
            "(torch 2.13 CPU): it counted only the projections"
        )
    return "\n".join(lines)
