"""Fast cached decoding for :class:`attnkit.TransformerLM`: a :class:`Decoder` with a static cache.

Decoding one token at a time is per-token overhead on small models (dozens of tiny ops per
layer) and weight-read bandwidth on large ones (every weight is read once per token). The
:class:`Decoder` prepares the model's weights once, so that a step reads each of them once and
copies nothing: the query/key/value projections are one matrix, the gate and up projections of a
SwiGLU feed-forward are one matrix, and every matrix is stored in the layout a single row reads
fastest on CPU (measured; see ``_layout``), gathered in one huge-page block. The prepared
matrices are one extra copy of the model's (for the 100M model in fp32, 400 MB). Rotary positions
become one complex multiply over the queries and keys together (a half-split "NeoX" model has its
query/key rows permuted to the interleaved pairing once; scores are unchanged). Keys and values go
into a preallocated static cache of ``capacity`` slots (gpt-fast's design): sequences in a batch
share the slot index, and left padding is a key mask over the slots.

:meth:`Decoder.prefill` runs the prompt through the same prepared weights and calls
:func:`attnkit.functional.scaled_dot_product_attention` (causal, padding and window masks).
:meth:`Decoder.step` decodes one token per sequence. Its attention calls torch's fused kernel
directly: with a single query per sequence every row has at least one key (its own), so the
fully-masked-row and NaN-propagation guards of the functional path (five extra ops per layer)
cannot change the result; ``tests/test_decoding.py`` checks the step against the model's own
forward. With ``compile=True`` the step is one ``torch.compile(fullgraph=True)`` graph over the
whole cache capacity (static shapes; positions and the slot are tensors), compiled once per
``(batch, capacity)`` and reused.

The prepared weights are built for inference: they are rebuilt at :meth:`Decoder.prefill` when a
parameter of the model changed (in place or replaced) since they were prepared, never in between
steps. Dropout is not applied.
"""

from __future__ import annotations

import ctypes
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import functional as F_attn
from attnkit.attention import MultiHeadAttention
from attnkit.blocks import FeedForward, TransformerBlock
from attnkit.generation import positions_from_mask
from attnkit.models import TransformerLM
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    permute_rotary_weight,
)

__all__ = ["Decoder", "decoder_for"]

# One Decoder per (model, compile): prepared weights, cache and compiled step are reused across
# generate() calls (the weights are re-prepared when a parameter changed).
_DECODERS: weakref.WeakKeyDictionary[TransformerLM, dict[bool, Decoder]] = (
    weakref.WeakKeyDictionary()
)


def decoder_for(model: TransformerLM, *, compile: bool = False) -> Decoder:
    """The :class:`Decoder` of ``model`` (created on first use, then reused).

    A caller that keeps it across several steps marks it ``in_use`` (as
    :mod:`attnkit.generation` does while a stream is open); while it is, callers get a fresh
    decoder of their own instead, so that interleaved streams never share a cache.

    Raises:
        TypeError: If ``model`` is not a :class:`attnkit.TransformerLM`.
    """
    per_model = _DECODERS.setdefault(model, {})
    if compile not in per_model:
        decoder = Decoder(model, compile=compile)
        decoder._owner = None
        per_model[compile] = decoder
    if per_model[compile].in_use:
        return Decoder(model, compile=compile)
    return per_model[compile]


@dataclass
class _Norm:
    """A LayerNorm or RMSNorm as functional arguments (no module call per token)."""

    rms: bool
    weight: Tensor | None
    bias: Tensor | None
    eps: float | None

    def __call__(self, x: Tensor) -> Tensor:
        shape = (x.shape[-1],)
        if self.rms:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return F.layer_norm(
            x, shape, self.weight, self.bias, 1e-5 if self.eps is None else self.eps
        )


