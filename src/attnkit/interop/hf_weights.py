"""Checkpoint tensor names <-> :class:`attnkit.TransformerLM` parameters.

:func:`weight_map` says where each checkpoint tensor goes (a parameter, a row range of the fused
q/k/v or gate/up projection, transposed for GPT-2's ``Conv1D``), from the family's
:class:`~attnkit.interop.architectures.TensorNames` (Hugging Face's or llama.cpp's);
:func:`hf_state_dict` is the other direction, the tensors a Hugging Face folder holds;
:func:`translate_name` maps a tensor name between two naming schemes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor, nn

from attnkit.config import TransformerConfig
from attnkit.interop.architectures import Architecture, TensorNames, architecture
from attnkit.positional import permute_rotary_weight

__all__ = ["WeightEntry", "hf_state_dict", "translate_name", "weight_map"]


@dataclass(frozen=True)
class WeightEntry:
    """Where one checkpoint tensor goes: ``param[rows]`` (transposed first for ``Conv1D``).

    ``rotary_heads``: a query/key projection of that many heads, whose channels are permuted
    when the attnkit model pairs rotary channels interleaved (Hugging Face pairs halves).
    """

    param: str
    rows: tuple[int, int] | None = None
    transpose: bool = False
    rotary_heads: int | None = None


def _split(module: str, c: TransformerConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(rows of each part, rotary heads of the leading parts)`` of an attnkit module that
    checkpoints store as several tensors."""
    if module == "attention.qkv_proj":  # [q; k; v]: queries and keys carry rotary channels
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return (q, kv, kv), (c.num_heads, c.num_kv_heads)
    if module == "feed_forward.gate_up":  # [gate; up]
        return (c.ffn_dim, c.ffn_dim), ()
    raise ValueError(f"attnkit module {module!r} is not stored split in any checkpoint")


def weight_map(
    arch: str | Architecture, lm: nn.Module, *, names: TensorNames | None = None
) -> dict[str, WeightEntry]:
    """Checkpoint tensor name -> attnkit parameter, for every parameter of ``lm``.

    Args:
        arch: The architecture (a record or its Hugging Face name).
        lm: The model (a :class:`attnkit.TransformerLM`); its parameters say which tensors a
            checkpoint of its config holds (biases, qk-norms, post-norms, an untied head).
        names: The naming scheme (default: the family's Hugging Face names).

    Raises:
        ValueError: If a parameter of ``lm`` has no tensor name in the family (an option the
            family does not have).
    """
    record = architecture(arch) if isinstance(arch, str) else arch
    names = names or record.tensors
    config: TransformerConfig = lm.config  # type: ignore[assignment]
    out: dict[str, WeightEntry] = {}
    for param, p in lm.named_parameters():
        module, _, kind = param.rpartition(".")
        if module.startswith("blocks."):
            _, i, sub = module.split(".", 2)
            theirs, prefix = names.block.get(sub), names.layer.format(i=i)
        else:
            sub, theirs, prefix = "", names.model.get(module), ""
        if theirs is None:
            raise ValueError(f"{record.name} checkpoints have no tensor for parameter {param}")
        transpose = names.transposed and bool(sub) and p.dim() == 2
        if isinstance(theirs, str):
            out[f"{prefix}{theirs}.{kind}"] = WeightEntry(param, transpose=transpose)
            continue
        sizes, heads = _split(sub, config)
        start = 0
        for j, (name, size) in enumerate(zip(theirs, sizes, strict=True)):
            rotary = heads[j] if j < len(heads) else None
            out[f"{prefix}{name}.{kind}"] = WeightEntry(
                param, (start, start + size), transpose, rotary_heads=rotary
            )
            start += size
    return out


def hf_state_dict(lm: nn.Module, arch: str | Architecture) -> Iterator[tuple[str, Tensor]]:
    """The tensors of ``lm`` under the names of Hugging Face architecture ``arch``, one by one.

    Each is a contiguous CPU tensor (a copy only where a row range, a transpose or the rotary
    permutation asks for one); interleaved rotary channels are saved as Hugging Face's halves.

    Yields:
        ``(checkpoint name, tensor)`` in :func:`weight_map` order.
    """
    config: TransformerConfig = lm.config  # type: ignore[assignment]
    params = dict(lm.named_parameters())
    for key, entry in weight_map(arch, lm).items():
        t = params[entry.param].detach()
        if entry.rows is not None:
            t = t[entry.rows[0] : entry.rows[1]]
        if entry.rotary_heads is not None and config.rope_interleaved:
            t = permute_rotary_weight(t, entry.rotary_heads, to="split")
        yield key, (t.t() if entry.transpose else t).contiguous().cpu()


def _parts(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else names


def _module(names: TensorNames, module: str) -> tuple[str, int] | None:
    """``(attnkit module, part)`` of checkpoint module ``module`` under ``names``."""
    for ours, name in names.model.items():
        if name == module:
            return ours, 0
    layer = re.escape(names.layer).replace(re.escape("{i}"), r"(\d+)")
    match = re.fullmatch(f"{layer}(.+)", module)
    if match:
        for ours, theirs in names.block.items():
            if match.group(2) in _parts(theirs):
                return f"blocks.{match.group(1)}.{ours}", _parts(theirs).index(match.group(2))
    return None


def translate_name(name: str, source: TensorNames, target: TensorNames) -> str:
    """Tensor ``name`` of naming scheme ``source`` in scheme ``target`` (``name`` itself when it
    has no counterpart there)."""
    module, _, kind = name.rpartition(".")
    found = _module(source, module)
    if found is None:
        return name
    ours, part = found
    if not ours.startswith("blocks."):
        top = target.model.get(ours)
        return name if top is None else f"{top}.{kind}"
    _, i, sub = ours.split(".", 2)
    theirs = target.block.get(sub)
    parts = () if theirs is None else _parts(theirs)
    if part >= len(parts):
        return name
    return f"{target.layer.format(i=i)}{parts[part]}.{kind}"
