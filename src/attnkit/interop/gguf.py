"""llama.cpp GGUF files -> :class:`attnkit.TransformerLM` and a ``tokenizers`` tokenizer.

A GGUF file holds the config as metadata (``llama.embedding_length``, ...), the tokenizer as
metadata (``tokenizer.ggml.tokens``, ``.merges``, ``.token_type``, the special ids and the chat
template) and the tensors, each in one of ggml's types. The file is read with the ``gguf``
package's :class:`gguf.GGUFReader` (header and metadata); the tensors are checked here against
the file (type, shape, offset, size) before anything is allocated, then dequantized with torch a
block of rows at a time straight into the model's parameters:

=========  ==================================================================================
``F32``    ``F16``, ``BF16``: plain little-endian floats
``Q8_0``   blocks of 32: an f16 scale ``d`` and 32 int8 ``q``: ``d * q``
``Q4_0``   blocks of 32: ``d`` and 16 bytes of 4-bit ``q`` (low nibbles first): ``d * (q - 8)``
``Q4_1``   blocks of 32: ``d``, a minimum ``m`` and 4-bit ``q``: ``d * q + m``
``Q4_K``   super-blocks of 256: ``d``, ``dmin``, eight 6-bit (scale, min) pairs, 4-bit ``q``:
           ``d * scale * q - dmin * min`` per sub-block of 32
``Q6_K``   super-blocks of 256: 6-bit ``q`` (low 4 bits in ``ql``, high 2 in ``qh``), sixteen
           int8 scales and ``d``: ``d * scale * (q - 32)`` per sub-block of 16
=========  ==================================================================================

Supported architectures (``general.architecture``): those with a GGUF name in
:mod:`attnkit.interop.architectures`, ``llama`` (which llama.cpp also writes for Mistral-style
models), ``qwen2`` (q/k/v biases) and ``qwen3`` (qk-norm: ``attn_q_norm`` and ``attn_k_norm``);
the record gives the Hugging Face family and the tensor names. For ``llama`` files llama.cpp's
converter permutes each head's query and key rows so that rotary pairs are interleaved; loading
undoes it (the Hugging Face layout attnkit's Llama config uses); the Qwen graphs rotate halves
as Hugging Face does. Llama 3.1's rotary
scaling is stored as per-frequency divisors (``rope_freqs.weight``); loading turns them back into
the ``llama3`` ``rope_scaling`` that gives exactly those divisors (:func:`llama3_scaling`). The
config is mapped through :func:`attnkit.interop.hf_config.config_from_hf`, so every option is
mapped or rejected exactly as for a Hugging Face folder.

Needs the ``gguf`` extra (``gguf``, ``numpy``, ``tokenizers``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnkit.interop.architectures import Architecture, architecture, find_gguf, supported
from attnkit.interop.hf_config import config_from_hf
from attnkit.interop.hf_weights import WeightEntry, translate_name
from attnkit.interop.loading import Checkpoint, CheckpointTensor, NativeBlocks
from attnkit.positional import permute_rotary_weight, rope_inv_freq

__all__ = [
    "GGML_TYPES",
    "GGUFTensor",
    "GGUFTokenizer",
    "dequantize",
    "hf_name",
    "llama3_scaling",
    "llama_cpp_name",
    "read_gguf",
    "read_tokenizer",
]


# --------------------------------------------------------------------------------------------
# Dequantization: (blocks, bytes per block) uint8 -> (blocks, values per block) float32
# --------------------------------------------------------------------------------------------


def _f16(raw: Tensor) -> Tensor:
    """``(n, 2)`` bytes -> ``(n, 1)`` float32 (little-endian f16)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """``(..., k)`` bytes -> ``(..., 2k)``: the k low nibbles, then the k high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(b: Tensor) -> Tensor:
    return _f16(b[:, :2]) * b[:, 2:].view(torch.int8).float()  # (n, 32)


def _q4_0(b: Tensor) -> Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8)  # (n, 32)


def _q4_1(b: Tensor) -> Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])  # (n, 32)


def _q4_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (n, 1)
    s = b[:, 4:16].int()
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # 12 bytes pack 8 six-bit (scale, min) pairs
    scale = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=1).float()  # (n, 8)
    low = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1).float()  # (n, 8)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()  # sub-blocks of 32
    return (d[:, :, None] * scale[:, :, None] * q - dmin[:, :, None] * low[:, :, None]).reshape(
        n, 256
    )


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64).int()  # two halves of 128 values
    qh = b[:, 128:192].reshape(n, 2, 1, 32).int()
    scale = b[:, 192:208].view(torch.int8).float()  # (n, 16): one per 16 values
    d = _f16(b[:, 208:210])  # (n, 1)
    low = torch.stack(
        [ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4]
    )
    low = low.permute(1, 2, 0, 3)  # (n, 2, 4, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6]).view(1, 1, 4, 1)) & 3  # (n, 2, 4, 32)
    q = ((low | (high << 4)) - 32).reshape(n, 16, 16).float()
    return (d[:, :, None] * scale[:, :, None] * q).reshape(n, 256)


def _plain(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


class GGMLType(NamedTuple):
    """A ggml tensor type attnkit reads: values and bytes per block, and the dequantizer."""

    block: int
    nbytes: int
    dequantize: Callable[[Tensor], Tensor]


# ggml type id -> (name, type); ids from ggml.h.
GGML_TYPES: dict[int, tuple[str, GGMLType]] = {
    0: ("F32", GGMLType(1, 4, _plain(torch.float32))),
    1: ("F16", GGMLType(1, 2, _plain(torch.float16))),
    2: ("Q4_0", GGMLType(32, 18, _q4_0)),
    3: ("Q4_1", GGMLType(32, 20, _q4_1)),
    8: ("Q8_0", GGMLType(32, 34, _q8_0)),
    12: ("Q4_K", GGMLType(256, 144, _q4_k)),
    14: ("Q6_K", GGMLType(256, 210, _q6_k)),
    30: ("BF16", GGMLType(1, 2, _plain(torch.bfloat16))),
}


def dequantize(raw: Tensor, type_id: int, shape: tuple[int, ...]) -> Tensor:
    """The float32 values of a ggml tensor's bytes.

    Args:
        raw: The tensor's bytes, uint8, ``rows * bytes per row`` of them.
        type_id: The ggml type (a key of :data:`GGML_TYPES`).
        shape: The values' shape, the last dimension the contiguous one.

    Returns:
        ``(*shape)`` float32.

    Raises:
        ValueError: For a type attnkit does not read or bytes that do not fit ``shape``.
    """
    if type_id not in GGML_TYPES:
        raise ValueError(f"ggml type {type_id} is not supported ({_supported()})")
    name, kind = GGML_TYPES[type_id]
    numel = math.prod(shape)
    if numel % kind.block or raw.numel() != numel // kind.block * kind.nbytes:
        raise ValueError(f"{raw.numel()} bytes of {name} do not hold a tensor of shape {shape}")
    return kind.dequantize(raw.reshape(-1, kind.nbytes)).reshape(shape)


def _supported() -> str:
    return "supported: " + ", ".join(name for name, _ in GGML_TYPES.values())


# --------------------------------------------------------------------------------------------
# The file: header and metadata by gguf's reader, tensors checked here
# --------------------------------------------------------------------------------------------


class GGUFTensor(NamedTuple):
    """A tensor of a GGUF file: its torch shape (outermost first), ggml type and bytes."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class _File:
    path: Path
    reader: Any  # gguf.GGUFReader without its tensor views
    tensors: dict[str, GGUFTensor]

    def value(self, key: str, default: Any = None) -> Any:
        """The metadata value ``key`` (str, number, bool or list), ``default`` when absent."""
        from gguf import GGUFValueType

        field = self.reader.fields.get(key)
        if field is None:
            return default
        kinds = list(field.types)

        def one(index: int, kind: Any) -> Any:
            part = field.parts[index]
            if kind == GGUFValueType.STRING:
                return bytes(part).decode("utf-8", errors="replace")
            return part.tolist()[0]

        try:
            if kinds[0] == GGUFValueType.ARRAY:
                return [one(i, kinds[-1]) for i in field.data] if len(kinds) > 1 else []
            return one(field.data[0], kinds[0])
        except (IndexError, ValueError) as err:
            raise ValueError(f"{self.path}: metadata {key!r} is malformed ({err})") from None

    def read_rows(self, tensor: GGUFTensor, r0: int, r1: int) -> Tensor:
        """Rows ``r0:r1`` (of the outermost dimensions flattened) as float32 ``(r1 - r0, cols)``."""
        _, kind = GGML_TYPES[tensor.type_id]
        cols = tensor.shape[-1]
        row_bytes = cols // kind.block * kind.nbytes
        start = tensor.start + r0 * row_bytes
        raw = torch.from_numpy(self.reader.data[start : start + (r1 - r0) * row_bytes].copy())
        return dequantize(raw, tensor.type_id, (r1 - r0, cols))


