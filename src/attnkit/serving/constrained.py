"""Constrained decoding: ``response_format`` JSON (any object, or one JSON schema) through
xgrammar, as a per-request logits processor of the engine.

:class:`GrammarCache` holds a model's vocabulary as xgrammar reads it and compiles each grammar
once (keyed by the schema's text). :meth:`GrammarCache.processor` gives a fresh
``logits_processor(generated_ids, logits) -> logits`` for one request: it feeds xgrammar's matcher
the tokens generated since its last call, then sets the logits of every token the grammar forbids
next to ``-inf``. Once the JSON is complete, only the stop tokens remain allowed, so generation
ends there.

Needs ``xgrammar`` (the ``serve`` extra).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["GrammarCache", "LogitsProcessor", "vocab_type"]

LogitsProcessor = Callable[[list[int], Tensor], Tensor]


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError("response_format needs xgrammar: pip install 'attnkit[serve]'") from err
    return xgrammar


def vocab_type(tokenizer: Any) -> tuple[str, bool]:
    """How a ``tokenizers.Tokenizer`` spells its vocabulary: ``("byte_level" | "byte_fallback" |
    "raw", add_prefix_space)`` (what xgrammar needs to know to read token strings as bytes)."""
    spec = json.loads(tokenizer.to_str())

    def kinds(node: Any) -> list[str]:
        if not isinstance(node, dict):
            return []
        found = [str(node.get("type"))]
        for child in node.get("decoders", []) or node.get("pretokenizers", []) or []:
            found += kinds(child)
        return found

    decoders = kinds(spec.get("decoder"))
    pre = kinds(spec.get("pre_tokenizer"))
    if "ByteLevel" in decoders:
        return "byte_level", False
    if "ByteFallback" in decoders or (spec.get("model") or {}).get("byte_fallback"):
        prefix_space = "Metaspace" in pre or "Prepend" in json.dumps(spec.get("normalizer"))
        return "byte_fallback", prefix_space
    return "raw", False


class GrammarCache:
    """A model's vocabulary for xgrammar and its compiled grammars.

    Args:
        tokenizer: The model's ``tokenizers.Tokenizer``.
        vocab_size: Rows of the model's output head (may exceed the tokenizer's vocabulary).
        stop_ids: Tokens that end a reply (allowed once the JSON is complete).

    Raises:
        ValueError: If ``stop_ids`` is empty (a finished grammar could not end the reply).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_ids: Sequence[int]) -> None:
        if not stop_ids:
            raise ValueError("constrained decoding needs the model's stop token ids; it has none")
        xgr = _xgrammar()
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        size = max(vocab_size, max(vocab.values()) + 1)
        encoded = [""] * size
        for token, i in vocab.items():
            encoded[i] = token
        kind, prefix_space = vocab_type(tokenizer)
        info = xgr.TokenizerInfo(
            encoded,
            vocab_type=getattr(xgr.VocabType, kind.upper()),
            vocab_size=vocab_size,
            stop_token_ids=list(stop_ids),
            add_prefix_space=prefix_space,
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[str, Any] = {}
        self._lock = threading.Lock()

    def compile(self, schema: dict[str, Any] | bool | None) -> Any:
        """The compiled grammar of a JSON schema (``None``: any JSON object).

        Raises:
            ValueError: If xgrammar cannot compile the schema (naming its complaint).
        """
        key = json.dumps(schema, sort_keys=True)
        with self._lock:
            if key not in self._compiled:
                try:
                    if schema is None:
                        grammar = self.compiler.compile_json_schema(
                            {"type": "object"}, any_whitespace=False, strict_mode=False
                        )
                    else:
                        grammar = self.compiler.compile_json_schema(
                            json.dumps(schema), any_whitespace=False
                        )
                except Exception as err:  # xgrammar raises several of its own types
                    raise ValueError(f"the JSON schema cannot be used: {err}") from None
                self._compiled[key] = grammar
            return self._compiled[key]

    def processor(self, schema: dict[str, Any] | bool | None) -> LogitsProcessor:
        """A new logits processor that keeps one reply inside ``schema``'s JSON."""
        return _Matcher(self.compile(schema), self.vocab_size)


class _Matcher:
    """One request's grammar state: tokens accepted so far and the mask of the next one."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.accepted = 0

    def __call__(self, generated: list[int], logits: Tensor) -> Tensor:
        for token in generated[self.accepted :]:
            # A token the mask allowed is accepted; a refusal means the caller ignored the mask.
            if not self.matcher.is_terminated():
                self.matcher.accept_token(int(token))
            self.accepted += 1
        if self.matcher.is_terminated():
            return logits
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.reshape(1, -1)
        out = row.float() if row.dtype != torch.float32 else row.clone()
        self.xgr.apply_token_bitmask_inplace(out, self.bitmask, vocab_size=self.vocab_size)
        return out.reshape(logits.shape).to(logits.dtype)
