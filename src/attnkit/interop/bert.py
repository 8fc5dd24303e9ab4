"""A BERT encoder on attnkit's blocks, and the loader of Hugging Face BERT weights into it.

BERT (Devlin et al. 2018) is the blog's post-norm block (attnkit's ``TransformerLayer``) stacked
over an embedding of word + learned absolute position + token type, followed by a LayerNorm.
Hugging Face checkpoints keep separate query/key/value projections; :func:`bert_state_dict`
concatenates them into the fused ``attention.qkv_proj`` (rows ``[q | k | v]``) that attnkit's
block uses.

Texts of different lengths can run without padding: :class:`PackedBatch` stores their tokens back
to back, every token-wise layer (projections, feed-forward, norms) sees only real tokens, and
attention runs per group of similar lengths (:meth:`PackedBatch.attend`), each group padded only
to its own longest text. :meth:`BertEncoder.forward_packed` is that path; the padded
:meth:`BertEncoder.forward` stays for attention weights and padded inputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from attnkit import functional as F_attn
from attnkit.attention import MultiHeadAttention
from attnkit.blocks import TransformerLayer
from attnkit.config import FAMILIES, TransformerConfig, check_sizes

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "BertLayer",
    "PackedBatch",
    "bert_state_dict",
]

#: A packed batch's texts (longest first) share one attention call while the longest of the group
#: is at most this factor longer than the shortest; a shorter text opens the next group. Each group
#: pads to its own longest text, so a text's attention costs at most ratio^2 times its real work.
#: 2 keeps the call count low at a small padding cost (``python -m attnkit.bench.sentence --sweep``
#: measures other ratios).
GROUP_RATIO = 2.0

# Hugging Face config.json key -> TransformerConfig field, for the sizes every BERT config has.
_SIZES = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "ffn_dim",
}


@dataclass(frozen=True)
class BertConfig:
    """A BERT encoder: its stack as a :class:`attnkit.TransformerConfig` plus BERT's embedding
    extras.

    Build it from a Hugging Face ``config.json`` with :meth:`from_json` / :meth:`from_hf`; the
    stack is then of the ``"bert"`` family of :data:`attnkit.config.FAMILIES` (post-norm
    LayerNorm blocks, learned positions, exact GELU or ReLU).

    Attributes:
        model: The stack: vocabulary, sizes, positions (``max_seq_len``), norm eps, activation.
        type_vocab_size: Token types (segments) of the embedding.
        pad_token_id: The padding token, whose embedding row gets no gradient.

    Raises:
        ValueError: If ``model`` is not a post-norm, non-causal LayerNorm stack with learned
            positions and a vocabulary, or a size is out of range.
    """

    model: TransformerConfig
    type_vocab_size: int = 2
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        m = self.model
        layout = {k: FAMILIES["bert"][k] for k in ("position", "causal", "norm_first")}
        layout["norm"] = "layernorm"
        got = {k: getattr(m, k) for k in layout}
        if got != layout:
            raise ValueError(f"a BERT stack needs {layout}, got {got}")
        if m.vocab_size is None:
            raise ValueError("a BERT stack needs a vocab_size")
        check_sizes({"type_vocab_size": self.type_vocab_size})
        if not 0 <= self.pad_token_id < m.vocab_size:
            raise ValueError(
                f"pad_token_id must be in [0, vocab_size={m.vocab_size}), got {self.pad_token_id}"
            )

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> BertConfig:
        """Map a Hugging Face BERT ``config.json`` dict.

        Raises:
            ValueError: If the model is not a BERT with absolute positions, uses an activation
                other than exact gelu/relu, or lacks a size.
        """
        model_type = data.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"expected model_type 'bert', got {model_type!r}")
        positions = data.get("position_embedding_type", "absolute")
        if positions != "absolute":
            raise ValueError(f"only absolute position embeddings are supported, got {positions!r}")
        act = data.get("hidden_act", "gelu")
        if act not in ("gelu", "relu"):
            raise ValueError(f"hidden_act must be one of ['gelu', 'relu'], got {act!r}")
        missing = [k for k in _SIZES if data.get(k) is None]
        if missing:
            raise ValueError(f"the BERT config lacks the sizes {missing}")
        model = TransformerConfig(
            **{field: data[key] for key, field in _SIZES.items()},
            max_seq_len=data.get("max_position_embeddings") or 512,
            **(FAMILIES["bert"] | {"activation": act, "eps": data.get("layer_norm_eps") or 1e-12}),
        )
        extras = {
            k: data[k] for k in ("type_vocab_size", "pad_token_id") if data.get(k) is not None
        }
        return cls(model, **extras)

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read a Hugging Face BERT ``config.json`` (see :meth:`from_hf`).

        Raises:
            ValueError: As :meth:`from_hf`, naming the file.
        """
        data: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        try:
            return cls.from_hf(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


@dataclass(frozen=True, eq=False)
class _Group:
    """Consecutive texts of a packed batch that share one padded attention call."""

    start: int  # first packed row of the group
    stop: int  # one past its last packed row
    count: int  # n texts
    width: int  # S: the group's longest text
    rows: Tensor | None  # (n * S,) packed row of each padded slot; None: no padding, rows in order
    real: Tensor | None  # (n, S) bool, True at real tokens; None: no padding


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Where the tokens of ``B`` texts lie when stored back to back, without padding.

    Text ``b`` holds packed rows ``offsets[b] : offsets[b] + lengths[b]``. Build it with
    :meth:`from_lengths`; :meth:`attend` runs self-attention within each text and :meth:`mean`
    mean-pools each text.

    Attributes:
        lengths: Tokens of each text, shape ``(B,)``.
        offsets: First packed row of each text, shape ``(B,)``.
        segments: Text of each packed row, shape ``(N,)``.
        positions: Position of each packed row within its text, shape ``(N,)``.
        max_length: The longest text.
        groups: The attention calls: consecutive texts of similar lengths.
    """

    lengths: Tensor
    offsets: Tensor
    segments: Tensor
    positions: Tensor
    max_length: int
    groups: tuple[_Group, ...]

    @property
    def num_tokens(self) -> int:
        """``N``: real tokens in the batch."""
        return int(self.segments.shape[0])

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int],
        *,
        device: torch.device | str | None = None,
        group_ratio: float | None = None,
    ) -> PackedBatch:
        """The layout of texts with these token counts, in this order.

        Texts are grouped in order: a group grows while its longest text is at most
        ``group_ratio`` times its shortest; sorting the texts longest first (as
        :meth:`attnkit.interop.SentenceEncoder.encode` does) makes the groups tight.

        Args:
            lengths: Tokens of each text (each at least 1).
            device: Device of the index tensors.
            group_ratio: At least 1 (default :data:`GROUP_RATIO`); ``float("inf")`` puts all
                texts in one attention call.

        Returns:
            The layout.

        Raises:
            ValueError: If ``lengths`` is empty or holds a count below 1, or ``group_ratio < 1``.
        """
        lens = [int(n) for n in lengths]
        if not lens:
            raise ValueError("a packed batch needs at least one text, got no lengths")
        bad = [n for n in lens if n < 1]
        if bad:
            raise ValueError(f"every text needs at least one token, got lengths {bad}")
        group_ratio = GROUP_RATIO if group_ratio is None else group_ratio
        if not group_ratio >= 1.0:
            raise ValueError(f"group_ratio must be >= 1, got {group_ratio}")
        offsets = [0]
        for n in lens[:-1]:
            offsets.append(offsets[-1] + n)
        groups, first = [], 0
        longest = shortest = lens[0]
        for b in range(1, len(lens) + 1):
            if b < len(lens):
                hi, lo = max(longest, lens[b]), min(shortest, lens[b])
                if hi <= group_ratio * lo:
                    longest, shortest = hi, lo
                    continue
            groups.append(_group(lens[first:b], offsets[first], longest, device))
            if b < len(lens):
                first, longest, shortest = b, lens[b], lens[b]
        lengths_t = torch.tensor(lens, device=device)  # (B,)
        offsets_t = torch.tensor(offsets, device=device)  # (B,)
        segments = torch.repeat_interleave(torch.arange(len(lens), device=device), lengths_t)
        positions = torch.arange(segments.shape[0], device=device) - offsets_t[segments]  # (N,)
        return cls(lengths_t, offsets_t, segments, positions, max(lens), tuple(groups))

    def attend(self, qkv: Tensor, *, num_heads: int, scale: float | None = None) -> Tensor:
        """Self-attention of every text over its own tokens, from fused projections.

        Each group of texts is gathered into one padded ``(n, H, S, E)`` batch (a padding slot
        repeats a real row and is masked as a key; its output row is dropped) and handed to
        :func:`attnkit.functional.scaled_dot_product_attention`.

        Args:
            qkv: Packed ``[q | k | v]`` projections of the tokens.
            num_heads: Heads ``H`` (queries and keys alike).
            scale: Score multiplier; defaults to ``1 / sqrt(E)``.

        Returns:
            The attention output of every token, heads merged, in packed order.

        Shape:
            qkv ``(N, 3 * H * E)`` -> ``(N, H * E)``.

        Raises:
            ValueError: If ``qkv`` does not have ``N`` rows of ``3 * H * E`` columns.
        """
        if qkv.dim() != 2 or qkv.shape[0] != self.num_tokens or qkv.shape[1] % (3 * num_heads):
            raise ValueError(
                f"qkv must have shape (N={self.num_tokens}, 3 * num_heads * E) with "
                f"num_heads={num_heads}, got {tuple(qkv.shape)}"
            )
        E = qkv.shape[1] // (3 * num_heads)
        outs = []
        for g in self.groups:
            slots = qkv[g.start : g.stop] if g.rows is None else qkv[g.rows]  # (n * S, 3*H*E)
            q, k, v = slots.view(g.count, g.width, 3, num_heads, E).permute(2, 0, 3, 1, 4)
            mask = None if g.real is None else g.real[:, None, None, :]  # (n, 1, 1, S)
            out = F_attn.scaled_dot_product_attention(q, k, v, mask, scale=scale)  # (n, H, S, E)
            out = out.transpose(1, 2)  # (n, S, H, E)
            out = out.flatten(0, 1) if g.real is None else out[g.real]  # (tokens, H, E)
            outs.append(out.flatten(1))  # (tokens, H*E)
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # (N, H*E)

    def mean(self, x: Tensor) -> Tensor:
        """Mean of each text's rows.

        Shape:
            x ``(N, D)`` -> ``(B, D)``.
        """
        sums = x.new_zeros(self.lengths.shape[0], x.shape[-1]).index_add_(0, self.segments, x)
        return sums / self.lengths.to(x.dtype)[:, None]  # (B, D)


def _group(lens: list[int], start: int, width: int, device: torch.device | str | None) -> _Group:
    """The padded attention call of consecutive texts with ``lens`` tokens from row ``start``."""
    stop = start + sum(lens)
    if all(n == width for n in lens):
        return _Group(start, stop, len(lens), width, None, None)
    lengths = torch.tensor(lens, device=device)[:, None]  # (n, 1)
    slot = torch.arange(width, device=device)[None, :]  # (1, S)
    first = torch.cumsum(lengths, 0) - lengths + start  # (n, 1): each text's first row
    rows = (first + torch.minimum(slot, lengths - 1)).flatten()  # (n * S,)
    return _Group(start, stop, len(lens), width, rows, slot < lengths)


class BertEmbeddings(nn.Module):
    """``LayerNorm(word(ids) + token_type(types) + position(arange(L)))``.

    Args:
        config: Sizes.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        m = config.model
        V, D = cast(int, m.vocab_size), m.dim
        self.word_embeddings = nn.Embedding(V, D, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(m.max_seq_len, D)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, D)
        self.norm = nn.LayerNorm(D, eps=m.eps)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Embed tokens.

        Args:
            input_ids: Token ids.
            token_type_ids: Segment ids (defaults to zeros).
            positions: Position of each token (defaults to ``arange(L)``); packed texts pass
                each token's position within its own text.

        Returns:
            The normalized sum of the three embeddings.

        Shape:
            input_ids, token_type_ids ``(..., L)``, positions ``(L,)`` or ``(..., L)`` ->
            ``(..., L, D)``.

        Raises:
            ValueError: If ``L`` (without ``positions``) exceeds the number of learned positions.
        """
        if positions is None:
            length, n_positions = input_ids.shape[-1], self.position_embeddings.num_embeddings
            if length > n_positions:
                raise ValueError(
                    f"sequence of {length} tokens exceeds the {n_positions} learned positions"
                )
            positions = torch.arange(length, device=input_ids.device)  # (L,)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)  # (..., L, D)
        return self.norm(x)


class BertLayer(TransformerLayer):
    """One BERT layer: attnkit's post-norm :class:`attnkit.blocks.TransformerLayer` with BERT's
    sizes.

    Its ``forward`` is the block's (padded batches, masks, attention weights);
    :meth:`forward_packed` runs the same layer on a :class:`PackedBatch`. Build it with
    ``BertLayer.from_config(bert_config.model)``.
    """

    attention: MultiHeadAttention

    def forward_packed(self, x: Tensor, batch: PackedBatch) -> Tensor:
        """The layer on packed tokens: each text attends over its own tokens, then the post-norm
        residual steps of :meth:`attnkit.blocks.TransformerLayer.forward` (BERT's blocks have no
        dropout).

        Args:
            x: Hidden states of the packed tokens.
            batch: Where each text lies.

        Returns:
            The layer's output for every token, in packed order.

        Shape:
            x ``(N, D)`` -> ``(N, D)``.
        """
        attn = self.attention
        mixed = batch.attend(attn.qkv_proj(x), num_heads=attn.num_heads, scale=attn.scale)  # (N, D)
        x = self.norm1(x + attn.out_proj(mixed))
        return self.norm2(x + self.feed_forward(x))


class BertEncoder(nn.Module):
    """BERT: embeddings, then ``config.model.num_layers`` post-norm attnkit ``TransformerLayer`` s.

    Args:
        config: Sizes.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(
            BertLayer.from_config(config.model) for _ in range(config.model.num_layers)
        )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Contextual token embeddings.

        Args:
            input_ids: Token ids.
            attention_mask: Which tokens are real (``1``/``True``) rather than padding.
            token_type_ids: Segment ids (defaults to zeros).
            return_weights: Also return every layer's attention weights.

        Returns:
            ``hidden`` of shape ``(B, L, D)``, or ``(hidden, weights)`` with weights of shape
            ``(layers, B, H, L, L)``.

        Shape:
            input_ids, attention_mask, token_type_ids ``(B, L)`` -> ``(B, L, D)``.
        """
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):  # no padding: no mask
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L): padded keys are hidden
        x = self.embeddings(input_ids, token_type_ids)  # (B, L, D)
        weights = []
        for layer in self.layers:
            x, w = layer(x, mask, return_weights=return_weights)  # w (B, H, L, L) or None
            if w is not None:
                weights.append(w)
        stacked = torch.stack(weights) if weights else None  # (layers, B, H, L, L)
        return x if stacked is None else (x, stacked)  # (B, L, D)

    def forward_packed(
        self, input_ids: Tensor, batch: PackedBatch, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Contextual token embeddings of texts packed back to back, without padding.

        Equal to :meth:`forward` on the same texts padded (at the real tokens), at the cost of
        the real tokens only.

        Args:
            input_ids: Token ids of all texts, concatenated.
            batch: Where each text lies (:meth:`PackedBatch.from_lengths`).
            token_type_ids: Segment ids (defaults to zeros).

        Returns:
            The hidden state of every token, in packed order.

        Shape:
            input_ids, token_type_ids ``(N,)`` -> ``(N, D)``.

        Raises:
            ValueError: If ``input_ids`` does not hold ``N`` ids, or a text is longer than the
                learned positions.
        """
        if input_ids.shape != (batch.num_tokens,):
            raise ValueError(
                f"input_ids must have shape ({batch.num_tokens},) for this packed batch, "
                f"got {tuple(input_ids.shape)}"
            )
        limit = self.config.model.max_seq_len
        if batch.max_length > limit:
            raise ValueError(
                f"a text of {batch.max_length} tokens exceeds the {limit} learned positions"
            )
        x = self.embeddings(input_ids, token_type_ids, batch.positions)  # (N, D)
        for layer in self.layers:
            x = cast(BertLayer, layer).forward_packed(x, batch)
        return x


def bert_state_dict(hf: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Rename a Hugging Face ``BertModel`` state dict to :class:`BertEncoder`'s names.

    The separate ``query``/``key``/``value`` projections are concatenated into the fused
    ``attention.qkv_proj`` (rows ``[q | k | v]``). The pooler and ``position_ids`` are dropped,
    and a ``bert.`` prefix (task-head checkpoints) is stripped.

    Args:
        hf: The checkpoint tensors.
        num_layers: Layers to convert.

    Returns:
        A state dict for ``BertEncoder.load_state_dict(..., strict=True)``.

    Raises:
        KeyError: Naming the first tensor the checkpoint lacks.
    """
    hf = {k.removeprefix("bert."): v for k, v in hf.items()}

    def take(key: str) -> Tensor:
        if key not in hf:
            raise KeyError(f"the checkpoint has no tensor {key!r}")
        return hf[key]

    out = {
        "embeddings.word_embeddings.weight": take("embeddings.word_embeddings.weight"),
        "embeddings.position_embeddings.weight": take("embeddings.position_embeddings.weight"),
        "embeddings.token_type_embeddings.weight": take("embeddings.token_type_embeddings.weight"),
        "embeddings.norm.weight": take("embeddings.LayerNorm.weight"),
        "embeddings.norm.bias": take("embeddings.LayerNorm.bias"),
    }
    for i in range(num_layers):
        src, dst = f"encoder.layer.{i}.", f"layers.{i}."
        for p in ("weight", "bias"):
            out[dst + f"attention.qkv_proj.{p}"] = torch.cat(
                [take(src + f"attention.self.{name}.{p}") for name in ("query", "key", "value")]
            )  # (3 * D, D) or (3 * D,)
            out[dst + f"attention.out_proj.{p}"] = take(src + f"attention.output.dense.{p}")
            out[dst + f"norm1.{p}"] = take(src + f"attention.output.LayerNorm.{p}")
            out[dst + f"feed_forward.linear1.{p}"] = take(src + f"intermediate.dense.{p}")
            out[dst + f"feed_forward.linear2.{p}"] = take(src + f"output.dense.{p}")
            out[dst + f"norm2.{p}"] = take(src + f"output.LayerNorm.{p}")
    return out