def _open(path: Path) -> _File:
    """Read the header and metadata, and check every tensor against the file.

    Raises:
        ValueError: Naming the file (and the tensor) for a file that is not GGUF, truncated or
            malformed, a tensor of an unknown or unsupported type, of an impossible shape, or
            whose data runs past the end of the file.
    """
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'attnkit[gguf]'"
        ) from err

    class Reader(GGUFReader):  # type: ignore[misc]
        """gguf's reader, minus the tensor views it would build unchecked."""

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            self.tensor_start, self.tensor_fields = start_offs, fields

    size = path.stat().st_size
    try:
        reader = Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{path}: not a readable GGUF file (truncated or malformed header: {err})"
        ) from None
    tensors: dict[str, GGUFTensor] = {}
    for field in reader.tensor_fields:
        _, name_data, n_dims, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        where = f"{path}: tensor {name!r}"
        if len(dims) != int(n_dims[0]) or len(raw_type) != 1 or len(offset) != 1:
            raise ValueError(f"{where}: the file ends inside its description (truncated)")
        type_id = int(raw_type[0])
        if type_id not in GGML_TYPES:
            from gguf import GGMLQuantizationType

            known = {t.value: t.name for t in GGMLQuantizationType}
            what = f"type {known[type_id]}" if type_id in known else f"unknown type {type_id}"
            raise ValueError(f"{where} has {what}, which attnkit does not read ({_supported()})")
        type_name, kind = GGML_TYPES[type_id]
        ne = [int(d) for d in dims]  # innermost first
        if not 1 <= len(ne) <= 4 or min(ne) < 1:
            raise ValueError(f"{where} has the impossible shape {ne[::-1]}")
        numel = math.prod(ne)
        if ne[0] % kind.block:
            raise ValueError(
                f"{where}: rows of {ne[0]} values do not split into {type_name} blocks of "
                f"{kind.block}"
            )
        nbytes = numel // kind.block * kind.nbytes
        start = reader.tensor_start + int(offset[0])
        if start + nbytes > size:
            raise ValueError(
                f"{where} ({type_name}, shape {ne[::-1]}, {numel} values) needs bytes "
                f"{start}..{start + nbytes}, past the end of the file ({size} bytes)"
            )
        if name in tensors:
            raise ValueError(f"{where} appears twice")
        tensors[name] = GGUFTensor(name, tuple(ne[::-1]), type_id, start, nbytes)
    return _File(path, reader, tensors)


