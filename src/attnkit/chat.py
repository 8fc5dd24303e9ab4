"""Chat templates: a conversation -> the prompt (text or token ids) a chat model was trained on.

A model folder's chat template (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``) is a Jinja program written by whoever published the model. It is
rendered here as ``transformers``' ``apply_chat_template`` renders it: the same variables
(``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special tokens
``bos_token``/``eos_token``/...) and functions (``raise_exception``, ``strftime_now``,
``namespace``, ``dict``, the ``tojson`` filter, loop controls), then encoded with the folder's
``tokenizer.json`` without adding special tokens, so the token ids are the same.

A template from a downloaded folder is untrusted code: it runs in Jinja's
``ImmutableSandboxedEnvironment`` (no attribute starting with ``_``, no mutation of the inputs),
and reaching for Python internals (``''.__class__.__mro__``, ``cycler.__init__.__globals__``)
stops rendering with a :class:`ChatTemplateError` instead of printing nothing.

Needs the ``chat`` extra (``jinja2``, ``tokenizers``).

Example::

    >>> ids = format_chat("SmolLM2-135M-Instruct", [{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplateError", "ChatTokenizer", "format_chat"]

# The named special tokens a template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A chat template that does not parse, raises (``raise_exception``) or reaches for Python
    internals; the message names the template's source."""


def _jinja() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as err:
        raise ImportError("chat templates need jinja2: pip install 'attnkit[chat]'") from err
    return jinja2


def _environment() -> Any:
    """The sandboxed environment with transformers' chat-template globals and filters."""
    jinja2 = _jinja()
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace as JinjaNamespace

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            # Jinja's default gives an undefined value that prints as ""; stop instead.
            raise SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
            )

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text): renders its body."""

        tags = {"generation"}  # noqa: RUF012 - Jinja's class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(JinjaNamespace):
        """``namespace(...)`` that refuses names starting with ``_``."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check(name)
            JinjaNamespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check(name)
            JinjaNamespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a namespace cannot hold the attribute {name!r}")

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)`` without the class itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    return env


