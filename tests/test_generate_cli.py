"""``attnkit generate`` on a tiny GPT-2 folder with a BPE tokenizer trained here."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from attnkit import TransformerLM
from attnkit.chat import ChatTokenizer
from attnkit.cli import main
from tests.chat_templates import write_chat_folder
from tests.helpers import build_hf

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "attention is all you need, said the paper about attention",
    "a small model generates a few tokens after the prompt",
] * 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("gpt2-tok")
    build_hf("gpt2", path, seed=5, vocab_size=tok.get_vocab_size())
    tok.save(str(path / "tokenizer.json"))
    return path


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_streams_prompt_then_greedy_continuation(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = "the cat sat on"
    code, out, err = _run(
        ["--model", str(folder), "--prompt", prompt, "--max-new-tokens", "6"], capsys
    )
    assert code == 0, err
    lm = TransformerLM.from_pretrained(folder)
    ids = torch.tensor([tok.encode(prompt).ids])
    expected = lm.generate(ids, 6)[0].tolist()  # eos of the folder (2) applies too
    assert out == tok.decode(expected, skip_special_tokens=True) + "\n"
    assert out.startswith(prompt) and len(out) > len(prompt) + 1


def test_compile_gives_the_eager_text(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(folder), "--prompt", "the cat sat on", "--max-new-tokens", "5"]
    code, eager, err = _run([*args, "--quiet"], capsys)
    assert code == 0, err
    code, compiled, err = _run([*args, "--compile"], capsys)
    assert code == 0, err
    assert compiled == eager and "tokens/s" in err and "first compiled step" in err


@pytest.mark.slow
def test_prompt_from_stdin_sampling_seed_and_attention(
    folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("attention is\n"))
    args = [
        "--model",
        str(folder),
        "--max-new-tokens",
        "5",
        "--temperature",
        "1.2",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--seed",
        "3",
        "--dtype",
        "bfloat16",
        "--attention",
        str(tmp_path / "att"),
        "--layer",
        "0",
        "-1",
        "--head",
        "1",
    ]
    code, out, err = _run(args, capsys)
    assert code == 0, err
    assert out.startswith("attention is")
    monkeypatch.setattr("sys.stdin", io.StringIO("attention is\n"))
    assert _run(args, capsys)[1] == out  # the seed makes sampling reproducible
    names = {p.name for p in (tmp_path / "att").iterdir()}
    assert {"layer0_head1.png", "layer1_head1.png", "grid.png"} <= names
    explorer = importlib.util.find_spec("attnkit.explorer")
    assert ("explorer.html" in names) == (explorer is not None)
    assert all(str(tmp_path / "att" / n) in err for n in ("grid.png", "layer0_head1.png"))


@pytest.mark.parametrize(
    "draft", [["--prompt-lookup", "4"], ["--draft", "int8"], ["--draft", "SELF"]]
)
def test_speculative_options_give_the_plain_text(
    folder: Path, capsys: pytest.CaptureFixture[str], draft: list[str]
) -> None:
    draft = [str(folder) if d == "SELF" else d for d in draft]  # a draft folder: the model itself
    args = ["--model", str(folder), "--prompt", "the cat sat on the mat and the cat sat"]
    args += ["--max-new-tokens", "12"]
    code, plain, err = _run([*args, "--quiet"], capsys)
    assert code == 0, err
    code, out, err = _run([*args, *draft], capsys)
    assert code == 0, err
    assert out == plain
    assert re.search(r"tokens/s, \d+% of \d+ proposed tokens kept", err), err


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--top-p", "1.5"], "--top-p must be in"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--max-new-tokens", "-2"], "--max-new-tokens"),
        (["--max-new-tokens", "5000"], "max_seq_len"),
        (["--layer", "7", "--attention", "ATT"], "--layer must be in"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt-lookup", "0"], "--prompt-lookup must be >= 1, got 0"),
        (["--prompt-lookup", "3", "--draft", "int8"], "--prompt-lookup (3) or --draft (int8)"),
        (["--draft", "int8", "--compile"], "leave out --compile"),
        (["--draft", "nowhere"], "draft model nowhere does not exist"),
    ],
)
def test_bad_options_are_one_line_with_status_2(
    folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    match: str,
) -> None:
    extra = [str(tmp_path / "att") if e == "ATT" else e for e in extra]
    args = ["--model", str(folder), "--prompt", "the cat", "--max-new-tokens", "2", *extra]
    code, _, err = _run(args, capsys)
    assert code == 2
    assert match in err and len(err.strip().splitlines()) == 1


def test_bad_folders_are_one_line_with_status_2(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases: dict[str, Any] = {"nowhere": "does not exist"}
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((folder / "config.json").read_bytes())
    cases["bare"] = "lacks tokenizer.json"
    for name, match in cases.items():
        code, _, err = _run(["--model", str(tmp_path / name), "--prompt", "x"], capsys)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1
    (bare / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    code, _, err = _run(["--model", str(bare), "--prompt", "x"], capsys)
    assert code == 2 and "model.safetensors" in err


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the Qwen2 chat template and its end-of-turn ids."""
    path = tmp_path_factory.mktemp("llama-chat")
    write_chat_folder(path, "qwen2")
    vocab = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    build_hf("llama-gqa-untied", path, seed=2, vocab_size=vocab, max_position_embeddings=256)
    # build_hf's config.json carries eos 2; the chat's end-of-turn ids come from here
    write_chat_folder(path, "qwen2")
    return path


