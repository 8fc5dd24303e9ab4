"""Support for the server tests: tiny model folders, a server on a free port, and a stand-in
engine (used while ``attnkit.serving.engine`` is absent) that follows the engine's interface with
the plainest possible loop: every step recomputes each running request's whole sequence.
"""

from __future__ import annotations

import importlib
import json
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------------------------
# the stand-in engine


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_block_size: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    preemptions: int
    kv_bytes_used: int


@dataclass
class _Running:
    rid: str
    prompt: list[int]
    params: SamplingParams
    processor: Callable[[list[int], torch.Tensor], torch.Tensor] | None
    on_event: Callable[[TokenEvent], None] | None
    generator: torch.Generator
    out: list[int]


class StandInEngine:
    """The engine interface over a whole-sequence recompute per step (no KV cache)."""

    BLOCK = 16

    def __init__(
        self, model: Any, *, max_batch: int = 16, kv_cache_tokens: int | None = None, **_: Any
    ) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_context = int(model.config.max_seq_len)
        self.blocks = (kv_cache_tokens or 4096) // self.BLOCK
        self.running: dict[str, _Running] = {}
        self.waiting: list[_Running] = []
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.count = 0

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        logits_processor: Any = None,
        on_event: Callable[[TokenEvent], None] | None = None,
    ) -> str:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise ValueError(
                f"prompt {len(prompt_ids)} + max_tokens {params.max_tokens} > "
                f"context {self.max_context}"
            )
        with self.cond:
            self.count += 1
            rid = request_id or f"r{self.count}"
            g = torch.Generator().manual_seed(
                params.seed if params.seed is not None else self.count
            )
            self.waiting.append(
                _Running(rid, list(prompt_ids), params, logits_processor, on_event, g, [])
            )
            self.cond.notify_all()
        return rid

    def _emit(
        self, r: _Running, token: int, lp: float | None, top: Any, reason: str | None
    ) -> None:
        if r.on_event is not None:
            r.on_event(TokenEvent(r.rid, token, lp, top, reason, len(r.prompt), len(r.out), 0))

    def abort(self, request_id: str) -> None:
        with self.cond:
            found = self.running.pop(request_id, None)
            for r in list(self.waiting):
                if r.rid == request_id:
                    self.waiting.remove(r)
                    found = r
        if found is not None:
            self._emit(found, -1, None, None, "abort")

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        with self.cond:
            while self.waiting and len(self.running) < self.max_batch:
                r = self.waiting.pop(0)
                self.running[r.rid] = r
            batch = list(self.running.values())
        for r in batch:
            logits = self.model(torch.tensor([r.prompt + r.out]))[0, -1].float()  # (V,)
            if r.processor is not None:
                logits = r.processor(list(r.out), logits)
            logprobs = torch.log_softmax(logits, dim=-1)
            p = r.params
            if p.temperature == 0:
                token = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / p.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=r.generator))
            top = None
            if p.logprobs is not None:
                values, ids = logprobs.topk(p.logprobs)
                pairs = zip(ids.tolist(), values.tolist(), strict=True)
                top = tuple((int(i), float(v)) for i, v in pairs)
            r.out.append(token)
            reason = None
            if token in p.stop_token_ids and not p.ignore_eos:
                reason = "stop"
            elif len(r.out) >= p.max_tokens:
                reason = "length"
            with self.cond:
                if r.rid not in self.running:
                    continue  # aborted meanwhile
                if reason is not None:
                    del self.running[r.rid]
            self._emit(r, token, float(logprobs[token]), top, reason)
        return []

    def stats(self) -> EngineStats:
        with self.cond:
            used = sum(
                -(-(len(r.prompt) + len(r.out)) // self.BLOCK) for r in self.running.values()
            )
            return EngineStats(
                len(self.running),
                len(self.waiting),
                used,
                self.blocks - used,
                self.BLOCK,
                0,
                0,
                0,
                used * self.BLOCK,
            )

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.has_work() and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
            self.step()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self, *, cancel: bool = True, timeout: float | None = None) -> None:
        for rid in [r.rid for r in self.waiting] + list(self.running):
            self.abort(rid)
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)


def engine_module() -> Any:
    """``attnkit.serving.engine``: the real one, else this stand-in installed under its name."""
    try:
        return importlib.import_module("attnkit.serving.engine")
    except ImportError:
        module = types.ModuleType("attnkit.serving.engine")
        module.Engine = StandInEngine  # type: ignore[attr-defined]
        module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
        module.TokenEvent = TokenEvent  # type: ignore[attr-defined]
        sys.modules["attnkit.serving.engine"] = module
        return module


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
