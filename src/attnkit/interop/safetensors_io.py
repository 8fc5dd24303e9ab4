"""safetensors files through the ``safetensors`` package, one block of rows in memory at a time.

Reading opens a file with :class:`safetensors.safe_open` and copies each tensor into its
destination a few rows at a time (``get_slice``), with the ``pread`` backend where the package
has it: memory-mapped reads would keep the whole file in the process's resident memory, so the
peak would be the weights twice instead of the weights plus one block.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["SafetensorsEntry", "open_safetensors", "read_safetensors_header", "write_safetensors"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Bytes read at a time: a tensor larger than this is copied in blocks of rows, so loading
# needs the parameters plus one block, whatever the checkpoint's and the target's dtypes.
_CHUNK_BYTES = 4 * 2**20


class SafetensorsEntry(NamedTuple):
    """One tensor of a safetensors file: dtype, shape and size in bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError as err:
        raise ImportError(
            "reading model weights needs the safetensors package: pip install 'attnkit[models]'"
        ) from err
    return safetensors


@contextmanager
def open_safetensors(path: str | Path) -> Iterator[Any]:
    """A :class:`safetensors.safe_open` handle (PyTorch tensors, ``pread`` where available).

    Raises:
        ValueError: If the file is truncated or malformed (naming the file and the reason).
    """
    safetensors = _safetensors()
    path = Path(path)
    try:
        try:
            handle = safetensors.safe_open(path, "pt", backend="pread")
        except TypeError:  # safetensors before 0.7: memory-mapped only
            handle = safetensors.safe_open(path, "pt")
    except safetensors.SafetensorError as err:
        raise ValueError(f"{path} is truncated or malformed: {err}") from None
    with handle as f:
        yield f


def read_safetensors_header(path: str | Path) -> dict[str, SafetensorsEntry]:
    """The tensors of a safetensors file, in file order: name -> (dtype, shape, nbytes).

    Raises:
        ValueError: If the file is truncated or malformed, or holds a dtype torch cannot load
            (naming the file and the tensor).
    """
    out: dict[str, SafetensorsEntry] = {}
    with open_safetensors(path) as f:
        for key in f.offset_keys():
            view = f.get_slice(key)
            code = view.get_dtype()
            if code not in DTYPES:
                raise ValueError(f"{path}: tensor {key!r} has dtype {code}, not one torch loads")
            shape = tuple(int(s) for s in view.get_shape())
            dtype = DTYPES[code]
            out[key] = SafetensorsEntry(dtype, shape, math.prod(shape) * dtype.itemsize)
    return out


def copy_tensor(f: Any, key: str, entry: SafetensorsEntry, dest: Tensor) -> None:
    """Copy tensor ``key`` of the open file ``f`` into ``dest`` (same shape, any dtype and
    device), a block of rows at a time."""
    if not entry.nbytes:
        return
    view = f.get_slice(key)
    if not entry.shape:
        dest.copy_(view[...])
        return
    rows = entry.shape[0]
    step = max(1, _CHUNK_BYTES // (entry.nbytes // rows))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        dest[r0:r1].copy_(view[r0:r1])


def write_safetensors(path: str | Path, tensors: dict[str, Tensor]) -> None:
    """Write ``tensors`` (CPU, contiguous, no shared storage) as one safetensors file, synced to
    disk before returning."""
    _safetensors()
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
