"""Chat templates rendered by attnkit against transformers' ``apply_chat_template`` (the
templates of :mod:`tests.chat_templates`), the sandbox, and ``attnkit chat``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnkit import TransformerLM
from attnkit.chat import ChatTemplateError, ChatTokenizer, format_chat
from attnkit.cli import main
from tests.chat_templates import (
    CONVERSATION,
    FAMILIES,
    PHI3,
    QWEN2,
    TOOLS,
    train_tokenizer,
    write_chat_folder,
)

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


@pytest.fixture(scope="module")
def shared_tokenizer() -> Any:
    return train_tokenizer()


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


# --------------------------------------------------------------------------------------------
# attnkit chat
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory, shared_tokenizer: Any) -> Path:
    """A tiny random Llama with the Qwen2 chat template."""
    pytest.importorskip("transformers")
    from tests.helpers import build_hf

    path = tmp_path_factory.mktemp("chat-model")
    vocab = shared_tokenizer.get_vocab_size()
    build_hf("llama-gqa-untied", path, seed=4, vocab_size=vocab, max_position_embeddings=256)
    return write_chat_folder(path, "qwen2", tok=shared_tokenizer)


def _reply(folder: Path, history: list[dict[str, str]], new: int) -> str:
    """The greedy reply to ``history``, by the Python API."""
    chat = ChatTokenizer.from_folder(folder)
    lm = TransformerLM.from_pretrained(folder)
    ids = chat.encode(history)
    out = lm.generate(torch.tensor([ids]), new, eos_token_id=list(chat.stop_ids))
    return chat.decode(out[0, len(ids) :].tolist())


def _chat(
    folder: Path, lines: str, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, str, str]:
    import io

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stdin", io.StringIO(lines))
        code = main(["chat", "--model", str(folder), "--max-new-tokens", "6", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_keeps_history_resets_and_exits(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = "Explain attention.\n\n/reset\nExplain attention.\nAnd then?\n/exit\nnever read\n"
    code, out, err = _chat(chat_model, lines, capsys, "--system", "Be brief.")
    assert code == 0, err
    first, again, then = out.split("\n")[:3]
    system = {"role": "system", "content": "Be brief."}
    history = [system, {"role": "user", "content": "Explain attention."}]
    assert first == again == _reply(chat_model, history, 6)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    assert then == _reply(chat_model, history, 6)
    assert out.count("\n") == 3
    assert "reset" in err and err.count("tokens/s") == 3


def test_chat_with_a_self_draft_writes_the_same_replies(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = "Explain attention.\nAnd then?\n"
    code, plain, err = _chat(chat_model, lines, capsys, "--quiet")
    assert code == 0, err
    code, out, err = _chat(chat_model, lines, capsys, "--draft", "int8")
    assert code == 0, err
    assert out == plain and err.count("proposed tokens kept") == 2


def test_ctrl_c_stops_a_reply_not_the_chat(
    chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnkit.commands import generate

    real = generate.Session.stream
    calls: list[int] = []

    def interrupted(self: Any, prompt_ids: list[int], args: Any) -> Any:
        calls.append(len(prompt_ids))
        for i, token in enumerate(real(self, prompt_ids, args)):
            if len(calls) == 1 and i == 2:
                raise KeyboardInterrupt
            yield token

    monkeypatch.setattr(generate.Session, "stream", interrupted)
    code, out, err = _chat(chat_model, "Explain attention.\nAnd then?\n", capsys, "--quiet")
    assert code == 0, err
    shown, then = out.split("\n")[:2]
    history = [{"role": "user", "content": "Explain attention."}]
    full, kept = _reply(chat_model, history, 6), _reply(chat_model, history, 2)
    assert full.startswith(kept) and kept.startswith(shown) and len(kept) < len(full)
    assert "[stopped]" in err
    history += [{"role": "assistant", "content": kept}, {"role": "user", "content": "And then?"}]
    assert then == _reply(chat_model, history, 6)


def test_chat_drops_the_oldest_turns_to_fit(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = "Ça marche ✓ " * 6  # about 80 tokens: three turns do not fit in 256
    code, out, err = _chat(chat_model, f"{long}\n{long}\n{long}\n", capsys, "--quiet")
    assert code == 0, err
    assert out.count("\n") == 3 and "oldest turn was dropped" in err
    code, out, err = _chat(chat_model, " ".join([long] * 4) + "\n", capsys, "--quiet")
    assert code == 0 and out == "" and "has no room" in err
