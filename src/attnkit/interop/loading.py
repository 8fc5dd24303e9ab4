"""Building a model from any checkpoint: allocate once, place each tensor, check the result.

A reader (:func:`attnkit.interop.hf.read_folder` for Hugging Face folders,
:func:`attnkit.interop.gguf.read_gguf` for GGUF files) turns a checkpoint into a
:class:`Checkpoint`: its architecture's record, the config, the naming scheme of its tensors and
the tensors themselves, each with the function that copies its values into a view of a parameter.
:func:`load` does the rest for every format: it builds the model on the meta device, allocates
the parameters once in the target dtype on the target device, fills them through a
:class:`ParameterFiller` (which checks every name and shape) and raises for anything left over
or missing.

Streamed replacement (weight-only quantization while loading): given ``replace``,
:func:`allocate` leaves the weight of every plain ``nn.Linear`` unallocated, the filler allocates
it when its first tensor arrives and, once it is full, swaps the linear for ``replace(linear)``
and drops the full-precision weight. Loading then peaks near the final (replaced) model's size
plus a linear or two, not at the full-precision model's size.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import torch
from torch import Tensor, nn

from attnkit.config import TransformerConfig
from attnkit.interop.architectures import Architecture, TensorNames
from attnkit.interop.hf_weights import WeightEntry, weight_map

if TYPE_CHECKING:
    from typing_extensions import Required, Unpack

# The model class a loader builds: ``cls(config)`` (:class:`attnkit.TransformerLM`, which sits
# above this package and passes itself in).
ModelClass = Callable[[TransformerConfig], nn.Module]
# What a plain linear becomes once its weight is loaded (a quantized linear, say).
Replace = Callable[[nn.Linear], nn.Module]

__all__ = [
    "Checkpoint",
    "CheckpointTensor",
    "LoadOptions",
    "ModelClass",
    "NativeBlocks",
    "ParameterFiller",
    "Replace",
    "allocate",
    "check_load_options",
    "load",
]


class LoadOptions(TypedDict, total=False):
    """How a checkpoint becomes a model: the options of :func:`load` and
    :func:`attnkit.interop.hf.from_pretrained`.

    Attributes:
        cls: The model class (:class:`attnkit.TransformerLM`), called with the config.
        dtype: Parameter dtype (default: torch's default dtype).
        device: Where the parameters are allocated (default: CPU).
        replace: Swap each plain ``nn.Linear`` for ``replace(linear)`` as soon as its weight is
            loaded (see :class:`ParameterFiller`).
    """

    cls: Required[ModelClass]
    dtype: torch.dtype | None
    device: str | torch.device | None
    replace: Replace | None


def check_load_options(what: str, options: Mapping[str, Any]) -> None:
    """Raise unless ``options`` (the ``**options`` of ``what``) give ``cls`` and only the other
    keys of :class:`LoadOptions`.

    Raises:
        TypeError: Naming what was given and what is taken.
    """
    known = LoadOptions.__optional_keys__ | LoadOptions.__required_keys__
    if not options.keys() <= known or "cls" not in options:
        raise TypeError(
            f"{what} takes cls and the options {sorted(known - {'cls'})}, got {sorted(options)}"
        )


# Tensors some checkpoints carry that are recomputed buffers, not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class NativeBlocks(NamedTuple):
    """A block-quantized matrix as a :class:`attnkit.quantized.BlockLinear` holds it: its
    ``layout`` (``"q8_0"``, ``"q4_0"``, ``"q4_1"``), codes, f16 scales and (``q4_1``) offsets."""

    layout: str
    codes: Tensor
    scales: Tensor
    offsets: Tensor | None


class CheckpointTensor(NamedTuple):
    """A tensor of a checkpoint: its name, shape and file, and how to read it.

    ``copy(dest, entry)`` writes the tensor's values into ``dest`` (a view of the parameter
    ``entry`` names, of the tensor's shape, in the parameter's dtype and device). ``native``,
    where the tensor is a matrix in a block layout attnkit's kernels multiply, gives its blocks
    as they are (:class:`NativeBlocks`) for ``entry``.
    """

    name: str
    shape: tuple[int, ...]
    file: str
    copy: Callable[[Tensor, WeightEntry], None]
    native: Callable[[WeightEntry], NativeBlocks] | None = None


@dataclass
class Checkpoint:
    """A checkpoint read up to its tensors, which :func:`load` turns into a model.

    Attributes:
        arch: The family's record.
        config: The config its metadata maps to.
        names: The naming scheme of its tensors.
        tensors: Its tensors, read as :func:`load` iterates over them.
        where: The checkpoint's path (named in errors).
        label: The format and architecture (named in errors), e.g. ``"llama GGUF"``.
        generation_config: Its eos/pad/bos ids.
    """

    arch: Architecture
    config: TransformerConfig
    names: TensorNames
    tensors: Iterable[CheckpointTensor]
    where: str
    label: str
    generation_config: dict[str, Any] = field(default_factory=dict)


def load(checkpoint: Checkpoint, *, native: bool = False, **options: Unpack[LoadOptions]) -> Any:
    """``cls(checkpoint.config)`` holding the checkpoint's weights, in eval mode.

    Args:
        checkpoint: What a reader found.
        native: Load block-quantized matrices (:attr:`CheckpointTensor.native`) of plain
            linears as :class:`attnkit.quantized.BlockLinear` layers holding their blocks as
            they are, on the CPU (a linear whose parts come in different layouts, or as floats,
            is dequantized). A tied output head gets a block layer of the embedding's blocks.
        **options: ``cls`` (required), ``dtype``, ``device``, ``replace``: see
            :class:`LoadOptions`.

    Returns:
        The model; ``model.generation_config`` holds the checkpoint's eos/pad/bos ids.

    Raises:
        TypeError: If ``dtype`` is not a floating torch dtype or ``device`` not a device; without
            ``cls``, or for an option :class:`LoadOptions` does not name.
        ValueError: For tensor shapes that do not match the config, missing or unexpected
            tensors (naming the file and tensor).
    """
    check_load_options("load", options)
    cls, dtype, device = options["cls"], options.get("dtype"), options.get("device")
    replace = options.get("replace")
    native = native and torch.device("cpu" if device is None else device).type == "cpu"
    if native and replace is None:
        replace = _kept
    lm = allocate(
        cls, checkpoint.config, dtype=dtype, device=device, stream_linears=replace is not None
    )
    filler = ParameterFiller(
        lm,
        weight_map(checkpoint.arch, lm, names=checkpoint.names),
        checkpoint.label,
        checkpoint.where,
        base_prefix=checkpoint.names.base_prefix,
        replace=replace,
    )
    tied_head: NativeBlocks | None = None
    with torch.no_grad():
        for tensor in checkpoint.tensors:
            entry = filler.entry(tensor.name)
            if entry is None:
                continue
            name, shape, file = tensor.name, tensor.shape, tensor.file
            native_blocks = tensor.native if native else None
            if native_blocks is not None and filler.place_native(
                entry, name, shape, file, native_blocks
            ):
                continue
            tensor.copy(filler.target(entry, name, shape, file), entry)
            if native_blocks is not None and entry.param == "embedding.weight":
                tied_head = native_blocks(entry)
    filler.finish()
    if tied_head is not None and getattr(lm, "lm_head", 0) is None:
        # A tied head multiplies the file's blocks (as quantize() gives a tied head a quantized
        # copy); the lookup keeps the float table.
        lm.lm_head = _block_linear(tied_head, None)
    lm.generation_config = dict(checkpoint.generation_config)
    return lm.eval()


def _kept(linear: nn.Linear) -> nn.Module:
    """The linear itself (loading with ``native`` and no ``replace``)."""
    return linear


def _concat(parts: list[tuple[int, NativeBlocks]]) -> NativeBlocks | None:
    """The parts (by first row) of one matrix as one, or None where their layouts differ."""
    parts = sorted(parts, key=lambda p: p[0])
    blocks = [p[1] for p in parts]
    if len({(b.layout, b.scales.shape[1]) for b in blocks}) != 1:
        return None
    if len(blocks) == 1:
        return blocks[0]
    offsets = None
    if blocks[0].offsets is not None:
        offsets = torch.cat([b.offsets for b in blocks if b.offsets is not None])
    return NativeBlocks(
        blocks[0].layout,
        torch.cat([b.codes for b in blocks]),
        torch.cat([b.scales for b in blocks]),
        offsets,
    )


def _block_linear(blocks: NativeBlocks, bias: Tensor | None) -> nn.Module:
    from attnkit.quantized.block import BlockLinear

    layout: Any = blocks.layout
    layer = BlockLinear.from_codes(blocks.codes, blocks.scales, blocks.offsets, layout=layout)
    # The model's own bias parameter, filled as it is loaded (any earlier value kept).
    layer.bias = bias if isinstance(bias, nn.Parameter) or bias is None else nn.Parameter(bias)
    return layer


def allocate(
    cls: ModelClass,
    config: TransformerConfig,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    stream_linears: bool = False,
) -> Any:
    """``cls(config)`` with uninitialised parameters, built on the meta device and allocated
    once in ``dtype`` on ``device`` (for a loader to fill).

    With ``stream_linears``, the weights of plain ``nn.Linear`` modules stay on the meta device:
    a :class:`ParameterFiller` with ``replace`` allocates each when its tensor arrives.

    Raises:
        TypeError: If ``dtype`` is not a floating torch dtype or ``device`` not a device.
        ValueError: If the model holds a non-empty buffer (a loader could not fill it).
    """
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    try:
        target = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as err:
        raise TypeError(f"device must be a torch.device or its name, got {device!r}") from err
    with torch.device("meta"):
        lm = cls(config)
    lm = lm.to(dtype)
    if not stream_linears:
        lm = lm.to_empty(device=target)
    else:
        made: dict[int, nn.Parameter] = {}  # shared parameters stay shared
        for module in lm.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if type(module) is nn.Linear and name == "weight":
                    continue
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(
                        torch.empty_like(param, device=target), param.requires_grad
                    )
                setattr(module, name, made[id(param)])
            for name, buf in list(module.named_buffers(recurse=False)):
                module._buffers[name] = torch.empty_like(buf, device=target)
    for name, buf in lm.named_buffers():
        if buf.numel():  # to_empty left them uninitialised; every buffer here is recomputable
            raise ValueError(f"unexpected non-empty buffer {name} after allocating {config}")
    return lm


def _release_freed_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). Without it the staged weights freed between the long-lived quantized ones leave
    holes in the heap that count as resident memory, well above the final model's size."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


class ParameterFiller:
    """Places checkpoint tensors, read one at a time, into a model's (allocated) parameters.

    :meth:`target` checks each tensor's name and shape and returns the view to copy it into;
    :meth:`finish` raises for tensors with no place and parameters left unfilled.

    Args:
        lm: The model whose parameters receive the tensors.
        entries: Checkpoint tensor name -> where it goes (:func:`weight_map`).
        label: The checkpoint's format and architecture (named in errors).
        where: The checkpoint's path (named in errors).
        base_prefix: Tried before a name that is not in the map (base-model checkpoints, such as
            the original gpt2, omit ``transformer.``/``model.``).
        replace: For a model from :func:`allocate` with ``stream_linears``: each plain linear
            whose weight is on the meta device gets it allocated (in that dtype) when its first
            tensor arrives and is swapped for ``replace(linear)`` once its weight and bias are
            full (checked as the next tensor arrives and in :meth:`finish`).
    """

    def __init__(
        self,
        lm: nn.Module,
        entries: dict[str, WeightEntry],
        label: str,
        where: str,
        *,
        base_prefix: str = "",
        replace: Replace | None = None,
    ) -> None:
        self.label, self.where, self.base_prefix = label, where, base_prefix
        self.lm, self.replace = lm, replace
        self.config: TransformerConfig = lm.config  # type: ignore[assignment]
        self.entries = entries
        self.params = dict(lm.named_parameters())
        self.sizes = {k: p.numel() for k, p in self.params.items()}
        self.filled = dict.fromkeys(self.params, 0)
        self.unexpected: list[str] = []
        # Linears waiting for their weight (module name -> module), when streaming.
        self.pending: dict[str, nn.Linear] = {}
        if replace is not None:
            self.pending = {
                name: m
                for name, m in lm.named_modules()
                if type(m) is nn.Linear and m.weight.is_meta
            }
        # Block-quantized parts of pending linears (module name -> (first row, blocks)).
        self.parts: dict[str, list[tuple[int, NativeBlocks]]] = {}
        real = [p for p in self.params.values() if not p.is_meta]
        self.device = real[0].device if real else torch.device("cpu")

    def _swap_full(self) -> None:
        """Swap every pending linear whose weight (and bias) is full for ``replace(linear)``."""
        assert self.replace is not None or not self.pending
        for name, linear in list(self.pending.items()):
            parts = [f"{name}.weight"] + ([f"{name}.bias"] if linear.bias is not None else [])
            if linear.weight.is_meta or any(self.filled[k] < self.sizes[k] for k in parts):
                continue
            parent, _, attr = name.rpartition(".")
            new = self.replace(linear)  # type: ignore[misc]
            setattr(self.lm.get_submodule(parent), attr, new)
            del self.pending[name]
            for k in parts:  # the full-precision weight goes with the last reference
                self.params.pop(k)
            del linear
            _release_freed_memory()

    def place_native(
        self,
        entry: WeightEntry,
        key: str,
        shape: tuple[int, ...],
        file: str,
        native: Callable[[WeightEntry], NativeBlocks],
    ) -> bool:
        """Keep tensor ``key``'s blocks (``native(entry)``) for the linear ``entry`` fills, if it
        is a pending plain linear whose weight is still unallocated; once every row has come,
        the linear becomes a :class:`attnkit.quantized.BlockLinear` of them (parts in different
        layouts are dequantized into its weight instead). False: the caller copies floats.

        Raises:
            ValueError: If ``shape`` is not the shape the config needs (naming file and tensor).
        """
        self._swap_full()
        module, _, attr = entry.param.rpartition(".")
        linear = self.pending.get(module)
        if attr != "weight" or linear is None or entry.transpose or not linear.weight.is_meta:
            return False
        rows = entry.rows or (0, linear.out_features)
        want = (rows[1] - rows[0], linear.in_features)
        if tuple(shape) != want:
            raise ValueError(
                f"{file}: tensor {key} has shape {list(shape)}, the config ({self.label}) needs "
                f"{list(want)}"
            )
        self.parts.setdefault(module, []).append((rows[0], native(entry)))
        self.filled[entry.param] += want[0] * want[1]
        if self.filled[entry.param] < self.sizes[entry.param]:
            return True
        blocks = _concat(self.parts.pop(module))
        if blocks is None:  # (mixed layouts: the float weight, replaced as any other)
            self._stage(module, linear)
            return True
        parent, _, name = module.rpartition(".")
        setattr(self.lm.get_submodule(parent), name, _block_linear(blocks, linear.bias))
        del self.pending[module]
        self.params.pop(entry.param)
        return True

    def _stage(self, module: str, linear: nn.Linear) -> None:
        """Allocate ``linear``'s float weight, holding its block-quantized parts dequantized."""
        from attnkit.quantized.block import BlockLinear

        staged = torch.empty_like(linear.weight, device=self.device)
        for first, blocks in self.parts.pop(module, []):
            layout: Any = blocks.layout
            part = BlockLinear.from_codes(
                blocks.codes, blocks.scales, blocks.offsets, layout=layout
            )
            staged[first : first + blocks.codes.shape[0]] = part.dequantize()
        linear.weight = nn.Parameter(staged, requires_grad=False)
        self.params[f"{module}.weight"] = linear.weight

    def entry(self, key: str) -> WeightEntry | None:
        """The entry of checkpoint tensor ``key``; ``None`` (noted unless ignorable) if none."""
        entry = self.entries.get(key) or self.entries.get(self.base_prefix + key)
        tied_head = key == "lm_head.weight" and self.config.tie_embeddings
        if entry is None and not key.endswith(IGNORED_SUFFIXES) and not tied_head:
            self.unexpected.append(key)
        return entry

    def target(self, entry: WeightEntry, key: str, shape: tuple[int, ...], file: str) -> Tensor:
        """The view of the parameter that tensor ``key`` of ``shape`` is copied into.

        Raises:
            ValueError: If ``shape`` is not the shape the config needs (naming file and tensor).
        """
        self._swap_full()
        module = entry.param.rpartition(".")[0]
        if module in self.pending and entry.param.endswith(".weight"):
            linear = self.pending[module]
            if linear.weight.is_meta:
                self._stage(module, linear)
        if entry.param not in self.params:
            raise ValueError(
                f"{file}: tensor {key} fills {entry.param}, which an earlier tensor already filled"
            )
        target: Tensor = self.params[entry.param]
        if entry.rows is not None:
            target = target[entry.rows[0] : entry.rows[1]]
        want = tuple(target.shape[::-1] if entry.transpose else target.shape)
        if tuple(shape) != want:
            raise ValueError(
                f"{file}: tensor {key} has shape {list(shape)}, the config ({self.label}) needs "
                f"{list(want)}"
            )
        self.filled[entry.param] += target.numel()
        return target.t() if entry.transpose else target

    def finish(self) -> None:
        """Raise if a tensor had no place or a parameter was not (fully) filled.

        Raises:
            ValueError: Naming up to 8 tensors without a place, or the unfilled parameters.
        """
        self._swap_full()
        if self.unexpected:
            more = len(self.unexpected) - 8
            raise ValueError(
                f"{self.where}: tensors with no place in {self.label} as configured: "
                f"{self.unexpected[:8]}" + (f" and {more} more" if more > 0 else "")
            )
        missing = [k for k, n in self.sizes.items() if self.filled[k] < n]
        if missing:
            raise ValueError(f"{self.where}: the weights lack tensors for {missing[:8]}")
