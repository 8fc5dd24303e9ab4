"""Autoregressive generation for :class:`attnkit.TransformerLM`, as ``transformers`` users expect.

* Batches of prompts of different lengths, **left-padded**, with an ``attention_mask``
  (``True``/1 = real token). Positions come from the mask as ``transformers`` computes them
  (``cumsum - 1``, padding at 1), and the padding mask is carried through the preallocated KV
  cache, so each row gives the tokens it would give alone.
* ``eos_token_id`` (one id or several): a row that produced one is padded with ``pad_token_id``
  from then on; generation stops when every row has ended (the result is then shorter than
  ``P + max_new_tokens``).
* Greedy decoding (``temperature=0``) or sampling with ``temperature``, ``top_k``, ``top_p`` and a
  ``generator``; an optional ``repetition_penalty``. The logits are processed in ``transformers``'
  order: repetition penalty, temperature, top-k, top-p.
* :func:`stream` yields each new column of tokens as soon as it is chosen; :func:`generate`
  collects them.
* Speculative decoding (``prompt_lookup_num_tokens=``, ``assistant_model=``): proposed tokens
  verified by the model in one forward (:mod:`attnkit.speculative`), same tokens (greedy) or
  same distribution (sampling).

A sliding-window model keeps its window in cached decoding: the attention kernel applies it
over cache positions, so a new token sees at most ``window`` keys.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch
from torch import Tensor, nn

from attnkit import decoding, speculative
from attnkit.cache import KVCache
from attnkit.config import TransformerConfig
from attnkit.kernels import policy
from attnkit.positional import reserved_rotary_tables

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "CausalLM",
    "GenerationOptions",
    "compiled_steps_fuse",
    "generate",
    "positions_from_mask",
    "process_logits",
    "stream",
]


class CausalLM(Protocol):
    """What generation needs of a model (:class:`attnkit.TransformerLM` is one).

    ``lm(input_ids, mask, positions=, kv_caches=, cache_position=, logits_to_keep=)`` returns
    next-token logits; ``make_kv_caches(batch_size, capacity)`` one cache per layer.
    """

    config: TransformerConfig
    max_seq_len: int
    training: bool

    def __call__(self, input_ids: Tensor, mask: Tensor | None = None, **kwargs: Any) -> Any: ...

    def make_kv_caches(self, batch_size: int, capacity: int) -> list[KVCache]: ...

    def parameters(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


def _device(lm: CausalLM) -> torch.device:
    return next(iter(lm.parameters())).device


@dataclass(frozen=True)
class GenerationOptions:
    """How to choose each next token.

    Attributes:
        temperature: ``0`` = greedy (argmax); otherwise sample from ``softmax(logits / T)``.
        top_k: Sample only among the ``top_k`` most likely tokens.
        top_p: Sample only from the smallest set of tokens whose probability reaches ``top_p``.
        repetition_penalty: ``> 1`` makes tokens already in the sequence less likely
            (``transformers``' rule: positive logits divided, negative multiplied).

    Raises:
        ValueError: For out-of-range values (naming them).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        t, k, p, r = self.temperature, self.top_k, self.top_p, self.repetition_penalty
        if not _is_real(t):
            raise TypeError(f"temperature must be a number, got {t!r}")
        if not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        if k is not None and not _is_int(k):
            raise TypeError(f"top_k must be an int or None, got {k!r}")
        if k is not None and k < 1:
            raise ValueError(f"top_k must be positive, got {k}")
        if p is not None and not _is_real(p):
            raise TypeError(f"top_p must be a number or None, got {p!r}")
        if p is not None and not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        if r is not None and not _is_real(r):
            raise TypeError(f"repetition_penalty must be a number or None, got {r!r}")
        if r is not None and not (r > 0 and math.isfinite(r)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r}")
        # numpy scalars and other numbers.Integral/Real become plain Python numbers.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", None if k is None else int(k))
        object.__setattr__(self, "top_p", None if p is None else float(p))
        object.__setattr__(self, "repetition_penalty", None if r is None else float(r))


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def positions_from_mask(mask: Tensor) -> Tensor:
    """Positions of a left-padded batch: ``cumsum(mask) - 1``, with padding at position 1
    (what ``transformers`` computes; padded positions are never attended to).

    Shape:
        mask ``(B, S)`` -> ``(B, S)`` int64.
    """
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(~mask.bool(), 1)


def process_logits(
    logits: Tensor,
    ids: Tensor,
    options: GenerationOptions,
) -> Tensor:
    """Apply the repetition penalty, temperature, top-k and top-p to next-token logits.

    Args:
        logits: Next-token logits.
        ids: Every token so far (prompt, padding included, as ``transformers`` does).
        options: The generation options.

    Returns:
        Float32 logits; filtered tokens are ``-inf``. Greedy options only apply the penalty.

    Shape:
        logits ``(B, V)``, ids ``(B, S)`` -> ``(B, V)``.
    """
    logits = logits.float()
    if options.repetition_penalty is not None and options.repetition_penalty != 1.0:
        seen = logits.gather(-1, ids)  # (B, S)
        penalty = options.repetition_penalty
        seen = torch.where(seen < 0, seen * penalty, seen / penalty)
        logits = logits.scatter(-1, ids, seen)
    if options.temperature == 0:
        return logits
    logits = logits / options.temperature
    if options.top_k is not None and options.top_k < logits.shape[-1]:
        kth = logits.topk(options.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p is not None and options.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - options.top_p
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _pick(logits: Tensor, options: GenerationOptions, generator: torch.Generator | None) -> Tensor:
    """Greedy or sampled next token. Shape: ``(B, V) -> (B,)``."""
    if options.temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def _eos_tensor(eos: int | Sequence[int] | Tensor | None, device: torch.device) -> Tensor | None:
    """The eos ids as a tensor; ``None`` for no eos (``None`` or ``[]``)."""
    if eos is None:
        return None
    values: list[Any]
    if isinstance(eos, Tensor):
        values = eos.flatten().tolist()
    elif _is_int(eos):
        values = [eos]
    elif isinstance(eos, Sequence) and not isinstance(eos, str):
        values = list(eos)
    else:
        values = [eos]  # rejected below
    if not all(_is_int(v) for v in values):
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    if not values:  # [] turns off the model's default eos
        return None
    return torch.tensor([int(v) for v in values], dtype=torch.long, device=device)


def _check_inputs(
    lm: CausalLM,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None,
) -> Tensor | None:
    """Validate the prompts; return the mask as bool (``None`` when there is no padding)."""
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or input_ids.dtype == torch.bool
    ):
        raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (B, P) with P >= 1, got {tuple(input_ids.shape)}")
    if not _is_int(max_new_tokens):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    V = lm.config.vocab_size or 0
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= V):
        raise ValueError(
            f"token ids must be in [0, {V}), got min {int(input_ids.min())}, "
            f"max {int(input_ids.max())}"
        )
    P = input_ids.shape[1]
    total = P + max_new_tokens
    if total > lm.max_seq_len:
        raise ValueError(
            f"prompt ({P}) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds max_seq_len {lm.max_seq_len}"
        )
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool:
        if attention_mask.dtype.is_floating_point or not bool(
            ((attention_mask == 0) | (attention_mask == 1)).all()
        ):
            raise ValueError("attention_mask must be bool or hold only 0 and 1")
        attention_mask = attention_mask.bool()
    if not bool(attention_mask[:, -1].all()):
        rows = (~attention_mask[:, -1]).nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask must be left-padded (each prompt ends at the last column); "
            f"rows {rows} end with padding"
        )
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded: padding only before the tokens")
    return None if bool(attention_mask.all()) else attention_mask


