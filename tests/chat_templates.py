"""Chat templates for the tests, following the structure of the published Llama 3/3.1, Qwen2,
Qwen3, Gemma 3 and Phi-3 templates (bos handling, default system prompts, ``namespace``,
``raise_exception``, ``tojson``, ``strftime_now``, trimming, ``enable_thinking``), and a folder
writer: one byte-level BPE tokenizer trained here carries every family's special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
LLAMA31_TOOLS = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have these functions:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "system" or message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
PHI3 = """{% for message in messages %}
    {% if message['role'] == 'system' %}
        {{ '<|system|>\n' + message['content'] + '<|end|>\n' }}
    {% elif message['role'] == 'user' %}
        {{ '<|user|>\n' + message['content'] + '<|end|>\n' }}
    {% elif message['role'] == 'assistant' %}
        {{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|assistant|>\n' }}
{% else %}
    {{ eos_token }}
{% endif %}
"""

# family -> (template, bos, eos, end-of-turn ids' tokens in generation_config.json)
FAMILIES: dict[str, tuple[str, str, str, list[str]]] = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["<|end_of_text|>", "<|eot_id|>"]),
    "llama31-tools": (LLAMA31_TOOLS, "<|begin_of_text|>", "<|eot_id|>", ["<|eot_id|>"]),
    "qwen2": (QWEN2, "<|endoftext|>", "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "qwen3": (QWEN3, "<|endoftext|>", "<|im_end|>", ["<|im_end|>"]),
    "gemma3": (GEMMA3, "<bos>", "<eos>", ["<eos>", "<end_of_turn>"]),
    "phi3": (PHI3, "<s>", "<|endoftext|>", ["<|end|>", "<|endoftext|>"]),
}
SPECIALS = sorted(
    {
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<bos>",
        "<eos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<s>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
        "<think>",
        "</think>",
    }
)
CORPUS = [
    "You are a helpful assistant. Explain attention in one sentence.",
    "Attention weighs every token by how well its key matches the query.",
    "Today Date: 01 Dec 2026. The weather is fine, thank you!",
] * 10

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Explain attention in one sentence.  "},
    {"role": "assistant", "content": "<think>\nkeys, queries\n</think>\n\nIt weighs tokens."},
    {"role": "user", "content": "Et en français ? Ça marche ✓"},
]
TOOLS = [{"name": "get_weather", "parameters": {"city": {"type": "string"}}}]


def train_tokenizer() -> Any:
    """A byte-level BPE tokenizer with every family's special tokens."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_chat_folder(
    folder: Path, family: str, *, template_in_config: bool = False, tok: Any = None
) -> Path:
    """A folder with ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``
    and the family's chat template (in ``chat_template.jinja`` unless ``template_in_config``)."""
    template, bos, eos, stops = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    tok = tok or train_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": {"__type": "AddedToken", "content": eos, "special": True},
        "pad_token": eos,
    }
    if template_in_config:
        config["chat_template"] = template
    else:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tok.token_to_id(t) for t in stops]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder
