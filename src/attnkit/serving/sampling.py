"""How the serving engine picks each request's next token: :class:`SamplingParams` and
:func:`choose`.

Greedy (``temperature=0``) takes the argmax, as :meth:`attnkit.TransformerLM.generate` does
without sampling, so a greedy request gets the tokens it would get alone. Otherwise the token is
drawn from ``softmax(logits / temperature)`` restricted to the top-``top_p`` nucleus, with the
request's own generator (seeded by ``seed``), so a seeded request repeats whatever else runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MAX_LOGPROBS", "LogitsProcessor", "SamplingParams", "TokenChoice", "choose"]

#: Most alternatives a request may ask logprobs for (the OpenAI API's limit).
MAX_LOGPROBS = 20

#: ``processor(generated_ids, logits)`` -> logits: a per-request hook on the ``(V,)`` logits
#: (constrained decoding sets the tokens a grammar forbids to ``-inf``).
LogitsProcessor = Callable[[list[int], Tensor], Tensor]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_tokens: Most tokens to generate.
        temperature: ``0`` = greedy; otherwise the softmax temperature.
        top_p: Sample from the smallest set of tokens of total probability ``top_p``.
        seed: Seed of the request's own generator (``None``: a random one).
        stop_token_ids: Tokens that end the request once emitted (eos ids etc.).
        logprobs: ``None``: no log-probabilities; ``k >= 0``: the chosen token's and the top
            ``k`` alternatives'.
        ignore_eos: Keep generating past the ``stop_token_ids`` (up to ``max_tokens``).

    Raises:
        ValueError: Naming the field, for ``max_tokens < 1``, ``temperature < 0``, ``top_p``
            outside ``(0, 1]``, ``logprobs`` outside ``[0, MAX_LOGPROBS]``.
        TypeError: For a field of the wrong type.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_tokens):
            raise TypeError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            is_int(t) for t in self.stop_token_ids
        ):
            raise TypeError(f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        if self.logprobs is not None:
            if not is_int(self.logprobs):
                raise TypeError(f"logprobs must be an int or None, got {self.logprobs!r}")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature == 0


@dataclass(frozen=True)
class TokenChoice:
    """A chosen token with its log-probability and the top alternatives (when asked)."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None


def choose(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> TokenChoice:
    """Pick the next token from one request's logits (after its logits processor).

    The log-probabilities are those of the model's distribution over the allowed tokens
    (``log_softmax`` of the logits, before temperature and nucleus).

    Shape:
        logits ``(V,)``.
    """
    logits = logits.float()
    if params.greedy:
        token = int(logits.argmax())
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)  # (V,)
        if params.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
            sorted_probs[before >= params.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if params.logprobs is None:
        return TokenChoice(token, None, None)
    logprobs = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs:
        values, ids = logprobs.topk(params.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenChoice(token, float(logprobs[token]), top)
