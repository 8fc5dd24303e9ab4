"""The fused decoding step against the same model's blocks: ``python -m attnkit.bench.fused``.

Writes ``benchmarks/results/fused.json`` (``--out``). The model is the 135M Llama shape
(:data:`attnkit.bench.decoding.DECODE_MODELS`, random weights, prepared for decoding) in each
weight kind a user decodes with: fp32, bf16, and its int8 and int4 self-drafts
(:meth:`attnkit.TransformerLM.self_draft`). Each kind's greedy generation runs twice a round,
interleaved: as it is (every step in one call, :mod:`attnkit.fused`) and with a no-op forward
pre-hook on its first block, which makes the fused step leave every step to the blocks. A row
gives each side's milliseconds per decoded token (the time of ``new`` tokens less the time of
one, over ``new - 1``: the prompt's forward is left out) as medians over the rounds, the ratio,
and whether both sides wrote the same tokens.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit import decoding
from attnkit.bench.decoding.models import model_parser, model_report, random_lm, random_prompt
from attnkit.bench.results import parse_with_threads, write_report
from attnkit.models import TransformerLM

__all__ = ["KINDS", "main", "measure"]

#: The weight kinds measured: their names and how each is made from the fp32 model.
KINDS: dict[str, Callable[[TransformerLM], TransformerLM]] = {
    "fp32": lambda lm: lm,
    "bf16": lambda lm: decoding.prepare(copy.deepcopy(lm).to(torch.bfloat16)),
    "int8 self-draft": lambda lm: lm.self_draft("int8"),
    "int4 self-draft": lambda lm: lm.self_draft("int4"),
}


def _generate(lm: TransformerLM, prompt: Tensor, new: int, blocks: bool) -> tuple[Tensor, float]:
    """Greedy tokens and seconds, through the blocks where ``blocks`` (a hooked first block)."""
    hook = lm.blocks[0].register_forward_pre_hook(lambda m, args: None) if blocks else None
    try:
        start = time.perf_counter()
        out = lm.generate(prompt, new, eos_token_id=[])
        return out, time.perf_counter() - start
    finally:
        if hook is not None:
            hook.remove()


def measure(
    name: str = "llama-135m",
    *,
    prompt_len: int = 40,
    new: int = 32,
    repeats: int = 3,
    kinds: tuple[str, ...] = tuple(KINDS),
    progress: bool = True,
) -> dict[str, Any]:
    """Every kind's fused and blocks' decode rates, ``repeats`` interleaved rounds after a
    warm-up; the rows of the report."""
    base = random_lm(name)
    models = {kind: KINDS[kind](base) for kind in kinds}
    prompt = random_prompt(base, prompt_len)
    times: dict[tuple[str, bool, int], list[float]] = {}
    tokens: dict[tuple[str, bool], Tensor] = {}
    for round_ in range(repeats + 1):
        for kind, lm in models.items():
            for blocks in (False, True):
                if progress:
                    side = "blocks" if blocks else "fused"
                    print(f"round {round_}/{repeats}: {kind} {side}", file=sys.stderr, flush=True)
                for count in (1, new):
                    out, seconds = _generate(lm, prompt, count, blocks)
                    if round_:
                        times.setdefault((kind, blocks, count), []).append(seconds)
                tokens[kind, blocks] = out

    def per_token(kind: str, blocks: bool) -> float:
        whole = statistics.median(times[kind, blocks, new])
        first = statistics.median(times[kind, blocks, 1])
        return max(whole - first, 1e-9) / (new - 1)

    rows = []
    for kind in kinds:
        fused_s, blocks_s = per_token(kind, False), per_token(kind, True)
        rows.append(
            {
                "kind": kind,
                "fused_ms": fused_s * 1e3,
                "blocks_ms": blocks_s * 1e3,
                "speedup": blocks_s / fused_s,
                "identical": bool(torch.equal(tokens[kind, False], tokens[kind, True])),
            }
        )
    return model_report("fused", name, prompt=prompt_len, new=new, repeats=repeats, rows=rows)


def _line(r: dict[str, Any]) -> str:
    """A row as the command prints it."""
    return (
        f"{r['kind']}: {r['fused_ms']:.2f} ms/token fused, {r['blocks_ms']:.2f} through the "
        f"blocks = {r['speedup']:.2f}x, same tokens: {r['identical']}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its report."""
    args = parse_with_threads(model_parser("attnkit.bench.fused", __doc__, new=32), argv)
    report = measure(args.model, new=args.new, repeats=args.repeats)
    write_report(report, args.out, "fused.json", _line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
