"""Time to first token: attnkit's prefill against transformers', per dtype and prompt length
(``python -m attnkit.bench.decoding --prefill`` and the first-token rows of ``attnkit bench
--vs``)."""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit import decoding
from attnkit.bench.decoding.models import QUANT_MODELS
from attnkit.bench.peers import hf_greedy, to_transformers
from attnkit.models import TransformerLM
from attnkit.profiling import time_calls

__all__ = ["PREFILL_GOALS", "bf16_gemm_speedup", "prefill_rows", "vs_prefill_rows"]


def prefill_rows(
    name: str = "llama-135m",
    *,
    prompts: tuple[int, ...] = (256, 2048),
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time to first token: attnkit's eager prefill (the model prepared as ``attnkit generate``
    prepares it) against transformers' ``generate`` of one token, per dtype and prompt length.

    Random weights, one prompt, both libraries in the same dtype and process, rounds interleaved,
    medians. Rows carry ``attnkit_s``, ``transformers_s``, ``vs_transformers`` (transformers'
    time over attnkit's), ``vs_fp32`` (attnkit's fp32 time over this dtype's) and whether the
    two first tokens agree. Targets (bf16, prompt 2048): >= 1.0x transformers, and >= 2.5x
    attnkit fp32 where torch's bf16 GEMM is >= 4x its fp32 one.

    Raises:
        ValueError: For an unknown ``name`` or a prompt shorter than 1.
    """
    if name not in QUANT_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(QUANT_MODELS)}")
    if not prompts or min(prompts) < 1:
        raise ValueError(f"prompt lengths must be at least 1, got {prompts}")
    say = progress or (lambda _msg: None)
    config = QUANT_MODELS[name][0].replace(max_seq_len=max(prompts) + 1)
    torch.manual_seed(0)
    base = TransformerLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size or 2, (1, max(prompts)), generator=gen)
    runners: dict[tuple[str, str, int], Callable[[], Tensor]] = {}
    for dtype in dtypes:
        kind = str(dtype).removeprefix("torch.")
        ours = decoding.prepare(copy.deepcopy(base).to(dtype))
        try:
            theirs = to_transformers(base).to(dtype)
        except ImportError:
            theirs = None
        for P in prompts:
            prompt = ids[:, :P]
            runners[("attnkit", kind, P)] = functools.partial(
                ours.generate, prompt, 1, eos_token_id=[]
            )
            if theirs is not None:
                runners[("transformers", kind, P)] = functools.partial(hf_greedy(theirs, prompt), 1)
    firsts = {key: run() for key, run in runners.items()}  # (warm-up)
    seconds: dict[tuple[str, str, int], list[float]] = {key: [] for key in runners}
    for r in range(repeats):
        say(f"{name}: prefill round {r + 1}/{repeats}")
        for key, run in runners.items():
            start = time.perf_counter()
            run()
            seconds[key].append(time.perf_counter() - start)
    med = {key: statistics.median(v) for key, v in seconds.items()}
    rows = []
    for dtype in dtypes:
        kind = str(dtype).removeprefix("torch.")
        for P in prompts:
            ours_s = med[("attnkit", kind, P)]
            row: dict[str, Any] = {"dtype": kind, "prompt": P, "attnkit_s": ours_s}
            hf_key = ("transformers", kind, P)
            if hf_key in med:
                row["transformers_s"] = med[hf_key]
                row["vs_transformers"] = med[hf_key] / ours_s
                row["same_first_token"] = bool(
                    torch.equal(firsts[("attnkit", kind, P)][:, -1], firsts[hf_key][:, -1])
                )
            if ("attnkit", "float32", P) in med:
                row["vs_fp32"] = med[("attnkit", "float32", P)] / ours_s
            rows.append(row)
    notes = [] if any(k[0] == "transformers" for k in runners) else ["transformers not installed"]
    return {"rows": rows, "notes": notes, "threads": torch.get_num_threads()}


#: The prefill targets: bf16 time to first token at the longest prompt against transformers bf16,
#: and against attnkit's own fp32 where torch's bf16 GEMM is at least 4x its fp32 one.
PREFILL_GOALS = {"transformers": 1.0, "fp32": 2.5}


def bf16_gemm_speedup(rows: int = 2048, inputs: int = 576, outputs: int = 1536) -> float:
    """How many times faster torch's bf16 GEMM is than its float32 one on this CPU (a prompt's
    product of the 135M Llama shape, medians of interleaved rounds)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, inputs, generator=gen), torch.randn(outputs, inputs, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    with torch.no_grad():
        seconds = time_calls({"fp32": lambda: x @ w.T, "bf16": lambda: xb @ wb.T}, rounds=5)
    return seconds["fp32"] / seconds["bf16"]


def vs_prefill_rows(
    name: str = "llama-135m",
    *,
    prompts: tuple[int, ...] = (256, 2048),
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The time-to-first-token rows of ``attnkit bench --vs`` (see :func:`prefill_rows`): each
    dtype and prompt against transformers in the same dtype, and bf16 against attnkit fp32. The
    longest prompt's bf16 rows carry :data:`PREFILL_GOALS` (the fp32 one only where
    :func:`bf16_gemm_speedup` is at least 4)."""
    report = prefill_rows(name, prompts=prompts, repeats=repeats, progress=progress)
    fast_bf16 = bf16_gemm_speedup()
    longest = max(prompts)
    out: list[dict[str, Any]] = []
    for row in report["rows"]:
        P, kind = row["prompt"], row["dtype"]
        size = f"prompt {P}, {kind}, batch 1, {report['threads']} threads"
        goal = PREFILL_GOALS["transformers"] if kind == "bfloat16" and longest == P else None
        same = row.get("same_first_token")
        out.append(
            {
                "job": f"first token {name} {kind} P={P}",
                "peer": "transformers LlamaForCausalLM",
                "attnkit_s": row["attnkit_s"],
                "peer_s": row.get("transformers_s"),
                "note": size if same is None else f"{size}; same first token: {same}",
                "goal": goal,
            }
        )
        if kind == "bfloat16" and "vs_fp32" in row:
            fp32 = row["attnkit_s"] * row["vs_fp32"]
            goal = PREFILL_GOALS["fp32"] if longest == P and fast_bf16 >= 4 else None
            out.append(
                {
                    "job": f"first token {name} bf16 weights P={P}",
                    "peer": "attnkit fp32 weights",
                    "attnkit_s": row["attnkit_s"],
                    "peer_s": fp32,
                    "note": f"{size}; torch's bf16 GEMM {fast_bf16:.1f}x its fp32 here",
                    "goal": goal,
                }
            )
    return out