def _plain(value: Any, where: str) -> Any:
    """``value`` rebuilt from plain JSON types (what a template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise TypeError(f"{where}: {type(value).__name__} values cannot go into a chat template")


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise TypeError(f"messages[{i}] must be a dict with a 'role', got {message!r}")
        # Keys set to None are dropped, as transformers does (templates test for presence).
        out.append(_plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]"))
    return out


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an added-token dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _template_from_config(value: Any, source: Path) -> str:
    """``chat_template`` of ``tokenizer_config.json``: a string, or a list of named templates
    (the one named ``default``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ValueError(f"{source}: chat_template lists {sorted(map(str, named))}, no 'default'")
    raise ValueError(f"{source}: chat_template must be a string, got {type(value).__name__}")


@dataclass
class ChatTokenizer:
    """A folder's tokenizer with its chat template, special tokens and end-of-turn ids.

    Attributes:
        tokenizer: The ``tokenizers.Tokenizer`` of ``tokenizer.json``.
        template: The chat template's Jinja source.
        special_tokens: ``bos_token``, ``eos_token``, ... as the template sees them.
        stop_ids: Token ids that end a reply: ``eos_token_id`` of ``generation_config.json``
            (an int or a list; falling back to ``config.json``, then to ``eos_token``).
        source: Where the template came from (named in errors).
    """

    tokenizer: Any
    template: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    stop_ids: tuple[int, ...] = ()
    source: str = "chat template"

    def __post_init__(self) -> None:
        self._compiled: Any = None

    @classmethod
    def from_path(cls, path: str | Path) -> ChatTokenizer:
        """:meth:`from_folder` for a folder, :meth:`from_gguf` for a ``.gguf`` file."""
        path = Path(path)
        if path.suffix == ".gguf" and not path.is_dir():
            return cls.from_gguf(path)
        return cls.from_folder(path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> ChatTokenizer:
        """The vocabulary, special tokens, end-of-turn ids and chat template (metadata key
        ``tokenizer.chat_template``) of a llama.cpp GGUF file.

        Raises:
            ValueError: If the file has no chat template, or is not a readable GGUF file.
        """
        from attnkit.interop.gguf import read_tokenizer

        found = read_tokenizer(path)
        if found.chat_template is None:
            raise ValueError(
                f"{path} has no chat template (metadata tokenizer.chat_template); it is not a "
                "chat model, drop --chat"
            )
        source = f"{path} (tokenizer.chat_template)"
        return cls(
            found.tokenizer, found.chat_template, found.special_tokens, found.stop_ids, source
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTokenizer:
        """Read ``tokenizer.json``, the chat template and the special and end-of-turn tokens.

        Raises:
            FileNotFoundError: Naming the missing folder or ``tokenizer.json``.
            ValueError: If the folder has no chat template (naming where it looked), or a file
                is malformed.
        """
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder {folder} does not exist")
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} lacks tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # tokenizers raises its own exception type
            raise ValueError(f"{folder / 'tokenizer.json'}: cannot read it ({err})") from None
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            template, source = jinja_path.read_text(encoding="utf-8"), jinja_path
        elif config.get("chat_template") is not None:
            template = _template_from_config(config["chat_template"], config_path)
            source = config_path
        elif (folder / "chat_template.json").is_file():
            data = _read_json(folder / "chat_template.json")
            template = _template_from_config(data.get("chat_template"), folder)
            source = folder / "chat_template.json"
        else:
            raise ValueError(
                f"{folder} has no chat template (looked for chat_template.jinja and chat_template "
                "in tokenizer_config.json); it is not a chat model, drop --chat"
            )
        special: dict[str, str] = {}
        legacy = folder / "special_tokens_map.json"
        for data in (_read_json(legacy) if legacy.is_file() else {}, config):  # config wins
            for name in SPECIAL_TOKEN_NAMES:
                text = _token_text(data.get(name))
                if text is not None:
                    special[name] = text
        stop: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (folder / name).is_file() and not stop:
                eos = _read_json(folder / name).get("eos_token_id")
                stop = [eos] if isinstance(eos, int) else [int(i) for i in eos or []]
        if not stop and "eos_token" in special:
            eos_id = tokenizer.token_to_id(special["eos_token"])
            stop = [] if eos_id is None else [eos_id]
        return cls(tokenizer, template, special, tuple(stop), str(source))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the prompt text (see :func:`format_chat`).

        Raises:
            ChatTemplateError: If the template does not parse, raises or is refused by the
                sandbox (naming the template's source).
            TypeError: If ``messages`` is not a list of dicts with a ``role``.
        """
        from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

        chat = _messages(messages)
        variables = self.special_tokens | _plain(template_kwargs, "template_kwargs")
        try:
            if self._compiled is None:
                self._compiled = _environment().from_string(self.template)
            return str(
                self._compiled.render(
                    messages=chat,
                    tools=_plain(tools, "tools"),
                    documents=_plain(documents, "documents"),
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                )
            )
        except SecurityError as err:
            raise ChatTemplateError(
                f"{self.source}: the chat template reaches for Python internals, refused: {err}"
            ) from None
        except TemplateSyntaxError as err:
            raise ChatTemplateError(
                f"{self.source}: the chat template does not parse (line {err.lineno}): "
                f"{err.message}"
            ) from None
        except TemplateError as err:
            raise ChatTemplateError(f"{self.source}: the chat template raised: {err}") from None

    def encode(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """Token ids of :meth:`render`'s text (no special tokens added: the template has them)."""
        text = self.render(messages, **options)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of token ``ids``."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def format_chat(
    folder_or_tokenizer: str | Path | ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    **template_kwargs: Any,
) -> list[int] | str:
    """Format a conversation with a chat model's template, as transformers'
    ``apply_chat_template`` does.

    Args:
        folder_or_tokenizer: A model folder (``tokenizer.json`` plus ``chat_template.jinja`` or
            ``tokenizer_config.json``'s ``chat_template``), a ``.gguf`` file or a
            :class:`ChatTokenizer`.
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        add_generation_prompt: End with the header of the assistant's turn (so that the model
            writes the reply).
        tokenize: Return token ids (default) instead of the text.
        **template_kwargs: Further template variables (``tools``, ``documents``, or a family's
            own such as ``enable_thinking``).

    Returns:
        The token ids (``tokenize=True``) or the prompt text.

    Raises:
        ChatTemplateError: If the template does not parse, raises or is refused by the sandbox.
        FileNotFoundError: Naming a missing folder or ``tokenizer.json``.
        ValueError: If the folder has no chat template, or ``messages`` is empty.
        TypeError: If ``messages`` is not a list of dicts with a ``role``.
    """
    tok = (
        folder_or_tokenizer
        if isinstance(folder_or_tokenizer, ChatTokenizer)
        else ChatTokenizer.from_path(folder_or_tokenizer)
    )
    options = template_kwargs | {"add_generation_prompt": add_generation_prompt}
    return tok.encode(messages, **options) if tokenize else tok.render(messages, **options)