# How a single row reads each weight fastest, measured on the 2-core AMD EPYC (Zen 4, AVX-512
# BF16) this project runs on, one thread, the 100M model's 49 matrices (400 MB fp32) per pass,
# interleaved medians (:func:`attnkit.decoding_bench.layout_table` prints this table):
#   eager fp32  sum (pure read) 1.48x | x @ W^T-contiguous 1.35x | oneDNN packed 1.19x | F.linear 1x
#   eager bf16  oneDNN packed 2.22x | F.linear 1.21x | x @ W^T 1.16x
#   compiled    inductor's fused multiply-sum over W: fp32 as fast as the pure-read sum (1.19x
#               x @ W^T); bf16 2.15x the fp32 sum's speed (1.8x oneDNN packed), and 1.2x faster
#               again when the sum runs over 16 lanes first
# So, eagerly, fp32 weights are stored transposed, (in, out) contiguous, and applied with addmm
# (MKL streams the rows; as fast or faster than F.linear on the 3M model's small, cached
# matrices too), and bf16 weights are reordered once into oneDNN's blocked layout (torch's bf16
# F.linear converts the weight on every call instead). In the compiled step a single row's
# product is written as ``(W * x).sum(-1)``, which inductor turns into one streaming reduction.
# Other dtypes/devices use F.linear.
Layout = Literal["linear", "transposed", "packed", "reduce"]


def _layout(weight: Tensor, *, compiled: bool) -> Layout:
    """The measured-fastest layout for single-row products with ``weight`` (see above)."""
    if weight.device.type != "cpu":
        return "linear"
    if compiled:
        return "reduce" if weight.dtype in (torch.float32, torch.bfloat16) else "linear"
    if weight.dtype == torch.float32:
        return "transposed"
    if weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        return "packed"
    return "linear"


class _Linear:
    """``F.linear(x, weight, bias)`` with the weight prepared once in a faster layout.

    ``"transposed"`` keeps a contiguous ``(in, out)`` copy used with ``addmm``; ``"packed"``
    reorders it into oneDNN's blocked layout (a copy) applied with
    ``torch.ops.mkldnn._linear_pointwise`` (the kernel inductor uses for frozen CPU linears);
    ``"linear"`` uses the tensor as is. A torch build without the oneDNN op falls back to
    ``"linear"``. ``"reduce"`` keeps the tensor as is and, inside a compiled graph and for one
    row, computes ``(W * x).sum(-1)`` in float32 (inductor's fused reduction); elsewhere it is
    ``"linear"``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, layout: Layout) -> None:
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        self.layout: Layout = layout
        self.weight = weight  # (out, in), or (in, out) when transposed, or oneDNN's layout
        if layout == "transposed":
            self.weight = weight.t().contiguous()
        elif layout == "packed":
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            except (AttributeError, RuntimeError):  # a torch build without the op
                self.layout = "linear"

    def __call__(self, x: Tensor) -> Tensor:
        """Shape: ``(*, in) -> (*, out)``."""
        if self.layout == "reduce":
            if x.dim() == 2 and x.shape[0] == 1 and torch.compiler.is_compiling():
                # An identity view that makes inductor store x first: otherwise it inlines the
                # producer (a norm, SwiGLU's silu) into the reduction and recomputes it for
                # every output row (measured: 1.6x slower on a bf16 4096x768 product).
                x = torch.as_strided(x, x.shape, x.stride())
                n_in = x.shape[1]
                if x.dtype == torch.bfloat16 and n_in % 16 == 0:
                    # bf16: partial sums over 16 lanes first, then across them (measured on the
                    # 100M model's matrices: 1.2x the one-pass row sum, 86% of a pure read).
                    w = self.weight.view(1, self.out_features, n_in // 16, 16)
                    part = (x.view(1, 1, n_in // 16, 16) * w).sum(-2, dtype=torch.float32)
                    part = torch.as_strided(part, part.shape, part.stride())  # (1, out, 16)
                    y = part.sum(-1)  # (1, out)
                else:
                    y = (x.unsqueeze(1) * self.weight).sum(-1, dtype=torch.float32)  # (1, out)
                y = y if self.bias is None else y + self.bias
                return y.to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        if self.layout == "linear":
            return F.linear(x, self.weight, self.bias)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (N, in)
        if self.layout == "transposed":
            if self.bias is None:
                y = torch.mm(rows, self.weight)
            else:
                y = torch.addmm(self.bias, rows, self.weight)
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _huge_page_empty(numel: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised 1-D tensor whose memory asks Linux for transparent huge pages.

    Streaming hundreds of MB of weights per token through 4 KiB pages costs TLB misses: a sum
    over the 100M model's 49 matrices read 11.5 GB/s from ordinary allocations and 14.4 GB/s
    from one huge-page block (same machine, interleaved). ``madvise`` must come before the pages
    are first touched; it is a no-op where unsupported.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    slack = _HUGE_PAGE // itemsize
    buf = torch.empty(numel + slack, dtype=dtype)
    start = (-buf.data_ptr() % _HUGE_PAGE) // itemsize
    out = buf[start : start + numel]  # 2 MiB aligned; keeps `buf` alive
    length = numel * itemsize // _HUGE_PAGE * _HUGE_PAGE
    if sys.platform.startswith("linux") and length:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc symbol: ordinary pages
            pass
    return out


def _gather_on_huge_pages(linears: list[_Linear]) -> None:
    """Copy the plain CPU weights of ``linears`` into one huge-page block per dtype."""
    groups: dict[torch.dtype, list[_Linear]] = {}
    for lin in linears:
        if lin.layout in ("transposed", "reduce") and lin.weight.device.type == "cpu":
            groups.setdefault(lin.weight.dtype, []).append(lin)
    for dtype, members in groups.items():
        block = _huge_page_empty(sum(m.weight.numel() for m in members), dtype)
        offset = 0
        for m in members:
            n = m.weight.numel()
            m.weight = block[offset : offset + n].view(m.weight.shape).copy_(m.weight)
            offset += n


@dataclass
class _Layer:
    """One block's prepared weights."""

    norm1: _Norm
    norm2: _Norm
    qkv: _Linear  # (H*E + 2*K*E, D): rows [q | k | v], q/k rows in interleaved rotary pairs
    out: _Linear  # (D, H*E)
    up: _Linear  # (2*F, D) rows [gate | up] for SwiGLU, else (F, D)
    down: _Linear  # (D, F)
    activation: nn.Module
    gated: bool

    def linears(self) -> list[_Linear]:
        return [self.qkv, self.out, self.up, self.down]


