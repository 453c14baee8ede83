"""A tokenizer seen as bytes: what each token id writes, and the token ids of any bytes.

Models that do not share a tokenizer share text: a request's committed output is a byte string,
and each model holds its own tokens of it. `ByteVocab` is the one definition of both directions:

- ``table[id]``: the exact bytes token ``id`` writes. Byte-level BPE vocabularies (GPT-2,
  Llama 3, Qwen, SmolLM2) spell bytes with the GPT-2 byte -> character map; SentencePiece-style
  vocabularies (Gemma, Llama 2 with ``byte_fallback``) write ``▁`` for a space and ``<0xNN>`` for
  a raw byte. Special tokens (BOS, EOS, chat markers) write nothing, as the output text skips
  them; other added tokens write their content.
- `ByteVocab.encode`: the token ids of any bytes. Each maximal run of valid UTF-8 is encoded
  by the tokenizer (no special tokens added, and text that spells a special token stays text);
  every byte outside such a run (an incomplete character at the end, where a model handed off
  inside a multi-byte character, or invalid UTF-8 a byte-level model wrote) is its byte token.
  A run whose tokens would not write it back exactly (a normalizer changed it) is written in
  byte tokens. So ``bytes_of(encode(b)) == b`` for every ``b``.
- `ByteVocab.retokenize`: the encoding of a grown byte string from a token view of a prefix of
  it, re-encoding only a window at its end (the view's last tokens may merge with the new bytes).
- `ByteVocab.count`: the number of tokens of a growing byte string, kept incrementally.

A tokenizer that cannot do this (no fast tokenizer, a vocabulary without all 256 byte tokens,
one that adds a space in front of the text it encodes or changes plain text) is refused with
`TokenizerBytesError` naming the problem.
"""

from __future__ import annotations

import copy
import json
import threading
from typing import Sequence

LOOKBACK = 3  # tokens between the window's start and the earlier start it is checked against
COUNT_MARGIN = 16  # tokens kept after the stable boundary of `ByteVocab.count`
NEEDED = frozenset([0x09, 0x0A, 0x0D, *range(0x20, 0x7F), *range(0x80, 0xC0), *range(0xC2, 0xF1)])
"""Bytes every vocabulary must have a token for: tab, newlines, printable ASCII, every UTF-8
continuation byte and the lead bytes of the characters in use (planes 0-3)."""
PROBES = (
    "Hello, world!",
    " leading space",
    "two  spaces\tand a tab\n\nnew lines\r\n",
    "trailing space ",
    "naïve café — 你好 🙂 ß",
    "x = [1, 2]; print(f'{x}')  # code",
    "<b>bold</b> &amp; 3.14e-5",
    "   indented\n        deeper\n",
)


class TokenizerMismatchError(ValueError):
    """Two models do not share one vocabulary, so tokens cannot be routed between them (the
    same-tokenizer check, `tokenrouter_sdk.models.check_same_tokenizer`)."""


class TokenizerBytesError(TokenizerMismatchError):
    """A tokenizer whose tokens cannot be read as exact bytes, so models with another vocabulary
    cannot share text with it."""


def byte_level_map() -> dict[str, int]:
    """The GPT-2 byte-level alphabet as character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the characters from U+0100 on, in byte order (the map
    of byte-level BPE vocabularies: GPT-2, RoBERTa, Llama 3, Qwen, SmolLM2)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {chr(b): b for b in kept}
    nxt = 0x100
    for b in range(256):
        if b not in out.values():
            out[chr(nxt)] = b
            nxt += 1
    return out


def _decoder_types(spec) -> list[str]:
    """Every decoder type named in a tokenizer decoder's JSON (a `Sequence` flattened)."""
    if not spec:
        return []
    out = [spec.get("type", "")]
    for sub in spec.get("decoders", []) or []:
        out += _decoder_types(sub)
    return out


