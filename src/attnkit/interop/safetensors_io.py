"""safetensors files through the ``safetensors`` package, one block of rows in memory at a time.

Reading checks a file with :class:`safetensors.safe_open` (which validates the header and the
offsets) and copies each tensor into its destination a few rows at a time, each block read
with ``os.preadv`` straight from the tensor's byte range into a block-sized buffer. Memory-mapped
reads would keep the whole file in the process's resident memory, and the package's sliced reads
(``get_slice``) materialize the whole tensor for every slice; either would make the loading peak
the weights plus a full tensor or file rather than the weights plus one block.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "SafetensorsEntry",
    "SafetensorsFile",
    "open_safetensors",
    "read_safetensors_header",
    "write_safetensors",
]

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
    """One tensor of a safetensors file: dtype, shape, size in bytes and where its bytes start in
    the file (``None``: read through the package)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int | None = None


class SafetensorsFile(NamedTuple):
    """An open safetensors file: the package's handle and a raw descriptor for block reads."""

    handle: Any
    fd: int
    path: Path


def _data_offsets(path: Path) -> dict[str, int]:
    """Absolute byte offset of each tensor's data (the header: 8-byte little-endian size, JSON)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    return {
        k: 8 + size + int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"
    }


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError as err:
        raise ImportError(
            "reading model weights needs the safetensors package: pip install 'attnkit[models]'"
        ) from err
    return safetensors


@contextmanager
def open_safetensors(path: str | Path) -> Iterator[SafetensorsFile]:
    """A :class:`SafetensorsFile`: a :class:`safetensors.safe_open` handle (PyTorch tensors,
    ``pread`` where available) and a descriptor :func:`copy_tensor` reads blocks through.

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
    fd = os.open(path, os.O_RDONLY)
    try:
        with handle as f:
            yield SafetensorsFile(f, fd, path)
    finally:
        os.close(fd)


def read_safetensors_header(path: str | Path) -> dict[str, SafetensorsEntry]:
    """The tensors of a safetensors file, in file order: name -> (dtype, shape, nbytes).

    Raises:
        ValueError: If the file is truncated or malformed, or holds a dtype torch cannot load
            (naming the file and the tensor).
    """
    out: dict[str, SafetensorsEntry] = {}
    with open_safetensors(path) as f:
        offsets = _data_offsets(Path(path))  # (safe_open validated the header)
        for key in f.handle.offset_keys():
            view = f.handle.get_slice(key)
            code = view.get_dtype()
            if code not in DTYPES:
                raise ValueError(f"{path}: tensor {key!r} has dtype {code}, not one torch loads")
            shape = tuple(int(s) for s in view.get_shape())
            dtype = DTYPES[code]
            nbytes = math.prod(shape) * dtype.itemsize
            out[key] = SafetensorsEntry(dtype, shape, nbytes, offsets.get(key))
    return out


def copy_tensor(f: SafetensorsFile, key: str, entry: SafetensorsEntry, dest: Tensor) -> None:
    """Copy tensor ``key`` of the open file ``f`` into ``dest`` (same shape, any dtype and
    device), a block of rows at a time.

    Raises:
        ValueError: If the file ends inside the tensor's bytes.
    """
    if not entry.nbytes:
        return
    if not entry.shape or entry.offset is None or entry.dtype == torch.bool:
        view = f.handle.get_slice(key)
        dest.copy_(view[...])
        return
    rows = entry.shape[0]
    row_bytes = entry.nbytes // rows
    step = max(1, _CHUNK_BYTES // row_bytes)
    buffer = bytearray(min(rows, step) * row_bytes)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        block = memoryview(buffer)[: (r1 - r0) * row_bytes]
        got = os.preadv(f.fd, [block], entry.offset + r0 * row_bytes)
        if got != len(block):
            raise ValueError(f"{f.path}: tensor {key} is truncated (rows {r0}:{r1})")
        values = torch.frombuffer(block, dtype=entry.dtype).reshape(r1 - r0, *entry.shape[1:])
        dest[r0:r1].copy_(values)


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
