"""Speculative decoding: cheap guesses of the next tokens, checked by the model in one forward.

Decoding one token reads every weight of the model once; a forward over ``k + 1`` tokens reads
them once too. So when something cheap proposes the next ``k`` tokens, the model verifies them
all in one cached forward, keeps the longest prefix it agrees with plus a token of its own, and
the key/value cache is rolled back past the rest. The output is the model's own:

* greedy: a proposed token is kept only if it is the model's argmax at its position, so the
  tokens equal plain greedy decoding;
* sampling: speculative sampling's rule (Leviathan et al., Chen et al.): a proposed token ``x``
  drawn from the proposer's ``q`` is kept with probability ``min(1, p(x) / q(x))``; at the first
  rejection the model's token is drawn from the residual ``max(0, p - q)`` normalized. Every kept
  or drawn token then has the model's distribution ``p`` (``p`` after temperature, top-k and
  top-p). A prompt lookup proposal is a point mass (``q(x) = 1``).

Proposers: :class:`PromptLookup` copies the tokens that followed the most recent earlier
occurrence of the sequence's last n-gram (summaries, edits, code and answers grounded in a given
text repeat it); :class:`DraftModel` runs a smaller decoder over the same vocabulary (or the model
itself with quantized weights) one token at a time with its own cache.
:class:`AdaptiveLength` grows the number of proposed tokens while they are kept and shrinks it
when not, so that proposals that keep failing cost about one extra token per step.

Batches: each row decides its own acceptance; a round keeps the fewest tokens any unfinished row
kept (each row's token at that column is still drawn by the rule), so the rows share one cache
length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from attnkit.cache import KVCache

__all__ = [
    "AdaptiveLength",
    "DraftModel",
    "PromptLookup",
    "Proposal",
    "SpeculationStats",
    "acceptance_ratio",
    "decode",
    "lookup",
    "truncate_caches",
    "verify",
]

#: Longest n-gram prompt lookup matches (it tries this length first, then shorter ones).
MAX_NGRAM = 3
#: Tokens a draft model proposes in its first round, and at most (see AdaptiveLength).
DRAFT_START = 5
DRAFT_MAX = 16
#: Most plain steps between two proposals while proposals keep failing (see AdaptiveLength).
MAX_PAUSE = 32

#: ``process(logits (B, V), ids (B, S)) -> (B, V)``: the caller's logits processing (penalty,
#: temperature, top-k, top-p), applied to the model's and the draft's logits alike.
Process = Callable[[Tensor, Tensor], Tensor]


class Decoder(Protocol):
    """What speculative decoding needs of a model or draft (:class:`attnkit.TransformerLM`)."""

    config: Any
    max_seq_len: int
    training: bool

    def __call__(self, input_ids: Tensor, mask: Tensor | None = None, **kwargs: Any) -> Any: ...

    def make_kv_caches(self, batch_size: int, capacity: int) -> list[KVCache]: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


@dataclass
class SpeculationStats:
    """Counts of one generation: proposed tokens verified and kept (per unfinished row), rounds
    (forwards that verified a proposal; a step without one is a plain step, not counted).

    Pass one as ``generate(..., speculation_stats=stats)`` to read the acceptance rate after.
    """

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Kept share of the proposed tokens (``0.0`` when none were proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(frozen=True)
class Proposal:
    """Proposed tokens of a round.

    Attributes:
        tokens: ``(B, k)`` proposed ids (past a row's ``lengths`` any id: never kept).
        lengths: ``(B,)`` how many of each row's tokens are proposals.
        q: ``(B, k, V)`` the proposer's probabilities when it sampled; ``None`` for a point
            mass (a lookup, or greedy drafting).
    """

    tokens: Tensor
    lengths: Tensor
    q: Tensor | None = None


class AdaptiveLength:
    """How many tokens to propose next: ``+2`` after a round that kept all, ``-1`` (at least 1)
    after one that did not (``transformers``' heuristic), at most ``maximum``.

    Rounds that keep nothing in a row also pause the proposals (``propose()`` gives 0: a plain
    step) for 2, 6, 14, ... up to :data:`MAX_PAUSE` steps: verifying a rejected proposal costs
    more than a plain step where a forward's time grows with its tokens, so proposals that keep
    failing are tried less and less often; the first kept token ends the pause.

    Raises:
        ValueError: Unless ``1 <= start <= maximum``.
    """

    def __init__(self, start: int, maximum: int) -> None:
        if not 1 <= start <= maximum:
            raise ValueError(f"need 1 <= start <= maximum, got start={start}, maximum={maximum}")
        self.k, self.maximum = start, maximum
        self.failures = 0  # rounds in a row that kept nothing
        self.pause = 0  # steps left without proposals

    def propose(self) -> int:
        """The length of the next proposal (0 while paused)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.k

    def update(self, kept: int, proposed: int) -> None:
        """Record a round that proposed ``proposed`` tokens and kept ``kept`` of them."""
        if proposed == 0:  # nothing was proposed: nothing learned
            return
        self.k = min(self.k + 2, self.maximum) if kept >= proposed else max(1, self.k - 1)
        self.failures = 0 if kept else self.failures + 1
        self.pause = min((1 << self.failures) - 2, MAX_PAUSE) if self.failures > 1 else 0


def lookup(tokens: list[int], num_tokens: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``num_tokens`` tokens that followed an earlier occurrence of the last n-gram of
    ``tokens``, trying ``n = max_ngram`` down to 1; ``[]`` when none occurs.

    The most recent occurrence with ``num_tokens`` tokens after it wins. Without one, every
    occurrence lies so close to the end that the text since it is a loop in the making: the
    most recent occurrence's continuation is copied on past the end as that loop repeats (an
    overlapping copy, as LZ77 decodes one), so a run of one token proposes ``num_tokens`` more
    of it instead of one.
    """
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), 0, -1):
        tail = tokens[size - n :]
        nearest = -1
        for start in range(size - n - 1, -1, -1):  # most recent first, the tail itself excluded
            if tokens[start : start + n] == tail:
                begin = start + n
                if begin + num_tokens <= size:
                    return tokens[begin : begin + num_tokens]
                nearest = begin if nearest < 0 else nearest
        if nearest >= 0:
            period = size - nearest
            return [tokens[nearest + i % period] for i in range(num_tokens)]
    return []


def _pad_rows(rows: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    width = max((len(r) for r in rows), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
    return tokens, lengths


class PromptLookup:
    """Propose the continuation of the last n-gram's earlier occurrence in the prompt or the
    output (real tokens only: left padding is skipped)."""

    def __init__(self, max_ngram: int = MAX_NGRAM) -> None:
        self.max_ngram = max_ngram

    def propose(
        self, ids: Tensor, positions: Tensor, full_mask: Tensor | None, k: int, active: Tensor
    ) -> Proposal:
        """Up to ``k`` tokens per unfinished (``active``) row. Shape: ids ``(B, S)``."""
        S = ids.shape[1]
        rows: list[list[int]] = []
        for i, row in enumerate(ids.tolist()):
            if k == 0 or not bool(active[i]):
                rows.append([])
                continue
            first = 0 if full_mask is None else S - int(full_mask[i, :S].sum())
            rows.append(lookup(row[first:], k, self.max_ngram))
        tokens, lengths = _pad_rows(rows, ids.device)
        return Proposal(tokens, lengths)

    def start(self, caches: list[KVCache]) -> None:
        """Nothing read from the model's caches."""

    def rollback(self, length: int) -> None:
        """Nothing cached."""

    def close(self) -> None:
        """Nothing to restore."""


class DraftModel:
    """Propose with a draft decoder, one token at a time with its own KV cache, or with the
    model's (``model_cache``).

    With ``model_cache`` (a self-draft: the model's own layers with quantized weights, so the
    caches have the same shapes) the draft reads the model's keys and values of every position
    the model has computed and writes its own only for the tokens it proposes, which the model's
    verifying forward then overwrites. Its own keys and values of those positions would be near
    copies of the model's, and computing them costs a second prefill of the prompt and a second
    forward of every kept token; proposals are only proposals, so the output is the model's
    either way.

    Args:
        draft: The draft (same vocabulary as the model).
        batch_size: Rows decoded.
        capacity: Cache slots (the prompt plus every new token).
        process: The logits processing of the model's tokens, applied to the draft's too.
        greedy: Propose argmax tokens (a point mass); else sample them from ``q``.
        generator: The sampling's generator.
        model_cache: Read and write the model's caches (handed over by :meth:`start`).
    """

    def __init__(
        self,
        draft: Decoder,
        batch_size: int,
        capacity: int,
        process: Process,
        *,
        greedy: bool,
        generator: torch.Generator | None = None,
        model_cache: bool = False,
    ) -> None:
        self.draft, self.process, self.greedy, self.generator = draft, process, greedy, generator
        self.model_cache = model_cache
        self.caches = [] if model_cache else draft.make_kv_caches(batch_size, capacity)
        self.length = 0  # positions of the sequence in the draft's cache
        self.was_training = draft.training
        draft.eval()

    def start(self, caches: list[KVCache]) -> None:
        """The model's caches after the prompt: kept to read and write with ``model_cache``."""
        if self.model_cache:
            self.caches = caches

    def propose(
        self, ids: Tensor, positions: Tensor, full_mask: Tensor | None, k: int, active: Tensor
    ) -> Proposal:
        """``k`` tokens per row, fed the sequence's positions the cache lacks first."""
        B = ids.shape[0]
        tokens: list[Tensor] = []
        probs: list[Tensor] = []
        history = ids
        if self.model_cache:  # (the model's cache holds every position but the last token's)
            self.length = self.caches[0].length if self.caches else 0
        step_ids, step_pos = ids[:, self.length :], positions[:, self.length :]
        for _ in range(k):
            end = self.length + step_ids.shape[1]
            mask = None if full_mask is None else full_mask[:, :end]
            with torch.inference_mode():
                raw = self.draft(
                    step_ids, mask, positions=step_pos, kv_caches=self.caches, logits_to_keep=1
                )[:, -1]
            self.length = end
            logits = self.process(raw, history)  # (B, V)
            if self.greedy:
                token = logits.argmax(dim=-1)
            else:
                q = logits.softmax(dim=-1)
                token = torch.multinomial(q, 1, generator=self.generator)[:, 0]
                probs.append(q)
            tokens.append(token)
            history = torch.cat([history, token[:, None]], dim=1)
            step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1
        if not tokens:
            empty = ids.new_zeros(B, 0)
            return Proposal(empty, ids.new_zeros(B))
        q_all = torch.stack(probs, dim=1) if probs else None  # (B, k, V)
        return Proposal(torch.stack(tokens, dim=1), ids.new_full((B,), k), q_all)

    def rollback(self, length: int) -> None:
        """Forget cached positions from ``length`` on (those past the kept tokens); the model's
        caches, with ``model_cache``, are the model's to cut."""
        if self.model_cache:
            return
        self.length = min(self.length, length)
        truncate_caches(self.caches, self.length)

    def close(self) -> None:
        """Give the draft its training mode back."""
        self.draft.train(self.was_training)


def truncate_caches(caches: list[KVCache], length: int) -> None:
    """Roll every cache back to its first ``length`` positions."""
    for cache in caches:
        if cache.length > length:
            cache.truncate(length)


def acceptance_ratio(p: Tensor, q: Tensor) -> Tensor:
    """Probability of keeping a proposed token: ``min(1, p / q)`` (the rule that makes the kept
    tokens follow ``p``)."""
    return (p / q).clamp(max=1.0)


def verify(
    logits: Tensor,
    proposal: Proposal,
    active: Tensor,
    *,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, int]:
    """Decide which proposed tokens to keep and choose the model's token after them.

    Args:
        logits: The model's processed logits at the ``k + 1`` positions (after the last token,
            then after each proposed one).
        proposal: The round's proposal (``k`` tokens).
        active: ``(B,)`` rows not yet ended (ended rows never limit the others).
        greedy: Keep a token iff it is the argmax; else speculative sampling's rule.
        generator: The sampling's generator.

    Returns:
        ``(tokens (B, n + 1), n)``: ``n`` proposed tokens kept by every active row, then each
        row's token at column ``n`` (its own proposal where that row kept it, else the model's
        choice).

    Shape:
        logits ``(B, k + 1, V)``.
    """
    draft, lengths, q = proposal.tokens, proposal.lengths, proposal.q
    B, k = draft.shape
    valid = torch.arange(k, device=draft.device) < lengths[:, None]  # (B, k)
    if greedy:
        target = logits.argmax(dim=-1)  # (B, k + 1)
        keep = (draft == target[:, :k]) & valid
    else:
        p = logits.softmax(dim=-1)  # (B, k + 1, V)
        p_x = p[:, :k].gather(-1, draft[..., None])[..., 0]  # (B, k)
        q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft[..., None])[..., 0]
        u = torch.rand(B, k, generator=generator, device=draft.device)
        keep = (u < acceptance_ratio(p_x, q_x)) & valid
    kept = keep.long().cumprod(dim=1).sum(dim=1)  # (B,) each row's agreeing prefix
    kept = torch.where(active, kept, k)
    n = int(kept.min()) if B else 0
    if greedy:
        own = target[:, n]
    else:
        p_n = p[:, n]  # (B, V)
        if n < k:  # the residual of a rejected proposal: max(0, p - q), normalized
            if q is None:
                q_n = torch.zeros_like(p_n).scatter(-1, draft[:, n : n + 1], 1.0)
            else:
                q_n = q[:, n]
            residual = (p_n - q_n * valid[:, n : n + 1]).clamp(min=0)
            total = residual.sum(dim=-1, keepdim=True)
            p_n = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)
        own = torch.multinomial(p_n, 1, generator=generator)[:, 0]
    if n < k:
        own = torch.where(kept > n, draft[:, n], own)
    return torch.cat([draft[:, :n], own[:, None]], dim=1), n


