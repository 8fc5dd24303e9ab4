"""``attnkit chat``: talk to a chat model, one line in, one streamed reply out.

``attnkit chat --model DIR`` (a Hugging Face folder with a chat template, or a ``.gguf`` file)
reads a line, sends the conversation so far through the model's chat template
(:mod:`attnkit.chat`), streams the reply to stdout and keeps both in the history. ``/reset``
forgets the history (the ``--system`` message stays), ``/exit`` or the end of input ends the chat,
Ctrl-C stops a reply (what was written of it stays in the history) without ending the chat.
Lines piped on stdin work the same (no prompt is shown then); each reply ends with a newline.
When the history no longer fits the model's context, the oldest turns are dropped (said on
stderr).

Needs the ``chat`` extra (``jinja2``, ``tokenizers``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from attnkit.commands.generate import (
    Session,
    Timing,
    add_model_arguments,
    check_model_arguments,
    stream_text,
)

HELP = "commands: /reset forgets the conversation, /exit ends it; Ctrl-C stops a reply"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``chat`` options to ``parser``."""
    add_model_arguments(parser)


def _fit(session: Session, history: list[dict[str, Any]], args: argparse.Namespace) -> list[int]:
    """The prompt ids of ``history``, dropping the oldest turns (after a system message) until
    the prompt and the reply fit the model's context.

    Raises:
        ValueError: If even the last message alone does not fit.
    """
    limit = session.lm.config.max_seq_len - args.max_new_tokens
    system = 1 if history and history[0]["role"] == "system" else 0
    while True:
        ids: list[int] = session.chat.encode(history)
        if len(ids) <= limit:
            return ids
        if len(history) - system <= 1:
            raise ValueError(
                f"the message gives {len(ids)} tokens; with --max-new-tokens "
                f"{args.max_new_tokens} the model's context of {session.lm.config.max_seq_len} "
                "has no room for it"
            )
        del history[system : system + 2]  # the oldest user turn and its reply
        print("attnkit chat: the oldest turn was dropped to fit the context", file=sys.stderr)


def _read(interactive: bool) -> str | None:
    """The next line (``None`` at the end of input)."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run(args: argparse.Namespace) -> int:
    """Run the conversation until ``/exit`` or the end of input."""
    check_model_arguments(args)
    session = Session.load(args, chat=True)
    base = [] if args.system is None else [{"role": "system", "content": args.system}]
    history: list[dict[str, Any]] = list(base)
    interactive = sys.stdin.isatty()
    if interactive:
        print(HELP, file=sys.stderr)
    while True:
        try:
            line = _read(interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat
            print(file=sys.stderr)
            return 0
        if line is None or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = list(base)
            print("attnkit chat: the conversation is reset", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt_ids = _fit(session, history, args)
        except ValueError as err:
            history.pop()
            print(f"attnkit chat: {err}", file=sys.stderr)
            continue
        timing = Timing(time.perf_counter(), compiled=args.compile)
        steps = session.stream(prompt_ids, args)
        reply: list[int] = []

        def collect(steps: Any = steps, reply: list[int] = reply) -> Any:
            for token in steps:
                reply.append(token)
                yield token

        try:
            stream_text(session.tokenizer, [], collect(), timing, sys.stdout)
        except KeyboardInterrupt:
            steps.close()
            print(" [stopped]", end="", file=sys.stderr)
        sys.stdout.write("\n")
        sys.stdout.flush()
        text = session.tokenizer.decode(reply, skip_special_tokens=True)
        history.append({"role": "assistant", "content": text})
        if not args.quiet:
            print(f"attnkit chat: {timing.summary()}{session.speculation()}", file=sys.stderr)
