"""``attnkit generate``: run a Hugging Face decoder folder (or a GGUF file) on attnkit and stream
its text.

``attnkit generate --model DIR --prompt TEXT`` (or the prompt on stdin) tokenizes with the
folder's ``tokenizer.json`` (the ``tokenizers`` package; a ``.gguf`` file carries its own
vocabulary), prints the prompt, then each new piece of text as soon as it is decoded.

``--chat`` (implied by ``--system TEXT``) sends the prompt as a user message through the model's
chat template (:mod:`attnkit.chat`) and prints the reply only; generation stops at the template's
end-of-turn tokens (``eos_token_id`` of ``generation_config.json``). At the end, the number of
new tokens, the time to the first token and the decoding speed go to stderr (``--quiet``: not;
with ``--compile`` the speed leaves out the first compiled step, whose time is given apart).
``--quantize int8|int4`` quantizes the linear weights after loading
(:func:`attnkit.quantize.quantize`); ``--compile`` decodes through the model's forward compiled
for one-token steps (:func:`attnkit.decoding.compiled_step`: the first call compiles, the steps
after reuse the compiled graph).

``--prompt-lookup N`` (speculative decoding: up to ``N`` tokens copied from where the last few
tokens occurred before, see :mod:`attnkit.speculative`) or ``--draft int8|int4|PATH`` (a
weight-quantized copy of the model, or another decoder folder of the same tokenizer, proposes the
tokens) give the same tokens faster where the proposals are kept; the share of proposed tokens
kept is printed with the speed.

``--attention OUT`` also writes the attention of the whole text (prompt and continuation): one map
per chosen ``--layer``/``--head``, a grid of the chosen layers' heads and, when
:mod:`attnkit.explorer` is available, an interactive page. Layers and heads count from 0;
negative values count from the end.

Needs the ``models`` extra (``tokenizers``; matplotlib for ``--attention``), ``chat`` for
``--chat`` and ``gguf`` for ``.gguf`` files.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnkit.commands.options import add_dtype_option, add_quantize_option


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``generate`` and ``chat`` share: the model, length, sampling, seed, dtype."""
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="folder with config.json, safetensors weights and tokenizer.json, or a .gguf file",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=50, help="most tokens to add (default: 50)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    parser.add_argument(
        "--top-p", type=float, default=None, help="sample from the top-p probability mass"
    )
    parser.add_argument(
        "--repetition-penalty", type=float, default=None, help="> 1 discourages repeats"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_dtype_option(parser, "parameter dtype (default: float32)")
    parser.add_argument(
        "--system", default=None, metavar="TEXT", help="a system message (generate: implies --chat)"
    )
    add_quantize_option(
        parser, "weight-only quantization of the linears after loading (default: none)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode through a torch.compile'd step: the first call compiles (slow once; "
        "cached after), each step after is faster (see docs/guide/decoding.md)",
    )
    parser.add_argument(
        "--prompt-lookup",
        type=int,
        default=None,
        metavar="N",
        help="speculative decoding: propose up to N tokens copied from an earlier occurrence of "
        "the last n-gram (same output; faster when the text repeats its input)",
    )
    parser.add_argument(
        "--draft",
        default=None,
        metavar="int8|int4|PATH",
        help="speculative decoding with a draft: the model's own int8/int4 copy, or a smaller "
        "decoder folder with the same tokenizer (same output)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="do not print the token count, time to first token and tokens/s to stderr",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` options to ``parser``."""
    add_model_arguments(parser)
    parser.add_argument("--prompt", help="the prompt (default: read from stdin)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the model's chat template; print the reply",
    )
    parser.add_argument(
        "--attention",
        type=Path,
        default=None,
        metavar="OUT",
        help="also write the attention maps of the generated text into this folder",
    )
    parser.add_argument(
        "--layer",
        type=int,
        nargs="+",
        default=[-1],
        help="layers drawn with --attention (default: -1, the last)",
    )
    parser.add_argument(
        "--head", type=int, nargs="+", default=[0], help="heads drawn one by one (default: 0)"
    )


def _index(value: int, size: int, name: str) -> int:
    if not -size <= value < size:
        raise ValueError(f"--{name} must be in [{-size}, {size - 1}], got {value}")
    return value % size


def check_model_arguments(args: argparse.Namespace) -> None:
    """Reject bad option values and a missing model before loading anything (one line, exit
    status 2)."""
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.repetition_penalty is not None and not args.repetition_penalty > 0:
        raise ValueError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    if args.prompt_lookup is not None and args.draft is not None:
        raise ValueError(
            f"give --prompt-lookup ({args.prompt_lookup}) or --draft ({args.draft}), not both"
        )
    if args.prompt_lookup is not None and args.prompt_lookup < 1:
        raise ValueError(f"--prompt-lookup must be >= 1, got {args.prompt_lookup}")
    if args.compile and (args.draft is not None or args.prompt_lookup is not None):
        raise ValueError("--draft and --prompt-lookup decode eagerly: leave out --compile")
    if args.draft not in (None, "int8", "int4") and not Path(args.draft).exists():
        raise FileNotFoundError(f"draft model {args.draft} does not exist")
    if args.model.suffix == ".gguf" and not args.model.is_dir():
        if not args.model.is_file():
            raise FileNotFoundError(f"model file {args.model} does not exist")
        return
    if not args.model.is_dir():
        raise FileNotFoundError(f"model folder {args.model} does not exist")
    if not (args.model / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{args.model} lacks tokenizer.json")


@dataclass
class Session:
    """A loaded model with its tokenizer (and chat template when asked for)."""

    lm: Any
    tokenizer: Any  # tokenizers.Tokenizer
    chat: Any = None  # attnkit.chat.ChatTokenizer
    draft: Any = None  # an assistant_model: "int8", "int4" or a loaded decoder
    stats: Any = None  # attnkit.speculative.SpeculationStats of the last reply

    @classmethod
    def load(cls, args: argparse.Namespace, *, chat: bool) -> Session:
        """Load ``args.model`` in ``args.dtype``; with ``chat``, its chat template too.

        Raises:
            ValueError: If the tokenizer cannot be read or the model has no chat template.
        """
        import torch

        from attnkit import TransformerLM, decoding
        from attnkit.chat import ChatTokenizer

        if chat:
            chat_tokenizer = ChatTokenizer.from_path(args.model)
            tokenizer = chat_tokenizer.tokenizer
        else:
            chat_tokenizer = None
            tokenizer = read_tokenizer(args.model)
        lm = TransformerLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), quantize=args.quantize
        )
        # inference only: linears laid out for one-token steps (eager or compiled)
        decoding.prepare(lm, compiled=args.compile)
        draft: Any = getattr(args, "draft", None)
        if draft in ("int8", "int4"):
            lm.self_draft(draft)  # built now, not inside the first reply's timing
        elif draft is not None:
            draft = TransformerLM.from_pretrained(Path(draft), dtype=getattr(torch, args.dtype))
            decoding.prepare(draft)
        return cls(lm, tokenizer, chat_tokenizer, draft)

    def speculation(self) -> str:
        """``, N% of P proposed tokens kept`` after a speculative reply; ``""`` otherwise."""
        if self.stats is None:
            return ""
        stats = self.stats
        return f", {stats.acceptance_rate:.0%} of {stats.proposed} proposed tokens kept"

    def stream(self, prompt_ids: list[int], args: argparse.Namespace) -> Generator[int, None, None]:
        """The new token ids, one by one (stopping at the chat template's end-of-turn tokens)."""
        import torch

        from attnkit.speculative import SpeculationStats

        options: dict[str, Any] = {}
        if self.chat is not None and self.chat.stop_ids:
            options["eos_token_id"] = list(self.chat.stop_ids)
        lookup = getattr(args, "prompt_lookup", None)
        self.stats = None
        if lookup is not None or self.draft is not None:
            self.stats = options["speculation_stats"] = SpeculationStats()
            if lookup is not None:
                options["prompt_lookup_num_tokens"] = lookup
            else:
                options["assistant_model"] = self.draft
        generator = None if args.seed is None else torch.Generator().manual_seed(args.seed)
        steps = self.lm.stream(
            torch.tensor([prompt_ids]),
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            generator=generator,
            compile=args.compile,
            **options,
        )
        try:
            for column in steps:
                yield int(column[0])
        finally:
            steps.close()


def read_tokenizer(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` of a folder's ``tokenizer.json`` or of a ``.gguf`` file.

    Raises:
        ValueError: If it cannot be read (naming the file).
    """
    if path.suffix == ".gguf" and not path.is_dir():
        from attnkit.interop.gguf import read_tokenizer

        return read_tokenizer(path).tokenizer
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(f"{path / 'tokenizer.json'}: cannot read the tokenizer ({err})") from None


@dataclass
class Timing:
    """When generation started and when its first, second and last tokens came; ``compiled``:
    the steps after the first token run a compiled graph, whose first call may compile it."""

    start: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    second: float | None = None
    compiled: bool = False

    def summary(self) -> str:
        """``N tokens, first after X ms, Y tokens/s``: the rate of the tokens after the first,
        or, for compiled steps, after the second (the first step's time, which may include the
        compilation, is given apart)."""
        if self.first is None or self.last is None:
            return "0 tokens"
        ttft = (self.first - self.start) * 1e3
        since, count, step = self.first, self.tokens - 1, ""
        if self.compiled and self.second is not None and self.tokens > 2:
            since, count = self.second, self.tokens - 2
            step = f", first compiled step {self.second - self.first:.1f} s"
        rate = count / (self.last - since) if self.last > since else 0.0
        return f"{self.tokens} tokens, first after {ttft:.0f} ms{step}, {rate:.1f} tokens/s"


def stream_text(
    tokenizer: Any, prefix_ids: list[int], new_ids: Iterable[int], timing: Timing, out: Any
) -> list[int]:
    """Write the text of ``new_ids`` to ``out`` as it settles; return the ids.

    The text is decoded with ``prefix_ids`` in front (so word boundaries come out right) and only
    what is settled is written: byte-level pieces of one character decode to U+FFFD until the
    character is complete.
    """
    new: list[int] = []
    shown = tokenizer.decode(prefix_ids, skip_special_tokens=True)
    for token in new_ids:
        now = time.perf_counter()
        timing.first = timing.first or now
        timing.last, timing.tokens = now, timing.tokens + 1
        if timing.tokens == 2:
            timing.second = now
        new.append(token)
        text = tokenizer.decode(prefix_ids + new, skip_special_tokens=True)
        if text.startswith(shown) and not text.endswith("\ufffd"):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    text = tokenizer.decode(prefix_ids + new, skip_special_tokens=True)
    if text.startswith(shown) and len(text) > len(shown):
        out.write(text[len(shown) :])
    out.flush()
    return new


def run(args: argparse.Namespace) -> int:
    """Stream the prompt and its continuation (or, with ``--chat``, the reply) to stdout; write
    attention pictures if asked."""
    check_model_arguments(args)
    import torch

    chat = args.chat or args.system is not None
    prompt = args.prompt if args.prompt is not None else sys.stdin.read().rstrip("\n")
    if not prompt:
        raise ValueError("the prompt is empty (give --prompt TEXT or text on stdin)")
    session = Session.load(args, chat=chat)
    tokenizer = session.tokenizer
    if args.attention is not None:  # before generating: bad layers/heads are one line
        config = session.lm.config
        for layer in args.layer:
            _index(layer, config.num_layers, "layer")
        for head in args.head:
            _index(head, config.num_heads, "head")
    if session.chat is not None:
        messages = [] if args.system is None else [{"role": "system", "content": args.system}]
        prompt_ids = session.chat.encode([*messages, {"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        raise ValueError(f"the prompt {prompt!r} gives no tokens")
    timing = Timing(time.perf_counter(), compiled=args.compile)
    if session.chat is None:  # the prompt, then its continuation
        sys.stdout.write(tokenizer.decode(prompt_ids, skip_special_tokens=True))
        new = stream_text(
            tokenizer, prompt_ids, session.stream(prompt_ids, args), timing, sys.stdout
        )
    else:  # the reply only
        new = stream_text(tokenizer, [], session.stream(prompt_ids, args), timing, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        print(f"attnkit generate: {timing.summary()}{session.speculation()}", file=sys.stderr)
    if args.attention is not None:
        all_ids = torch.tensor([prompt_ids + new])
        # Each token as text (byte-level tokenizers' "Ġsat" reads " sat").
        tokens = [
            tokenizer.decode([i], skip_special_tokens=False) or tokenizer.id_to_token(i) or str(i)
            for i in prompt_ids + new
        ]
        for path in _write_attention(session.lm, all_ids, tokens, args):
            print(path, file=sys.stderr)
    return 0


def _write_attention(lm: Any, ids: Any, tokens: list[str], args: argparse.Namespace) -> list[Path]:
    """Maps of the chosen layers/heads, a grid of the chosen layers and an explorer page."""
    import torch

    from attnkit import viz

    with torch.no_grad():
        _, per_layer = lm(ids, return_weights=True)
    weights = torch.stack([w[0].float() for w in per_layer])  # (layers, H, T, T)
    n_layers, n_heads = weights.shape[:2]
    layers = sorted({_index(x, n_layers, "layer") for x in args.layer})
    heads = sorted({_index(x, n_heads, "head") for x in args.head})
    out: Path = args.attention
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with warnings.catch_warnings():  # tokens in scripts the default font lacks draw as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing", category=UserWarning)
        for layer in layers:
            for head in heads:
                fig = viz.attention_map(
                    weights[layer, head], query_tokens=tokens, title=f"layer {layer}, head {head}"
                )
                written.append(viz.save_figure(fig, out / f"layer{layer}_head{head}.png"))
        title = f"attention per head of layers {layers} (rows in that order)"
        grid = viz.attention_grid(weights[layers], tokens=tokens, title=title)
        written.append(viz.save_figure(grid, out / "grid.png"))
    try:
        explorer = importlib.import_module("attnkit.explorer")
    except ImportError:  # the interactive page is optional
        explorer = None
    limit = getattr(explorer, "MAX_TOKENS", None)
    if explorer is not None and hasattr(explorer, "write_explorer"):
        if limit is not None and len(tokens) > limit:
            print(
                f"attnkit generate: {len(tokens)} tokens, more than the explorer page shows "
                f"({limit}); wrote the pictures only",
                file=sys.stderr,
            )
        else:
            page = explorer.write_explorer(
                out / "explorer.html",
                tokens,
                weights,
                title="attnkit generate",
                description=f"{args.model.name}: the prompt and its continuation",
                layer=layers[-1],
            )
            written.append(Path(page))
    return written
