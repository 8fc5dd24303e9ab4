"""Draw the guide's pictures with attnkit.viz.

The site build calls :func:`render` (through ``docs/hooks.py``), so the pictures always show what
the current code draws and no image is committed. Run it by hand to look at them:

    python docs/make_figures.py --out /tmp/figures

Needs the ``viz`` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.figure import Figure

import attnkit
from attnkit import complexity, masks, viz
from attnkit.flex import presets


def _masks() -> Figure:
    """The mask builders, drawn as maps (1 = may attend)."""
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    panels = {
        "causal_mask(4, 8)": masks.causal_mask(4, 8),
        "causal_mask(4, 8, align='top_left')": masks.causal_mask(4, 8, align="top_left"),
        "sliding_window_mask(8, window=3)": masks.sliding_window_mask(8, window=3),
        "combine(causal, document_mask)": masks.combine_masks(
            masks.causal_mask(8), masks.document_mask(docs)
        )[0, 0],
    }
    return viz.attention_maps({name: m.float() for name, m in panels.items()})


def _sinusoidal() -> Figure:
    return viz.sinusoidal_heatmap(attnkit.SinusoidalPositionalEncoding(128, 100).pe)


def _complexity() -> Figure:
    seq_lens = [2**i for i in range(6, 15)]
    costs = [complexity.attention_cost(n, 512, 8) for n in seq_lens]
    series = {
        c.name: [cost.components[i].flops for cost in costs]
        for i, c in enumerate(costs[0].components)
    }
    series["total"] = [cost.flops for cost in costs]
    return viz.complexity_curves(
        seq_lens,
        series,
        crossover=float(costs[0].crossover_exact),
        title="one attention layer, D=512, H=8: FLOPs per component",
    )


def _model_attention() -> Figure:
    torch.manual_seed(0)
    config = attnkit.TransformerConfig(
        vocab_size=64,
        dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=64,
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        rope_interleaved=False,
        window=6,
    )
    lm = attnkit.TransformerLM(config).eval()
    with torch.no_grad():
        _, weights = lm(torch.randint(0, 64, (1, 12)), return_weights=True)
    return viz.attention_grid(
        torch.stack([w[0] for w in weights]), title="a random Mistral-shaped model, window 6"
    )


def _flex_window() -> Figure:
    return viz.mask_picture(presets.sliding_window(12), 96, block_size=16)


def _flex_prefix_lm() -> Figure:
    return viz.mask_picture(presets.prefix_lm(24), 64, block_size=16)


#: File name -> function that draws it; the guide links ``figures/<name>``.
FIGURES: dict[str, Callable[[], Figure]] = {
    "masks.png": _masks,
    "scaling.png": viz.scaling_demo,
    "softmax.png": viz.softmax_demo,
    "sinusoidal.png": _sinusoidal,
    "rotary_frequencies.png": lambda: viz.rotary_frequencies(64),
    "rotary_relative.png": viz.rotary_relative_scores,
    "complexity.png": _complexity,
    "model_attention.png": _model_attention,
    "flex_window.png": _flex_window,
    "flex_prefix_lm.png": _flex_prefix_lm,
    "flex_alibi.png": lambda: viz.score_bias(presets.alibi(4), 32, num_heads=4),
}


def render(names: list[str] | None = None) -> dict[str, bytes]:
    """Draw the figures and return them as PNG bytes.

    Args:
        names: File names from :data:`FIGURES` to draw; all of them when ``None``.

    Returns:
        File name -> PNG bytes.

    Raises:
        ValueError: If a name is not in :data:`FIGURES`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = list(FIGURES) if names is None else names
    unknown = sorted(set(chosen) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figures {unknown}; known: {sorted(FIGURES)}")
    pngs = {}
    for name in chosen:
        fig = FIGURES[name]()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        pngs[name] = buffer.getvalue()
    return pngs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNG files")
    parser.add_argument(
        "names", nargs="*", help=f"figures to draw (default: all of {list(FIGURES)})"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figures {unknown}; known: {sorted(FIGURES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, png in render(args.names or None).items():
        path = args.out / name
        path.write_bytes(png)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
