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

:meth:`TransformerLM.generate` / :meth:`TransformerLM.stream` decode greedily or by sampling,
left-padded batches included, with a preallocated :class:`attnkit.KVCache` per layer
(``use_cache=True``) or by re-running the whole prefix. They run this model's own forward (the
loop is :mod:`attnkit.generation`; ``compile=True`` compiles the model's one-token step, see
:mod:`attnkit.decoding`), so a swapped module (a quantized or LoRA linear) is what runs.
:meth:`TransformerLM.from_pretrained` / :meth:`TransformerLM.save_pretrained` read and write
Hugging Face decoder folders (:mod:`attnkit.interop.hf`).
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from attnkit import decoding, fused, generation
from attnkit import masks as M
from attnkit import quantize as quantization
from attnkit.blocks import TransformerLayer, make_norm
from attnkit.cache import AttendingCache, KVCache
from attnkit.config import FAMILIES, TransformerConfig
from attnkit.generation import GenerateOptions
from attnkit.interop import hf
from attnkit.kernels import policy
from attnkit.masks import attention_mask_from_padding
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["TransformerEncoder", "TransformerLM", "attention_mask_from_padding"]

Pooling = Literal["none", "mean", "first"]


# Keyword defaults of TransformerEncoder where they differ from TransformerConfig's (the LM's):
# the blog's block.
_ENCODER_DEFAULTS: dict[str, Any] = {**FAMILIES["blog"], "max_seq_len": 512}


def _make_config(
    cls_name: str,
    config: TransformerConfig | int | None,
    sizes: dict[str, int | None],
    options: dict[str, Any],
    defaults: dict[str, Any],
) -> TransformerConfig:
    """The config of ``Model(config)`` or of the keyword form ``Model(vocab, dim, ..., **opts)``."""
    if isinstance(config, TransformerConfig):
        extra = {k: v for k, v in sizes.items() if v is not None} | options
        if extra:
            raise TypeError(
                f"{cls_name}(config) takes no other options; got {sorted(extra)} "
                "(use config.replace(...))"
            )
        return config
    if config is None and "vocab_size" in options:  # vocab_size passed by name
        options = dict(options)
        config = options.pop("vocab_size")
    known = {f.name for f in fields(TransformerConfig)} | {"hidden_dim"}  # deprecated ffn_dim
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{cls_name} got unknown options {unknown}")
    missing = [k for k, v in sizes.items() if v is None]
    if missing:
        raise TypeError(f"{cls_name} needs a TransformerConfig or the sizes {missing}")
    if "hidden_dim" in options:  # 0.2's name of ffn_dim: the warning points at the caller's line
        options = dict(options)
        hidden_dim = options.pop("hidden_dim")
        if options.get("ffn_dim") not in (None, hidden_dim):
            raise ValueError(
                f"got ffn_dim={options['ffn_dim']} and its deprecated alias hidden_dim={hidden_dim}"
            )
        warnings.warn(
            f"{cls_name}(hidden_dim=...) is deprecated; use ffn_dim",
            DeprecationWarning,
            stacklevel=3,  # _make_config <- the model's __init__ <- the caller
        )
        options["ffn_dim"] = hidden_dim
    return TransformerConfig(config, **sizes, **(defaults | options))  # type: ignore[arg-type]


