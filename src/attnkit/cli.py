"""The ``attnkit`` command line: ``lab``, ``complexity``, ``plot``, ``explain``, ``bench``,
``tour``, ``generate``, ``chat``, ``kernels``, ``serve``.

Each sub-command lives in ``attnkit.commands.<name>`` and exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported lazily so that
``attnkit --help`` stays fast and optional extras are only needed by the commands that use them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

COMMANDS: dict[str, str] = {
    "lab": "train a small transformer on a built-in task and write a report with pictures",
    "complexity": "FLOPs and memory of multi-head attention, per component, with formulas",
    "plot": "write the blog's pictures (scaling, softmax, positions, rotary, masks) as PNG files",
    "explain": "attention maps and similarity from a real pretrained model (all-MiniLM-L6-v2)",
    "bench": "benchmark attnkit's attention against torch SDPA and the textbook implementation",
    "tour": "measure every claim of the blog on attnkit's modules; write a report and claims.json",
    "generate": "stream text from a Hugging Face decoder folder (Llama, Mistral, Qwen2, GPT-2) "
    "or a GGUF file",
    "chat": "talk to a chat model (folder or GGUF file): streamed replies, /reset, /exit",
    "kernels": "the CPU features, compilers and kernels found here, and every kernel choice made",
    "serve": "an OpenAI-compatible HTTP server for decoders (folders, GGUF) and sentence encoders",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``attnkit CMD: error: ...``."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line (with where to find the usage) and exit with 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with one sub-parser per command."""
    parser = _Parser(
        prog="attnkit",
        description="attnkit: attention made real. Run a command with --help for its options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"attnkit.commands.{name}")
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnkit`` console script and ``python -m attnkit``.

    Args:
        argv: The arguments after ``attnkit``; ``sys.argv[1:]`` when omitted.

    Returns:
        The exit status: 0 on success, 2 for bad input (one line on stderr, no traceback).
        ``--help`` and usage errors exit through ``SystemExit`` (0 and 2) as argparse does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(f"attnkit.commands.{args.command}")
    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, PermissionError, ImportError) as err:
        print(f"attnkit {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
