"""Claims 9 and 10, the blog's "Attention weight, attention mask and causal attention": causal
weights never see the future, and a trained model's weights point at the answer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnkit import TransformerEncoder, TransformerLM
from attnkit.tour.verdict import ClaimResult, claim_result, seeded

__all__ = ["check_causal", "check_interpretable", "train_tour_model"]

# --------------------------------------------------------------------------- 9: causal


def check_causal(
    model: nn.Module | None = None, *, vocab: int = 32, length: int = 16, seed: int = 0
) -> ClaimResult:
    """Claim 9: causal weights are lower-triangular and the future never changes the past.

    Args:
        model: Maps ids ``(B, L)`` to ``(logits, per-layer weights)`` with
            ``return_weights=True``; default a small ``TransformerLM``.
        vocab: Vocabulary of the random ids.
        length: Sequence length.
        seed: Seed of the model and the ids.

    Returns:
        The claim's result.
    """
    torch.manual_seed(seed)
    lm = model if model is not None else TransformerLM(vocab, 32, 2, 4, max_seq_len=64)
    lm.eval().double()  # float64: "never changes" is then checked to 1e-10, not float32 noise
    gen = seeded(seed)
    ids = torch.randint(0, vocab, (2, length), generator=gen)
    with torch.no_grad():
        logits, weights = lm(ids, return_weights=True)
        upper = max(float(w.triu(diagonal=1).abs().max()) for w in weights)
        past_change, future_change = [], []
        for t in range(length - 1):
            other = ids.clone()
            other[:, t + 1 :] = (
                ids[:, t + 1 :] + torch.randint(1, vocab, (2, length - t - 1), generator=gen)
            ) % vocab
            changed = (lm(other) - logits).abs().amax(dim=(0, 2))  # (L,) per position
            past_change.append(float(changed[: t + 1].max()))
            future_change.append(float(changed[t + 1 :].max()))
    past = max(past_change)
    uses_context = min(future_change) > 1e-4
    ok = upper == 0.0 and past <= 1e-10 and uses_context
    verdict = (
        f"largest weight above the diagonal {upper:.1e} (must be 0); largest change of an "
        f"earlier output {past:.1e} (<= 1e-10); later outputs do change: {uses_context}"
    )
    measured = {
        "max_weight_above_diagonal": upper,
        "max_past_change": past,
        "min_future_change": min(future_change),
    }
    drawing = {
        "map": weights[-1][0, 0],  # last layer, first example, head 0: (L, L)
        "past_change": past_change,
        "future_change": future_change,
    }
    return claim_result(9, ok, measured, verdict, drawing)


# --------------------------------------------------------------------------- 10: interpretable


def train_tour_model(*, steps: int = 300, seed: int = 0) -> Any:
    """A small encoder trained on the lab's ``reverse`` task, small enough to train on a CPU.

    Returns:
        The lab's :class:`attnkit.lab.train.TrainResult`.
    """
    from attnkit.lab.train import LabConfig, train

    config = LabConfig(
        task="reverse",
        seq_len=10,
        dim=32,
        ffn_dim=64,
        num_layers=2,
        num_heads=4,
        steps=steps,
        eval_size=256,
        eval_every=0,
        seed=seed,
    )
    return train(config, progress=False)


def check_interpretable(
    model: TransformerEncoder | None = None, config: Any = None, *, threshold: float = 0.5
) -> ClaimResult:
    """Claim 10: the trained model's best head puts most of its weight on the answer's source.

    On held-out inputs of the lab's task, each head's share of attention on the positions that
    hold the answer (:func:`attnkit.lab.train.head_alignment`) is measured; the best head must
    reach ``threshold`` (chance is 1/n).

    Args:
        model: A lab model; default one trained by :func:`train_tour_model`.
        config: Its :class:`attnkit.lab.train.LabConfig` (needed with ``model``).
        threshold: Share the best head must reach.

    Returns:
        The claim's result; ``measured`` holds the alignment of every head and the accuracy.
    """
    from attnkit.lab.train import attention_weights, eval_set, evaluate, head_alignment

    if model is None:
        result = train_tour_model()
        model, config = result.model, result.config
    if config is None:
        raise ValueError("pass the model's LabConfig with the model")
    task = config.make_task()
    x, y = eval_set(task, 256, config.seed + 1)
    weights = attention_weights(model, x)  # (B, layers, H, L, L)
    align = head_alignment(task, x, weights)  # (layers, H)
    best = int(align.argmax())
    layer, head = divmod(best, align.shape[1])
    share = float(align[layer, head])
    accuracy = evaluate(model, x, y)["accuracy"]
    verdict = (
        f"best head (layer {layer}, head {head}) puts {share:.3f} of its weight on the answer's "
        f"position (threshold {threshold}; chance {1 / task.seq_len:.2f}); held-out accuracy "
        f"{accuracy:.3f}"
    )
    measured = {
        "best_layer": layer,
        "best_head": head,
        "best_share": share,
        "threshold": threshold,
        "chance": 1 / task.seq_len,
        "alignment": align.tolist(),
        "heldout_accuracy": accuracy,
        "task": task.name,
        "train_steps": config.steps,
    }
    drawing = {"map": weights[0, layer, head], "tokens": task.labels(x[0])}
    res = claim_result(10, share >= threshold, measured, verdict, drawing)
    res.explorer = (task.labels(x[0]), list(weights[0].unbind(0)))  # layers x (H, L, L)
    return res
