"""Built-in sequence tasks, generated on the fly from a seeded ``torch.Generator`` (no downloads).

Every task is sequence tagging for a non-causal encoder: an input row of ``seq_len`` token ids
and a target row of the same length, with :data:`IGNORE` where nothing is scored.

* ``reverse``: output ``i`` is input ``n-1-i``. Order-dependent; a trained head attends along
  the anti-diagonal. The fastest task that shows attention clearly: the lab's default.
* ``copy``: the first half holds symbols, the second half blanks; each blank must output the
  symbol ``n/2`` positions earlier (an offset diagonal).
* ``sort``: output ``i`` is the ``i``-th smallest input symbol.
* ``recall``: associative recall (the induction-head task): ``k1 v1 k2 v2 ... ? k`` with distinct
  keys; the last position must output the value stored with key ``k``.

Held-out evaluation: a polynomial hash of the input row puts about one sequence in
:data:`HELD_OUT_MODULUS` into the evaluation split. Training batches never contain such a row, so
the evaluation accuracy is measured on sequences the model has never seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "HELD_OUT_MODULUS",
    "IGNORE",
    "TASKS",
    "Task",
    "get_task",
    "is_held_out",
]

IGNORE = -100  # target id that the loss and accuracy skip (torch's cross_entropy default)
HELD_OUT_MODULUS = 7  # one input sequence in 7 (by hash) is reserved for evaluation

_SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_SPECIALS = ("_", "?")  # blank (copy), query marker (recall)
_HASH_PRIME = 2_147_483_647  # 2^31 - 1
_HASH_BASE = 1_000_003


@dataclass(frozen=True)
class Task:
    """A task family at a given sequence length and alphabet size.

    Symbols are ids ``0 .. num_symbols-1``; the blank is ``num_symbols`` and the query marker
    ``num_symbols + 1``, so ``vocab_size = num_symbols + 2`` for every task.

    Attributes:
        name: One of :data:`TASKS`.
        seq_len: Tokens per sequence ``n``.
        num_symbols: Alphabet size.
    """

    name: str
    seq_len: int
    num_symbols: int

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}; valid tasks: {', '.join(TASKS)}")
        for field, value in (("seq_len", self.seq_len), ("num_symbols", self.num_symbols)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.num_symbols > len(_SYMBOLS):
            raise ValueError(f"num_symbols must be <= {len(_SYMBOLS)}, got {self.num_symbols}")
        TASKS[self.name].check(self.seq_len, self.num_symbols)

    @property
    def vocab_size(self) -> int:
        """Input/output vocabulary: the symbols plus the blank and query marker."""
        return self.num_symbols + len(_SPECIALS)

    @property
    def description(self) -> str:
        """One line saying what the task asks."""
        return TASKS[self.name].description

    def with_seq_len(self, seq_len: int) -> Task:
        """The same task at another length (for length-generalization tests)."""
        return Task(self.name, seq_len, self.num_symbols)

    def sample(self, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Draw ``batch`` random sequences (either split).

        Returns:
            ``(inputs, targets)``, int64, targets :data:`IGNORE` where not scored.

        Shape:
            ``(batch, seq_len)`` each.
        """
        return TASKS[self.name].make(batch, self.seq_len, self.num_symbols, generator)

    def sample_split(
        self, batch: int, generator: torch.Generator, *, held_out: bool
    ) -> tuple[Tensor, Tensor]:
        """Draw ``batch`` sequences from the training (``held_out=False``) or evaluation split.

        Rejection sampling: rows of the other split are dropped and more are drawn.

        Raises:
            ValueError: If the split is empty (tiny tasks) so no row can be found.
        """
        inputs, targets, have = [], [], 0
        for _ in range(100):
            need = batch - have
            if need <= 0:
                break
            draw = need * (HELD_OUT_MODULUS if held_out else 2) + 8
            x, y = self.sample(draw, generator)
            keep = is_held_out(x) == held_out
            inputs.append(x[keep][:need])
            targets.append(y[keep][:need])
            have += int(keep.sum().clamp(max=need))
        if have < batch:
            split = "evaluation" if held_out else "training"
            raise ValueError(
                f"task {self.name!r} with seq_len={self.seq_len}, num_symbols="
                f"{self.num_symbols} has (almost) no {split} sequences; make it larger"
            )
        return torch.cat(inputs)[:batch], torch.cat(targets)[:batch]

    def sources(self, inputs: Tensor) -> Tensor:
        """Where the answer is: ``True`` at (i, j) if key ``j`` holds what query ``i`` needs.

        Reverse: the anti-diagonal; copy: the offset diagonal; sort: the positions holding the
        ``i``-th smallest symbol; recall: the matching key and the value after it. Rows that are
        not scored are all ``False``. Used to find the head that learned the task.

        Shape:
            inputs ``(B, n)`` -> ``(B, n, n)`` bool.
        """
        n = inputs.shape[-1]
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        if self.name == "reverse":
            return (j == n - 1 - i).expand(inputs.shape[0], n, n)
        if self.name == "copy":
            half = n // 2
            return ((j == i - (n - half)) & (i >= n - half)).expand(inputs.shape[0], n, n)
        if self.name == "sort":
            wanted = inputs.sort(-1).values  # (B, n)
            return wanted[:, :, None] == inputs[:, None, :]  # (B, n, n)
        out = torch.zeros(inputs.shape[0], n, n, dtype=torch.bool)
        is_key = torch.zeros(n, dtype=torch.bool)
        is_key[0 : n - 2 : 2] = True
        match = (inputs == inputs[:, -1:]) & is_key  # (B, n): the matching key
        out[:, -1] = match | torch.roll(match, 1, dims=-1)  # the key and its value
        return out

    def labels(self, ids: Sequence[int] | Tensor) -> list[str]:
        """Readable token labels for plots: letters for symbols, ``_`` blank, ``?`` query."""
        table = _SYMBOLS[: self.num_symbols] + "".join(_SPECIALS)
        return [table[int(i)] if 0 <= int(i) < len(table) else "·" for i in ids]


