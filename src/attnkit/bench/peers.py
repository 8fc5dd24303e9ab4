"""The libraries attnkit is measured against, imported only where a row needs them, quietly.

transformers, sentence-transformers, torchao and llama-cpp-python are optional: a benchmark row
that needs one imports it through :func:`quiet` (or :func:`to_transformers`), so a missing peer
costs only its own rows. Importing them logs load failures of native libraries built for other
machines and deprecation notices of torch internals; those lines would land between the rows of
a table, so :func:`quiet` holds them back for the duration of the import only (Python warnings
and the named loggers, nothing global).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from torch import Tensor, nn

__all__ = ["QUIET_LOGGERS", "hf_greedy", "import_quietly", "quiet", "to_transformers"]

#: Loggers whose import-time messages :func:`quiet` holds back: torchao's native-library loader
#: and torch's pytree registrations (called by torchao and transformers at import).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "transformers", "sentence_transformers")


@contextlib.contextmanager
def quiet(*loggers: str) -> Iterator[None]:
    """Hold back Python warnings, messages below ERROR of ``loggers`` (default
    :data:`QUIET_LOGGERS`) and, once transformers is imported, its loading progress bars, inside
    the block; everything is restored on exit."""
    names = loggers or QUIET_LOGGERS
    levels = {name: logging.getLogger(name).level for name in names}
    bars = _hf_progress_bars(False)
    try:
        for name in names:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        if bars:
            _hf_progress_bars(True)


def _hf_progress_bars(enabled: bool) -> bool:
    """Turn transformers' progress bars on or off where it is imported; returns whether they
    were on."""
    hf = sys.modules.get("transformers")
    if hf is None:
        return False
    hf_logging = hf.utils.logging
    was = bool(hf_logging.is_progress_bar_enabled())
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    return was


def import_quietly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` inside :func:`quiet`, offline for Hugging Face hubs.

    Raises:
        ImportError: When the module is not installed.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with quiet():
        return importlib.import_module(name)


def to_transformers(model: nn.Module) -> Any:
    """transformers' ``LlamaForCausalLM`` computing the same function as a Llama-shaped ``model``,
    in the model's dtype (:func:`attnkit.interop.hf.to_transformers`, imported quietly).

    Raises:
        ImportError: Without transformers.
        ValueError: If ``model`` is not Llama-shaped (pre-norm RMSNorm, SwiGLU, rotary
            positions, no biases or window).
    """
    cfg: Any = model.config
    llama_like = (
        cfg.norm == "rmsnorm"
        and cfg.activation == "swiglu"
        and cfg.norm_first
        and cfg.position == "rope"
        and cfg.window is None
        and not any(m.bias is not None for m in model.modules() if isinstance(m, nn.Linear))
    )
    if not llama_like:
        raise ValueError(f"model is not Llama-shaped: {cfg}")
    from attnkit.interop import hf

    import_quietly("transformers")
    with quiet():
        peer = hf.to_transformers(model)
    if type(peer).__name__ != "LlamaForCausalLM":
        raise ValueError(f"model is not Llama-shaped: converted to {type(peer).__name__}")
    dtype = next(model.parameters()).dtype
    return peer.to(dtype).eval()


def hf_greedy(peer: Any, prompt: Tensor) -> Callable[[int], Tensor]:
    """transformers' greedy ``generate`` of exactly ``n`` new tokens (no end-of-sequence)."""

    def run(n: int) -> Tensor:
        out: Tensor = peer.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        return out

    return run
