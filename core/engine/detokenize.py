"""Incremental detokenization, and stop strings matched on the text it makes stable.

`IncrementalText` turns a growing list of token ids into text a short window at a time;
`StopMatcher` finds the first stop string in that text, including one whose characters span tokens
(a byte-level tokenizer writes 'V椀' as four tokens, and no single token decodes to '椀'). The hf
engine ends a row with them, and the gateway's stream holds text back with the same decoding, so a
stop string ends a reply at the same place however the reply is delivered.

This module only decodes and compares text: it samples nothing and knows no request or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for a UTF-8 character not yet complete


class IncrementalText:
    """The text of a growing list of token ids, decoding a short window per token instead of the whole list.

    Decoding token by token is not enough (a token's text can depend on the one before it, and a
    UTF-8 character may span tokens), so each new token is decoded together with the tokens since
    the last stable point, and the difference against the window without it is the new text. Text
    is only taken once it does not end in half a character. `add` returns only the new text, so
    nothing per token grows with the completion (the vLLM/TGI scheme).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids, self._pieces = decode, [], []
        self._prefix = self._read = 0  # window start; end of what is already in the pieces

    def add(self, token: int) -> str:
        """Append one token; returns the text it made stable ("" while a character is incomplete)."""
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix : self._read])
        now = self.decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self._pieces.append(now[len(before) :])
            self._prefix, self._read = self._read, len(self.ids)
            return self._pieces[-1]
        return ""

    @property
    def text(self) -> str:
        """The stable text so far (joined on demand: O(n), for the end of a stream or a test)."""
        return "".join(self._pieces)


class StopMatcher:
    """Which stop string, if any, the stable text of a completion now holds.

    Only the last `longest - 1` characters before the new text can start a stop string that the new
    text completes, so each `feed` looks at that tail plus the new text: O(new text) per token.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._keep = max((len(s) for s in self.stops), default=1) - 1
        self._tail = ""

    def feed(self, piece: str) -> str | None:
        """Add newly stable text; the stop string that occurs first in the text so far, or None."""
        if not piece or not self.stops:
            return None
        window = self._tail + piece
        found = [(window.find(s), s) for s in self.stops if s in window]
        self._tail = window[-self._keep :] if self._keep else ""
        return min(found)[1] if found else None
