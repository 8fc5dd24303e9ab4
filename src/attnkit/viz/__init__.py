"""Pictures of attention for learners: every function returns a matplotlib ``Figure``.

Nothing here calls ``plt.show()`` or touches pyplot's global state: figures are built with
``matplotlib.figure.Figure`` directly, which renders with the Agg canvas and works on headless
machines. Save them with :func:`save_figure`. Inputs are torch tensors, numpy arrays or nested
lists; the rotary pictures rotate with :func:`attnkit.positional.apply_rope`, so they show the
library's own rotation.

matplotlib is the optional ``viz`` extra; ``import attnkit`` never imports this module.

Shape legend: L query length, S key length, E head dimension.

The pictures live by topic: :mod:`attnkit.viz.weights` (attention maps),
:mod:`attnkit.viz.positions` (sinusoidal and rotary positions), :mod:`attnkit.viz.demos` (the
blog's numbers), :mod:`attnkit.viz.curves` (costs and training) and :mod:`attnkit.viz.masks`
(the masks and biases of attention variants); every name is importable from ``attnkit.viz``.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from attnkit.viz.curves import complexity_curves, run_comparison, training_curves
from attnkit.viz.demos import scaling_demo, softmax_demo
from attnkit.viz.masks import bias_values, block_states, mask_grid, mask_picture, score_bias
from attnkit.viz.positions import (
    rotary_frequencies,
    rotary_relative_scores,
    rotary_table,
    sinusoidal_heatmap,
)
from attnkit.viz.weights import attention_grid, attention_map, attention_maps

__all__ = [
    "attention_grid",
    "attention_map",
    "attention_maps",
    "bias_values",
    "block_states",
    "complexity_curves",
    "mask_grid",
    "mask_picture",
    "rotary_frequencies",
    "rotary_relative_scores",
    "rotary_table",
    "run_comparison",
    "save_figure",
    "scaling_demo",
    "score_bias",
    "sinusoidal_heatmap",
    "softmax_demo",
    "training_curves",
]


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (PNG at 120 dpi unless the suffix names another format).

    Parent directories are created. A path without a suffix gets ``.png``.

    Args:
        fig: The figure to write.
        path: Destination file.

    Returns:
        The path written.
    """
    out = Path(path)
    if not out.suffix:
        out = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, facecolor="white")
    return out