class GenerateOptions(TypedDict, total=False):
    """The keyword options of :func:`generate`, :func:`stream` and ``TransformerLM.generate``.

    Attributes:
        attention_mask: ``(B, P)``, ``True``/1 = real token (left padding); default: none.
        pad_token_id: Fills the rows that ended; default the folder's, else the first eos.
        eos_token_id: An int or a list of ints ending a row; default ``lm.generation_config``'s
            (``[]``: none).
        temperature: ``0`` (default) = greedy; see :class:`GenerationOptions`.
        top_k: See :class:`GenerationOptions` (default ``None``).
        top_p: See :class:`GenerationOptions` (default ``None``).
        repetition_penalty: See :class:`GenerationOptions` (default ``None``).
        use_cache: Decode with a KV cache instead of re-running the prefix (default ``True``;
            same tokens).
        generator: The ``torch.Generator`` of the sampling (default: torch's global one).
        compile: Run each cached step as one compiled graph of the model's own forward
            (default ``False``; see :func:`attnkit.decoding.compiled_step`); the first call per
            batch size and length pays the compilation. A model whose stack runs in one kernel
            call (:mod:`attnkit.fused`) steps through that call instead, where the policy's
            ``decoding.compiled_step.<dtype>`` says so (measured once per machine on a small
            stack; ``graph`` compiles regardless).
        prompt_lookup_num_tokens: Speculative decoding proposing up to this many tokens copied
            from the earlier occurrence of the last n-gram (:class:`attnkit.speculative.
            PromptLookup`); default ``None`` (off).
        assistant_model: Speculative decoding with a draft decoder of the same vocabulary, or
            ``"int8"``/``"int4"``: the model's own weight-quantized copy (the model's
            ``self_draft``, built once); default ``None`` (off).
        speculation_stats: A :class:`attnkit.speculative.SpeculationStats` that speculative
            decoding fills in (proposed and kept tokens).
    """

    attention_mask: Tensor | None
    pad_token_id: int | None
    eos_token_id: int | Sequence[int] | None
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    use_cache: bool
    generator: torch.Generator | None
    compile: bool
    prompt_lookup_num_tokens: int | None
    assistant_model: Any
    speculation_stats: speculative.SpeculationStats | None


