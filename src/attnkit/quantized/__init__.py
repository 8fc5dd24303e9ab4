"""Quantized linears, the modules :func:`attnkit.quantize.quantize` swaps in for a model's linears
(and a GGUF file's quantized tensors load into):

* :class:`Int8Linear` (:mod:`attnkit.quantized.int8`): int8 codes, one scale per output channel;
  several kernels, chosen by the policy;
* :class:`Int4Linear` (:mod:`attnkit.quantized.int4`): 4-bit codes with a bf16 scale and offset
  per group of inputs, activations rounded to int8 for integer dots;
* :class:`BlockLinear` (:mod:`attnkit.quantized.block`): GGUF's block layouts ``q8_0``, ``q4_0``
  and ``q4_1``, f16 scales per group of 32 (or more) inputs, float32 activations.
"""

from attnkit.quantized import int8
from attnkit.quantized.block import BLOCK_LAYOUTS, BlockLayout, BlockLinear
from attnkit.quantized.int4 import Int4Linear
from attnkit.quantized.int8 import *  # noqa: F403  (the int8 layer and its kernels: int8.__all__)

__all__ = ["BLOCK_LAYOUTS", "BlockLayout", "BlockLinear", "Int4Linear"]
__all__ += int8.__all__
