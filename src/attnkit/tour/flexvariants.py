"""Claims 13 to 15, attention variants through :mod:`attnkit.flex`: ALiBi extrapolates, a
prefix-LM's prefix sees its own future, a sliding window's cost grows linearly."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.config import TransformerConfig
from attnkit.flex import create_block_mask, presets
from attnkit.models import TransformerLM
from attnkit.tour.verdict import ClaimResult, claim_result, seeded

__all__ = ["check_alibi_extrapolation", "check_prefix_lm", "check_window_cost", "recency_batch"]

# The recency task's vocabulary: signal tokens 0..SIGNALS-1, noise tokens after them.
SIGNALS, VOCAB = 8, 16


def recency_batch(
    gen: torch.Generator, n: int, length: int, p: float = 0.35
) -> tuple[Tensor, Tensor]:
    """The recency task: at every position, name the most recent signal token seen so far.

    Each token is a signal (probability ``p``) or noise; the target of a position is the last
    signal at or before it (``-100``, ignored, before the first signal). Without positions a
    causal model cannot tell the most recent signal from the others.

    Returns:
        ``(tokens, targets)``, both ``(n, length)`` int64.
    """
    signal = torch.rand(n, length, generator=gen) < p
    tokens = torch.where(
        signal,
        torch.randint(0, SIGNALS, (n, length), generator=gen),
        torch.randint(SIGNALS, VOCAB, (n, length), generator=gen),
    )
    targets = torch.full((n, length), -100)
    last = torch.full((n,), -100)
    for t in range(length):
        last = torch.where(signal[:, t], tokens[:, t], last)
        targets[:, t] = last
    return tokens, targets


def _train_recency(
    score_mod: Any, *, length: int, steps: int, seed: int, lengths: Sequence[int]
) -> dict[int, float]:
    """Train a one-layer LM without position embeddings (``score_mod`` the only position
    information) at ``length``; its accuracy at each of ``lengths``."""
    torch.manual_seed(seed)
    config = TransformerConfig(VOCAB, 32, 1, 8, ffn_dim=64, max_seq_len=max(lengths),
                               position="none", score_mod=score_mod)  # fmt: skip
    lm = TransformerLM(config)
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    gen = seeded(seed)
    for _ in range(steps):
        x, y = recency_batch(gen, 32, length)
        loss = F.cross_entropy(lm(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.eval()
    accuracy = {}
    for n in lengths:
        x, y = recency_batch(seeded(seed + 1), 128, n)
        with torch.no_grad():
            pred = lm(x).argmax(-1)
        seen = y != -100
        accuracy[n] = float((pred[seen] == y[seen]).double().mean())
    return accuracy


def check_alibi_extrapolation(
    score_mod: Any = "alibi",
    *,
    length: int = 24,
    steps: int = 100,
    seed: int = 0,
) -> ClaimResult:
    """Claim 13: ALiBi trained at ``L`` keeps its accuracy at ``2L``; no positions does not.

    Two one-layer LMs without position embeddings train side by side on the recency task
    (:func:`recency_batch`) at length ``L``: one with ``score_mod`` (ALiBi), one without. Passes
    when the ALiBi model is right on at least 90% of the positions at ``2L``, within 5 points of
    its accuracy at ``L``, and at least 20 points above the model without positions at ``2L``.

    Args:
        score_mod: The variant under test (a config ``score_mod``).
        length: Training length ``L``.
        steps: Training steps (batches of 32).
        seed: Seed of both models and the data.

    Returns:
        The claim's result; measured: both models' accuracy at ``L`` and ``2L``.
    """
    lengths = (length, 2 * length)
    ours = _train_recency(score_mod, length=length, steps=steps, seed=seed, lengths=lengths)
    plain = _train_recency(None, length=length, steps=steps, seed=seed, lengths=lengths)
    long = 2 * length
    holds = ours[long] >= 0.9 and ours[long] >= ours[length] - 0.05
    beats = ours[long] >= plain[long] + 0.2
    verdict = (
        f"with {score_mod!r}: accuracy {ours[length]:.1%} at L={length}, {ours[long]:.1%} at "
        f"2L={long} (>= 90% and within 5 points: {holds}); without positions {plain[long]:.1%} "
        f"at 2L (20 points below: {beats})"
    )
    measured = {
        "train_length": length,
        "steps": steps,
        "score_mod": repr(score_mod),
        "accuracy": {str(n): ours[n] for n in lengths},
        "accuracy_without_positions": {str(n): plain[n] for n in lengths},
    }
    return claim_result(13, holds and beats, measured, verdict)


def check_prefix_lm(
    model: Callable[[int], nn.Module] | None = None,
    *,
    prefix: int = 6,
    length: int = 16,
    seed: int = 0,
) -> ClaimResult:
    """Claim 14: a prefix-LM's prefix sees its whole self; the tokens after it stay causal.

    A random two-layer LM with ``mask_mod={"name": "prefix_lm", "prefix": n}`` (float64) reads a
    random sequence; one token is changed at a time and the outputs compared. Passes when
    changing the last prefix token changes the first prefix token's output (the prefix sees
    its future) while changing a token after the prefix changes no output before it (causal
    there, to 1e-12).

    Args:
        model: ``(prefix) -> LM`` under test (``lm(ids)`` returns ``(B, L, V)``); default a
            ``TransformerLM`` with the prefix-LM mask.
        prefix: Prefix length ``n``.
        length: Sequence length.
        seed: Seed of the weights and the tokens.

    Returns:
        The claim's result; measured: the largest output changes before each changed token.
    """
    torch.manual_seed(seed)
    if model is None:
        config = TransformerConfig(32, 32, 2, 4, ffn_dim=64, max_seq_len=length,
                                   mask_mod={"name": "prefix_lm", "prefix": prefix})  # fmt: skip
        lm: nn.Module = TransformerLM(config)
    else:
        lm = model(prefix)
    lm = lm.double().eval()
    ids = torch.randint(0, 32, (1, length), generator=seeded(seed))

    def change(at: int) -> list[float]:
        """Per position, the largest output change when token ``at`` changes."""
        other = ids.clone()
        other[0, at] = (other[0, at] + 1) % 32
        with torch.no_grad():
            return (lm(other) - lm(ids)).abs().amax(-1)[0].tolist()

    in_prefix, after = prefix - 1, min(prefix + 3, length - 1)
    seen = change(in_prefix)
    causal = change(after)
    sees_future = seen[0] > 1e-6
    stays_causal = max(causal[:after]) <= 1e-12
    verdict = (
        f"changing prefix token {in_prefix} changes the output at position 0 by {seen[0]:.2g} "
        f"(> 1e-6: {sees_future}); changing token {after} after the prefix changes earlier "
        f"outputs by at most {max(causal[:after]):.2g} (<= 1e-12: {stays_causal})"
    )
    measured = {
        "prefix": prefix,
        "length": length,
        "changed_in_prefix": in_prefix,
        "change_at_0": seen[0],
        "changed_after_prefix": after,
        "max_change_before_it": max(causal[:after]),
    }
    drawing = {"change_in_prefix": seen, "change_after_prefix": causal}
    return claim_result(14, sees_future and stays_causal, measured, verdict, drawing)


def check_window_cost(
    window_mask: Callable[[int], Any] | None = None,
    *,
    window: int = 256,
    lengths: Sequence[int] = (1024, 2048, 4096, 8192, 16384),
    block_size: int = 128,
) -> ClaimResult:
    """Claim 15: a sliding window's cost grows linearly with the length; causal grows as N².

    Counts the blocks :func:`attnkit.flex.create_block_mask` marks as computed (not empty) for
    the window and for the causal mask at each length, the work :func:`attnkit.flex.flex_attention`
    does. Passes when the window's count grows with log-log slope 1 (within 0.1) and the causal
    count with slope 2 (within 0.1).

    Args:
        window_mask: ``(window) -> mask_mod`` under test; default
            :func:`attnkit.flex.presets.sliding_window`.
        window: Window size.
        lengths: Sequence lengths ``N``.
        block_size: Block size of the block masks.

    Returns:
        The claim's result; measured: per length, both block counts.
    """
    windowed = presets.sliding_window(window) if window_mask is None else window_mask(window)

    def computed(mask_mod: Any, n: int) -> int:
        blocks = create_block_mask(mask_mod, None, None, n, n, BLOCK_SIZE=block_size)
        return int(blocks.to_dense().sum())

    rows = [
        {
            "n": n,
            "window_blocks": computed(windowed, n),
            "causal_blocks": computed(presets.causal(), n),
        }
        for n in lengths
    ]
    a, b = rows[0], rows[-1]
    span = math.log(b["n"] / a["n"])
    window_slope = math.log(b["window_blocks"] / a["window_blocks"]) / span
    causal_slope = math.log(b["causal_blocks"] / a["causal_blocks"]) / span
    linear = abs(window_slope - 1) <= 0.1
    quadratic = abs(causal_slope - 2) <= 0.1
    verdict = (
        f"computed blocks grow with slope {window_slope:.2f} for window {window} (1 ± 0.1: "
        f"{linear}) and {causal_slope:.2f} for causal (2 ± 0.1: {quadratic}), N = "
        f"{a['n']}..{b['n']}, blocks of {block_size}"
    )
    measured = {
        "window": window,
        "block_size": block_size,
        "per_length": rows,
        "window_slope": window_slope,
        "causal_slope": causal_slope,
    }
    return claim_result(15, linear and quadratic, measured, verdict)
