"""Incremental detokenization and stop strings: the text of a request as its tokens arrive.

`IncrementalDetokenizer` turns a growing list of token ids into text that only ever grows:
each call decodes a short window (the tokens since the last stable point) and releases text
only when it cannot change any more (it does not end in U+FFFD, the mark of a character whose
bytes are split across tokens). The window's first tokens are decoded twice, alone and with
the new ones, so tokenizers that drop a leading space at the start of a decode (SentencePiece)
give the same text as one decode of everything. Special tokens are skipped, as in the final
text. `StopMatcher` finds stop strings in that text and says how much of its end must be held
back from a stream because it may be the start of one. `ByteDetokenizer` is the text of models
that do not share a tokenizer: each writer's tokens are read as their bytes and the bytes
decoded as UTF-8 as they arrive.
"""

from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Stable text of a growing token sequence.

    Args:
        tokenizer: a `transformers` tokenizer (``decode``).
        skip_special_tokens: as in ``tokenizer.decode`` (True: what `RequestOutput.text` shows).

    Attributes:
        text: the stable text so far.
        ids: every token id added.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: the tokens before it are in ``text`` for good
        self._read = 0  # tokens up to here are in ``text``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, ids, model: str | None = None) -> str:
        """Append token ids; return the text that became stable (possibly ""). ``model`` (the
        writer) is not needed: every model shares the tokenizer."""
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        delta = now[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def peek(self) -> str:
        """The stable text and what the tokens after it decode to so far, without the incomplete
        character at its end (the text stop strings are searched in: a token that completes one
        and begins another character still completes it). Nothing is released."""
        if self._read == len(self.ids):
            return self.text
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        return self.text + now[len(before) :].rstrip(REPLACEMENT)

    def extend(self, ids, model: str | None = None) -> None:
        """Append token ids without decoding (text nobody streams: `flush` decodes it once)."""
        self.ids.extend(int(i) for i in ids)

    def flush(self) -> str:
        """The text of every token not yet released (an incomplete character stays as U+FFFD);
        after it, ``text`` covers every token."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        delta = now[len(before) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


class ByteDetokenizer:
    """Stable text of a committed output written by models with different tokenizers: each
    token's bytes (`tokenrouter_sdk.byte_vocab.ByteVocab.table` of its writer) join one byte
    string, decoded as UTF-8 as it grows (a character whose bytes are not all there yet is held
    back; an invalid byte becomes U+FFFD, as ``bytes.decode(errors="replace")`` of the whole).

    Args:
        vocabs: model name -> its `ByteVocab`.

    Attributes:
        text: the stable text so far.
        data: every byte added.
    """

    def __init__(self, vocabs: dict):
        self.vocabs = vocabs
        self.data = bytearray()
        self.text = ""
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._read = 0  # bytes up to here went through the decoder

    def _decode(self, final: bool = False) -> str:
        delta = self._dec.decode(bytes(self.data[self._read :]), final=final)
        self._read = len(self.data)
        self.text += delta
        return delta

    def add(self, ids, model: str) -> str:
        """Append the bytes of ``model``'s token ids; return the text that became stable."""
        self.data += self.vocabs[model].bytes_of(ids)
        return self._decode()

    def peek(self) -> str:
        """The stable text (a character whose bytes are not all there is not part of it)."""
        return self.text

    def extend(self, ids, model: str) -> None:
        """Append the bytes of ``model``'s token ids without decoding them yet."""
        self.data += self.vocabs[model].bytes_of(ids)

    def flush(self) -> str:
        """Decode every byte not yet released (an incomplete character at the end as U+FFFD)."""
        return self._decode(final=True)


class StopMatcher:
    """Stop strings over a growing text.

    Args:
        stops: the stop strings (non-empty).
    """

    def __init__(self, stops):
        self.stops = tuple(stops)

    def find(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """The earliest stop string in ``text[start:]`` as ``(index in text, string)``, or None.
        A search from ``start`` finds matches that begin before it too, as long as they end
        after it (pass the length of the text already searched)."""
        best = None
        for s in self.stops:
            i = text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` may begin a stop string (so a stream must
        hold them back until more text decides): the longest suffix that is a proper prefix of
        some stop string."""
        n = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), n, -1):
                if text.endswith(s[:k]):
                    n = k
                    break
        return n
