"""Atomic checkpoints: one safetensors file holds weights, optimizer state and RNG state.

A checkpoint is written to a temporary file in the destination directory, flushed to disk and
moved over the old one with ``os.replace`` (atomic on POSIX and Windows), so a crash leaves either
the previous checkpoint or the new one, never half a file. Weights, optimizer moments and the RNG
state travel in one file so they can never come from different steps; the JSON fields (config,
step, history) go in the safetensors metadata. ``config.json`` and ``metrics.json`` beside it are
written the same way.

Keys: ``model.<parameter name>`` (load them into a fresh model with :func:`model_state`),
``optim.<param index>.<state name>``, ``rng.torch``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "CHECKPOINT_NAME",
    "FORMAT",
    "CheckpointError",
    "atomic_write",
    "full_states",
    "load_checkpoint",
    "model_state",
    "remove_temp_files",
    "restore_optimizer",
    "restore_sharded",
    "save_checkpoint",
    "write_json",
]

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT = "attnkit-lab-1"
# atomic_write's temporary files: ".<target name>.<mkstemp's 8 random characters>.tmp"
_TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: truncated, damaged, or not an attnkit lab one."""


def remove_temp_files(directory: str | Path) -> list[Path]:
    """Delete the temporary files that :func:`atomic_write` leaves when a process is killed.

    Only files named like its temporaries (``.<name>.<8 characters>.tmp``) directly in
    ``directory`` are removed; call it before a run writes there, not while one does.

    Args:
        directory: A run's output directory (need not exist).

    Returns:
        The files removed.
    """
    folder = Path(directory)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if _TEMP_NAME.fullmatch(p.name) and p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def atomic_write(path: str | Path, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` then move the temporary file onto ``path`` atomically.

    Args:
        path: Destination file.
        write: Writes the complete content to the path it is given.

    Returns:
        ``path``.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        # After the write: mkstemp makes 0600 files, and writers such as safetensors' save_file
        # create the file anew with that mode. Give it the usual mode, as open() would.
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, atomically."""
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module | dict[str, Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write model weights, optimizer state and the torch RNG state to one safetensors file.

    Args:
        path: Destination file (its directory must exist).
        model: The model (unwrapped, not the DistributedDataParallel wrapper), or its full
            ``state_dict`` (as gathered from a sharded model by :func:`full_states`).
        optimizer: Its optimizer, for resuming, or the optimizer's ``state_dict`` in torch's
            form (parameters numbered in order).
        metadata: JSON-serialisable fields stored in the file's header (config, step, ...).

    Returns:
        ``path``.
    """
    from safetensors.torch import save_file

    # clone: tied weights share storage, which safetensors refuses; copies load back fine.
    tensors: dict[str, Tensor] = {
        f"model.{k}": v.detach().to("cpu").clone().contiguous()
        for k, v in (model if isinstance(model, dict) else model.state_dict()).items()
    }
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        for idx, fields in state["state"].items():
            for name, value in fields.items():
                value = value if isinstance(value, Tensor) else torch.tensor(value)
                tensors[f"optim.{idx}.{name}"] = value.detach().to("cpu").clone().contiguous()
        groups = state["param_groups"]
    tensors["rng.torch"] = torch.get_rng_state()
    header = {
        "format": FORMAT,
        "optim_param_groups": json.dumps(groups),
        **{k: json.dumps(v) for k, v in (metadata or {}).items()},
    }
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Returns:
        ``(tensors, metadata)`` with the metadata values decoded from JSON.

    Raises:
        FileNotFoundError: If there is no checkpoint at ``path``.
        CheckpointError: If the file is damaged, truncated or not an attnkit lab checkpoint
            (a ``ValueError``).
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (nothing to resume)")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        if header.get("format") != FORMAT:
            raise CheckpointError(
                f"{path} is not an attnkit lab checkpoint (format "
                f"{header.get('format')!r}, expected {FORMAT!r})"
            )
        meta = {k: json.loads(v) for k, v in header.items() if k != "format"}
        return load_file(str(path)), meta
    except (SafetensorError, json.JSONDecodeError, OSError) as err:
        reason = " ".join(str(err).split())  # one line
        raise CheckpointError(f"{path} is damaged or truncated ({reason})") from err


def model_state(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The model's ``state_dict`` from a checkpoint's tensors (``model.`` prefix removed)."""
    return {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}


def restore_optimizer(
    optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict[str, Any]
) -> None:
    """Load the optimizer state saved by :func:`save_checkpoint` into ``optimizer``."""
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["optim_param_groups"]})


def _full_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_states(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Gather a sharded (``fully_shard``) model's and optimizer's full state on the CPU.

    A collective: every rank calls it; rank 0 receives the whole state (other ranks get empty
    dicts), in the form :func:`save_checkpoint` writes, so a single process loads the file.

    Args:
        model: The sharded model.
        optimizer: Its optimizer.

    Returns:
        ``(model state_dict, optimizer state_dict)``, the optimizer's parameters numbered in
        the order of ``model.parameters()`` like an unsharded optimizer's.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = _full_options()
    weights: dict[str, Tensor] = dict(get_model_state_dict(model, options=options))  # type: ignore[arg-type]
    optim: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if not optim:
        return weights, {}
    number = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    groups = [
        {**g, "params": [number[name] for name in g["params"]]} for g in optim["param_groups"]
    ]
    state = {number[name]: fields for name, fields in optim["state"].items()}
    return weights, {"state": state, "param_groups": groups}


def restore_sharded(
    optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict[str, Any]
) -> None:
    """:func:`restore_optimizer` for the optimizer of a sharded (``fully_shard``) model.

    Every rank calls it with the whole checkpoint; each optimizer moment is cut like its
    parameter (load the weights into the model before sharding it).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            param = params[int(idx)]
            if isinstance(param, DTensor) and value.shape == param.shape:
                value = distribute_tensor(
                    value.to(param.device), param.device_mesh, param.placements
                )
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["optim_param_groups"]})
