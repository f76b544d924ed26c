"""What a request gives back: incremental detokenisation, stop strings, results.

`Detokenizer` turns a growing list of token ids into text by decoding a short window around
each new token (the offsets scheme of vLLM and Hugging Face's streamers), not the whole text
again. `RowOutput` adds the stop strings: after each batch of new tokens it searches only the
new text (plus the longest stop string's overlap) and remembers where the first one started and
how many tokens it took. Shared by `jkv.generate`, `jkv.stream` and (later) the engine and the
server.
"""

from __future__ import annotations

import dataclasses
from typing import Any

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]  # generated ids (a final eos included)
    finish_reason: str  # "stop" (eos or a stop string) | "length"
    kv_bytes: int  # bytes of the live KV state (K, V and fp8 scales) that served the request
    stats: dict[str, Any]
    cache: str | None = None  # which response-cache level answered: "l1" | "l2" | None


class Detokenizer:
    """Text of a growing token list, one window decode per token.

    `text` grows only by complete characters: a token that ends inside a UTF-8 sequence (decoded
    as U+FFFD) waits for the next one. `ends[i]` is len(text) once token i was pushed.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self.ends: list[int] = []
        self._prefix = 0  # the window starts here: the last emitted chunk gives the context
        self._read = 0  # ids before this are in `text`

    def push(self, token: int) -> str:
        """Adds one token; returns the text it completed ("" while a character is partial)."""
        self.ids.append(int(token))
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read])
        now = decode(self.ids[self._prefix :])
        piece = ""
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            piece = now[len(before) :]
            self.text += piece
            self._prefix, self._read = self._read, len(self.ids)
        self.ends.append(len(self.text))
        return piece


class RowOutput:
    """One row's text and stop strings as its tokens arrive."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.detok = Detokenizer(tokenizer)
        self.stop = stop
        self.longest = max((len(s) for s in stop), default=0)
        self.searched = 0  # text before this holds no stop string's start
        self.hit: tuple[int, int] | None = None  # (cut in text, tokens up to the stop string)

    def push(self, ids: list[int]) -> None:
        """Adds the row's new token ids, then looks for a stop string in the new text."""
        for token in ids:
            self.detok.push(token)
        if self.stop and self.hit is None:
            self._search()

    def _search(self) -> None:
        text = self.detok.text
        start = max(0, self.searched - self.longest + 1)
        found = [(text.find(s, start), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        self.searched = len(text)
        if not found:
            return
        # The fewest tokens whose text already holds a whole stop string.
        end = min(i + len(s) for i, s in found)
        n = next(k + 1 for k, e in enumerate(self.detok.ends) if e >= end)
        self.hit = (min(i for i, _ in found), n)

    @property
    def text(self) -> str:
        """The text so far, cut before a stop string once one appeared."""
        return self.detok.text if self.hit is None else self.detok.text[: self.hit[0]]

    def settled(self) -> str:
        """The text no later token can change: a stop string may still be forming in the last
        `longest - 1` characters."""
        if self.hit is not None:
            return self.text
        return self.detok.text[: max(0, len(self.detok.text) - max(self.longest - 1, 0))]