def is_held_out(inputs: Tensor) -> Tensor:
    """Whether each input row belongs to the evaluation split (hash of its tokens).

    Shape:
        inputs ``(B, n)`` int -> ``(B,)`` bool.
    """
    n = inputs.shape[-1]
    powers = torch.ones(n, dtype=torch.int64)
    for i in range(1, n):
        powers[i] = powers[i - 1] * _HASH_BASE % _HASH_PRIME
    h = (inputs.to(torch.int64) + 1) * powers  # each term < 2^37: no overflow for n < 2^20
    h = h.sum(-1) % _HASH_PRIME
    h = (h * 2_654_435_761) % (1 << 32)  # Knuth's multiplicative mix spreads the residues
    return (h >> 8) % HELD_OUT_MODULUS == 0


# --------------------------------------------------------------------------- the task families


@dataclass(frozen=True)
class _Family:
    description: str
    make: Callable[[int, int, int, torch.Generator], tuple[Tensor, Tensor]]
    check: Callable[[int, int], None]


def _symbols(batch: int, n: int, v: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, v, (batch, n), generator=gen)  # (B, n)


def _make_reverse(batch: int, n: int, v: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = _symbols(batch, n, v, gen)
    return x, x.flip(-1)


def _make_copy(batch: int, n: int, v: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    half = n // 2
    x = torch.full((batch, n), v, dtype=torch.int64)  # blanks
    x[:, :half] = _symbols(batch, half, v, gen)
    y = torch.full_like(x, IGNORE)
    y[:, n - half :] = x[:, :half]
    return x, y


def _make_sort(batch: int, n: int, v: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = _symbols(batch, n, v, gen)
    return x, x.sort(-1).values


def _make_recall(batch: int, n: int, v: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    pairs = (n - 2) // 2
    keys = torch.rand(batch, v, generator=gen).argsort(-1)[:, :pairs]  # distinct keys
    values = _symbols(batch, pairs, v, gen)
    x = torch.empty((batch, n), dtype=torch.int64)
    x[:, 0 : 2 * pairs : 2] = keys
    x[:, 1 : 2 * pairs : 2] = values
    x[:, -2] = v + 1  # "?"
    pick = torch.randint(0, pairs, (batch, 1), generator=gen)
    x[:, -1:] = keys.gather(-1, pick)
    y = torch.full_like(x, IGNORE)
    y[:, -1:] = values.gather(-1, pick)
    return x, y


def _check_any(n: int, v: int) -> None:
    if n < 2:
        raise ValueError(f"seq_len must be >= 2, got {n}")
    if v < 2:
        raise ValueError(f"num_symbols must be >= 2, got {v}")


def _check_copy(n: int, v: int) -> None:
    _check_any(n, v)
    if n % 2:
        raise ValueError(f"copy needs an even seq_len (symbols, then as many blanks), got {n}")


def _check_recall(n: int, v: int) -> None:
    _check_any(n, v)
    if n < 4 or n % 2:
        raise ValueError(f"recall needs an even seq_len >= 4 (key/value pairs, '?', key), got {n}")
    if (n - 2) // 2 > v:
        raise ValueError(
            f"recall needs distinct keys: (seq_len - 2) / 2 = {(n - 2) // 2} pairs but only "
            f"num_symbols={v}"
        )


TASKS: dict[str, _Family] = {
    "reverse": _Family("output i is input n-1-i", _make_reverse, _check_any),
    "copy": _Family("each blank outputs the symbol n/2 positions earlier", _make_copy, _check_copy),
    "sort": _Family("output i is the i-th smallest input symbol", _make_sort, _check_any),
    "recall": _Family(
        "associative recall: after '?' and a key, output its value", _make_recall, _check_recall
    ),
}


def get_task(name: str, *, seq_len: int, num_symbols: int) -> Task:
    """Look up a task by name.

    Raises:
        ValueError: For an unknown name (the message lists the valid ones) or sizes that do
            not fit the task.
    """
    return Task(name, seq_len, num_symbols)