def _norm(module: nn.Module) -> _Norm:
    if isinstance(module, nn.RMSNorm):
        return _Norm(True, module.weight, None, module.eps)
    if isinstance(module, nn.LayerNorm):
        return _Norm(False, module.weight, module.bias, module.eps)
    raise TypeError(f"Decoder supports LayerNorm and RMSNorm blocks, got {type(module).__name__}")


def _cat_biases(linears: list[nn.Linear]) -> Tensor | None:
    """The fused bias of ``linears`` (zeros where one has none); ``None`` if none has a bias."""
    if all(m.bias is None for m in linears):
        return None
    if len(linears) == 1:
        return linears[0].bias
    parts: list[Tensor] = [
        m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears
    ]
    return torch.cat(parts)


def _attention_linears(attn: MultiHeadAttention) -> tuple[list[nn.Linear], nn.Linear]:
    """The query/key/value projections (one fused or three) and the output projection."""
    if attn.fused_qkv:
        return [attn.qkv_proj], attn.out_proj
    return [attn.q_proj, attn.k_proj, attn.v_proj], attn.out_proj


def _block_parts(
    model: TransformerLM,
) -> list[tuple[TransformerBlock, MultiHeadAttention, FeedForward]]:
    """Each block with its attention and feed-forward, checked to be the kinds decoded here.

    Raises:
        TypeError: For another kind of block, attention or feed-forward.
    """
    parts = []
    for block in model.blocks:
        attn = getattr(block, "attention", None)
        ff = getattr(block, "feed_forward", None)
        if not (
            isinstance(block, TransformerBlock)
            and isinstance(attn, MultiHeadAttention)
            and isinstance(ff, FeedForward)
        ):
            raise TypeError(
                "Decoder supports TransformerBlock with MultiHeadAttention and FeedForward, got "
                f"{type(block).__name__}({type(attn).__name__}, {type(ff).__name__})"
            )
        parts.append((block, attn, ff))
    return parts