def _expected_reply(folder: Path, messages: list[dict[str, str]], new: int) -> str:
    chat = ChatTokenizer.from_folder(folder)
    lm = TransformerLM.from_pretrained(folder)
    ids = chat.encode(messages)
    out = lm.generate(torch.tensor([ids]), new, eos_token_id=list(chat.stop_ids))[0, len(ids) :]
    return chat.decode(out.tolist())


def test_chat_formats_the_prompt_and_prints_the_reply(
    chat_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "Explain attention in one sentence."
    args = ["--model", str(chat_folder), "--prompt", prompt, "--max-new-tokens", "12"]
    code, out, err = _run([*args, "--system", "You are terse."], capsys)
    assert code == 0, err
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": prompt},
    ]
    assert out == _expected_reply(chat_folder, messages, 12) + "\n"
    assert re.search(r"\d+ tokens, first after \d+ ms, [\d.]+ tokens/s", err)
    code, out, err = _run([*args, "--chat", "--quiet"], capsys)
    assert code == 0 and err == ""
    assert out == _expected_reply(chat_folder, [{"role": "user", "content": prompt}], 12) + "\n"
    code, spec, err = _run([*args, "--chat", "--prompt-lookup", "3"], capsys)
    assert code == 0 and spec == out and "proposed tokens kept" in err


def test_chat_stops_at_end_of_turn(
    chat_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reply ends at the first token listed in generation_config.json's eos_token_id."""
    folder = tmp_path / "chat"
    shutil.copytree(chat_folder, folder)
    chat = ChatTokenizer.from_folder(folder)
    lm = TransformerLM.from_pretrained(folder)
    ids = chat.encode([{"role": "user", "content": "hi"}])
    first, second = lm.generate(torch.tensor([ids]), 2, eos_token_id=[])[0, len(ids) :].tolist()
    stops = [*chat.stop_ids, second]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    args = ["--model", str(folder), "--prompt", "hi", "--chat", "--max-new-tokens", "8"]
    code, out, err = _run(args, capsys)
    assert code == 0, err
    assert out == chat.decode([first, second]) + "\n"
    assert "2 tokens" in err


def test_the_speed_leaves_out_a_compiled_first_step() -> None:
    """The first compiled step may include the compilation: its time is given apart and the rate
    is that of the tokens after it."""
    from attnkit.commands.generate import Timing

    timing = Timing(0.0, first=0.5, last=13.0, tokens=6, second=11.0)
    assert timing.summary() == "6 tokens, first after 500 ms, 0.4 tokens/s"
    timing.compiled = True
    assert timing.summary() == (
        "6 tokens, first after 500 ms, first compiled step 10.5 s, 2.0 tokens/s"
    )
