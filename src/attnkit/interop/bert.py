"""A BERT encoder on attnkit's blocks, and the loader of Hugging Face BERT weights into it.

BERT (Devlin et al. 2018) is the blog's post-norm :class:`TransformerBlock` stacked over an
embedding of word + learned absolute position + token type, followed by a LayerNorm. Hugging Face
checkpoints keep separate query/key/value projections; :func:`bert_state_dict` concatenates them
into the fused ``attention.w_qkv`` (rows ``[q | k | v]``) that attnkit's block uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.blocks import Activation, TransformerBlock

__all__ = ["BertConfig", "BertEmbeddings", "BertEncoder", "bert_state_dict"]

_ACTIVATIONS: dict[str, Activation] = {"gelu": "gelu", "relu": "relu"}


@dataclass(frozen=True)
class BertConfig:
    """The sizes of a BERT encoder (the fields of Hugging Face's ``config.json`` that matter)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got {self.hidden_act!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read a Hugging Face BERT ``config.json``.

        Raises:
            ValueError: If the model is not a BERT with absolute positions, or an activation
                other than exact gelu/relu.
        """
        raw: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        model_type = raw.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"{path}: expected model_type 'bert', got {model_type!r}")
        positions = raw.get("position_embedding_type", "absolute")
        if positions != "absolute":
            raise ValueError(
                f"{path}: only absolute position embeddings are supported, got {positions!r}"
            )
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in raw.items() if k in fields and v is not None})


class BertEmbeddings(nn.Module):
    """``LayerNorm(word(ids) + token_type(types) + position(arange(L)))``.

    Args:
        config: Sizes.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, D, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, D)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, D)
        self.norm = nn.LayerNorm(D, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Shape: input_ids ``(B, L)``, token_type_ids ``(B, L)`` -> ``(B, L, D)``.

        Raises:
            ValueError: If ``L`` exceeds the number of learned positions.
        """
        length, n_positions = input_ids.shape[-1], self.position_embeddings.num_embeddings
        if length > n_positions:
            raise ValueError(
                f"sequence of {length} tokens exceeds the {n_positions} learned positions"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(length, device=input_ids.device)  # (L,)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)  # (B, L, D)
        return self.norm(x)


def _block(config: BertConfig) -> TransformerBlock:
    return TransformerBlock(
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        norm_first=False,
        norm="layernorm",
        activation=_ACTIVATIONS[config.hidden_act],
        eps=config.layer_norm_eps,
    )


class BertEncoder(nn.Module):
    """BERT: embeddings, then ``num_hidden_layers`` post-norm attnkit ``TransformerBlock`` s.

    Args:
        config: Sizes.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(_block(config) for _ in range(config.num_hidden_layers))

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
        if not return_weights:
            for layer in self.layers:
                x = layer(x, mask)
            return x
        weights = []
        for layer in self.layers:
            x, w = layer(x, mask, return_weights=True)  # w (B, H, L, L)
            weights.append(w)
        return x, torch.stack(weights)  # (B, L, D), (layers, B, H, L, L)


def bert_state_dict(hf: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Rename a Hugging Face ``BertModel`` state dict to :class:`BertEncoder`'s names.

    The separate ``query``/``key``/``value`` projections are concatenated into the fused
    ``attention.w_qkv`` (rows ``[q | k | v]``). The pooler and ``position_ids`` are dropped, and a
    ``bert.`` prefix (task-head checkpoints) is stripped.

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
            out[dst + f"attention.w_qkv.{p}"] = torch.cat(
                [take(src + f"attention.self.{name}.{p}") for name in ("query", "key", "value")]
            )  # (3 * D, D) or (3 * D,)
            out[dst + f"attention.output_map.{p}"] = take(src + f"attention.output.dense.{p}")
            out[dst + f"norm1.{p}"] = take(src + f"attention.output.LayerNorm.{p}")
            out[dst + f"feed_forward.linear1.{p}"] = take(src + f"intermediate.dense.{p}")
            out[dst + f"feed_forward.linear2.{p}"] = take(src + f"output.dense.{p}")
            out[dst + f"norm2.{p}"] = take(src + f"output.LayerNorm.{p}")
    return out
