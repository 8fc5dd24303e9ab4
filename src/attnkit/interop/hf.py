"""Hugging Face decoder folders (and GGUF files) <-> :class:`attnkit.TransformerLM`.

A folder holds ``config.json``, the weights (``model.safetensors``, or shards
``model-0000N-of-0000M.safetensors`` listed in ``model.safetensors.index.json``) and optionally
``generation_config.json`` and ``tokenizer.json``. The supported architectures and the mapping of
their options are records in :mod:`attnkit.interop.architectures`, mapped by
:mod:`attnkit.interop.hf_config` (``config.json``) and :mod:`attnkit.interop.hf_weights` (tensor
names); the file reading is in :mod:`attnkit.interop.safetensors_io`. A path ending in ``.gguf``
is read by :mod:`attnkit.interop.gguf`.

Both formats load through :func:`attnkit.interop.loading.load`: the model is built on the meta
device, its parameters allocated once in the target dtype on the target device and the
checkpoint's tensors copied into them a block of rows at a time, so the peak memory is the
weights plus one block.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from attnkit.config import TransformerConfig
from attnkit.interop import gguf
from attnkit.interop.architectures import architecture
from attnkit.interop.hf_config import SUPPORTED_ARCHITECTURES, config_from_hf, hf_config_from
from attnkit.interop.hf_weights import WeightEntry, hf_state_dict, weight_map
from attnkit.interop.loading import (
    Checkpoint,
    CheckpointTensor,
    LoadOptions,
    check_load_options,
    load,
)
from attnkit.interop.safetensors_io import (
    SafetensorsEntry,
    SafetensorsFile,
    copy_tensor,
    open_safetensors,
    read_safetensors_header,
    write_safetensors,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "WeightEntry",
    "config_from_hf",
    "from_pretrained",
    "hf_config_from",
    "hf_state_dict",
    "read_folder",
    "read_generation_config",
    "read_safetensors_header",
    "save_pretrained",
    "to_transformers",
    "weight_map",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{index}: malformed index ({err!r})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path} lacks the weight shards {missing} named in {INDEX_NAME}"
            )
        return [path / n for n in names]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    raise FileNotFoundError(
        f"{path} has no weights: expected {WEIGHTS_NAME} or {INDEX_NAME} with its shards "
        "(.bin/.pt weights are not read; convert them to safetensors)"
    )


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        ValueError: If the file is not valid JSON or not an object (naming it).
    """
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """Token ids for generation: ``eos_token_id`` (int or list), ``pad_token_id``,
    ``bos_token_id`` from ``generation_config.json``, falling back to ``config.json``.

    Returns:
        The ids that are set (missing ones are left out).
    """
    path = Path(path)
    out: dict[str, Any] = {}
    for name in ("config.json", "generation_config.json"):  # the latter wins
        if (path / name).is_file():
            data = read_json(path / name)
            for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
                if data.get(key) is not None:
                    out[key] = data[key]
    return out


def _tensors(headers: dict[Path, dict[str, SafetensorsEntry]]) -> Iterator[CheckpointTensor]:
    """The tensors of the weight files, each file open while its tensors are read."""
    for file, entries in headers.items():
        with open_safetensors(file) as f:
            for key, info in entries.items():
                yield CheckpointTensor(key, info.shape, file.name, partial(_copy, f, key, info))


def _copy(
    f: SafetensorsFile, key: str, info: SafetensorsEntry, dest: Tensor, entry: WeightEntry
) -> None:
    copy_tensor(f, key, info, dest)


