"""Token ids -> text as it settles, cut at the first stop string.

A streamed reply is decoded from all of its ids each time (so word boundaries and multi-byte
characters come out right) and only the settled part is released: text that ends in an
incomplete character (U+FFFD) waits for the next token, and so does a tail that could still grow
into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]


class TextStream:
    """The text of one reply, released piece by piece.

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` (``decode(ids, skip_special_tokens=...)``).
        stop: Strings that end the reply; the text up to (not including) the first one found is
            all that is ever released.

    Example::

        >>> stream = TextStream(tok, stop=["\\n\\n"])
        >>> for token in tokens:
        ...     piece = stream.add(token)     # "" while nothing new has settled
        ...     if stream.stopped: break
        >>> rest = stream.finish()            # what was held back, once no token follows
    """

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False  # a stop string was found: the text is final

    def _decoded(self) -> str:
        return str(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _held(self, text: str) -> int:
        """How many trailing characters of ``text`` could start a stop string."""
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if stop.startswith(text[-n:]):
                    held = n
                    break
        return held

    def _release(self, text: str, *, final: bool) -> str:
        for_stop = len(text) + 1
        for stop in self.stop:
            at = text.find(stop, max(0, len(self.text) - len(stop) + 1))
            if at != -1:
                for_stop = min(for_stop, at)
        if for_stop <= len(text):
            self.stopped = True
            text = text[:for_stop]
        elif not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - self._held(text)]
        if not text.startswith(self.text) or len(text) <= len(self.text):
            return ""
        piece, self.text = text[len(self.text) :], text
        return piece

    def add(self, token_id: int) -> str:
        """Take the next token; return the newly settled text ("" when none)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        return self._release(self._decoded(), final=False)

    def finish(self) -> str:
        """No token follows: release what was held back."""
        if self.stopped:
            return ""
        return self._release(self._decoded(), final=True)

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprobs)."""
        return str(self.tokenizer.decode([int(token_id)], skip_special_tokens=False))
