"""The models a server holds: decoders (with their tokenizer, chat template and engine) and
sentence encoders, by the name requests give.

:func:`load_model` reads anything :meth:`attnkit.TransformerLM.from_pretrained` takes (a Hugging
Face decoder folder or a ``.gguf`` file) or a sentence-transformers encoder folder (BERT with mean
pooling: :class:`attnkit.interop.sentence.SentenceEncoder`), and tells them apart by what the
folder holds.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DecoderModel",
    "EncoderModel",
    "ModelRegistry",
    "is_encoder_folder",
    "load_model",
]

#: Builds the engine of a loaded decoder: ``factory(lm, max_batch=..., kv_cache_tokens=...)``.
EngineFactory = Callable[..., Any]


@dataclass
class DecoderModel:
    """A decoder served by an engine.

    Attributes:
        name: The name requests give as ``model``.
        lm: The :class:`attnkit.TransformerLM`.
        tokenizer: Its ``tokenizers.Tokenizer``.
        chat: Its :class:`attnkit.chat.ChatTokenizer` (``None``: no chat template, so no
            ``/v1/chat/completions``).
        stop_ids: Token ids that end a reply (end-of-turn and eos ids).
        engine: The continuous-batching engine that runs its requests.
        created: When it was loaded (Unix seconds).
    """

    name: str
    lm: Any
    tokenizer: Any
    chat: Any
    stop_ids: tuple[int, ...]
    engine: Any
    created: int = 0
    grammars: Any = None  # attnkit.serving.constrained.GrammarCache, built on first use
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def max_context(self) -> int:
        """The most tokens (prompt and reply) a request may hold."""
        return int(getattr(self.engine, "max_context", self.lm.config.max_seq_len))

    @property
    def kv_capacity(self) -> int | None:
        """Tokens the engine's KV pool holds in all (``None`` when the engine does not say)."""
        pool = getattr(getattr(self.engine, "cache", None), "pool", None)
        blocks, size = getattr(pool, "num_blocks", None), getattr(self.engine, "block_size", None)
        return None if blocks is None or size is None else int(blocks) * int(size)

    @property
    def vocab_size(self) -> int:
        return int(self.lm.config.vocab_size)

    def grammar_cache(self) -> Any:
        """The model's compiled-grammar cache (xgrammar), built on first use."""
        with self._grammar_lock:
            if self.grammars is None:
                from attnkit.serving.constrained import GrammarCache

                self.grammars = GrammarCache(
                    self.tokenizer, vocab_size=self.vocab_size, stop_ids=self.stop_ids
                )
            return self.grammars


@dataclass
class EncoderModel:
    """A sentence encoder (``/v1/embeddings``).

    Attributes:
        name: The name requests give as ``model``.
        encoder: The :class:`attnkit.interop.sentence.SentenceEncoder`.
        created: When it was loaded (Unix seconds).
    """

    name: str
    encoder: Any
    created: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_tokens(self, texts: list[str]) -> int:
        """Tokens the encoder reads for ``texts`` (after truncation)."""
        return sum(len(e.ids) for e in self.encoder.tokenize(texts))

    def embed(self, texts: list[str]) -> Any:
        """L2-normalized embeddings ``(len(texts), D)`` (one request at a time)."""
        with self.lock:
            return self.encoder.encode(texts)


Model = DecoderModel | EncoderModel


def is_encoder_folder(path: Path) -> bool:
    """Whether ``path`` is a sentence-transformers (BERT) folder rather than a decoder."""
    if not path.is_dir():
        return False
    if (path / "sentence_bert_config.json").is_file() or (path / "modules.json").is_file():
        return True
    config = path / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return False
        return isinstance(data, dict) and data.get("model_type") == "bert"
    return False


