"""Streamed text: released as it settles, held back where it could grow into a stop string, cut
at the first stop string; always equal to decoding the whole reply at once."""

from __future__ import annotations

from typing import Any

import pytest

from attnkit.serving.text import TextStream

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok() -> Any:
    from tests.chat_templates import train_tokenizer

    return train_tokenizer()


TEXTS = ["Attention weighs every token.", "Et en français ? Ça marche ✓ ✓", "a\n\nb, c; d"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [[], ["\n\n"], ["ç"], ["every", "tok"], ["zz-never"]])
def test_pieces_add_up_to_the_decoded_text_cut_at_the_first_stop(
    tok: Any, text: str, stop: list[str]
) -> None:
    ids = tok.encode(text).ids
    whole = tok.decode(ids, skip_special_tokens=True)
    cuts = [whole.find(s) for s in stop if s in whole]
    want = whole[: min(cuts)] if cuts else whole
    stream = TextStream(tok, stop=stop)
    pieces = [stream.add(i) for i in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == want == stream.text
    assert stream.stopped == bool(cuts)
    assert all("\ufffd" not in p for p in pieces)
    for s in stop:
        assert s not in "".join(pieces)


def test_a_possible_stop_prefix_is_held_until_it_is_decided(tok: Any) -> None:
    stream = TextStream(tok, stop=["end."])
    out = ""
    for piece in ("The", " en", "d", " is"):
        for i in tok.encode(piece).ids:
            out += stream.add(i)
        if piece == " en":
            assert not out.endswith("en")  # could be the start of "end."
    assert out + stream.finish() == "The end is"
