"""Batched decoding rows: several prompts of mixed lengths, left-padded, decoded together.

attnkit's ``generate`` against transformers' batched ``generate`` (``LlamaForCausalLM`` with the
same weights, ``attention_mask`` given to both), greedy, in interleaved rounds with medians; the
tokens of both must agree. What matters is the ratio of total new tokens per second. Used by
``python -m attnkit.bench.decoding --batched`` and ``attnkit bench --vs``.

Target: >= 2x transformers' batched ``generate`` (fp32, 8 prompts, 64 new tokens).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit import decoding
from attnkit.bench.decoding.models import DECODE_MODELS
from attnkit.bench.peers import to_transformers
from attnkit.config import TransformerConfig
from attnkit.models import TransformerLM

__all__ = ["TARGET", "batched_rows", "left_padded_prompts", "vs_batched_rows"]

#: The batched decoding target: total tokens/s against transformers' batched generate.
TARGET = 2.0


def left_padded_prompts(
    batch: int, longest: int, vocab: int, *, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``batch`` random prompts whose lengths spread evenly from ``longest // 4`` to
    ``longest``, left-padded with token 0, and their attention mask (``True`` = real token).

    Shape:
        ``(batch, longest)`` each.

    Raises:
        ValueError: For ``batch < 1`` or ``longest < 4``.
    """
    if batch < 1 or longest < 4:
        raise ValueError(f"need batch >= 1 and longest >= 4, got batch={batch}, longest={longest}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, longest), generator=gen)
    shortest = longest // 4
    lengths = [shortest + (longest - shortest) * i // max(batch - 1, 1) for i in range(batch)]
    mask = torch.arange(longest) >= longest - torch.tensor(lengths)[:, None]  # (batch, longest)
    return ids.masked_fill(~mask, 0), mask


def batched_rows(
    name: str = "llama-3m",
    *,
    batch: int = 8,
    new: int = 64,
    repeats: int = 3,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
    models: dict[str, tuple[TransformerConfig, int, int]] | None = None,
) -> dict[str, Any]:
    """Measure batched greedy decoding of :data:`attnkit.bench.decoding.DECODE_MODELS`'
    ``name`` (its prompt length is the longest prompt).

    Args:
        name: The model (a name of ``models``).
        batch: Prompts decoded together.
        new: New tokens per prompt.
        repeats: Interleaved runs per variant (median).
        compile: Add an attnkit ``compile=True`` row.
        progress: Called with a short message before each measurement.
        models: Table to take the name from instead of ``DECODE_MODELS``.

    Returns:
        ``{"rows": [...], "target": ..., "notes": [...]}``; each row has ``variant``,
        ``seconds`` (median), ``tokens_per_s`` (``batch * new / seconds``), and
        ``vs_transformers`` and ``same_tokens_as_transformers`` where transformers ran.

    Raises:
        ValueError: For an unknown model name or bad sizes.
    """
    table = DECODE_MODELS if models is None else models
    if name not in table:
        raise ValueError(f"unknown decode model {name!r}; known: {sorted(table)}")
    if new < 1 or repeats < 1:
        raise ValueError(f"need new >= 1 and repeats >= 1, got new={new}, repeats={repeats}")
    say = progress or (lambda _msg: None)
    config, longest, _ = table[name]
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    ids, mask = left_padded_prompts(batch, longest, config.vocab_size or 2)
    runners: dict[str, Callable[[], Tensor]] = {}
    notes: list[str] = []
    try:
        hf = to_transformers(model)
    except ImportError:
        notes.append("transformers is not installed: no row against it")
    else:

        def hf_run() -> Tensor:
            with torch.no_grad():
                out = hf.generate(
                    ids,
                    attention_mask=mask.long(),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            return out[:, longest:]

        runners["transformers"] = hf_run
    variants = {"attnkit": False, "attnkit compile": True} if compile else {"attnkit": False}
    for variant, compiled in variants.items():
        runners[variant] = _attnkit_run(model, ids, mask, new, compiled=compiled)
    outputs = {}
    for variant, run in runners.items():
        say(f"{name} batch {batch}: warm-up {variant}")
        outputs[variant] = run()
    times: dict[str, list[float]] = {v: [] for v in runners}
    for r in range(repeats):
        for variant, run in runners.items():
            say(f"{name} batch {batch}: run {r + 1}/{repeats} {variant}")
            start = time.perf_counter()
            run()
            times[variant].append(time.perf_counter() - start)
    ref = outputs.get("transformers")
    rows: list[dict[str, Any]] = []
    for variant in runners:
        seconds = statistics.median(times[variant])
        rows.append(
            {
                "model": name,
                "variant": variant,
                "batch": batch,
                "longest_prompt": longest,
                "new_tokens": new,
                "seconds": seconds,
                "tokens_per_s": batch * new / seconds,
                "same_tokens_as_transformers": None
                if ref is None
                else bool(torch.equal(outputs[variant], ref)),
            }
        )
    base = next((r for r in rows if r["variant"] == "transformers"), None)
    if base is not None:
        for row in rows:
            row["vs_transformers"] = row["tokens_per_s"] / base["tokens_per_s"]
            if row["variant"] != "transformers":
                row["target"] = TARGET
                row["met"] = row["vs_transformers"] >= TARGET
    return {"rows": rows, "target": TARGET, "notes": notes, "threads": torch.get_num_threads()}


def _attnkit_run(
    model: TransformerLM, ids: Tensor, mask: Tensor, new: int, *, compiled: bool
) -> Callable[[], Tensor]:
    """Batched greedy ``generate`` of a copy of ``model`` prepared for the batch; returns the new
    tokens."""
    prepared = decoding.prepare(copy.deepcopy(model), compiled=compiled, batch=ids.shape[0])

    def run() -> Tensor:
        out = prepared.generate(ids, new, attention_mask=mask, compile=compiled)
        return out[:, ids.shape[1] :]

    return run


def vs_batched_rows(
    *, repeats: int = 3, compile: bool = False, names: tuple[str, ...] = ("llama-3m",)
) -> list[dict[str, Any]]:
    """The batched rows as ``attnkit bench --vs`` rows (``job``, ``peer``, seconds, ``note``,
    ``goal``): each attnkit variant against transformers' batched ``generate``."""
    out = []
    for name in names:
        config, longest, _ = DECODE_MODELS[name]
        room = config.max_seq_len - longest  # a small model's table may hold fewer than 64
        report = batched_rows(name, new=min(64, room), repeats=repeats, compile=compile)
        rows = {r["variant"]: r for r in report["rows"]}
        hf = rows.get("transformers")
        for variant, row in rows.items():
            if variant == "transformers":
                continue
            notes = [
                f"{row['batch']} left-padded prompts of {row['longest_prompt'] // 4}-"
                f"{row['longest_prompt']} tokens, {row['new_tokens']} new, greedy",
                f"{row['tokens_per_s']:.1f} tok/s in all",
            ]
            if row["same_tokens_as_transformers"] is not None:
                notes.append(f"same tokens: {row['same_tokens_as_transformers']}")
            out.append(
                {
                    "job": f"decode {name} batched{variant.replace('attnkit', '')}",
                    "peer": "transformers batched generate",
                    "attnkit_s": row["seconds"],
                    "peer_s": None if hf is None else hf["seconds"],
                    "note": "; ".join([*notes, *report["notes"]]),
                    "goal": TARGET if hf is not None else None,
                }
            )
    return out
