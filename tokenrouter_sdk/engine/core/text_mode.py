"""Models that do not share a tokenizer: the committed output is bytes, and each model keeps its
own tokens of it (docs/mixed-vocabularies.md).

`Vocabularies` is what the Router learns of such a group once (per model its tokenizer, its
`ByteVocab`, its end-of-sequence ids, the tokens it must never write); `TextMode` is one model's
share of it, handed to its sub-server; `TextView` is one request's bytes and token boundaries on
one model, and re-encodes what the model has not seen when the request comes back
(`retokenize`: on the request's sub-server, with its KV rewound to the first token that changed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...byte_vocab import ByteVocab, TokenizerBytesError, unspellable


@dataclass
class TextMode:
    """What the sub-server of one model of a group without one shared tokenizer needs.

    Attributes:
        vocab: its model's `ByteVocab` (bytes of its tokens, its encoding of text).
        unit: the unit model's `ByteVocab`: ``max_new_tokens`` counts the committed text's
            tokens in it (the last model's).
        eos_ids: its model's end-of-sequence ids (they end a request when this model writes one).
        banned: ids it never writes: tokens whose bytes a peer's vocabulary cannot spell.
    """

    vocab: ByteVocab
    unit: ByteVocab
    eos_ids: tuple[int, ...] = ()
    banned: tuple[int, ...] = ()


@dataclass
class Vocabularies:
    """A group of models that do not share one tokenizer.

    Attributes:
        tokenizers: model -> its tokenizer.
        vocabs: model -> its `ByteVocab`.
        eos: model -> its end-of-sequence ids (its tokenizer's and its generation config's).
        banned: model -> ids it never writes (bytes another model cannot spell).
        unit: the model whose tokens count ``max_new_tokens`` and the token metrics (the last).
    """

    tokenizers: dict[str, Any]
    vocabs: dict[str, ByteVocab]
    eos: dict[str, tuple[int, ...]]
    banned: dict[str, tuple[int, ...]] = field(default_factory=dict)
    unit: str = ""

    @classmethod
    def build(cls, tokenizers: dict[str, Any], eos: dict[str, tuple[int, ...]]) -> "Vocabularies":
        """Read each tokenizer as bytes (`ByteVocab`) and find the tokens each model must not
        write (bytes some other vocabulary has no token for).

        Raises:
            TokenizerBytesError: a tokenizer whose tokens do not round-trip to bytes (names every
                model of the group and the problem).
        """
        names = list(tokenizers)
        vocabs = {}
        for n in names:
            try:
                vocabs[n] = ByteVocab(tokenizers[n], n)
            except TokenizerBytesError as e:
                raise TokenizerBytesError(
                    f"models {', '.join(repr(m) for m in names)} do not share a tokenizer, so they can only share "
                    f"text, and {e}"
                ) from None
        bad = unspellable(vocabs.values())
        banned = {n: tuple(v.ids_writing(bad)) for n, v in vocabs.items()}
        return cls(dict(tokenizers), vocabs, {n: tuple(eos.get(n, ())) for n in names}, banned, names[-1])

    def mode(self, model: str) -> TextMode:
        """The share of ``model``'s sub-server."""
        return TextMode(self.vocabs[model], self.vocabs[self.unit], self.eos[model], self.banned[model])


class TextView:
    """One model's view of one request's committed output: the bytes it has seen and where each
    of its output tokens ends in them (the token ids themselves are the sub-server's
    ``Seq.tokens`` after the prompt).

    Attributes:
        data: the committed output bytes this model has seen (all of them while it owns the
            request).
        ends: per output token of the view, the byte offset where it ends.
        first: output tokens that came from this model's last encoding of the text (the tokens
            after them are its own draws since).
    """

    __slots__ = ("data", "ends", "first")

    def __init__(self):
        self.data = bytearray()
        self.ends: list[int] = []
        self.first = 0

    def append(self, data: bytes) -> None:
        """The model wrote a token that writes ``data``."""
        self.data += data
        self.ends.append(len(self.data))

    def receive(self, vocab: ByteVocab, ids: list[int], new: bytes) -> tuple[int, list[int]]:
        """Take the committed bytes ``new`` the model has not seen and re-encode the view's end
        (`ByteVocab.retokenize`): returns ``(keep, view)``, the new output ids ``view`` (equal to
        ``vocab.encode`` of all the bytes) and how many of the old ``ids`` they begin with."""
        self.data += new
        k, tail = vocab.retokenize(ids, self.ends, self.data, self.first)
        j = 0
        while j < len(tail) and k + j < len(ids) and tail[j] == ids[k + j]:
            j += 1
        view = list(ids[:k]) + tail
        self.ends = self.ends[:k] + vocab.ends(tail, self.ends[k - 1] if k else 0)
        self.first = len(view)
        return k + j, view

    def text(self) -> str:
        """The bytes seen, as text (an incomplete or invalid sequence as U+FFFD)."""
        return self.data.decode("utf-8", "replace")


def retokenize(seq, vocab: ByteVocab, data: bytes, sched) -> None:
    """A request ``seq`` (a scheduler `Seq` with a `TextView`) comes back with the committed
    bytes ``data`` its model has not seen: re-encode the end of its output tokens with them
    (`TextView.receive`), drop the KV from the first token that changed
    (``sched.replaced_from``) and, when nothing new is left to feed (the peer discarded and
    bounced back), recompute the last position (``sched.rewind``)."""
    p = seq.prompt_len
    keep, view = seq.text.receive(vocab, seq.tokens[p:], data)
    seq.tokens[p:] = view
    sched.replaced_from(seq, p + keep)
    if seq.kv_len >= len(seq.tokens):
        sched.rewind(seq, len(seq.tokens) - 1)
