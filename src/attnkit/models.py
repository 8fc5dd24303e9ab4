"""Whole models: a bidirectional :class:`TransformerEncoder` and a decoder-only
:class:`TransformerLM`.

Both are a token embedding, a position scheme, ``num_layers``
:class:`attnkit.blocks.TransformerBlock` and (pre-norm only) a final norm.
Positions (``position=``):

* ``"none"``: no order information: the encoder is then permutation-equivariant;
* ``"sinusoidal"`` / ``"learned"``: a vector per position added *once* to the embeddings
  (unlike the blog's :class:`attnkit.blocks.PositionalTransformerBlock`, which re-adds it in
  every block);
* ``"rope"``: a :class:`attnkit.positional.RotaryEmbedding` shared by every attention layer.

:meth:`TransformerLM.generate` decodes greedily or by sampling, with a preallocated
:class:`attnkit.KVCache` per layer (``use_cache=True``) or by re-running the whole prefix.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import masks as M
from attnkit.blocks import Activation, NormType, TransformerBlock, make_norm
from attnkit.cache import KVCache
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)

__all__ = ["TransformerEncoder", "TransformerLM", "attention_mask_from_padding"]

PositionType = Literal["none", "sinusoidal", "learned", "rope"]
_POSITIONS = ("none", "sinusoidal", "learned", "rope")
Pooling = Literal["none", "mean", "first"]


def attention_mask_from_padding(
    mask: Tensor | None = None, lengths: Tensor | None = None, *, seq_len: int | None = None
) -> Tensor | None:
    """Turn a key-padding mask or lengths into a mask for attention scores ``(B, H, L, S)``.

    Args:
        mask: ``(B, S)`` bool (``True`` = real token) -> ``(B, 1, 1, S)``; ``(B, L, S)`` ->
            ``(B, 1, L, S)``; a 4-D bool or additive float mask is returned unchanged.
        lengths: Integer ``(B,)`` real lengths (alternative to ``mask``), padded to ``seq_len``.
        seq_len: Key length for ``lengths``.

    Returns:
        A mask broadcastable to ``(B, H, L, S)``, or ``None``.

    Raises:
        ValueError: If both ``mask`` and ``lengths`` are given, or ``mask`` has 1 dim.
    """
    if mask is not None and lengths is not None:
        raise ValueError("pass either mask or lengths, not both")
    if lengths is not None:
        return M.padding_mask(lengths, seq_len)
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask[:, None, None, :]  # (B, 1, 1, S)
    if mask.dim() == 3:
        return mask[:, None]  # (B, 1, L, S)
    if mask.dim() == 4:
        return mask
    raise ValueError(f"mask must be (B, S), (B, L, S) or (B, H, L, S), got {tuple(mask.shape)}")


class _TransformerStack(nn.Module):
    """Embedding + positions + blocks + final norm, shared by the encoder and the LM."""

    def __init__(
        self,
        vocab_size: int | None,
        dim: int,
        num_layers: int,
        num_heads: int,
        *,
        hidden_dim: int | None,
        num_kv_heads: int | None,
        max_seq_len: int,
        position: PositionType,
        causal: bool,
        norm_first: bool,
        norm: NormType,
        activation: Activation,
        eps: float,
        dropout: float,
        bias: bool,
        window: int | None,
        rope_base: float,
        rope_interleaved: bool,
    ) -> None:
        super().__init__()
        if position not in _POSITIONS:
            raise ValueError(f"position must be one of {_POSITIONS}, got {position!r}")
        bad = {
            n: v
            for n, v in {
                "dim": dim,
                "num_layers": num_layers,
                "num_heads": num_heads,
                "max_seq_len": max_seq_len,
            }.items()
            if v < 1
        }
        if vocab_size is not None and vocab_size < 1:
            bad["vocab_size"] = vocab_size
        if bad:
            raise ValueError(f"sizes must be positive, got {bad}")
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.vocab_size, self.dim, self.num_layers = vocab_size, dim, num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = dim // num_heads
        self.max_seq_len, self.position_type = max_seq_len, position
        self.embedding = nn.Embedding(vocab_size, dim) if vocab_size is not None else None
        self.position: nn.Module | None = None
        if position == "sinusoidal":
            self.position = SinusoidalPositionalEncoding(dim, max_seq_len)
        elif position == "learned":
            self.position = LearnedPositionalEmbedding(max_seq_len, dim)
        self.rotary = (
            RotaryEmbedding(self.head_dim, base=rope_base, interleaved=rope_interleaved)
            if position == "rope"
            else None
        )
        self.dropout = nn.Dropout(dropout)
        hidden_dim = 4 * dim if hidden_dim is None else hidden_dim
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                hidden_dim,
                num_heads,
                causal,
                norm_first=norm_first,
                norm=norm,
                activation=activation,
                eps=eps,
                dropout=dropout,
                num_kv_heads=num_kv_heads,
                rotary=self.rotary,
                window=window,
                bias=bias,
            )
            for _ in range(num_layers)
        )
        self.norm = make_norm(norm, dim, eps=eps) if norm_first else nn.Identity()

    def _hidden(
        self,
        x: Tensor,
        mask: Tensor | None,
        *,
        positions: Tensor | None,
        kv_caches: list[KVCache] | None,
        return_weights: bool,
    ) -> tuple[Tensor, list[Tensor]]:
        if self.embedding is not None:
            if x.dtype.is_floating_point:
                raise TypeError(f"expected integer token ids, got {x.dtype}")
            h = self.embedding(x)  # (B, L, D)
        else:
            if x.shape[-1] != self.dim:
                raise ValueError(f"inputs must have last dim {self.dim}, got {tuple(x.shape)}")
            h = x
        L = h.shape[-2]
        if kv_caches is not None and len(kv_caches) != self.num_layers:
            raise ValueError(
                f"need one KVCache per layer ({self.num_layers}), got {len(kv_caches)}"
            )
        if positions is None and kv_caches is not None and kv_caches[0].length:
            start = kv_caches[0].length
            positions = torch.arange(start, start + L, device=h.device)
        if self.position is not None:
            h = self.position(h, positions)
        h = self.dropout(h)
        weights: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            cache = None if kv_caches is None else kv_caches[i]
            if return_weights:
                h, w = block(h, mask, positions=positions, kv_cache=cache, return_weights=True)
                weights.append(w)
            else:
                h = block(h, mask, positions=positions, kv_cache=cache)
        return self.norm(h), weights


class TransformerEncoder(_TransformerStack):
    """Bidirectional transformer encoder over token ids (or over vectors if ``vocab_size=None``).

    Defaults follow the blog's block (post-norm, ReLU, LayerNorm) with sinusoidal positions
    added once at the input. An optional linear head turns it into a classifier or tagger:
    ``num_outputs`` with ``pool="none"`` gives per-token logits (tagging, masked-LM-style
    targets), ``pool="mean"`` (mean over real tokens) or ``"first"`` (a CLS token) gives one
    output per sequence.

    Args:
        vocab_size: Token vocabulary; ``None`` to feed ``(B, L, dim)`` vectors directly.
        dim: Model dim ``D``.
        num_layers: Number of blocks.
        num_heads: Query heads per block.
        hidden_dim: Feed-forward hidden dim (default ``4 * dim``).
        num_kv_heads: Key/value heads (grouped-query attention).
        max_seq_len: Positions of the sinusoidal/learned tables.
        position: ``"sinusoidal"`` (default), ``"learned"``, ``"rope"`` or ``"none"``.
        causal: Causal attention in every block.
        norm_first: Pre-norm blocks plus a final norm.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        activation: Feed-forward activation.
        eps: Norm epsilon.
        dropout: Dropout after the embeddings and inside the blocks.
        bias: Biases in the projections.
        window: Sliding-window attention size.
        rope_base: Rotary wavelength base.
        rope_interleaved: Rotary pair convention (see :mod:`attnkit.positional`).
        num_outputs: Size of an output head; ``None`` returns hidden states.
        pool: ``"none"``, ``"mean"`` or ``"first"`` (applied before the head).

    Raises:
        ValueError: For bad sizes or option values.
    """

    def __init__(
        self,
        vocab_size: int | None,
        dim: int,
        num_layers: int,
        num_heads: int,
        *,
        hidden_dim: int | None = None,
        num_kv_heads: int | None = None,
        max_seq_len: int = 512,
        position: PositionType = "sinusoidal",
        causal: bool = False,
        norm_first: bool = False,
        norm: NormType = "layernorm",
        activation: Activation = "relu",
        eps: float = 1e-5,
        dropout: float = 0.0,
        bias: bool = True,
        window: int | None = None,
        rope_base: float = 10_000.0,
        rope_interleaved: bool = True,
        num_outputs: int | None = None,
        pool: Pooling = "none",
    ) -> None:
        super().__init__(
            vocab_size,
            dim,
            num_layers,
            num_heads,
            hidden_dim=hidden_dim,
            num_kv_heads=num_kv_heads,
            max_seq_len=max_seq_len,
            position=position,
            causal=causal,
            norm_first=norm_first,
            norm=norm,
            activation=activation,
            eps=eps,
            dropout=dropout,
            bias=bias,
            window=window,
            rope_base=rope_base,
            rope_interleaved=rope_interleaved,
        )
        if pool not in ("none", "mean", "first"):
            raise ValueError(f"pool must be 'none', 'mean' or 'first', got {pool!r}")
        self.pool = pool
        self.head = nn.Linear(dim, num_outputs) if num_outputs is not None else None

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        lengths: Tensor | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Encode a batch.

        Args:
            x: Token ids ``(B, L)`` (or vectors ``(B, L, D)`` when ``vocab_size`` is ``None``).
            mask: Key-padding mask ``(B, L)`` bool, ``True`` = real token; or any attention mask
                accepted by :func:`attention_mask_from_padding`. Outputs at padded positions are
                computed but meaningless.
            lengths: Real lengths ``(B,)`` instead of ``mask``.
            positions: Explicit positions ``(L,)`` or ``(B, L)`` (packed sequences).
            return_weights: Also return each layer's attention weights.

        Returns:
            ``out``, or ``(out, weights)`` with ``weights`` a list (one per layer) of
            ``(B, H, L, L)`` tensors. ``out`` is ``(B, L, D)`` hidden states, or with a head
            ``(B, L, num_outputs)`` (``pool="none"``) / ``(B, num_outputs)`` (pooled).
        """
        L = x.shape[1]
        attn_mask = attention_mask_from_padding(mask, lengths, seq_len=L)
        h, weights = self._hidden(
            x, attn_mask, positions=positions, kv_caches=None, return_weights=return_weights
        )
        if self.pool == "first":
            h = h[:, 0]  # (B, D)
        elif self.pool == "mean":
            real = _token_mask(mask, lengths, L, h.device)
            if real is None:
                h = h.mean(dim=1)
            else:
                w = real.to(h.dtype)[..., None]  # (B, L, 1)
                h = (h * w).sum(1) / w.sum(1).clamp_min(1.0)  # (B, D)
        out = self.head(h) if self.head is not None else h
        return (out, weights) if return_weights else out