def stream(
    lm: CausalLM, input_ids: Tensor, max_new_tokens: int, **options: Unpack[GenerateOptions]
) -> Iterator[Tensor]:
    """Yield each new column of tokens ``(B,)`` as it is chosen (see :func:`generate`).

    The arguments are checked at once; the model runs in eval mode while the iterator is
    active and gets its mode back when it is exhausted or closed.

    Raises:
        ValueError: As :func:`generate`.
        TypeError: As :func:`generate`, and for an unknown option.
    """
    return _stream(lm, input_ids, max_new_tokens, False, **options)


def _stream(
    lm: CausalLM,
    input_ids: Tensor,
    max_new_tokens: int,
    unattended: bool,
    **options: Unpack[GenerateOptions],
) -> Iterator[Tensor]:
    """:func:`stream`; ``unattended``: the caller runs no code between the steps (generate)."""
    known = GenerateOptions.__optional_keys__
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown generation options {unknown}; known: {sorted(known)}")
    given: dict[str, Any] = dict(options)
    choice = GenerationOptions(
        **{f.name: given[f.name] for f in fields(GenerationOptions) if f.name in given}
    )
    attention_mask = options.get("attention_mask")
    pad_token_id, eos_token_id = options.get("pad_token_id"), options.get("eos_token_id")
    use_cache, compile = options.get("use_cache", True), options.get("compile", False)
    generator = options.get("generator")
    mask = _check_inputs(lm, input_ids, max_new_tokens, attention_mask)
    max_new_tokens = int(max_new_tokens)
    if not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {use_cache!r}")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {compile!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
    defaults = getattr(lm, "generation_config", {}) or {}
    if eos_token_id is None:
        eos_token_id = defaults.get("eos_token_id")
    if pad_token_id is None:
        pad_token_id = defaults.get("pad_token_id")
    device = _device(lm)
    eos = _eos_tensor(eos_token_id, device)
    if pad_token_id is None and eos is not None:
        pad_token_id = int(eos[0])  # transformers' fallback
    if pad_token_id is not None and not _is_int(pad_token_id):
        raise TypeError(f"pad_token_id must be an int or None, got {pad_token_id!r}")
    B, P = input_ids.shape
    ids = input_ids.to(device)
    # Real-token mask of the whole output, grown column by column; None = no padding anywhere.
    full_mask: Tensor | None = None
    if mask is None:
        positions = torch.arange(P, device=device).expand(B, P)  # (B, P)
    else:
        full_mask = torch.ones(B, P + max_new_tokens, dtype=torch.bool, device=device)
        full_mask[:, :P] = mask.to(device)
        positions = positions_from_mask(full_mask[:, :P])  # (B, P)
    speculation = _speculation(lm, options, P + max_new_tokens)
    if speculation is not None and max_new_tokens:
        if not use_cache or compile:
            raise ValueError(
                f"speculative decoding needs use_cache=True and compile=False, got "
                f"use_cache={use_cache}, compile={compile}"
            )
        draft, start, most = speculation
        greedy = choice.temperature == 0

        def process(raw: Tensor, history: Tensor) -> Tensor:
            return process_logits(raw, history, choice)

        proposer: speculative.PromptLookup | speculative.DraftModel
        if draft is None:
            proposer = speculative.PromptLookup()
        else:
            proposer = speculative.DraftModel(
                draft,
                B,
                P + max_new_tokens,
                process,
                greedy=greedy,
                generator=generator,
                model_cache=isinstance(options.get("assistant_model"), str),  # (a self-draft)
            )
        return speculative.decode(
            lm,
            ids,
            positions,
            full_mask,
            max_new_tokens,
            proposer=proposer,
            length=speculative.AdaptiveLength(start, most),
            process=process,
            greedy=greedy,
            eos=eos,
            pad_token_id=pad_token_id,
            generator=generator,
            stats=options.get("speculation_stats"),
        )
    return _decode(
        lm,
        ids,
        positions,
        full_mask,
        max_new_tokens,
        choice,
        eos,
        pad_token_id,
        use_cache,
        generator,
        compile,
        unattended,
    )