# --------------------------------------------------------------------------------------------
# Config and tensor names
# --------------------------------------------------------------------------------------------


def _bias_keys(arch: Architecture, file: _File) -> dict[str, bool]:
    """The family's bias switches (``attention_bias``, ...), set when layer 0 holds the
    tensor: a key shared by several projections is set when any of them has its bias."""
    assert arch.gguf is not None  # found by its GGUF name
    names = arch.gguf.tensors
    modules = ("attention.qkv_proj", "attention.out_proj", "feed_forward.linear2")
    out: dict[str, bool] = {}
    for bias, module in zip(arch.biases, modules, strict=True):
        if isinstance(bias, str):
            theirs = names.block[module]
            first = theirs if isinstance(theirs, str) else theirs[0]
            found = f"{names.layer.format(i=0)}{first}.bias" in file.tensors
            out[bias] = out.get(bias, False) or found
    return out


def _hf_config(file: _File) -> tuple[Architecture, dict[str, Any]]:
    """The family's record and the ``config.json`` of the Hugging Face model equivalent to the
    file's metadata (llama.cpp names the sizes alike for every architecture).

    Raises:
        ValueError: For an architecture that is not registered, or metadata with no
            counterpart (partial rotary, rotary divisors that no llama3 scaling gives, an
            unknown scaling type).
    """
    name = file.value("general.architecture")
    arch = find_gguf(name)
    if arch is None:
        raise ValueError(
            f"{file.path}: GGUF architecture {name!r} is not supported (supported: "
            f"{supported(gguf=True)})"
        )

    def value(key: str, default: Any = None) -> Any:
        return file.value(f"{name}.{key}", default)

    def need(key: str) -> Any:
        found = value(key)
        if found is None:
            raise ValueError(f"{file.path} lacks the metadata {name}.{key}")
        return found

    dim, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(value("attention.key_length", dim // heads))
    rotary = int(value("rope.dimension_count", head_dim))
    value_dim = int(value("attention.value_length", head_dim))
    if rotary != head_dim or value_dim != head_dim:
        raise ValueError(
            f"{file.path}: rope.dimension_count {rotary} / value_length {value_dim} differ from "
            f"the head dim {head_dim} (partial rotary is not supported)"
        )
    embed = file.tensors.get("token_embd.weight")
    vocab = embed.shape[0] if embed is not None else len(file.value("tokenizer.ggml.tokens", []))
    rms = arch.options.get("norm", "layernorm") != "layernorm"
    sizes = {
        "vocab_size": int(value("vocab_size", vocab)),
        "dim": dim,
        "num_layers": int(need("block_count")),
        "num_heads": heads,
        "num_kv_heads": int(value("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "ffn_dim": int(need("feed_forward_length")),
        "max_seq_len": int(value("context_length", 2048)),
        "eps": float(value(f"attention.layer_norm{'_rms' if rms else ''}_epsilon", 1e-5)),
    }
    keys = arch.keys
    data: dict[str, Any] = {"architectures": [arch.name]}
    data |= {getattr(keys, k): v for k, v in sizes.items() if getattr(keys, k) is not None}
    data[keys.activation[0]] = next(iter(arch.activations))  # llama.cpp's graph of the family
    data |= _bias_keys(arch, file)
    data["rope_theta"] = float(value("rope.freq_base", 10_000.0))
    data["tie_word_embeddings"] = "output.weight" not in file.tensors
    kind = value("rope.scaling.type")
    if kind not in (None, "none"):  # config_from_hf maps linear and rejects the others
        data["rope_scaling"] = {
            "rope_type": kind,
            "factor": value("rope.scaling.factor"),
        }
    freqs = file.tensors.get("rope_freqs.weight")
    if freqs is not None:
        if "rope_scaling" in data:
            raise ValueError(
                f"{file.path}: both rope.scaling.type {kind!r} and tensor 'rope_freqs.weight'"
            )
        factors = file.read_rows(freqs, 0, math.prod(freqs.shape[:-1])).flatten()
        scaling = llama3_scaling(factors, head_dim, data["rope_theta"], str(file.path))
        if scaling is not None:
            data["rope_scaling"] = scaling
    return arch, data


def _tidy(x: float) -> float:
    """``x`` rounded to an integer when it is one up to float32 rounding (8192.0004 -> 8192)."""
    if not math.isfinite(x):
        return x
    return float(round(x)) if abs(x - round(x)) <= 1e-5 * max(1.0, abs(x)) else x


def llama3_scaling(
    factors: Tensor, head_dim: int, base: float, where: str = "GGUF file"
) -> dict[str, Any] | None:
    """The ``rope_scaling`` whose frequencies equal llama.cpp's per-frequency divisors.

    llama.cpp's converter turns Llama 3.1's ``rope_scaling`` (type ``llama3``) into the tensor
    ``rope_freqs.weight``: one divisor per rotary frequency, 1 for the high frequencies,
    ``factor`` for the low ones and ``1 / ((1 - s) / factor + s)`` in between, ``s`` affine in
    the frequency. This recovers ``factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` with ``low_freq_factor = 1`` (the three are only defined
    up to a common multiple: Llama 3.1's own values are 1, 4 and 8192) and checks that the
    result reproduces every divisor (all equal: type ``linear``; all 1: no scaling).

    Args:
        factors: The divisors, ``(head_dim / 2,)``.
        head_dim: Rotary dim ``E``.
        base: Rotary base.
        where: The file, for error messages.

    Returns:
        A ``rope_scaling`` dict, or None when every divisor is 1.

    Raises:
        ValueError: For divisors of the wrong length, non-positive or non-finite ones, or ones
            no ``llama3`` scaling produces.
    """
    f = factors.to(torch.float64)
    if f.shape != (head_dim // 2,) or not bool(torch.isfinite(f).all()) or bool((f <= 0).any()):
        raise ValueError(
            f"{where}: tensor 'rope_freqs.weight' must hold {head_dim // 2} positive divisors "
            f"(one per rotary frequency), got shape {tuple(f.shape)}"
        )
    tol = 1e-5
    if bool(((f - 1).abs() <= tol).all()):
        return None
    factor = float(f.max())
    if bool(((f - factor).abs() <= tol * factor).all()):
        scaling: dict[str, Any] = {"rope_type": "linear", "factor": _tidy(factor)}
    else:
        inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        x = inv / (2 * math.pi)  # 1 / wavelength
        high = (f - 1).abs() <= tol
        low = (f - factor).abs() <= tol * factor
        mid = ~(high | low)
        smooth = (1 / f - 1 / factor) / (1 - 1 / factor)  # s = L0 * x - 1 over hf - 1
        if int(mid.sum()) >= 2:
            xs, ss = x[mid], smooth[mid]
            slope = float(
                ((xs - xs.mean()) * (ss - ss.mean())).sum() / (xs - xs.mean()).square().sum()
            )
            intercept = float(ss.mean()) - slope * float(xs.mean())
            hf = 1 - 1 / intercept if intercept < 0 else math.nan
            old_len = slope * (hf - 1)
        else:  # too few in-between frequencies to fit: place the bands between the neighbours
            w_high = float((1 / x[high]).max()) if bool(high.any()) else 0.0
            w_low = float((1 / x[low]).min()) if bool(low.any()) else math.inf
            if int(mid.sum()) == 1:
                xm, sm = float(x[mid][0]), float(smooth[mid][0])
                old_len = math.sqrt(1 / xm * w_low) if math.isfinite(w_low) else 2 / xm
                hf = 1 + (old_len * xm - 1) / sm
            else:
                old_len = math.sqrt(w_high * w_low) if w_high and math.isfinite(w_low) else math.nan
                hf = math.sqrt(old_len / w_high) if w_high else math.nan
        scaling = {
            "rope_type": "llama3",
            "factor": _tidy(factor),
            "low_freq_factor": 1.0,
            "high_freq_factor": _tidy(hf),
            "original_max_position_embeddings": _tidy(old_len),
        }
    length = scaling.get("original_max_position_embeddings")
    if isinstance(length, float) and length.is_integer():
        scaling["original_max_position_embeddings"] = int(length)  # as config.json writes it
    try:
        plain = rope_inv_freq(head_dim, base)
        again = plain / rope_inv_freq(head_dim, base, scaling)
    except (ValueError, TypeError):
        again = None
    if again is None or not bool(((again - f).abs() <= 1e-4 * f).all()):
        raise ValueError(
            f"{where}: tensor 'rope_freqs.weight' holds divisors that no llama3 or linear "
            f"rope scaling produces (got {[round(v, 4) for v in f.tolist()]})"
        )
    return scaling


def llama_cpp_name(name: str) -> str:
    """The llama.cpp tensor name of Hugging Face Llama tensor ``name``: the inverse of
    :func:`hf_name` (itself when it has none)."""
    llama = architecture("LlamaForCausalLM")
    assert llama.gguf is not None
    return translate_name(name, llama.tensors, llama.gguf.tensors)


def hf_name(name: str) -> str:
    """The Hugging Face name of llama.cpp tensor ``name`` (itself when it has none)."""
    llama = architecture("LlamaForCausalLM")
    assert llama.gguf is not None
    return translate_name(name, llama.gguf.tensors, llama.tensors)


# Rows dequantized at a time (times the row length in float32: 16 MiB for rows of 4096).
_CHUNK_VALUES = 4 * 2**20


def _copy(
    file: _File, tensor: GGUFTensor, interleaved: bool, dest: Tensor, entry: WeightEntry
) -> None:
    """Dequantize ``tensor`` into ``dest`` a block of rows at a time; with ``interleaved``,
    undo llama.cpp's interleaving of the rotary pairs of a query/key projection."""
    rows, cols = math.prod(tensor.shape[:-1]), tensor.shape[-1]
    if interleaved and entry.rotary_heads is not None:
        w = file.read_rows(tensor, 0, rows).reshape(tensor.shape)
        dest.copy_(permute_rotary_weight(w, entry.rotary_heads, to="split"))
        return
    step = max(1, _CHUNK_VALUES // cols)
    flat = dest.reshape(rows, cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        flat[r0:r1].copy_(file.read_rows(tensor, r0, r1))


# ggml's block types that load as they are into a BlockLinear: name -> (layout, offset bytes).
_NATIVE = {"Q8_0": ("q8_0", 0), "Q4_0": ("q4_0", 0), "Q4_1": ("q4_1", 2)}


def _native(file: _File, tensor: GGUFTensor, interleaved: bool, entry: WeightEntry) -> NativeBlocks:
    """The blocks of a ``Q8_0``, ``Q4_0`` or ``Q4_1`` matrix split into codes, f16 scales and
    (``Q4_1``) minimums without touching the values; with ``interleaved``, the rows of a
    query/key projection reordered as :func:`_copy` reorders them."""
    name, kind = GGML_TYPES[tensor.type_id]
    layout, extra = _NATIVE[name]
    rows, cols = tensor.shape
    raw = torch.from_numpy(file.reader.data[tensor.start : tensor.start + tensor.nbytes].copy())
    blocks = raw.reshape(rows, cols // kind.block, kind.nbytes)  # (rows, blocks, bytes)
    if interleaved and entry.rotary_heads is not None:
        order = torch.arange(rows, dtype=torch.float64)[:, None]
        order = permute_rotary_weight(order, entry.rotary_heads, to="split")[:, 0].long()
        blocks = blocks[order]
    scales = blocks[:, :, :2].contiguous().view(torch.float16).reshape(rows, -1)
    offsets = None
    if extra:
        offsets = blocks[:, :, 2 : 2 + extra].contiguous().view(torch.float16).reshape(rows, -1)
    codes = blocks[:, :, 2 + extra :].contiguous().reshape(rows, -1)
    if layout == "q8_0":
        codes = codes.view(torch.int8)
    return NativeBlocks(layout, codes, scales, offsets)


def read_gguf(path: str | Path) -> Checkpoint:
    """A GGUF file read up to its tensors, for :func:`attnkit.interop.loading.load` (which
    :func:`attnkit.interop.hf.from_pretrained` calls for a ``.gguf`` path).

    The config comes from the metadata through
    :func:`attnkit.interop.hf_config.config_from_hf`; ``generation_config`` holds the file's
    bos/eos/pad ids (eos: the end-of-text and end-of-turn ids). Every tensor is checked against
    the file here, before anything is allocated.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: For a damaged or hostile file (naming the file and tensor), an unsupported
            architecture, option or tensor type.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    file = _open(path)
    arch, data = _hf_config(file)
    _, config = config_from_hf(data)
    gguf = arch.gguf
    assert gguf is not None  # found by its GGUF name
    tensors = (
        CheckpointTensor(
            name,
            t.shape,
            path.name,
            partial(_copy, file, t, gguf.interleaved_rotary),
            partial(_native, file, t, gguf.interleaved_rotary)
            if GGML_TYPES[t.type_id][0] in _NATIVE and len(t.shape) == 2
            else None,
        )
        for name, t in file.tensors.items()
        if name != "rope_freqs.weight"  # read into the config's rope_scaling
    )
    gen: dict[str, Any] = {}
    stops = _stop_ids(file)
    if stops:
        gen["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    for key, meta in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        value = file.value(f"tokenizer.ggml.{meta}")
        if value is not None:
            gen[key] = int(value)
    return Checkpoint(arch, config, gguf.tensors, tensors, str(path), f"{gguf.name} GGUF", gen)


def _stop_ids(file: _File) -> list[int]:
    """End-of-text and end-of-turn ids (``eos``, ``eot``, ``eom``), each once."""
    out: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = file.value(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in out:
            out.append(int(value))
    return out


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class GGUFTokenizer(NamedTuple):
    """The tokenizer a GGUF file describes, with what chat formatting needs."""

    tokenizer: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, unk_token, pad_token
    stop_ids: tuple[int, ...]
    chat_template: str | None


# Pre-tokenizer splits by tokenizer.ggml.pre (the regexes of the models' tokenizer.json files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(file: _File, tokens: list[str]) -> tuple[Any, dict[str, int]]:
    """GPT-2-style byte-level BPE: the file's merges, its split regex, no prefix space."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in file.value("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    split = _SPLITS.get(file.value("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    tokens, best-scored merged token first (ties: shorter left, then right piece last)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _sentencepiece(file: _File, tokens: list[str]) -> tuple[Any, dict[str, int]]:
    """SentencePiece BPE (Llama 2, Mistral, TinyLlama files): byte fallback, a prefix space on
    the first piece, merges from the file or from the scores."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    given = file.value("tokenizer.ggml.merges")
    if given:
        merges = [tuple(m.split(" ", 1)) for m in given]
    else:
        scores = file.value("tokenizer.ggml.scores") or []
        if len(scores) != len(tokens):
            raise ValueError(
                f"{file.path}: {len(scores)} tokenizer.ggml.scores for {len(tokens)} tokens"
            )
        merges = _merges_from_scores(tokens, [float(x) for x in scores])
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tokenizer, vocab


def read_tokenizer(path: str | Path) -> GGUFTokenizer:
    """Build the tokenizer a GGUF file describes, with ``tokenizers``.

    ``tokenizer.ggml.model`` ``gpt2`` is byte-level BPE (Llama 3, Qwen2, SmolLM: the file's
    merges, the split regex of ``tokenizer.ggml.pre``); ``llama`` is SentencePiece BPE (Llama 2,
    Mistral, TinyLlama: byte fallback, merges from the file or recovered from the scores, bos
    added unless ``tokenizer.ggml.add_bos_token`` is false). Control tokens (type 3) become
    special added tokens, user-defined ones (type 4) plain added tokens.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: For a damaged file, no vocabulary, or another tokenizer model.
    """
    from tokenizers import AddedToken, processors

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    file = _open(path)
    model = file.value("tokenizer.ggml.model")
    tokens: list[str] = file.value("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{path} has no vocabulary (tokenizer.ggml.tokens)")
    if model == "gpt2":
        tokenizer, vocab = _byte_level(file, tokens)
        spelled = set(_byte_alphabet().values())
        add_bos = bool(file.value("tokenizer.ggml.add_bos_token", False))
    elif model == "llama":
        tokenizer, vocab = _sentencepiece(file, tokens)
        spelled = None
        add_bos = bool(file.value("tokenizer.ggml.add_bos_token", True))
    else:
        raise ValueError(
            f"{path}: tokenizer model {model!r} is not supported (supported: gpt2, the byte-level "
            "BPE of Llama 3, Qwen2, SmolLM; llama, the SentencePiece BPE of Llama 2, Mistral)"
        )
    types = file.value("tokenizer.ggml.token_type") or []
    pairs = list(zip(tokens, types, strict=False))
    control = [t for t, k in pairs if k == 3 and (spelled is None or set(t) <= spelled)]
    user = [t for t, k in pairs if k == 4 and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    special: dict[str, str] = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        index = file.value(f"tokenizer.ggml.{key}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            special[f"{name}_token"] = tokens[int(index)]
    if add_bos and "bos_token" in special:
        bos = special["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab[bos])],
        )
    template = file.value("tokenizer.chat_template")
    return GGUFTokenizer(tokenizer, special, tuple(_stop_ids(file)), template)