def unspellable(vocabs) -> frozenset[int]:
    """Byte values some vocabulary of ``vocabs`` (`ByteVocab` objects) has no token for: no model
    of the group may write them, so every model can write every committed byte in its tokens."""
    out: set[int] = set()
    for v in vocabs:
        out |= set(range(256)) - v.spells
    return frozenset(out)


def is_continuation(byte: int) -> bool:
    """Whether ``byte`` continues a UTF-8 character (0b10xxxxxx)."""
    return (byte & 0xC0) == 0x80


def char_count(data) -> int:
    """Characters that begin in ``data`` (bytes that are not UTF-8 continuation bytes)."""
    return sum(1 for b in data if not is_continuation(b))


class ByteVocab:
    """One tokenizer's token ids as bytes, and bytes as its token ids.

    Args:
        tokenizer: a transformers fast tokenizer (``backend_tokenizer``) or a `tokenizers.Tokenizer`.
        name: how errors name it (the model's name).

    Attributes:
        table: per token id, the bytes it writes (``b""`` for special tokens and unused ids);
            length = the vocabulary including added tokens.
        byte_ids: per byte value 0..255, the id of the token that writes exactly that byte (None
            for the few a byte-level vocabulary may lack: some control bytes and bytes that never
            occur in UTF-8; `ids_writing` finds the tokens of other vocabularies to keep from them).
        spells: the byte values it has a byte token for.
        special: ids of the special tokens (they write no bytes).
        kind: ``"byte_level"`` or ``"sentencepiece"``.

    Raises:
        TokenizerBytesError: a tokenizer whose tokens do not round-trip to bytes (names the
            model, the problem and the text that showed it).
    """

    def __init__(self, tokenizer, name: str = "model"):
        self.name = name
        self.tokenizer = tokenizer
        backend = self._backend()
        spec = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
        types = _decoder_types(spec)
        vocab = backend.get_vocab(with_added_tokens=True)
        added = self._added(backend)
        size = max([len(tokenizer) if hasattr(tokenizer, "__len__") else 0, *[i + 1 for i in vocab.values()]])
        table: list[bytes] = [b""] * size
        if "ByteLevel" in types:
            self.kind = "byte_level"
            cmap = byte_level_map()
            for piece, i in vocab.items():
                if i in added:
                    continue
                try:
                    table[i] = bytes(cmap[c] for c in piece)
                except KeyError:
                    raise TokenizerBytesError(
                        f"model '{name}': its byte-level token {piece!r} (id {i}) holds a character outside the "
                        f"byte alphabet, so its bytes are unknown; this tokenizer cannot share text with another "
                        f"vocabulary"
                    ) from None
            byte_ids = [vocab.get(c) for c in sorted(cmap, key=cmap.get)]
        elif "ByteFallback" in types or "Metaspace" in types:
            self.kind = "sentencepiece"
            for piece, i in vocab.items():
                if i in added:
                    continue
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    table[i] = bytes([int(piece[3:5], 16)])
                else:
                    table[i] = piece.replace("\u2581", " ").encode("utf-8")
            byte_ids = [vocab.get(f"<0x{b:02X}>") for b in range(256)]
        else:
            raise TokenizerBytesError(
                f"model '{name}': its tokenizer's decoder ({' + '.join(types) or 'none'}) is neither byte-level "
                f"BPE nor SentencePiece with byte fallback, so its tokens' bytes are unknown; models with "
                f"different tokenizers need one of those (GPT-2/Llama 3/Qwen/SmolLM2 or Gemma/Llama 2 style)"
            )
        missing = [b for b, i in enumerate(byte_ids) if i is None and b in NEEDED]
        if missing:
            raise TokenizerBytesError(
                f"model '{name}': its vocabulary has no token for {len(missing)} byte values that UTF-8 text uses "
                f"(e.g. 0x{missing[0]:02X}), so text that ends inside a character (a handoff between two bytes of "
                f"one character) cannot be written in its tokens; a SentencePiece tokenizer needs byte_fallback"
            )
        for i, special in added.items():
            content = special[1]
            table[i] = b"" if special[0] else content.encode("utf-8")
        self.table = tuple(table)
        self.byte_ids = tuple(byte_ids)
        self.spells = frozenset(b for b, i in enumerate(byte_ids) if i is not None)
        self.special = frozenset(i for i, (sp, _) in added.items() if sp)
        self._encoder = None
        self._lock = threading.Lock()
        self._check(backend)

    # -- construction ---------------------------------------------------------------------
    def _backend(self):
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None and type(tok).__module__.startswith("tokenizers"):
            backend = tok
        if backend is None:
            raise TokenizerBytesError(
                f"model '{self.name}': its tokenizer ({type(tok).__name__}) is not a fast tokenizer (no "
                f"backend_tokenizer); models with different tokenizers need fast ones "
                f"(AutoTokenizer.from_pretrained(..., use_fast=True))"
            )
        return backend

    @staticmethod
    def _added(backend) -> dict[int, tuple[bool, str]]:
        """Added tokens: id -> (special, content)."""
        return {int(i): (bool(t.special), str(t.content)) for i, t in backend.get_added_tokens_decoder().items()}

    def _check(self, backend) -> None:
        """Encode and decode each probe text both ways: the tokenizer's own encoding must write
        the text back exactly, and the table must agree with the tokenizer's own decoder."""
        for text in PROBES:
            ids = backend.encode(text, add_special_tokens=False).ids
            got = self.bytes_of(ids)
            if got != text.encode("utf-8"):
                what = (
                    "adds a space in front of the text it encodes (a SentencePiece dummy prefix)"
                    if got == b" " + text.encode("utf-8")
                    else "changes plain text when it encodes it"
                )
                raise TokenizerBytesError(
                    f"model '{self.name}': its tokenizer {what}: {text!r} encodes to tokens that write "
                    f"{got.decode('utf-8', 'replace')!r}; text shared between vocabularies must round-trip "
                    f"exactly through each tokenizer"
                )
            shown = backend.decode(ids, skip_special_tokens=False)
            if shown != text and shown != text.lstrip(" "):
                raise TokenizerBytesError(
                    f"model '{self.name}': its tokenizer decodes the tokens of {text!r} as {shown!r}, but their "
                    f"bytes read {text!r}; its decoder does something this library cannot model"
                )

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_encoder"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _text_encoder(self):
        """A private copy of the backend tokenizer that encodes special tokens' text as text
        (made at the first encode: copying a large vocabulary takes a second or two)."""
        enc = self._encoder
        if enc is None:
            with self._lock:
                if self._encoder is None:
                    enc = copy.deepcopy(self._backend())
                    enc.encode_special_tokens = True
                    enc.no_truncation()
                    enc.no_padding()
                    self._encoder = enc
                enc = self._encoder
        return enc

    # -- ids -> bytes ---------------------------------------------------------------------
    def bytes_of(self, ids: Sequence[int]) -> bytes:
        """The bytes token ids write, joined."""
        t = self.table
        return b"".join(t[i] for i in ids)

    def ends(self, ids: Sequence[int], start: int = 0) -> list[int]:
        """Byte offsets where each token of ``ids`` ends, starting from ``start``."""
        out, t, n = [], self.table, start
        for i in ids:
            n += len(t[i])
            out.append(n)
        return out

    # -- bytes -> ids ---------------------------------------------------------------------
    def encode(self, data) -> list[int]:
        """The token ids of ``data`` (bytes): each run of valid UTF-8 by the tokenizer, every other
        byte as its byte token; ``bytes_of(encode(data)) == data``."""
        out: list[int] = []
        i, n = 0, len(data)
        while i < n:
            chunk = data[i:]
            try:
                text = bytes(chunk).decode("utf-8")
            except UnicodeDecodeError as e:
                j = i + e.start
                if j > i:
                    out += self._encode_run(bytes(data[i:j]))
                bad = i + e.end
                out += [self.byte_ids[b] for b in data[j:bad]]
                i = bad
                continue
            out += self._encode_text(text, bytes(chunk))
            break
        return out

    def _encode_run(self, raw: bytes) -> list[int]:
        return self._encode_text(raw.decode("utf-8"), raw)

    def _encode_text(self, text: str, raw: bytes) -> list[int]:
        ids = self._text_encoder().encode(text, add_special_tokens=False).ids
        if self.bytes_of(ids) != raw:  # a normalizer changed the text: write it byte by byte
            return [self.byte_ids[b] for b in raw]
        return ids

    def retokenize(self, ids: Sequence[int], ends: Sequence[int], data, first: int) -> tuple[int, list[int]]:
        """``(k, tail)`` with ``encode(data) == ids[:k] + tail``, re-encoding only a window.

        ``ids`` is a token view of ``data[:ends[-1]]`` whose first ``first`` tokens came from an
        earlier `encode` of a prefix of ``data``; ``data`` grew since (new bytes at its end) and the
        tokens from ``first`` on may be any tokens that write their bytes (a model's own draws).
        The window starts at a token boundary ``k <= min(first, len(ids) - 1)`` on a character
        start and is taken when encoding from ``LOOKBACK`` tokens earlier gives the same tokens
        from ``k`` on (so ``k`` is a stable boundary: the text before it does not change how the
        rest is cut); else it grows back, down to encoding ``data`` whole.

        Args:
            ids: the view's token ids, shape [n].
            ends: ``ends[i]`` = bytes written by ``ids[:i + 1]``, shape [n].
            data: the bytes to encode (``data[:ends[-1]] == bytes_of(ids)``).
            first: tokens of ``ids`` known to come from an earlier encoding.

        Returns:
            ``k`` (tokens of ``ids`` kept as they are) and ``tail`` (the encoding of ``data[ends[k-1]:]``).
        """
        n = len(ids)
        if n == 0:
            return 0, self.encode(data)
        memo: dict[int, list[int]] = {}

        def start(k: int) -> int:
            return ends[k - 1] if k else 0

        def enc(k: int) -> list[int]:
            if k not in memo:
                memo[k] = self.encode(data[start(k) :])
            return memo[k]

        def char_start(k: int) -> int:
            while k > 0 and (start(k) >= len(data) or is_continuation(data[start(k)])):
                k -= 1
            return k

        k = char_start(min(first, n - 1))
        while k > 0:
            k2 = char_start(max(0, k - LOOKBACK))
            if enc(k2) == list(ids[k2:k]) + enc(k):
                return k, enc(k)
            k = k2
        return 0, enc(0)

    def count(self, data, at: int, base: int) -> tuple[int, int, int]:
        """Tokens of ``data`` (bytes) as ``(count, at, base)``: ``base`` tokens encode
        ``data[:at]`` (a stable boundary found earlier; ``0, 0`` at first) and the rest is
        encoded now; the boundary moves forward (returned) when the rest holds more than
        ``2 * COUNT_MARGIN`` tokens and encoding from ``COUNT_MARGIN`` tokens before its end gives
        the same last tokens. Equal to ``len(encode(data))``."""
        tail = self.encode(data[at:])
        n = base + len(tail)
        if len(tail) > 2 * COUNT_MARGIN:
            ends = self.ends(tail, at)
            k = len(tail) - COUNT_MARGIN
            while k > 0 and is_continuation(data[ends[k - 1]]):
                k -= 1
            if k > 0 and self.encode(data[ends[k - 1] :]) == tail[k:]:
                at, base = ends[k - 1], base + k
        return n, at, base

    def ids_writing(self, values) -> list[int]:
        """Ids of the tokens whose bytes hold any of the byte ``values`` (the tokens a model must
        not write when a peer's vocabulary cannot spell those bytes)."""
        drop = bytes(sorted(set(values)))
        if not drop:
            return []
        return [i for i, b in enumerate(self.table) if b and len(b.translate(None, drop)) != len(b)]

    def __repr__(self) -> str:
        return f"ByteVocab({self.name!r}, {self.kind}, {len(self.table)} tokens)"