class _TransformerStack(nn.Module):
    """Positions + blocks + final norm, shared by the encoder and the LM.

    The subclass builds the token embedding first (parameter creation order fixes the
    initialisation from a seed) and hands it in.
    """

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding | None) -> None:
        super().__init__()
        self.config = config
        self.vocab_size, self.dim, self.num_layers = (
            config.vocab_size,
            config.dim,
            config.num_layers,
        )
        self.num_heads, self.num_kv_heads = config.num_heads, int(config.num_kv_heads or 0)
        self.head_dim = int(config.head_dim or 0)
        self.max_seq_len, self.position_type = config.max_seq_len, config.position
        self.embedding = embedding
        self.position: nn.Module | None = None
        if config.position == "sinusoidal":
            self.position = SinusoidalPositionalEncoding(config.dim, config.max_seq_len)
        elif config.position == "learned":
            self.position = LearnedPositionalEmbedding(config.max_seq_len, config.dim)
        self.rotary = self._rotary(config.rope_base) if config.position == "rope" else None
        # Gemma 3: the sliding layers rotate with a base of their own.
        self.rotary_local = (
            self._rotary(config.rope_local_base)
            if self.rotary is not None and config.rope_local_base is not None
            else None
        )
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerLayer.from_config(config, self._layer_rotary(i), layer=i)
            for i in range(config.num_layers)
        )
        self.norm = (
            make_norm(config.norm, config.dim, eps=config.eps)
            if config.norm_first
            else nn.Identity()
        )

    def _rotary(self, base: float) -> RotaryEmbedding:
        c = self.config
        return RotaryEmbedding(
            self.head_dim, base=base, interleaved=c.rope_interleaved, scaling=c.rope_scaling
        )

    def _layer_rotary(self, layer: int) -> RotaryEmbedding | None:
        """The rotary module of block ``layer`` (the local one for Gemma 3's sliding layers)."""
        sliding = self.config.layer_window(layer) is not None
        return self.rotary_local if sliding and self.rotary_local is not None else self.rotary

    def _embed(self, x: Tensor) -> Tensor:
        if self.embedding is None:
            if x.shape[-1] != self.dim:
                raise ValueError(f"inputs must have last dim {self.dim}, got {tuple(x.shape)}")
            return x
        if x.dtype.is_floating_point:
            raise TypeError(f"expected integer token ids, got {x.dtype}")
        h = self.embedding(x)  # (B, L, D)
        if self.config.scale_embeddings:  # Gemma: sqrt(D), rounded to the embeddings' dtype
            h = h * torch.tensor(self.dim**0.5, dtype=h.dtype)
        return h

    def _hidden(
        self,
        x: Tensor,
        mask: Tensor | None,
        *,
        positions: Tensor | None,
        kv_caches: Sequence[KVCache | AttendingCache] | None,
        return_weights: bool,
        cache_position: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        h = self._embed(x)  # (B, L, D)
        L = h.shape[-2]
        if kv_caches is not None and len(kv_caches) != self.num_layers:
            raise ValueError(
                f"need one KVCache per layer ({self.num_layers}), got {len(kv_caches)}"
            )
        if cache_position is not None and kv_caches is None:
            raise ValueError("cache_position needs kv_caches")
        if positions is None and cache_position is not None:
            positions = cache_position
        first = None if kv_caches is None else kv_caches[0]
        if positions is None and isinstance(first, KVCache) and first.length:
            start = first.length
            positions = torch.arange(start, start + L, device=h.device)
        if self.position is not None:
            h = self.position(h, positions)
        if self.training:  # identity in evaluation: no call per decoding step
            h = self.dropout(h)
        elif (
            kv_caches is not None
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4))
            and cache_position is None
            and not return_weights
        ):
            # A cached step of a few tokens: every layer in one kernel call, where it serves
            # this stack and this call (attnkit.fused says which), else the blocks below.
            out = fused.run(self, h, positions, kv_caches, mask)
            if out is not None:
                return self.norm(out), []
        weights: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            h, w = block(
                h,
                mask,
                positions=positions,
                kv_cache=None if kv_caches is None else kv_caches[i],
                cache_position=cache_position,
                return_weights=return_weights,
            )
            if w is not None:
                weights.append(w)
        return self.norm(h), weights