def read_folder(path: str | Path) -> Checkpoint:
    """A Hugging Face folder read up to its tensors: config, architecture, the weight files'
    headers (checked before anything is allocated) and generation ids.

    Raises:
        FileNotFoundError: Naming the missing folder, ``config.json`` or weight files.
        ValueError: Unsupported architecture or option, malformed or truncated files.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} lacks config.json")
    name, config = config_from_hf(read_json(path / "config.json"))
    arch = architecture(name)
    headers = {f: read_safetensors_header(f) for f in _weight_files(path)}
    return Checkpoint(
        arch,
        config,
        arch.tensors,
        _tensors(headers),
        str(path),
        name,
        read_generation_config(path),
    )


def from_pretrained(
    path: str | Path, *, dequantize: bool = False, **options: Unpack[LoadOptions]
) -> Any:
    """Load a Hugging Face decoder folder or a ``.gguf`` file into ``cls(config)`` (eval mode).

    ``TransformerLM.from_pretrained`` calls this with ``cls=TransformerLM``; the loader itself
    knows only the config and the parameter names, so it sits below the models.

    Args:
        path: Folder with ``config.json`` and safetensors weights, or a llama.cpp ``.gguf`` file
            (see :func:`attnkit.interop.gguf.read_gguf`).
        cls: The model class (:class:`attnkit.TransformerLM`), called with the config.
        dtype: Parameter dtype (default: torch's default dtype, float32); ``torch.bfloat16`` or
            ``torch.float16`` load straight into that dtype (GGUF's quantized tensors are
            dequantized to float32 a block of rows at a time and cast).
        device: Where the parameters are allocated and the weights copied to (default: CPU), e.g.
            ``"cuda"``; nothing passes through a full CPU copy of the model.
        replace: Swap each plain ``nn.Linear`` for ``replace(linear)`` as soon as its weight is
            loaded (in ``dtype``), e.g. a quantized linear: only a linear or two is ever held in
            full precision (see :class:`attnkit.interop.loading.ParameterFiller`).
        dequantize: For a ``.gguf`` file, dequantize its ``Q8_0``, ``Q4_0`` and ``Q4_1``
            matrices to ``dtype``. By default (on the CPU) each linear whose matrix is in one of
            them becomes a :class:`attnkit.quantized.BlockLinear` holding the file's blocks as
            they are (no dequantizing and quantizing again; ``replace`` is not applied to it).

    Returns:
        The model; ``model.generation_config`` holds the folder's eos/pad/bos ids (a GGUF
        file's: the end-of-text and end-of-turn ids).

    Raises:
        FileNotFoundError: Naming the missing folder, file, ``config.json`` or weight files.
        ValueError: Unsupported architecture or option, truncated, damaged or hostile files,
            tensor shapes that do not match the config, missing or unexpected tensors (naming
            the file and tensor, before any allocation where the file's description is at
            fault).
        TypeError: If ``dtype`` is not a floating torch dtype; without ``cls``, or for an option
            :class:`attnkit.interop.loading.LoadOptions` does not name.
    """
    check_load_options("from_pretrained", options)
    path = Path(path)
    native = False
    if path.suffix == ".gguf" and not path.is_dir():
        checkpoint = gguf.read_gguf(path)
        native = not dequantize
    else:
        checkpoint = read_folder(path)
    return load(checkpoint, native=native, **options)


def to_transformers(lm: nn.Module) -> Any:
    """The ``transformers`` model computing the same function as ``lm`` (eval mode, float32).

    Built from :func:`hf_config_from` and :func:`hf_state_dict`, the mapping
    :func:`save_pretrained` writes, without a folder in between.

    Raises:
        ImportError: Without ``transformers``.
        ValueError: If an option of ``lm`` has no counterpart (naming it).
    """
    import transformers

    config: TransformerConfig = lm.config  # type: ignore[assignment]
    data = hf_config_from(config)
    arch = data["architectures"][0]
    model = getattr(transformers, arch)(transformers.AutoConfig.for_model(**data)).eval()
    state = dict(hf_state_dict(lm, arch))
    if config.tie_embeddings:
        model.tie_weights()
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if not (k == "lm_head.weight" and config.tie_embeddings)]
    if left or unexpected:  # pragma: no cover - the mapping and transformers disagree
        raise ValueError(f"transformers {arch}: missing {left}, unexpected {unexpected}")
    return model


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_pretrained(lm: nn.Module, path: str | Path, *, max_shard_size: int | None = None) -> Path:
    """Write ``lm`` as a Hugging Face folder ``transformers`` loads with the same outputs.

    Writes ``config.json``, ``generation_config.json`` (when ``lm.generation_config`` has ids)
    and ``model.safetensors`` (or shards of at most ``max_shard_size`` bytes plus
    ``model.safetensors.index.json``). Everything is written into a temporary folder beside
    ``path`` first; a new ``path`` is then renamed into place in one step, an existing folder
    gets each file moved in atomically (weights before ``config.json``; other files, such as a
    ``tokenizer.json``, are kept; stale shards are removed).

    Args:
        lm: A :class:`attnkit.TransformerLM`.
        path: Destination folder.
        max_shard_size: Shard the weights into files of at most this many bytes.

    Returns:
        ``path``.

    Raises:
        ValueError: If an option of the model has no counterpart (naming it), or a bad
            ``max_shard_size``.
    """
    config: TransformerConfig = lm.config  # type: ignore[assignment]
    hf = hf_config_from(config)
    arch = hf["architectures"][0]
    if max_shard_size is not None and max_shard_size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    dtype = next(lm.parameters()).dtype
    gen: dict[str, Any] = dict(getattr(lm, "generation_config", {}))
    hf |= {k: v for k, v in gen.items() if k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    hf["dtype"] = hf["torch_dtype"] = _HF_DTYPE_NAMES.get(dtype, "float32")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        shards: list[dict[str, Tensor]] = [{}]
        size = 0
        for key, t in hf_state_dict(lm, arch):
            if max_shard_size is not None and shards[-1] and size + t.nbytes > max_shard_size:
                shards.append({})
                size = 0
            shards[-1][key] = t
            size += t.nbytes
        names = (
            [WEIGHTS_NAME]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        for name, shard in zip(names, shards, strict=True):
            write_safetensors(tmp / name, shard)
        if len(shards) > 1:
            total = sum(t.nbytes for s in shards for t in s.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: n for n, s in zip(names, shards, strict=True) for k in s},
            }
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
            names.append(INDEX_NAME)
        if gen:
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
            names.append("generation_config.json")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        names.append("config.json")
        if not path.exists():
            os.replace(tmp, path)
            return path
        stale = [p for p in path.glob("model*.safetensors*") if p.name not in names]
        for name in names:
            os.replace(tmp / name, path / name)
        for p in stale:
            p.unlink()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path
