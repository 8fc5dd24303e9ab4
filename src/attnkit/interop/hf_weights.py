"""Hugging Face checkpoint tensor names <-> :class:`attnkit.TransformerLM` parameters.

:func:`weight_map` says where each checkpoint tensor goes (a parameter, a row range of the fused
q/k/v projection, transposed for GPT-2's ``Conv1D``); :class:`ParameterFiller` checks and places
tensors read one at a time (by the safetensors and GGUF readers) into a model's parameters;
:func:`hf_state_dict` is the other direction, the tensors a Hugging Face folder holds.

Streamed replacement (weight-only quantization while loading): given ``replace``,
:func:`allocate` leaves the weight of every plain ``nn.Linear`` unallocated, the filler allocates
it when its first tensor arrives and, once it is full, swaps the linear for ``replace(linear)``
and drops the full-precision weight. Loading then peaks near the final (replaced) model's size
plus a linear or two, not at the full-precision model's size.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.config import TransformerConfig
from attnkit.positional import permute_rotary_weight

# The model class a loader builds: ``cls(config)`` (:class:`attnkit.TransformerLM`, which sits
# above this package and passes itself in).
ModelClass = Callable[[TransformerConfig], nn.Module]
# What a plain linear becomes once its weight is loaded (a quantized linear, say).
Replace = Callable[[nn.Linear], nn.Module]

__all__ = [
    "ModelClass",
    "ParameterFiller",
    "Replace",
    "WeightEntry",
    "allocate",
    "hf_state_dict",
    "weight_map",
]

# Tensors some checkpoints carry that are recomputed buffers, not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")

# Attribute names of the block attention's fused q/k/v and output projections.
_QKV, _OUT = "qkv_proj", "out_proj"


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


def weight_map(arch: str, config: TransformerConfig) -> dict[str, WeightEntry]:
    """Checkpoint tensor name -> attnkit parameter (name, row range, transpose)."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv_rows = {
        "q": (0, q_rows),
        "k": (q_rows, q_rows + kv_rows),
        "v": (q_rows + kv_rows, q_rows + 2 * kv_rows),
    }
    qkv_bias = c.bias if c.qkv_bias is None else c.qkv_bias
    out_bias = c.bias if c.out_bias is None else c.out_bias
    mlp_bias = c.bias if c.mlp_bias is None else c.mlp_bias
    out: dict[str, WeightEntry] = {}
    if arch == "GPT2LMHeadModel":
        out["transformer.wte.weight"] = WeightEntry("embedding.weight")
        out["transformer.wpe.weight"] = WeightEntry("position.weight")
        out["transformer.ln_f.weight"] = WeightEntry("norm.weight")
        out["transformer.ln_f.bias"] = WeightEntry("norm.bias")
        for i in range(c.num_layers):
            hf, ak = f"transformer.h.{i}.", f"blocks.{i}."
            attn = f"{ak}attention."
            for part, target in [
                ("ln_1", f"{ak}norm1"),
                ("ln_2", f"{ak}norm2"),
                ("attn.c_attn", f"{attn}{_QKV}"),
                ("attn.c_proj", f"{attn}{_OUT}"),
                ("mlp.c_fc", f"{ak}feed_forward.linear1"),
                ("mlp.c_proj", f"{ak}feed_forward.linear2"),
            ]:
                conv = not part.startswith("ln")
                out[f"{hf}{part}.weight"] = WeightEntry(f"{target}.weight", transpose=conv)
                out[f"{hf}{part}.bias"] = WeightEntry(f"{target}.bias")
    else:
        out["model.embed_tokens.weight"] = WeightEntry("embedding.weight")
        out["model.norm.weight"] = WeightEntry("norm.weight")
        F = int(c.ffn_dim or 4 * c.dim)
        fused = arch == "Phi3ForCausalLM"  # Phi-3 stores q/k/v and gate/up fused, as attnkit
        for i in range(c.num_layers):
            hf, ak = f"model.layers.{i}.", f"blocks.{i}."
            attn = f"{ak}attention."
            if fused:
                out[f"{hf}self_attn.qkv_proj.weight"] = WeightEntry(f"{attn}{_QKV}.weight")
            else:
                for name, rows in qkv_rows.items():
                    heads = {"q": c.num_heads, "k": c.num_kv_heads}.get(name)
                    for kind in ("weight", "bias") if qkv_bias else ("weight",):
                        out[f"{hf}self_attn.{name}_proj.{kind}"] = WeightEntry(
                            f"{attn}{_QKV}.{kind}", rows, rotary_heads=heads
                        )
            linears: list[tuple[str, str, bool, tuple[int, int] | None]] = [
                ("self_attn.o_proj", f"{attn}{_OUT}", out_bias, None),
                ("mlp.down_proj", f"{ak}feed_forward.linear2", mlp_bias, None),
            ]
            if fused:
                linears.append(("mlp.gate_up_proj", f"{ak}feed_forward.gate_up", mlp_bias, None))
            else:
                linears.append(("mlp.gate_proj", f"{ak}feed_forward.gate_up", mlp_bias, (0, F)))
                linears.append(("mlp.up_proj", f"{ak}feed_forward.gate_up", mlp_bias, (F, 2 * F)))
            for part, target, bias, span in linears:
                out[f"{hf}{part}.weight"] = WeightEntry(f"{target}.weight", span)
                if bias:
                    out[f"{hf}{part}.bias"] = WeightEntry(f"{target}.bias", span)
            norms = {"input_layernorm": "norm1"}
            if c.post_norms:  # Gemma: a norm after attention and one before and after the MLP
                norms |= {
                    "post_attention_layernorm": "post_attn_norm",
                    "pre_feedforward_layernorm": "norm2",
                    "post_feedforward_layernorm": "post_ffn_norm",
                }
            else:
                norms["post_attention_layernorm"] = "norm2"
            for theirs, ours in norms.items():
                out[f"{hf}{theirs}.weight"] = WeightEntry(f"{ak}{ours}.weight")
            if c.qk_norm:
                for name in ("q", "k"):
                    out[f"{hf}self_attn.{name}_norm.weight"] = WeightEntry(
                        f"{attn}{name}_norm.weight"
                    )
    if not c.tie_embeddings:
        out["lm_head.weight"] = WeightEntry("lm_head.weight")
    return out


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
    holes in the heap that count as resident memory: +50-70% over the final model's size."""
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
        arch: The checkpoint's architecture (named in errors).
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
        arch: str,
        where: str,
        *,
        base_prefix: str = "",
        replace: Replace | None = None,
    ) -> None:
        self.arch, self.where, self.base_prefix = arch, where, base_prefix
        self.lm, self.replace = lm, replace
        self.config: TransformerConfig = lm.config  # type: ignore[assignment]
        self.entries = weight_map(arch, self.config)
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
                staged = torch.empty_like(linear.weight, device=self.device)
                linear.weight = nn.Parameter(staged, requires_grad=False)
                self.params[entry.param] = linear.weight
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
                f"{file}: tensor {key} has shape {list(shape)}, the config ({self.arch}) needs "
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
                f"{self.where}: tensors with no place in {self.arch} as configured: "
                f"{self.unexpected[:8]}" + (f" and {more} more" if more > 0 else "")
            )
        missing = [k for k, n in self.sizes.items() if self.filled[k] < n]
        if missing:
            raise ValueError(f"{self.where}: the weights lack tensors for {missing[:8]}")


def hf_state_dict(lm: nn.Module, arch: str) -> Iterator[tuple[str, Tensor]]:
    """The tensors of ``lm`` under the names of Hugging Face architecture ``arch``, one by one.

    Each is a contiguous CPU tensor (a copy only where a row range, a transpose or the rotary
    permutation asks for one); interleaved rotary channels are saved as Hugging Face's halves.

    Yields:
        ``(checkpoint name, tensor)`` in :func:`weight_map` order.
    """
    config: TransformerConfig = lm.config  # type: ignore[assignment]
    params = dict(lm.named_parameters())
    for key, entry in weight_map(arch, config).items():
        t = params[entry.param].detach()
        if entry.rows is not None:
            t = t[entry.rows[0] : entry.rows[1]]
        if entry.rotary_heads is not None and config.rope_interleaved:
            t = permute_rotary_weight(t, entry.rotary_heads, to="split")
        yield key, (t.t() if entry.transpose else t).contiguous().cpu()