class TransformerEncoder(_TransformerStack):
    """Bidirectional transformer encoder over token ids (or over vectors if ``vocab_size=None``).

    Built from a :class:`attnkit.TransformerConfig`, or in the keyword form
    ``TransformerEncoder(vocab_size, dim, num_layers, num_heads, **options)`` whose options are
    the config's fields with the encoder's defaults: the blog's block (post-norm, ReLU,
    LayerNorm, ``causal=False``) with sinusoidal positions added once at the input and
    ``max_seq_len=512``. An optional linear head turns it into a classifier or tagger:
    ``num_outputs`` with ``pool="none"`` gives per-token logits (tagging, masked-LM-style
    targets), ``pool="mean"`` (mean over real tokens) or ``"first"`` (a CLS token) gives one
    output per sequence.

    Args:
        config: The stack's config, or (keyword form) the token vocabulary (``None`` to feed
            ``(B, L, dim)`` vectors directly).
        dim: Model dim ``D`` (keyword form).
        num_layers: Number of blocks (keyword form).
        num_heads: Query heads per block (keyword form).
        num_outputs: Size of an output head; ``None`` returns hidden states.
        pool: ``"none"``, ``"mean"`` or ``"first"`` (applied before the head).
        **options: Keyword form: any other :class:`attnkit.TransformerConfig` field
            (``ffn_dim``, ``num_kv_heads``, ``position``, ``causal``, ``norm_first``, ``norm``,
            ``activation``, ``eps``, ``dropout``, ``bias``, ``window``, ``rope_base``, ...).

    Raises:
        TypeError: For unknown options, or options besides a config.
        ValueError: For bad sizes or option values.
    """

    def __init__(
        self,
        config: TransformerConfig | int | None = None,
        dim: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        *,
        num_outputs: int | None = None,
        pool: Pooling = "none",
        **options: Any,
    ) -> None:
        sizes = {"dim": dim, "num_layers": num_layers, "num_heads": num_heads}
        cfg = _make_config("TransformerEncoder", config, sizes, options, _ENCODER_DEFAULTS)
        embedding = nn.Embedding(cfg.vocab_size, cfg.dim) if cfg.vocab_size is not None else None
        super().__init__(cfg, embedding)
        if pool not in ("none", "mean", "first"):
            raise ValueError(f"pool must be 'none', 'mean' or 'first', got {pool!r}")
        self.pool = pool
        self.head = nn.Linear(cfg.dim, num_outputs) if num_outputs is not None else None

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
        attn_mask = M.attention_mask_from_padding(mask, lengths, seq_len=L)
        h, weights = self._hidden(
            x, attn_mask, positions=positions, kv_caches=None, return_weights=return_weights
        )
        if self.pool == "first":
            h = h[:, 0]  # (B, D)
        elif self.pool == "mean":
            real = M.token_mask(mask, lengths, L, h.device)
            if real is None:
                h = h.mean(dim=1)
            else:
                w = real.to(h.dtype)[..., None]  # (B, L, 1)
                h = (h * w).sum(1) / w.sum(1).clamp_min(1.0)  # (B, D)
        out = self.head(h) if self.head is not None else h
        return (out, weights) if return_weights else out


