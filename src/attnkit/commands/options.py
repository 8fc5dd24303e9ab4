"""Options that several commands share, defined here once so that their choices stay alike.

Each command keeps its own help text (it says what the option means for that command); the flag,
its choices and its default are the same everywhere.
"""

from __future__ import annotations

import argparse

#: The parameter dtypes a loaded model can take.
MODEL_DTYPES = ("float32", "bfloat16", "float16")
#: The weight-only quantizations of :func:`attnkit.quantize.quantize` (named here, not imported,
#: so that parsing the command line does not load torch).
QUANTIZE_MODES = ("int8", "int4")


def add_dtype_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--dtype``: the parameter dtype of the loaded model(s), float32 unless given."""
    parser.add_argument("--dtype", choices=MODEL_DTYPES, default="float32", help=help)


def add_quantize_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--quantize int8|int4``: weight-only quantization of the linears after loading; none
    unless given."""
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, default=None, help=help)
