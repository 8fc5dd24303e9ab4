"""``attnkit generate``: run a Hugging Face decoder folder on attnkit and stream its text.

``attnkit generate --model DIR --prompt TEXT`` (or the prompt on stdin) tokenizes with the
folder's ``tokenizer.json`` (the ``tokenizers`` package), prints the prompt, then each new piece
of text as soon as it is decoded. ``--attention OUT`` also writes the attention of the whole text
(prompt and continuation): one map per chosen ``--layer``/``--head``, a grid of the chosen layers'
heads and, when :mod:`attnkit.explorer` is available, an interactive page. Layers and heads count
from 0; negative values count from the end. ``--quantize int8|int4`` quantizes the linear weights
after loading (:func:`attnkit.quantize.quantize`). At the end, stderr gets the time to first token
and the tokens/s after it (``--quiet`` leaves them out; stdout is the text only).

Needs the ``models`` extra (``tokenizers``; matplotlib for ``--attention``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` options to ``parser``."""
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="folder with config.json, safetensors weights and tokenizer.json",
    )
    parser.add_argument("--prompt", help="the prompt (default: read from stdin)")
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
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="parameter dtype (default: float32)"
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
    _add_speed_arguments(parser)


def _add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quantize`` and ``--quiet`` (the speed line)."""
    parser.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        default=None,
        help="weight-only quantization of the linears after loading (default: none)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="do not print time to first token and tokens/s (stderr) at the end",
    )


def _speed_line(n_tokens: int, start: float, first: float | None, end: float) -> str:
    """Time to first token and the decoding rate after it (tokens 2..n over their time)."""
    if first is None:
        return "attnkit generate: no new tokens"
    ttft_ms = 1e3 * (first - start)
    line = f"attnkit generate: {n_tokens} new tokens, time to first token {ttft_ms:.1f} ms"
    if n_tokens > 1 and end > first:
        line += f", {(n_tokens - 1) / (end - first):.1f} tokens/s after it"
    return line


def _index(value: int, size: int, name: str) -> int:
    if not -size <= value < size:
        raise ValueError(f"--{name} must be in [{-size}, {size - 1}], got {value}")
    return value % size


def _check(args: argparse.Namespace) -> None:
    """Reject bad option values before loading anything (one line, exit status 2)."""
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
    if not args.model.is_dir():
        raise FileNotFoundError(f"model folder {args.model} does not exist")
    if not (args.model / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{args.model} lacks tokenizer.json")


def run(args: argparse.Namespace) -> int:
    """Stream the prompt and its continuation to stdout; write attention pictures if asked."""
    _check(args)
    import torch
    from tokenizers import Tokenizer

    from attnkit import TransformerLM

    prompt = args.prompt if args.prompt is not None else sys.stdin.read().rstrip("\n")
    if not prompt:
        raise ValueError("the prompt is empty (give --prompt TEXT or text on stdin)")
    try:
        tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(
            f"{args.model / 'tokenizer.json'}: cannot read the tokenizer ({err})"
        ) from None
    lm = TransformerLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), quantize=args.quantize
    )
    prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        raise ValueError(f"the prompt {prompt!r} gives no tokens")
    ids = torch.tensor([prompt_ids])
    generator = None if args.seed is None else torch.Generator().manual_seed(args.seed)
    start, first = time.perf_counter(), None
    steps = lm.stream(
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        generator=generator,
    )
    new: list[int] = []
    shown = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    sys.stdout.write(shown)
    sys.stdout.flush()
    for column in steps:
        first = time.perf_counter() if first is None else first
        new.append(int(column[0]))
        text = tokenizer.decode(prompt_ids + new, skip_special_tokens=True)
        # Print what is settled: byte-level pieces of one character decode to U+FFFD until
        # the character is complete.
        if text.startswith(shown) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    text = tokenizer.decode(prompt_ids + new, skip_special_tokens=True)
    sys.stdout.write((text[len(shown) :] if text.startswith(shown) else "") + "\n")
    sys.stdout.flush()
    end = time.perf_counter()
    if args.attention is not None:
        all_ids = torch.tensor([prompt_ids + new])
        # Each token as text (byte-level tokenizers' "Ġsat" reads " sat").
        tokens = [
            tokenizer.decode([i], skip_special_tokens=False) or tokenizer.id_to_token(i) or str(i)
            for i in prompt_ids + new
        ]
        for path in _write_attention(lm, all_ids, tokens, args):
            print(path, file=sys.stderr)
    if not args.quiet:
        print(_speed_line(len(new), start, first, end), file=sys.stderr)
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