def _speculation(
    lm: CausalLM, options: GenerateOptions, capacity: int
) -> tuple[Any, int, int] | None:
    """``(draft or None for prompt lookup, first length, most tokens)`` of the speculative options,
    ``None`` without them.

    Raises:
        ValueError: Both given, a bad length, an unknown shortcut, another vocabulary or a draft
            too short for ``capacity`` positions.
        TypeError: A length that is no int, a draft that is no decoder.
    """
    num = options.get("prompt_lookup_num_tokens")
    draft = options.get("assistant_model")
    stats = options.get("speculation_stats")
    if stats is not None and not isinstance(stats, speculative.SpeculationStats):
        raise TypeError(f"speculation_stats must be a SpeculationStats, got {stats!r}")
    if num is not None and draft is not None:
        raise ValueError(
            f"give prompt_lookup_num_tokens ({num}) or assistant_model ({draft!r}), not both"
        )
    if num is not None:
        if not _is_int(num):
            raise TypeError(f"prompt_lookup_num_tokens must be an int, got {num!r}")
        if num < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {num}")
        return None, int(num), int(num)
    if draft is None:
        return None
    if isinstance(draft, str):
        if draft not in ("int8", "int4"):
            raise ValueError(f"assistant_model must be a model, 'int8' or 'int4', got {draft!r}")
        build = getattr(lm, "self_draft", None)
        if build is None:
            raise TypeError(f"{type(lm).__name__} has no self_draft for assistant_model={draft!r}")
        draft = build(draft)
    if not callable(draft) or not hasattr(draft, "make_kv_caches"):
        raise TypeError(f"assistant_model must be a decoder, got {type(draft).__name__}")
    mine, theirs = lm.config.vocab_size, getattr(draft.config, "vocab_size", None)
    if mine != theirs:
        raise ValueError(
            f"assistant_model must share the model's vocabulary: vocab_size {theirs} != {mine}"
        )
    if draft.max_seq_len < capacity:
        raise ValueError(
            f"assistant_model's max_seq_len {draft.max_seq_len} is shorter than the "
            f"{capacity} positions to generate"
        )
    return draft, speculative.DRAFT_START, speculative.DRAFT_MAX


#: Left padding, as a share of a batch's prompt positions, from which the prompts are filled in
#: a few at a time from their first real tokens instead of as one padded batch (see
#: _left_padding); each group of neighbouring prompts keeps its own padding below this share.
SPLIT_PREFILL_PADDING = 0.25
#: Real tokens up to which neighbouring prompts fill in together (see _prefill_groups): a
#: forward of a few dozen rows costs about a read of every weight, while GEMMs of a few hundred
#: rows run near their peak, so past that, padding only adds work.
PREFILL_RUN_TOKENS = 256


def _left_padding(mask: Tensor | None) -> list[int] | None:
    """Each prompt's first real column, where the batch is left-padded enough to fill the
    prompts in a few at a time (padding at least :data:`SPLIT_PREFILL_PADDING` of the
    positions); otherwise ``None``. (``mask`` is left-padding, each row ending in a real token:
    checked by ``_check_inputs``.)

    Padded positions cost a padded batch's prefill as much compute as real ones, so a batch of
    prompts of unequal lengths pays for its padding unless it is filled in by parts.
    """
    if mask is None or mask.shape[0] < 2:
        return None
    B, P = mask.shape
    lengths = mask.sum(1).tolist()
    if B * P - sum(lengths) < SPLIT_PREFILL_PADDING * B * P:
        return None
    return [P - n for n in lengths]