class Decoder:
    """Cached decoding of a :class:`attnkit.TransformerLM` with prepared weights.

    Usage: ``logits = dec.prefill(prompt)`` then ``logits = dec.step(next_ids)`` per token.
    The cache is (re)allocated by :meth:`prefill` for ``capacity`` slots (default: the prompt
    plus ``max_new_tokens`` passed there, or the model's ``max_seq_len``).

    Args:
        model: The language model (any :class:`attnkit.TransformerLM` configuration: rotary,
            sinusoidal, learned or no positions; pre- or post-norm; LayerNorm or RMSNorm; any
            activation; biases; grouped-query attention; sliding windows; tied or untied head).
        compile: Run :meth:`step` as one ``torch.compile(fullgraph=True)`` graph over the whole
            cache capacity (compiled on the first step of each ``(batch, capacity)``; the time it
            took is in :attr:`compile_seconds`).

    Raises:
        TypeError: If ``model`` is not a :class:`attnkit.TransformerLM` or holds blocks this
            decoder does not know.
    """

    def __init__(self, model: TransformerLM, *, compile: bool = False) -> None:
        if not isinstance(model, TransformerLM):
            raise TypeError(f"Decoder needs a TransformerLM, got {type(model).__name__}")
        self._model = weakref.ref(model)
        # decoder_for() drops this strong reference: it keeps decoders in a WeakKeyDictionary
        # keyed by their model, which a strong reference from the value would keep alive.
        self._owner: TransformerLM | None = model
        self.in_use = False  # see decoder_for
        self.max_seq_len = model.max_seq_len
        self.compile = bool(compile)
        cfg = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
        )
        self.window: int | None = cfg.window
        self.norm_first = cfg.norm_first
        self.compile_seconds: dict[tuple[int, int], float] = {}
        self._compiled: Any = None
        self._signature: list[tuple[int, int]] = []
        self._prepare()
        # Cache state (allocated by prefill).
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.key_mask = torch.zeros(0, 0, dtype=torch.bool)
        self.length = 0
        self._padded = False
        self._next_positions = torch.zeros(0, dtype=torch.long)

    # ------------------------------------------------------------------ preparation

    @property
    def model(self) -> TransformerLM:
        """The decoded model.

        Raises:
            RuntimeError: If the model no longer exists.
        """
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this Decoder no longer exists")
        return model

    def _sources(self) -> list[Tensor]:
        return [p for p in self.model.parameters()] + [b for b in self.model.buffers()]

    def _state_signature(self) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t._version) for t in self._sources()]

    @torch.no_grad()
    def _prepare(self) -> None:
        """Build the fused weights and position tables from the model's current parameters."""
        model = self.model
        H, K, E = self.num_heads, self.num_kv_heads, self.head_dim
        rotary = model.rotary
        if rotary is not None and not isinstance(rotary, RotaryEmbedding):
            raise TypeError(f"Decoder supports RotaryEmbedding, got {type(rotary).__name__}")
        split = rotary is not None and not rotary.interleaved
        compiled = self.compile
        layers: list[_Layer] = []
        for block, attn, ff in _block_parts(model):
            linears, out = _attention_linears(attn)
            w = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
            b = _cat_biases(linears)
            if split:  # one-time permutation of the q and k rows to interleaved pairs
                w = w.clone()
                w[: H * E] = permute_rotary_weight(w[: H * E], H, to="interleaved")
                w[H * E : (H + K) * E] = permute_rotary_weight(
                    w[H * E : (H + K) * E], K, to="interleaved"
                )
                if b is not None:
                    b = b.clone()
                    b[: H * E] = permute_rotary_weight(b[: H * E], H, to="interleaved")
                    b[H * E : (H + K) * E] = permute_rotary_weight(
                        b[H * E : (H + K) * E], K, to="interleaved"
                    )
            if ff.gate is not None:
                up_w = torch.cat([ff.gate.weight, ff.linear1.weight])  # (2F, D)
                up_b = _cat_biases([ff.gate, ff.linear1])
            else:
                up_w, up_b = ff.linear1.weight, ff.linear1.bias
            layers.append(
                _Layer(
                    norm1=_norm(block.norm1),
                    norm2=_norm(block.norm2),
                    qkv=_Linear(w, b, _layout(w, compiled=compiled)),
                    out=_Linear(out.weight, out.bias, _layout(out.weight, compiled=compiled)),
                    up=_Linear(up_w, up_b, _layout(up_w, compiled=compiled)),
                    down=_Linear(
                        ff.linear2.weight,
                        ff.linear2.bias,
                        _layout(ff.linear2.weight, compiled=compiled),
                    ),
                    activation=ff.activation,
                    gated=ff.gate is not None,
                )
            )
        self.layers = layers
        self.final_norm = _norm(model.norm) if self.norm_first else None
        self.embedding = model.embedding.weight
        head = model.lm_head.weight if model.lm_head is not None else model.embedding.weight
        self.head = _Linear(head, None, _layout(head, compiled=compiled))
        _gather_on_huge_pages([lin for layer in layers for lin in layer.linears()] + [self.head])
        self.position_table: Tensor | None = None
        if isinstance(model.position, SinusoidalPositionalEncoding):
            self.position_table = model.position.pe
        elif isinstance(model.position, LearnedPositionalEmbedding):
            self.position_table = model.position.weight
        self.rope: Tensor | None = None  # (N, E/2) complex64: cos + i sin
        self.rope_pairs: Tensor | None = None  # (N, E/2, 2) float32: [cos, sin]
        if rotary is not None:
            cos, sin = rotary.tables(model.max_seq_len, self.embedding.device)
            self.rope = torch.complex(cos, sin)
            self.rope_pairs = torch.stack((cos, sin), dim=-1)
        self._signature = self._state_signature()
        self._compiled = None

    def _refresh(self) -> None:
        if self._state_signature() != self._signature:
            self._prepare()

    # ------------------------------------------------------------------ the math

    def _embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        x = F.embedding(ids, self.embedding)  # (B, L, D)
        if self.position_table is not None:
            x = x + self.position_table[positions].to(x.dtype)
        return x

    def _rotate(self, qk: Tensor, rope: Tensor | None) -> Tensor:
        """Rotate queries and keys together (interleaved pairs). Shape: ``(*, H+K, E)``.

        ``rope`` is complex ``(*, 1, E/2)`` in eager mode (one complex multiply: fewest ops)
        and real ``(*, 1, E/2, 2)`` [cos, sin] when compiled (inductor generates no code for
        complex numbers; it fuses the real formula into one kernel). The rotation runs in
        float32 (as :func:`attnkit.positional.apply_rope`).
        """
        if rope is None:
            return qk
        x = qk if qk.dtype == torch.float32 else qk.float()
        if rope.is_complex():
            pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (*, H+K, E/2)
            out = torch.view_as_real(pairs * rope).flatten(-2)
        else:
            pairs = x.unflatten(-1, (-1, 2))  # (*, H+K, E/2, 2)
            x1, x2, cos, sin = pairs[..., 0], pairs[..., 1], rope[..., 0], rope[..., 1]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return out if out.dtype == qk.dtype else out.to(qk.dtype)

    def _feed_forward(self, layer: _Layer, x: Tensor) -> Tensor:
        h = layer.up(x)  # (*, 2F) or (*, F)
        if layer.gated:
            gate, up = h.chunk(2, dim=-1)
            h = layer.activation(gate) * up
        else:
            h = layer.activation(h)
        return layer.down(h)

    def _block(self, i: int, x: Tensor, attend: Any, rope: Tensor | None) -> Tensor:
        """Block ``i``; ``attend(i, q, k_new, v_new)`` stores the keys/values and attends.

        Shape:
            x ``(*, D)`` -> ``(*, D)`` with ``*`` = ``(B, L)`` (prefill) or ``(B,)`` (step);
            ``attend`` gets q ``(*, H, E)``, k/v ``(*, K, E)`` and returns ``(*, H*E)``.
        """
        layer = self.layers[i]
        H, K, E = self.num_heads, self.num_kv_heads, self.head_dim
        h = layer.norm1(x) if self.norm_first else x
        qkv = layer.qkv(h)  # (*, (H+2K)*E)
        qk = self._rotate(qkv[..., : (H + K) * E].unflatten(-1, (H + K, E)), rope)  # (*, H+K, E)
        v = qkv[..., (H + K) * E :].unflatten(-1, (K, E))  # (*, K, E)
        out = attend(i, qk[..., :H, :], qk[..., H:, :], v)  # (*, H*E)
        a = layer.out(out)  # (*, D)
        if self.norm_first:
            x = x + a
            return x + self._feed_forward(layer, layer.norm2(x))
        x = layer.norm1(x + a)
        return layer.norm2(x + self._feed_forward(layer, x))

    def _logits(self, h: Tensor) -> Tensor:
        if self.final_norm is not None:
            h = self.final_norm(h)
        return self.head(h)

    # ------------------------------------------------------------------ public API

    def _check_ids(self, ids: Tensor, name: str) -> None:
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {ids!r:.80}")
        if ids.dim() != 2 or ids.shape[1] < 1:
            raise ValueError(f"{name} must be (B, L) with L >= 1, got {tuple(ids.shape)}")

    @torch.no_grad()
    def prefill(
        self,
        input_ids: Tensor,
        *,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        capacity: int | None = None,
    ) -> Tensor:
        """Reset the cache, run the prompts and return the next-token logits of each sequence.

        Args:
            input_ids: Prompts ``(B, P)``, left-padded when ``mask`` is given.
            mask: ``(B, P)`` bool, ``True`` = real token (left padding); padded slots are never
                attended to, now or in later steps.
            positions: ``(B, P)`` or ``(P,)`` positions; by default ``0 .. P-1``, or with a
                ``mask`` the count of real tokens before each one (as transformers does).
            capacity: Cache slots (prompt + tokens to decode); default ``max_seq_len``.

        Returns:
            Logits of the last prompt slot, ``(B, V)``.

        Raises:
            TypeError: For non-integer ids or positions, or a non-bool mask.
            ValueError: For bad shapes, or a capacity smaller than the prompt or beyond
                ``max_seq_len``.
        """
        self._check_ids(input_ids, "input_ids")
        B, P = input_ids.shape
        device = self.embedding.device
        capacity = self.max_seq_len if capacity is None else capacity
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            raise TypeError(f"capacity must be an int, got {capacity!r}")
        if not P <= capacity <= self.max_seq_len:
            raise ValueError(
                f"capacity ({capacity}) must hold the prompt ({P}) and be at most "
                f"max_seq_len ({self.max_seq_len})"
            )
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
                raise TypeError(f"mask must be a bool tensor, got {mask!r:.80}")
            if mask.shape != (B, P):
                raise ValueError(f"mask must be {(B, P)} like input_ids, got {tuple(mask.shape)}")
            mask = mask.to(device)
        if positions is None:
            if mask is None:
                positions = torch.arange(P, device=device).expand(B, P)
            else:
                positions = positions_from_mask(mask)
        else:
            if positions.dtype.is_floating_point or positions.dtype == torch.bool:
                raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
            positions = positions.to(device).expand(B, P)
            if (
                positions.numel()
                and not 0 <= int(positions.min()) <= int(positions.max()) < capacity
            ):
                raise ValueError(
                    f"positions must lie in [0, capacity={capacity}), got "
                    f"[{int(positions.min())}, {int(positions.max())}]"
                )
        self._refresh()
        self._allocate(B, capacity, device)
        self._padded = mask is not None and not bool(mask.all())
        if mask is not None:
            self.key_mask[:, :P] = mask
        else:
            self.key_mask[:, :P] = True
        rope = None if self.rope is None else self.rope[positions][:, :, None]  # (B, P, 1, E/2)
        attn_mask = self.key_mask[:, None, None, :P] if self._padded else None  # (B, 1, 1, P)

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.k[i][:, :, :P] = k.transpose(1, 2)
            self.v[i][:, :, :P] = v.transpose(1, 2)
            out = F_attn.scaled_dot_product_attention(
                q.transpose(1, 2),  # (B, H, P, E)
                self.k[i][:, :, :P],
                self.v[i][:, :, :P],
                attn_mask,
                causal=True,
                window=self.window,
            )  # (B, H, P, E)
            return out.transpose(1, 2).flatten(-2)  # (B, P, H*E)

        x = self._embed(input_ids.to(device), positions)
        for i in range(len(self.layers)):
            x = self._block(i, x, attend, rope)
        self.length = P
        self._next_positions = positions[:, -1] + 1
        return self._logits(x[:, -1])  # (B, V)

    def _allocate(self, B: int, capacity: int, device: torch.device) -> None:
        dtype = self.embedding.dtype
        shape = (B, self.num_kv_heads, capacity, self.head_dim)
        if not self.k or self.k[0].shape != shape or self.k[0].dtype != dtype:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
            self.key_mask = torch.zeros(B, capacity, dtype=torch.bool, device=device)
        else:
            self.key_mask.zero_()
        self.slots = torch.arange(capacity, device=device)

    @property
    def capacity(self) -> int:
        """Slots of the current cache (0 before :meth:`prefill`)."""
        return self.k[0].shape[2] if self.k else 0

    @torch.no_grad()
    def step(self, next_ids: Tensor, positions: Tensor | None = None) -> Tensor:
        """Decode one token per sequence and return the logits that follow it.

        Args:
            next_ids: ``(B, 1)`` token ids (the tokens just chosen).
            positions: ``(B,)`` positions of these tokens; by default one past the previous.

        Returns:
            Next-token logits ``(B, V)``.

        Raises:
            RuntimeError: Before :meth:`prefill`, or when the cache is full.
            TypeError: For non-integer ids.
            ValueError: For a wrong shape.
        """
        if not self.k:
            raise RuntimeError("call prefill() before step()")
        self._check_ids(next_ids, "next_ids")
        B = self.k[0].shape[0]
        if next_ids.shape != (B, 1):
            raise ValueError(f"next_ids must be ({B}, 1), got {tuple(next_ids.shape)}")
        if self.length >= self.capacity:
            raise RuntimeError(f"the cache is full ({self.capacity} slots); prefill again")
        if positions is None:
            positions = self._next_positions
        elif positions.shape != (B,):
            raise ValueError(f"positions must be ({B},), got {tuple(positions.shape)}")
        if self.compile:
            logits = self._step_compiled(next_ids, positions)
        else:
            logits = self._step_eager(next_ids, positions)
        self.length += 1
        self._next_positions = positions + 1
        return logits

    def _step_eager(self, ids: Tensor, positions: Tensor) -> Tensor:
        B, H, K, E = ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        slot = self.length
        end = slot + 1
        lo = 0 if self.window is None else max(0, end - self.window)
        if self._padded:
            self.key_mask[:, slot] = True
            mask: Tensor | None = self.key_mask[:, None, None, lo:end]  # (B, 1, 1, S)
        else:
            mask = None
        rope = None if self.rope is None else self.rope[positions].unsqueeze(1)  # (B, 1, E/2)

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            ck, cv = self.k[i], self.v[i]
            ck[:, :, slot] = k
            cv[:, :, slot] = v
            # The H query heads of one token as K groups of H/K query rows: no GQA expansion.
            out = F.scaled_dot_product_attention(
                q.view(B, K, H // K, E), ck[:, :, lo:end], cv[:, :, lo:end], attn_mask=mask
            )  # (B, K, H/K, E)
            return out.view(B, H * E)

        x = self._embed(ids[:, 0], positions)  # (B, D)
        for i in range(len(self.layers)):
            x = self._block(i, x, attend, rope)
        return self._logits(x)

    # ------------------------------------------------------------------ compiled step

    def _static_step(self, ids: Tensor, positions: Tensor, slot: Tensor) -> Tensor:
        """One step over the whole capacity (static shapes): the function that is compiled."""
        B, H, K, E = ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        self.key_mask.index_fill_(1, slot, True)
        allowed = self.key_mask
        if self.window is not None:
            allowed = allowed & (self.slots > slot - self.window)
        mask = allowed[:, None, None, :]  # (B, 1, 1, C)
        rope = None
        if self.rope_pairs is not None:
            rope = self.rope_pairs[positions].unsqueeze(1)  # (B, 1, E/2, 2): [cos, sin]
        x = self._embed(ids[:, 0], positions)  # (B, D)

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            ck, cv = self.k[i], self.v[i]
            ck.index_copy_(2, slot, k.unsqueeze(2))  # (B, K, 1, E) into slot
            cv.index_copy_(2, slot, v.unsqueeze(2))
            out = F.scaled_dot_product_attention(
                q.reshape(B, K, H // K, E), ck, cv, attn_mask=mask
            )  # (B, K, H/K, E)
            return out.reshape(B, H * E)

        for i in range(len(self.layers)):
            x = self._block(i, x, attend, rope)
        return self._logits(x)

    def _step_compiled(self, ids: Tensor, positions: Tensor) -> Tensor:
        key = (ids.shape[0], self.capacity)
        if self._compiled is None:
            self._compiled = torch.compile(self._static_step, fullgraph=True, dynamic=False)
        slot = torch.tensor([self.length], device=ids.device)
        if key not in self.compile_seconds:
            start = time.perf_counter()
            logits = self._compiled(ids, positions, slot)
            self.compile_seconds[key] = time.perf_counter() - start
            return logits
        return self._compiled(ids, positions, slot)