def _default_name(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name


def load_model(
    path: str | Path,
    *,
    name: str | None = None,
    dtype: Any = None,
    quantize: str | None = None,
    max_batch: int = 16,
    kv_cache_tokens: int | None = None,
    engine_factory: EngineFactory | None = None,
) -> Model:
    """Load a decoder (with its engine, not started) or an encoder from ``path``.

    Args:
        path: A decoder folder, a ``.gguf`` file or a sentence-transformers encoder folder.
        name: The name requests give (default: the folder's name, or the file's stem).
        dtype: Parameter dtype of a decoder (default float32).
        quantize: ``"int8"`` or ``"int4"`` weight-only quantization of a decoder.
        max_batch: Most requests the engine runs at once.
        kv_cache_tokens: Tokens the engine's KV pool holds (default: the engine's choice).
        engine_factory: Builds the engine (default :class:`attnkit.serving.engine.Engine`).

    Raises:
        FileNotFoundError: If ``path`` does not exist or lacks a tokenizer.
        ValueError: If the checkpoint cannot be read.
    """
    import time

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model {path} does not exist")
    created = int(time.time())
    name = name or _default_name(path)
    if is_encoder_folder(path):
        from attnkit.interop.sentence import SentenceEncoder

        return EncoderModel(name, SentenceEncoder.from_pretrained(path), created)

    from attnkit import TransformerLM, decoding

    chat, tokenizer = _tokenizers(path)
    lm = TransformerLM.from_pretrained(path, dtype=dtype, quantize=quantize)  # type: ignore[arg-type]
    # The weights laid out for few-row products, as `attnkit generate` lays them out: every
    # engine step multiplies one row per running request.
    decoding.prepare(lm, batch=max_batch)
    stop: list[int] = list(chat.stop_ids) if chat is not None else []
    eos = lm.generation_config.get("eos_token_id")
    for i in [eos] if isinstance(eos, int) else list(eos or []):
        if int(i) not in stop:
            stop.append(int(i))
    if engine_factory is None:
        from attnkit.serving.engine import Engine

        engine_factory = Engine
    engine = engine_factory(lm, max_batch=max_batch, kv_cache_tokens=kv_cache_tokens)
    return DecoderModel(name, lm, tokenizer, chat, tuple(stop), engine, created)


def _tokenizers(path: Path) -> tuple[Any, Any]:
    """``(chat tokenizer or None, tokenizers.Tokenizer)`` of a decoder folder or GGUF file.

    Raises:
        FileNotFoundError: If a folder lacks ``tokenizer.json``.
        ValueError: If the tokenizer cannot be read.
    """
    from attnkit.chat import ChatTemplateError, ChatTokenizer

    gguf = path.suffix == ".gguf" and not path.is_dir()
    if not gguf and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} lacks tokenizer.json")
    try:
        chat = ChatTokenizer.from_path(path)
    except ChatTemplateError:
        raise
    except ValueError as err:
        if "no chat template" not in str(err):
            raise
        chat = None
    if chat is not None:
        return chat, chat.tokenizer
    if gguf:
        from attnkit.interop.gguf import read_tokenizer

        return None, read_tokenizer(path).tokenizer
    from tokenizers import Tokenizer

    try:
        return None, Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(f"{path / 'tokenizer.json'}: cannot read the tokenizer ({err})") from None


class ModelRegistry:
    """The loaded models by name; ``get(name, kind)`` raises the 4xx a request deserves."""

    def __init__(self, models: Iterable[Model] = ()) -> None:
        self.models: dict[str, Model] = {}
        for model in models:
            self.add(model)

    def add(self, model: Model) -> None:
        """Register ``model`` under its name.

        Raises:
            ValueError: If a model of that name is already registered.
        """
        if model.name in self.models:
            raise ValueError(f"two models are named {model.name!r}; give --name for each")
        self.models[model.name] = model

    def decoders(self) -> list[DecoderModel]:
        return [m for m in self.models.values() if isinstance(m, DecoderModel)]

    def get(self, name: str, kind: type) -> Any:
        """The model ``name``, which must be a ``kind``.

        Raises:
            RequestError: 404 for an unknown name, 400 for a model of the other kind.
        """
        from attnkit.serving.protocol import RequestError

        model = self.models.get(name)
        if model is None:
            raise RequestError(
                f"the model {name!r} does not exist; this server has {sorted(self.models)}",
                param="model",
                status=404,
                code="model_not_found",
            )
        if not isinstance(model, kind):
            what = "a decoder" if kind is DecoderModel else "an encoder (embeddings only)"
            raise RequestError(
                f"the model {name!r} is not {what}", param="model", code="wrong_model_kind"
            )
        return model
