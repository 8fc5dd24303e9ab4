"""Chat templates rendered by attnkit against transformers' ``apply_chat_template``.

The templates below follow the structure of the published Llama 3/3.1, Qwen2, Qwen3, Gemma 3
and Phi-3 templates (bos handling, default system prompts, ``namespace``, ``raise_exception``,
``tojson``, ``strftime_now``, trimming and ``enable_thinking``); one byte-level BPE tokenizer
trained here carries every family's special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attnkit.chat import ChatTemplateError, ChatTokenizer, format_chat

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

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


def _tokenizer() -> Any:
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
    tok = tok or _tokenizer()
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


@pytest.fixture(scope="module")
def shared_tokenizer() -> Any:
    return _tokenizer()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_folder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, shared_tokenizer: Any
) -> tuple[str, Path]:
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    return family, write_chat_folder(folder, family, tok=shared_tokenizer)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_token_ids_equal_transformers(
    family_folder: tuple[str, Path], add_generation_prompt: bool
) -> None:
    transformers = pytest.importorskip("transformers")
    family, folder = family_folder
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    extra: dict[str, Any] = {"tools": TOOLS} if family == "llama31-tools" else {}
    for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[1:]):
        want = ref.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **extra,
        )
        text = ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        options = extra | {"add_generation_prompt": add_generation_prompt}
        assert format_chat(folder, messages, **options) == list(want), family
        assert format_chat(folder, messages, tokenize=False, **options) == text, family


def test_template_variables_reach_the_template(tmp_path: Path, shared_tokenizer: Any) -> None:
    """Qwen3's ``enable_thinking=False`` writes an empty think block, as transformers does."""
    transformers = pytest.importorskip("transformers")
    folder = write_chat_folder(tmp_path, "qwen3", tok=shared_tokenizer)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATION[:2]
    want = ref.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    got = format_chat(folder, messages, enable_thinking=False)
    assert got == list(want)
    assert got != format_chat(folder, messages)


def test_stop_ids_from_generation_config(family_folder: tuple[str, Path]) -> None:
    family, folder = family_folder
    tok = ChatTokenizer.from_folder(folder)
    names = FAMILIES[family][3]
    assert [tok.tokenizer.id_to_token(i) for i in tok.stop_ids] == names


def test_template_in_tokenizer_config_and_named_list(tmp_path: Path, shared_tokenizer: Any) -> None:
    folder = write_chat_folder(
        tmp_path / "cfg", "qwen2", template_in_config=True, tok=shared_tokenizer
    )
    jinja = write_chat_folder(tmp_path / "jinja", "qwen2", tok=shared_tokenizer)
    assert format_chat(folder, CONVERSATION) == format_chat(jinja, CONVERSATION)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ raise_exception('wrong one') }}"},
        {"name": "default", "template": QWEN2},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert format_chat(folder, CONVERSATION) == format_chat(jinja, CONVERSATION)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers 5
    (folder / "chat_template.jinja").write_text(PHI3)
    assert "<|user|>" in str(format_chat(folder, CONVERSATION, tokenize=False))


def test_gemma_raise_exception_is_a_clear_error(tmp_path: Path, shared_tokenizer: Any) -> None:
    folder = write_chat_folder(tmp_path / "g", "gemma3", tok=shared_tokenizer)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja.*must alternate"):
        format_chat(folder, bad)


HOSTILE = {
    "mro": "{{ ''.__class__.__mro__ }}",
    "globals": "{{ cycler.__init__.__globals__ }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "namespace": "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "mutate": "{% set _ = messages.append({'role': 'x'}) %}{{ messages|length }}",
    "format": "{{ '{0.__class__}'.format(messages) }}",
    "dict-class": "{{ dict.__class__ }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_are_refused(name: str, tmp_path: Path, shared_tokenizer: Any) -> None:
    folder = write_chat_folder(tmp_path / name, "qwen2", tok=shared_tokenizer)
    (folder / "chat_template.jinja").write_text(HOSTILE[name])
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja.*(unsafe|internals|cannot)"):
        format_chat(folder, CONVERSATION)


def test_bad_inputs_are_named(tmp_path: Path, shared_tokenizer: Any) -> None:
    folder = write_chat_folder(tmp_path / "q", "qwen2", tok=shared_tokenizer)
    with pytest.raises(ValueError, match="empty"):
        format_chat(folder, [])
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        format_chat(folder, [{"content": "no role"}])
    with pytest.raises(TypeError, match="list of dicts"):
        format_chat(folder, "hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="object values"):
        format_chat(folder, [{"role": "user", "content": object()}])
    (folder / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        format_chat(folder, CONVERSATION)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        format_chat(folder, CONVERSATION)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        format_chat(tmp_path / "nowhere", CONVERSATION)
