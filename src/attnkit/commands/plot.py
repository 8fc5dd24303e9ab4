"""``attnkit plot WHAT --out DIR``: write the blog's pictures as PNG files and print their paths.

WHAT is one of ``scaling`` (why divide by sqrt(d)), ``softmax`` (softmax([1, 2]) vs
softmax([10, 20])), ``sinusoidal`` (the position table), ``rotary`` (rotation speeds, tables and
the relative-offset property), ``masks`` (the masks of :mod:`attnkit.flex.presets` with their block
structure, and ALiBi's bias per head) or ``all``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

WHATS = ("scaling", "softmax", "sinusoidal", "rotary", "masks", "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plot`` options to ``parser``."""
    parser.add_argument(
        "what", choices=WHATS, metavar="WHAT", help=f"which pictures to draw: {', '.join(WHATS)}"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("plots"),
        metavar="DIR",
        help="directory for the PNG files (created if missing; default: plots)",
    )
    parser.add_argument(
        "--dim",
        type=int,
        metavar="N",
        default=128,
        help="embedding dimension of the sinusoidal table (default: 128)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        default=100,
        help="positions in the sinusoidal and rotary tables (default: 100)",
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        metavar="N",
        default=64,
        help="head dimension for the rotary pictures, even (default: 64)",
    )
    parser.add_argument(
        "--mask-len",
        type=int,
        metavar="N",
        default=48,
        help="queries and keys in the mask pictures (default: 48)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        default=8,
        help="block size drawn over the mask pictures (default: 8)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        metavar="N",
        default=0,
        help="seed of the random vectors in scaling and rotary (default: 0)",
    )


def _builders(args: argparse.Namespace) -> dict[str, list[tuple[str, Callable[[], Any]]]]:
    """Map each WHAT to its (file name, figure builder) pairs; builders run lazily."""
    import torch

    from attnkit import viz

    def sinusoidal() -> Any:
        from attnkit.positional import SinusoidalPositionalEncoding

        pe = SinusoidalPositionalEncoding(args.dim, args.max_seq_len).pe  # (positions, dim)
        return viz.sinusoidal_heatmap(pe)

    def rotary_table() -> Any:
        from attnkit.positional import rope_cos_sin

        cos, sin = rope_cos_sin(args.max_seq_len, args.head_dim, torch.device("cpu"))
        return viz.rotary_table(cos, sin)

    def masks() -> list[tuple[str, Callable[[], Any]]]:
        from attnkit.flex import presets

        n = args.mask_len
        window, prefix, dilation = max(1, n // 6), max(1, n // 4), 3
        docs = torch.arange(n) * 3 // n  # three documents of equal length
        named = {
            "causal": presets.causal(),
            "sliding_window": presets.sliding_window(window),
            "prefix_lm": presets.prefix_lm(prefix),
            "dilated": presets.dilated(dilation),
            "document": presets.document(docs),
            "padding": presets.padding(torch.tensor([max(1, 3 * n // 4)])),
        }

        def picture(mod: Any) -> Callable[[], Any]:
            return lambda: viz.mask_picture(mod, n, block_size=args.block_size)

        pictures = [(f"mask_{name}.png", picture(mod)) for name, mod in named.items()]
        alibi = presets.alibi(4)
        return [*pictures, ("bias_alibi.png", lambda: viz.score_bias(alibi, n, num_heads=4))]

    return {
        "masks": masks(),
        "scaling": [("scaling.png", lambda: viz.scaling_demo(seed=args.seed))],
        "softmax": [("softmax.png", viz.softmax_demo)],
        "sinusoidal": [("sinusoidal.png", sinusoidal)],
        "rotary": [
            ("rotary_frequencies.png", lambda: viz.rotary_frequencies(args.head_dim)),
            ("rotary_table.png", rotary_table),
            (
                "rotary_relative.png",
                lambda: viz.rotary_relative_scores(args.head_dim, seed=args.seed),
            ),
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Draw the requested pictures into ``args.out`` and print one path per line."""
    for name in ("dim", "max_seq_len", "head_dim", "mask_len", "block_size"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, name)}")
    if args.head_dim % 2:
        raise ValueError(f"--head-dim must be even for rotary pairs, got {args.head_dim}")

    from attnkit import viz

    builders = _builders(args)
    chosen = [w for w in WHATS[:-1] if args.what in (w, "all")]
    for what in chosen:
        for filename, build in builders[what]:
            path = viz.save_figure(build(), Path(args.out) / filename)
            print(path)
    return 0
