"""Fixtures shared by several test modules: tiny Hugging Face checkpoints, model options.

Test modules import shared data and builders from here, never from one another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: TransformerConfig options of a Llama-shaped attnkit model (RMSNorm, SwiGLU, half-split
#: rotary, no biases, grouped-query attention with 2 key/value heads).
LLAMA_OPTIONS: dict[str, Any] = {
    "norm": "rmsnorm",
    "activation": "swiglu",
    "bias": False,
    "rope_interleaved": False,
    "num_kv_heads": 2,
}

#: Llama 3.1 rotary scaling for a model trained on 64 positions.
ROPE_LLAMA3: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# --------------------------------------------------------------------------------------------
# tiny Hugging Face checkpoints (transformers config keyword arguments)

VOCAB = 61

LLAMA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
GPT2: dict[str, Any] = {
    "vocab_size": VOCAB,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 8,
}

# id -> (config class name, options): every architecture and option of the issue.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-untied": ("LlamaConfig", LLAMA | {"num_key_value_heads": 2}),
    "llama-tied-linear": (
        "LlamaConfig",
        LLAMA
        | {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "llama-llama3-headdim-bias": (
        "LlamaConfig",
        LLAMA
        | {
            "rope_scaling": LLAMA3,
            "head_dim": 12,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_theta": 500.0,
        },
    ),
    "mistral-window": ("MistralConfig", LLAMA | {"sliding_window": 3, "num_key_value_heads": 2}),
    "qwen2-bias": ("Qwen2Config", LLAMA | {"num_key_value_heads": 2}),
    "qwen2-sliding": (
        "Qwen2Config",
        LLAMA | {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0},
    ),
    "qwen2-mixed-layers": (
        "Qwen2Config",
        LLAMA
        | {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 3}
        | {"max_window_layers": 1},
    ),
    "qwen3-qknorm-headdim": ("Qwen3Config", LLAMA | {"num_key_value_heads": 2, "head_dim": 12}),
    "qwen3-mixed-bias": (
        "Qwen3Config",
        LLAMA
        | {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}
        | {"attention_bias": True},
    ),
    "phi3-fused": ("Phi3Config", LLAMA | {"num_key_value_heads": 2, "pad_token_id": 0}),
    "gemma2-softcap-alternating": (
        "Gemma2Config",
        LLAMA
        | {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3}
        | {"attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0}
        | {"query_pre_attn_scalar": 12},
    ),
    "gemma3-qknorm-local-rope": (
        "Gemma3TextConfig",
        LLAMA
        | {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3}
        | {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
        | {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 100_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            }
        },
    ),
    "gpt2": ("GPT2Config", GPT2),
    "gpt2-untied-relu": (
        "GPT2Config",
        GPT2 | {"tie_word_embeddings": False, "activation_function": "relu", "n_inner": 40},
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that a wrong mapping changes the logits and greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or ".ln_" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * noise)
            else:
                p.copy_(0.3 * noise)


def build_hf(kind: str, folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """Save a tiny random ``transformers`` model of case ``kind`` (config ``overrides``
    applied) to ``folder``; return it."""
    cls_name, options = CASES[kind]
    import transformers  # a test-only dependency; callers skip without it

    config = getattr(transformers, cls_name)(**(options | overrides))
    config.eos_token_id, config.bos_token_id, config.pad_token_id = 2, 1, 0
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder)
    return model


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of lengths 10, 7 and 2 (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :8] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_greedy(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, **options: Any
) -> torch.Tensor:
    """transformers' greedy ``generate`` on a left-padded batch (pad id 0)."""
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **options,
    )


def int8_dot_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 product of the rows of ``x`` as the ``"attnkit"`` kernel rounds them (int8 per
    block of 32 inputs, the block's largest magnitude to 127, in float32 as the kernel does) and
    the weight ``codes * scale``: the integer sums are exact."""
    blocks = x.float().unflatten(-1, (-1, 32))
    top = blocks.abs().amax(-1, keepdim=True)
    q = torch.where(top > 0, blocks / top * 127, torch.zeros_like(blocks)).round()  # (to even)
    rows = (q.double() * (top / 127).double()).flatten(-2)
    return rows @ (codes.double() * scale.double()[:, None]).T
