"""A GGUF file served: its own vocabulary, no chat template (chat is refused by name), greedy
completions equal to the model run directly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnkit
from tests.serve_support import running_server

openai = pytest.importorskip("openai")
pytest.importorskip("gguf")
pytest.importorskip("fastapi")


@pytest.mark.slow
def test_a_gguf_file_serves_completions(tmp_path: Path) -> None:
    from attnkit.bench.llamacpp import write_gguf
    from attnkit.serving.app import build_app
    from attnkit.serving.models import DecoderModel, ModelRegistry, load_model

    config = attnkit.TransformerConfig(
        vocab_size=320,
        dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=64,
        max_seq_len=64,
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        rope_interleaved=False,
    )
    torch.manual_seed(0)
    path = write_gguf(attnkit.TransformerLM(config).eval(), tmp_path / "tiny.gguf", "f32")
    model = load_model(path)
    assert isinstance(model, DecoderModel) and model.name == "tiny" and model.chat is None
    lm = attnkit.TransformerLM.from_pretrained(path)
    prompt = [5, 300, 17, 42, 260]
    want = lm.generate(torch.tensor([prompt]), 6, eos_token_id=2)[0, len(prompt) :].tolist()
    if 2 in want:
        want = want[: want.index(2)]
    with running_server(build_app(ModelRegistry([model]))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0
        )
        got = reply.choices[0].text
        assert got == model.tokenizer.decode(want, skip_special_tokens=True)
        assert len(reply.choices[0].logprobs.tokens) == len(want)
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}]
            )