def _prefill_groups(starts: list[int], width: int) -> list[tuple[int, int, int]]:
    """Runs of neighbouring prompts filled in together: ``(first row, end row, first column)``
    each (``starts``: each row's first real column of ``width``). A run takes the next prompt
    while their real tokens stay within :data:`PREFILL_RUN_TOKENS` and their padding below
    :data:`SPLIT_PREFILL_PADDING` of their positions.

    Each forward reads every weight once, so short prompts cost less a few at a time than one
    at a time: the read is shared while the rows are still too few to keep the matrix products
    busy. Longer prompts keep them busy on their own, so grouping them only adds padded work;
    :data:`PREFILL_RUN_TOKENS` ends a run there.
    """
    groups: list[tuple[int, int, int]] = []
    first = 0
    while first < len(starts):
        end = first + 1
        while end < len(starts) and _joins(starts[first : end + 1], width):
            end += 1
        groups.append((first, end, min(starts[first:end])))
        first = end
    return groups


def _joins(starts: list[int], width: int) -> bool:
    """Whether these rows (the last one joining the others) run together: their real tokens
    within :data:`PREFILL_RUN_TOKENS`, the share of padded positions (run from the earliest of
    their ``starts``) below :data:`SPLIT_PREFILL_PADDING`."""
    real = sum(width - s for s in starts)
    positions = len(starts) * (width - min(starts))
    return real <= PREFILL_RUN_TOKENS and positions - real < SPLIT_PREFILL_PADDING * positions


def _prefill_runs(
    lm: CausalLM,
    ids: Tensor,
    mask: Tensor,
    positions: Tensor,
    caches: list[KVCache],
    starts: list[int],
) -> Tensor:
    """The prompts' last logits ``(B, V)``, the prompts run a few at a time
    (:func:`_prefill_groups`), each run from its first real column (``starts``: each row's)
    with its keys/values stored at the same slots as a padded batch would store them
    (:meth:`attnkit.KVCache.slots`); the caches then hold every prompt slot."""
    last = []
    for first, end, start in _prefill_groups(starts, ids.shape[1]):
        parts = [cache.slots(first, start, end - first) for cache in caches]
        padded = max(starts[first:end]) > start  # (a run's shorter prompts: left padding)
        logits = lm(
            ids[first:end, start:],
            mask[first:end, start:] if padded else None,
            positions=positions[first:end, start:],
            kv_caches=parts,
            logits_to_keep=1,
        )
        last.append(logits[:, -1])
    for cache in caches:
        cache.length = ids.shape[1]
    return torch.cat(last)


def compiled_steps_fuse(lm: CausalLM, batch: int = 1) -> bool:
    """Whether ``generate(lm, ..., compile=True)`` steps by ``lm``'s one-call fused step instead
    of a compiled graph (deciding the policy's choice, measured at its first use): the
    model says its stack runs in one (``fuses_steps``), and the policy prefers that call for
    its activations' dtype (the embedding's) and ``batch`` sequences."""
    fuses = getattr(lm, "fuses_steps", None)
    if not callable(fuses) or not fuses():
        return False
    table = getattr(getattr(lm, "embedding", None), "weight", None)
    dtype = table.dtype if isinstance(table, Tensor) else torch.float32
    return policy.compiled_step_fuses(dtype, batch)


