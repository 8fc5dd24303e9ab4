"""Support for the server tests: tiny model folders and a server on a free port."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------------------------
# tiny models


def write_decoder(folder: Path, tok: Any, *, max_positions: int = 128, seed: int = 4) -> Path:
    """A tiny random Llama with the Qwen2 chat template."""
    from tests.chat_templates import write_chat_folder
    from tests.helpers import build_hf

    build_hf(
        "llama-gqa-untied",
        folder,
        seed=seed,
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=max_positions,
    )
    return write_chat_folder(folder, "qwen2", tok=tok)


def write_encoder(folder: Path) -> Path:
    """A tiny random BERT sentence-transformers folder (the bundled MiniLM's tokenizer)."""
    import transformers

    from attnkit.interop.sentence import bundled_model_path

    source = bundled_model_path()
    folder.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "sentence_bert_config.json"):
        if (source / name).is_file():
            (folder / name).write_bytes((source / name).read_bytes())
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return folder


# --------------------------------------------------------------------------------------------
# a server in a thread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread; yield its base URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