@torch.no_grad()
def decode(
    lm: Decoder,
    ids: Tensor,
    positions: Tensor,
    full_mask: Tensor | None,
    max_new_tokens: int,
    *,
    proposer: PromptLookup | DraftModel,
    length: AdaptiveLength,
    process: Process,
    greedy: bool,
    eos: Tensor | None,
    pad_token_id: int | None,
    generator: torch.Generator | None = None,
    stats: SpeculationStats | None = None,
) -> Iterator[Tensor]:
    """Yield each new column ``(B,)`` of tokens, proposed and verified a round at a time.

    The prompt fills the model's cache; then each round the proposer offers up to
    ``length.k`` tokens, the model runs the last token and the proposals in one cached forward,
    :func:`verify` keeps a prefix and adds the model's token, and the caches are cut back to the
    kept positions. Arguments as :func:`attnkit.generation.generate` checks them (``full_mask``:
    ``(B, P + max_new_tokens)`` real-token mask, ``None`` without padding).
    """
    B, P = ids.shape
    stats = stats if stats is not None else SpeculationStats()
    unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
    was_training = lm.training
    lm.eval()
    caches = lm.make_kv_caches(B, P + max_new_tokens)
    try:
        mask = None if full_mask is None else full_mask[:, :P]
        with torch.inference_mode():
            raw = lm(ids, mask, positions=positions, kv_caches=caches, logits_to_keep=1)
        logits = process(raw[:, -1], ids)
        proposer.start(caches)
        first = logits.argmax(dim=-1) if greedy else _sample(logits, generator)
        columns = first[:, None]
        produced = 0
        while True:
            for column in columns.unbind(dim=1):  # emit, ending rows at eos
                if eos is not None:
                    column = torch.where(unfinished, column, pad_token_id)  # type: ignore[arg-type]
                    unfinished &= ~torch.isin(column, eos)
                ids = torch.cat([ids, column[:, None]], dim=1)
                positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
                produced += 1
                yield column
                if (eos is not None and not bool(unfinished.any())) or produced == max_new_tokens:
                    return
            S = ids.shape[1]  # the cache holds all but the last token
            k = min(length.propose(), max_new_tokens - produced - 1)
            proposal = proposer.propose(ids, positions, full_mask, k, unfinished)
            k = proposal.tokens.shape[1]
            if k == 0:  # nothing proposed (paused, or no match): a plain decoding step
                mask = None if full_mask is None else full_mask[:, :S]
                with torch.inference_mode():
                    raw = lm(
                        ids[:, -1:], mask, positions=positions[:, -1:], kv_caches=caches,
                        logits_to_keep=1,
                    )  # fmt: skip
                logits = process(raw[:, -1], ids)
                token = logits.argmax(dim=-1) if greedy else _sample(logits, generator)
                columns = token[:, None]
                proposer.rollback(S)
                continue
            step_ids = torch.cat([ids[:, -1:], proposal.tokens], dim=1)  # (B, k + 1)
            step_pos = positions[:, -1:] + torch.arange(k + 1, device=ids.device)  # (B, k + 1)
            mask = None if full_mask is None else full_mask[:, : S + k]
            truncate_caches(caches, S - 1)  # (a draft that shares them wrote its proposals)
            with torch.inference_mode():
                raw = lm(step_ids, mask, positions=step_pos, kv_caches=caches)  # (B, k + 1, V)
            history = torch.cat([ids, proposal.tokens], dim=1)
            logits = torch.stack(
                [process(raw[:, j], history[:, : S + j]) for j in range(k + 1)], dim=1
            )
            columns, n = verify(logits, proposal, unfinished, greedy=greedy, generator=generator)
            truncate_caches(caches, S + n)
            proposer.rollback(S + n)
            offered = int(proposal.lengths[unfinished].sum())
            stats.proposed += offered
            stats.accepted += min(n * int(unfinished.sum()), offered)
            stats.rounds += 1
            length.update(n, int(proposal.lengths.max()) if B else 0)
    finally:
        proposer.close()
        lm.train(was_training)


def _sample(logits: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]