@torch.no_grad()
def _decode(
    lm: CausalLM,
    ids: Tensor,
    positions: Tensor,
    full_mask: Tensor | None,
    max_new_tokens: int,
    options: GenerationOptions,
    eos: Tensor | None,
    pad_token_id: int | None,
    use_cache: bool,
    generator: torch.Generator | None,
    compile: bool = False,
    unattended: bool = False,
) -> Iterator[Tensor]:
    """The decoding loop of :func:`stream` (arguments validated there).

    With the cache, the prompt runs once through the model, filling one preallocated
    :class:`attnkit.KVCache` per layer, then each step runs one token per sequence through the
    model's own forward (``compile``: as one compiled graph over the whole static cache, the
    slot given as a tensor); without it, the whole prefix goes through the model again.
    ``unattended`` (no caller code between the steps): compiled steps after the first check only
    the guards that tell their graphs apart (:func:`attnkit.decoding.differentiating_guards_only`).
    """
    B, P = ids.shape
    capacity = P + max_new_tokens
    if compile and use_cache and compiled_steps_fuse(lm, B):
        compile = False
    if compile:
        # The compiled step has one graph per cache capacity: a power of two (at least 256,
        # within max_seq_len) lets calls of other lengths reuse it instead of recompiling.
        bucket = max(256, 1 << (capacity - 1).bit_length())
        capacity = max(capacity, min(bucket, getattr(lm, "max_seq_len", capacity)))
        if full_mask is not None and full_mask.shape[1] < capacity:  # slots past the end
            extra = full_mask.new_ones(B, capacity - full_mask.shape[1])
            full_mask = torch.cat([full_mask, extra], dim=1)
    unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
    was_training = lm.training
    lm.eval()
    caches = lm.make_kv_caches(B, capacity) if use_cache and max_new_tokens else None
    step_fn = decoding.compiled_step(lm) if compile and caches is not None else lm
    tables = contextlib.ExitStack()
    if step_fn is not lm and isinstance(lm, nn.Module) and positions.numel():
        # every position the steps will see (as many as the cache's slots at least, so that
        # nearby lengths share a graph): their rotary rows become lookups
        top = max(capacity, int(positions.max()) + max_new_tokens)
        tables.enter_context(reserved_rotary_tables(lm, top))
    try:
        step_ids, step_pos = ids, positions  # what the next forward reads
        for step in range(max_new_tokens):
            S = P + step
            if caches is None:  # re-run the whole prefix
                mask = None if full_mask is None else full_mask[:, :S]
                raw = lm(ids, mask, positions=positions, logits_to_keep=1)[:, -1]
            elif step == 0:  # prefill, eager: its shapes differ from every step's
                mask = None if full_mask is None else full_mask[:, :P]
                starts = _left_padding(mask)
                with torch.inference_mode():
                    if starts is not None and mask is not None:
                        raw = _prefill_runs(lm, ids, mask, positions, caches, starts)
                    else:
                        raw = lm(ids, mask, positions=positions, kv_caches=caches, logits_to_keep=1)
                        raw = raw[:, -1]
            elif compile:  # every slot, the one to write given as a tensor
                guards = (
                    decoding.differentiating_guards_only()
                    if unattended and step > 1
                    else contextlib.nullcontext()
                )
                with guards:
                    raw = step_fn(
                        step_ids,
                        full_mask,
                        positions=step_pos,
                        kv_caches=caches,
                        cache_position=torch.tensor([S - 1], device=ids.device),
                        logits_to_keep=1,
                    )[:, -1]
            else:
                mask = None if full_mask is None else full_mask[:, :S]
                with torch.inference_mode():
                    raw = lm(step_ids, mask, positions=step_pos, kv_caches=caches, logits_to_keep=1)
                raw = raw[:, -1]
            logits = process_logits(raw, ids, options)  # (B, V)
            next_id = _pick(logits, options, generator)  # (B,)
            if eos is not None:
                next_id = torch.where(unfinished, next_id, pad_token_id)  # type: ignore[arg-type]
                unfinished &= ~torch.isin(next_id, eos)
            next_pos = positions[:, -1:] + 1  # (B, 1): the last column is always real
            ids = torch.cat([ids, next_id[:, None]], dim=1)  # (B, S + 1)
            positions = torch.cat([positions, next_pos], dim=1)  # (B, S + 1)
            step_ids, step_pos = next_id[:, None], next_pos
            yield next_id
            if eos is not None and not bool(unfinished.any()):
                return
    finally:
        tables.close()
        lm.train(was_training)


def generate(
    lm: CausalLM,
    input_ids: Tensor,
    max_new_tokens: int,
    **options: Unpack[GenerateOptions],
) -> Tensor:
    """Extend each prompt by up to ``max_new_tokens`` tokens.

    Args:
        lm: The model (run in eval mode, its mode restored after).
        input_ids: Prompts ``(B, P)``, left-padded when of different lengths.
        max_new_tokens: Most tokens to add.
        **options: :class:`GenerateOptions` (``attention_mask``, ``pad_token_id``,
            ``eos_token_id``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``,
            ``use_cache``, ``generator``, ``compile``, ``prompt_lookup_num_tokens``,
            ``assistant_model``, ``speculation_stats``).

    Returns:
        ``(B, P + n)`` token ids, prompt included, with ``n <= max_new_tokens`` (fewer when
        every row ended with an eos token).

    Raises:
        ValueError: For bad shapes, right padding, out-of-range ids or options, or
            ``P + max_new_tokens > max_seq_len``.
        TypeError: For non-integer ids, a bad ``eos_token_id`` or an unknown option.
    """
    columns = list(_stream(lm, input_ids, max_new_tokens, True, **options))
    ids = input_ids.to(_device(lm))
    if not columns:
        return ids
    return torch.cat([ids, torch.stack(columns, dim=1)], dim=1)