class TransformerLM(_TransformerStack):
    """Decoder-only language model.

    Built from a :class:`attnkit.TransformerConfig` (``TransformerLM(config)``), or in the
    keyword form ``TransformerLM(vocab_size, dim, num_layers, num_heads, **options)`` whose
    options are the config's fields with its defaults: GPT-2-like pre-norm LayerNorm blocks,
    GELU, rotary positions, ``max_seq_len=1024`` and a tied output head (the logits are
    ``h @ embedding.weight.T``). With ``tie_embeddings=False`` the head is a separate
    ``lm_head`` ``Linear`` without bias.

    Args:
        config: The model's config, or (keyword form) the token vocabulary ``V``.
        dim: Model dim ``D`` (keyword form).
        num_layers: Number of blocks (keyword form).
        num_heads: Query heads per block (keyword form).
        **options: Keyword form: any other :class:`attnkit.TransformerConfig` field
            (``num_kv_heads``, ``head_dim``, ``ffn_dim``, ``max_seq_len``, ``position``,
            ``norm_first``, ``norm``, ``activation``, ``eps``, ``dropout``, ``bias``,
            ``qkv_bias``, ``out_bias``, ``mlp_bias``, ``window``, ``rope_base``,
            ``rope_interleaved``, ``rope_scaling``, ``tie_embeddings``).

    Raises:
        TypeError: For unknown options, or options besides a config.
        ValueError: For bad sizes or option values, a config without ``vocab_size`` or with
            ``causal=False``.
    """

    embedding: nn.Embedding

    def __init__(
        self,
        config: TransformerConfig | int | None = None,
        dim: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        **options: Any,
    ) -> None:
        sizes = {"dim": dim, "num_layers": num_layers, "num_heads": num_heads}
        cfg = _make_config("TransformerLM", config, sizes, options, {})
        if cfg.vocab_size is None or not cfg.causal:
            raise ValueError(
                "TransformerLM needs a vocab_size and causal=True, got "
                f"vocab_size={cfg.vocab_size}, causal={cfg.causal}"
            )
        embedding = nn.Embedding(cfg.vocab_size, cfg.dim)
        super().__init__(cfg, embedding)
        # Tied head: unit-variance logits at init need embeddings of variance 1/dim.
        nn.init.normal_(self.embedding.weight, std=cfg.dim**-0.5)
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )
        # Token ids generation defaults to (eos_token_id, pad_token_id, bos_token_id);
        # from_pretrained fills them from the folder's generation_config.json.
        self.generation_config: dict[str, Any] = {}

    def logits(self, h: Tensor) -> Tensor:
        """Output head (tied to the embedding, or ``lm_head``). Shape: ``(..., D) -> (..., V)``."""
        logits = (
            self.lm_head(h)
            if self.lm_head is not None
            else decoding.linear(h, self.embedding.weight)
        )
        cap = self.config.logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        input_ids: Tensor,
        mask: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        kv_caches: Sequence[KVCache | AttendingCache] | None = None,
        cache_position: Tensor | None = None,
        logits_to_keep: int = 0,
        logits_at: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits for every position (or the last ``logits_to_keep``).

        Args:
            input_ids: Token ids ``(B, L)``.
            mask: Optional key-padding ``(B, S)`` (``True`` = real) or attention mask, ANDed
                with the causal mask. With ``kv_caches`` the keys are the cached ones plus the
                new ones (with a ``cache_position``: every cache slot, ``S`` = capacity).
            positions: Explicit positions; by default ``0 .. L-1``, or continuing after the
                cached positions (or equal to ``cache_position``).
            kv_caches: One :class:`attnkit.KVCache` per layer (see :meth:`make_kv_caches`);
                the new keys/values are appended. Or one
                :class:`attnkit.cache.AttendingCache` per layer (with explicit ``positions``),
                which stores them and attends in its own layout (the serving engine's paged
                cache, several sequences packed along ``L``).
            cache_position: ``(L,)`` int tensor: write the new keys/values at these cache slots
                and attend over every slot with a mask, a static-shaped step that compiles
                once for all steps (see :class:`attnkit.attention.LayerOptions`).
            logits_to_keep: Compute the logits of the last ``logits_to_keep`` positions only
                (``0``: all), as generation does for the prompt.
            logits_at: ``(N,)`` int tensor: compute the logits of these positions only (of a
                packed batch, each sequence's last token); ``B`` must be 1.
            return_weights: Also return each layer's attention weights ``(B, H, L, S)``.

        Returns:
            Logits ``(B, L, V)`` (``(B, logits_to_keep, V)``, ``(1, N, V)``), or
            ``(logits, weights)``.

        Raises:
            ValueError: For ``logits_at`` with ``logits_to_keep`` or with ``B > 1``.
        """
        if logits_at is not None and (logits_to_keep or input_ids.shape[0] != 1):
            raise ValueError(
                f"logits_at takes one (packed) row and no logits_to_keep, got batch "
                f"{input_ids.shape[0]} and logits_to_keep={logits_to_keep}"
            )
        attn_mask = M.attention_mask_from_padding(mask)
        h, weights = self._hidden(
            input_ids,
            attn_mask,
            positions=positions,
            kv_caches=kv_caches,
            cache_position=cache_position,
            return_weights=return_weights,
        )
        if logits_to_keep:
            h = h[:, -logits_to_keep:]  # (B, logits_to_keep, D)
        elif logits_at is not None:
            h = h[:, logits_at]  # (1, N, D)
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
        ref = self.embedding.weight
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

    def fuses_steps(self) -> bool:
        """Whether this model's cached decoding steps run its stack in one kernel call
        (:func:`attnkit.fused.plan_of`: a stack the fused step describes, with no hooks)."""
        return fused.plan_of(self) is not None

    def generate(
        self, input_ids: Tensor, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Tensor:
        """Extend each prompt by up to ``max_new_tokens`` tokens (runs in eval mode).

        See :func:`attnkit.generation.generate` for left-padded batches and eos handling.

        Args:
            input_ids: Prompts ``(B, P)``, left-padded when of different lengths.
            max_new_tokens: Most tokens to add.
            **options: Keyword-only (:class:`attnkit.generation.GenerateOptions`):
                ``attention_mask`` ``(B, P)``, ``True``/1 = real token (left padding);
                ``pad_token_id`` fills rows that ended (default: ``generation_config``'s, else
                eos); ``eos_token_id``, one id or several, default ``generation_config``'s
                (``[]``: none); ``temperature``, ``0`` = greedy (argmax), otherwise sample from
                ``softmax(logits / temperature)``; ``top_k``, sample only among the ``top_k``
                most likely tokens; ``top_p``, sample only from the smallest set of tokens of
                total probability ``top_p``; ``repetition_penalty``, ``> 1`` discourages tokens
                already in the sequence; ``use_cache`` (default ``True``), decode with a KV cache
                (prefill once, then one token per step) instead of re-running the whole prefix
                every step, both give the same tokens; ``generator`` for sampling; ``compile``,
                with the cache run each step as one compiled graph of this model's forward
                (see :mod:`attnkit.decoding`; compiled once per batch size and length);
                ``prompt_lookup_num_tokens`` or ``assistant_model`` (a draft decoder,
                ``"int8"`` or ``"int4"``: :meth:`self_draft`) for speculative decoding, same
                tokens or same distribution (:mod:`attnkit.speculative`), with
                ``speculation_stats`` to count the kept proposals.

        Returns:
            ``(B, P + n)`` token ids, prompt included; ``n = max_new_tokens`` unless every row
            ended with an eos token earlier.

        Raises:
            TypeError: If an argument has the wrong type (float ``max_new_tokens``, float
                ``input_ids``, ...) or an option is unknown.
            ValueError: If ``P + max_new_tokens > max_seq_len``, or bad option values.
        """
        return generation.generate(self, input_ids, max_new_tokens, **options)

    def stream(
        self, input_ids: Tensor, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Iterator[Tensor]:
        """Yield each new column of tokens ``(B,)`` as it is chosen.

        Takes the options of :meth:`generate`; stops early when every row has ended.
        """
        return generation.stream(self, input_ids, max_new_tokens, **options)

    def self_draft(self, mode: quantization.Mode) -> TransformerLM:
        """This model with weight-only ``mode`` (``"int8"``/``"int4"``) linears: the draft of
        ``generate(..., assistant_model=mode)``. Built once per mode and kept (not as a
        submodule: no parameters or state-dict entries are added); built again when this
        model's parameters change.

        Raises:
            ValueError: Unknown ``mode``.
        """
        if mode not in quantization.MODES:
            raise ValueError(f"self_draft mode must be one of {quantization.MODES}, got {mode!r}")
        drafts: dict[str, tuple[tuple[int, ...], TransformerLM]]
        drafts = self.__dict__.setdefault("_attnkit_drafts", {})
        versions = tuple(p._version for p in self.parameters())
        kept = drafts.get(mode)
        if kept is not None and kept[0] == versions:
            return kept[1]
        # the kept drafts and a compiled step stay out of the copy
        memo: dict[int, Any] = {id(drafts): {}}
        step = self.__dict__.get("_attnkit_step")
        if step is not None:
            memo[id(step)] = None
        draft = copy.deepcopy(self, memo)
        draft.__dict__.pop("_attnkit_step", None)
        quantization.quantize(draft.eval(), mode)
        for p in draft.parameters():
            p.requires_grad_(False)
        drafts[mode] = (versions, draft)
        return draft

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        quantize: quantization.Mode | None = None,
        dequantize: bool = False,
    ) -> TransformerLM:
        """Load a Hugging Face decoder folder or a llama.cpp ``.gguf`` file, in eval mode.

        Folders: Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3 and GPT-2 (see
        :func:`attnkit.interop.hf.from_pretrained`); ``.gguf``: Llama-architecture files (see
        :mod:`attnkit.interop.gguf`). ``generation_config`` gets the eos/pad/bos ids.

        Args:
            path: Folder with ``config.json`` and safetensors weights, or a ``.gguf`` file.
            dtype: Parameter dtype (default float32); bf16/fp16 load straight into it.
            device: Where the parameters are allocated and the weights streamed to.
            quantize: ``"int8"`` or ``"int4"``: weight-only quantization of the linears and the
                output head (:func:`attnkit.quantize.quantize`). Each linear is quantized as soon
                as its weight is streamed in, so loading peaks near the quantized model's size,
                not the full-precision one's; the other parameters (embedding, norms) take
                ``dtype``.
            dequantize: For a ``.gguf`` file, dequantize its ``Q8_0``, ``Q4_0`` and ``Q4_1``
                matrices; by default they load as they are into
                :class:`attnkit.quantized.BlockLinear` layers (float32 activations: the logits
                of the dequantized model up to float32 summation order).

        Raises:
            FileNotFoundError: Naming missing files.
            ValueError: Unsupported architecture or option, bad or truncated weights, unknown
                ``quantize``.
        """
        if quantize is not None and quantize not in quantization.MODES:
            raise ValueError(f"quantize must be one of {quantization.MODES}, got {quantize!r}")
        replace = None
        if quantize is not None:
            replace = functools.partial(quantization.quantize_linear, mode=quantize)
        lm = hf.from_pretrained(
            path, cls=cls, dtype=dtype, device=device, replace=replace, dequantize=dequantize
        )
        if not isinstance(lm, cls):
            raise TypeError(f"{cls.__name__}.from_pretrained built a {type(lm).__name__}")
        if quantize is not None:
            quantization.quantize(lm, quantize)  # the tied output head
        return lm

    def save_pretrained(self, path: str | Path, *, max_shard_size: int | None = None) -> Path:
        """Write a Hugging Face folder ``transformers`` loads with the same outputs (atomic).

        See :func:`attnkit.interop.hf.save_pretrained`.

        Raises:
            ValueError: Naming the option without a counterpart in Llama/Mistral/Qwen2/GPT-2.
        """
        return hf.save_pretrained(self, path, max_shard_size=max_shard_size)


#: The stack whose decoding step the policy times for ``decoding.compiled_step.*``: four layers
#: of a small Llama checkpoint's shape (D576, 9 query and 3 key/value heads of 64, SwiGLU 1536),
#: prompts of up to :data:`_TIMED_PROMPT` tokens cached in ``max_seq_len`` slots.
_TIMED_STACK = TransformerConfig(
    4096, 576, 4, 9, num_kv_heads=3, ffn_dim=1536, max_seq_len=256, **FAMILIES["llama"]
)
_TIMED_PROMPT = 128


def _timed_steps(dtype: torch.dtype, batch: int) -> dict[str, Any]:
    """One cached decoding step of :data:`_TIMED_STACK` in ``dtype`` for ``batch`` sequences
    (more than one: left-padded prompts of unequal lengths) by its fused call (``"fused"``) and
    by its compiled graph (``"graph"``, compiled here), as ``generate`` runs them; each call
    writes the same slot and returns its logits. These are the candidates of the policy's
    ``decoding.compiled_step.*`` (none where the stack does not fuse here). The global random
    state is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm = decoding.prepare(TransformerLM(_TIMED_STACK).to(dtype).eval(), compiled=True)
    if not lm.fuses_steps():
        return {}
    P, capacity = _TIMED_PROMPT, _TIMED_STACK.max_seq_len
    ids = torch.arange(batch * P).reshape(batch, P) % lm.embedding.num_embeddings
    real = torch.arange(P)[None] >= (torch.arange(batch) * P // (2 * batch))[:, None]
    padded = batch > 1
    mask = torch.ones(batch, capacity, dtype=torch.bool)  # (generate's: every slot past the end)
    mask[:, :P] = real
    positions = generation.positions_from_mask(real)
    token, position = ids[:, -1:], positions[:, -1:] + 1

    def filled() -> list[KVCache]:
        caches = lm.make_kv_caches(batch, capacity)
        with torch.inference_mode():
            lm(ids, real if padded else None, positions=positions, kv_caches=caches)
        return caches

    def step(*args: Any, **kwargs: Any) -> Any:  # (its own code object: compile_for_steps)
        return lm.forward(*args, **kwargs)

    by_call, by_graph, graph = filled(), filled(), decoding.compile_for_steps(step)
    # (generate's compiled steps: every slot attended with a mask, and rotary tables reserved
    # for them, so that no step's positions grow the tables)
    for module in lm.modules():
        if isinstance(module, RotaryEmbedding):
            module.reserve(capacity)
    slot = torch.tensor([P])
    call_mask, graph_mask = (mask[:, : P + 1], mask) if padded else (None, None)

    def fused_step() -> Tensor:
        for cache in by_call:
            cache.length = P
        with torch.inference_mode():
            return lm(token, call_mask, positions=position, kv_caches=by_call, logits_to_keep=1)

    def graph_call() -> Tensor:
        return graph(
            token,
            graph_mask,
            positions=position,
            kv_caches=by_graph,
            cache_position=slot,
            logits_to_keep=1,
        )

    skip = [True]  # (whether the calls check only the guards that tell graphs apart)

    def graph_step() -> Tensor:
        with torch.no_grad():
            if skip[0]:
                try:
                    with decoding.differentiating_guards_only():
                        return graph_call()
                except RuntimeError:  # (dynamo asked to recompile: check every guard from now)
                    skip[0] = False
            return graph_call()

    with torch.no_grad():
        graph_call()  # (compiles, checking every guard, as generate's first compiled step does)
    return {"fused": fused_step, "graph": graph_step}


policy.provide_decoding_steps(_timed_steps)