def _token_mask(
    mask: Tensor | None, lengths: Tensor | None, L: int, device: torch.device
) -> Tensor | None:
    """``(B, L)`` bool of real tokens, if the padding is known per token."""
    if lengths is not None:
        return torch.arange(L, device=device)[None, :] < lengths.to(device)[:, None]
    if mask is not None and mask.dim() == 2 and mask.dtype == torch.bool:
        return mask
    return None


class TransformerLM(_TransformerStack):
    """Decoder-only language model with a tied output head.

    Defaults are GPT-2-like: pre-norm LayerNorm blocks, GELU, rotary positions; the logits are
    ``h @ embedding.weight.T`` (no separate head parameters).

    Args:
        vocab_size: Token vocabulary ``V``.
        dim: Model dim ``D``.
        num_layers: Number of blocks.
        num_heads: Query heads per block.
        num_kv_heads: Key/value heads (grouped-query attention; default ``num_heads``).
        hidden_dim: Feed-forward hidden dim (default ``4 * dim``).
        max_seq_len: Longest sequence (prompt + generated) :meth:`generate` accepts, and rows of
            the sinusoidal/learned tables.
        position: ``"rope"`` (default), ``"sinusoidal"``, ``"learned"`` or ``"none"``.
        norm_first: Pre-norm blocks plus a final norm (default) or post-norm.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        activation: Feed-forward activation.
        eps: Norm epsilon.
        dropout: Dropout after the embeddings and inside the blocks.
        bias: Biases in the projections.
        window: Sliding-window attention size.
        rope_base: Rotary wavelength base.
        rope_interleaved: Rotary pair convention.

    Raises:
        ValueError: For bad sizes or option values.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        hidden_dim: int | None = None,
        max_seq_len: int = 1024,
        position: PositionType = "rope",
        norm_first: bool = True,
        norm: NormType = "layernorm",
        activation: Activation = "gelu",
        eps: float = 1e-5,
        dropout: float = 0.0,
        bias: bool = True,
        window: int | None = None,
        rope_base: float = 10_000.0,
        rope_interleaved: bool = True,
    ) -> None:
        super().__init__(
            vocab_size,
            dim,
            num_layers,
            num_heads,
            hidden_dim=hidden_dim,
            num_kv_heads=num_kv_heads,
            max_seq_len=max_seq_len,
            position=position,
            causal=True,
            norm_first=norm_first,
            norm=norm,
            activation=activation,
            eps=eps,
            dropout=dropout,
            bias=bias,
            window=window,
            rope_base=rope_base,
            rope_interleaved=rope_interleaved,
        )
        # Tied head: unit-variance logits at init need embeddings of variance 1/dim.
        nn.init.normal_(self.embedding.weight, std=dim**-0.5)  # type: ignore[union-attr]

    def logits(self, h: Tensor) -> Tensor:
        """Tied output head. Shape: ``(..., D) -> (..., V)``."""
        return F.linear(h, self.embedding.weight)  # type: ignore[union-attr]

    def forward(
        self,
        input_ids: Tensor,
        mask: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits for every position.

        Args:
            input_ids: Token ids ``(B, L)``.
            mask: Optional key-padding ``(B, S)`` (``True`` = real) or attention mask, ANDed
                with the causal mask.
            positions: Explicit positions; by default ``0 .. L-1``, or continuing after the
                cached positions.
            kv_caches: One :class:`attnkit.KVCache` per layer (see :meth:`make_kv_caches`);
                the new keys/values are appended.
            return_weights: Also return each layer's attention weights ``(B, H, L, S)``.

        Returns:
            Logits ``(B, L, V)``, or ``(logits, weights)``.
        """
        attn_mask = attention_mask_from_padding(mask)
        h, weights = self._hidden(
            input_ids,
            attn_mask,
            positions=positions,
            kv_caches=kv_caches,
            return_weights=return_weights,
        )
        logits = self.logits(h)
        return (logits, weights) if return_weights else logits

    def make_kv_caches(
        self,
        batch_size: int,
        capacity: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[KVCache]:
        """One empty, preallocated :class:`attnkit.KVCache` per layer.

        Raises:
            ValueError: If ``capacity`` exceeds ``max_seq_len``.
        """
        if capacity > self.max_seq_len:
            raise ValueError(f"KV cache capacity {capacity} exceeds max_seq_len {self.max_seq_len}")
        ref = self.embedding.weight  # type: ignore[union-attr]
        return [
            KVCache(
                batch_size,
                self.num_kv_heads,
                capacity,
                self.head_dim,
                dtype=dtype or ref.dtype,
                device=device or ref.device,
            )
            for _ in range(self.num_layers)
        ]

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend each prompt by ``max_new_tokens`` tokens (runs in eval mode).

        Args:
            input_ids: Prompts ``(B, P)`` (no padding), ``P >= 1``.
            max_new_tokens: Tokens to add.
            temperature: ``0`` = greedy (argmax); otherwise sample from
                ``softmax(logits / temperature)``.
            top_k: Sample only among the ``top_k`` most likely tokens.
            use_cache: Decode with a KV cache (prefill once, then one token per step) instead
                of re-running the whole prefix every step. Both give the same tokens.
            generator: Random generator for sampling.

        Returns:
            ``(B, P + max_new_tokens)`` token ids, prompt included.

        Raises:
            ValueError: If ``P + max_new_tokens > max_seq_len``, or bad options.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be (B, P) with P >= 1, got {tuple(input_ids.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be positive, got {top_k}")
        B, P = input_ids.shape
        total = P + max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt ({P}) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds max_seq_len {self.max_seq_len}"
            )
        was_training = self.training
        self.eval()
        try:
            ids = input_ids
            caches = self.make_kv_caches(B, total) if use_cache else None
            step_input = ids
            for _ in range(max_new_tokens):
                if use_cache:
                    h, _ = self._hidden(
                        step_input, None, positions=None, kv_caches=caches, return_weights=False
                    )
                else:
                    h, _ = self._hidden(
                        ids, None, positions=None, kv_caches=None, return_weights=False
                    )
                logits = self.logits(h[:, -1])  # (B, V)
                next_id = _pick(logits, temperature, top_k, generator)  # (B, 1)
                ids = torch.cat([ids, next_id], dim=1)
                step_input = next_id
            return ids
        finally:
            self.train(was_training)


def _pick(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """Greedy or (top-k) sampled next token. Shape: ``(B, V) -> (B, 1)``."""
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
