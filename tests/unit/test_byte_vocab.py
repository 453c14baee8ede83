"""`ByteVocab`: each token's exact bytes, the encoding of any bytes (invalid UTF-8 and a
character cut between two handoffs included), the re-encoding of a view's end that must equal
encoding the whole text, the incremental token count, and the tokenizers it refuses."""

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenrouter_sdk.byte_vocab import ByteVocab, TokenizerBytesError, TokenizerMismatchError, unspellable
from tokenrouter_sdk.models import tiny_tokenizer

from ..helpers import byte_level_toy, sentencepiece_toy

ALPHABET = ["a", "e", "t", "h", "r", "n", " ", " ", "the ", "ere ", "é", "你", "好", "🙂", "ß", ".", "\n"]


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece", "tiny"])
def vocab(request):
    tok = {"byte_level": byte_level_toy, "sentencepiece": sentencepiece_toy, "tiny": tiny_tokenizer}[request.param]()
    return ByteVocab(tok, request.param)


def random_text(rng, n) -> bytes:
    return "".join(rng.choice(ALPHABET) for _ in range(n)).encode()


def test_tokens_write_their_exact_bytes(vocab):
    tok = vocab.tokenizer
    assert all(vocab.table[i] == b"" for i in vocab.special) and vocab.special
    for b in range(256):
        assert vocab.table[vocab.byte_ids[b]] == bytes([b])
    ids = tok.encode("the 你好 é🙂 there", add_special_tokens=False)
    assert vocab.bytes_of(ids) == "the 你好 é🙂 there".encode()
    assert vocab.kind == ("sentencepiece" if "▁" in "".join(tok.get_vocab()) else "byte_level")


def test_any_bytes_encode_and_write_back(vocab):
    rng = random.Random(0)
    cases = [b"", "你".encode()[:2], b"ab\xe4\xbd", b"\xbd\xa0x", b"\xff\xfe", "é".encode() + b"\xc3", b"a\x00b"]
    cases += [random_text(rng, 12)[: rng.randrange(1, 30)] for _ in range(150)]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20))) for _ in range(100)]
    for data in cases:
        ids = vocab.encode(data)
        assert vocab.bytes_of(ids) == data, data
    text = "the 你好 there".encode()
    assert vocab.encode(text) == list(vocab.tokenizer.encode("the 你好 there", add_special_tokens=False))


def test_text_that_spells_a_special_token_stays_text(vocab):
    eos = vocab.tokenizer.eos_token
    ids = vocab.encode(f"a{eos}b".encode())
    assert vocab.bytes_of(ids) == f"a{eos}b".encode() and not set(ids) & vocab.special


def test_reencoding_the_end_of_a_view_equals_encoding_the_whole(vocab):
    """A view = the encoding of an earlier prefix + a model's own tokens since (cut anywhere,
    inside characters and merges too); re-encoding its end with new bytes is the whole text's
    encoding, and the window reaches only a few tokens before the model's own."""
    rng = random.Random(1)
    windows = []
    for _ in range(400):
        data = random_text(rng, 40)
        a = rng.randrange(0, len(data))
        b = rng.randrange(a, len(data) + 1)
        c = rng.randrange(b, len(data) + 1)
        view = vocab.encode(data[:a])
        first = len(view)
        i = b if rng.random() < 0.2 else a
        while i < b:  # the model's own draws: any split of its bytes into tokens that write them
            j = min(b, i + rng.randrange(1, 4))
            view += vocab.encode(data[i:j])
            i = j
        k, tail = vocab.retokenize(view, vocab.ends(view), data[:c], first)
        assert view[:k] + tail == vocab.encode(data[:c])
        windows.append(min(first, len(view)) - k)
    assert sorted(windows)[len(windows) // 2] <= 4, sorted(windows)


def test_the_incremental_count_equals_the_whole_encoding(vocab):
    data = random_text(random.Random(2), 200)
    at = base = 0
    for cut in range(0, len(data) + 1, 3):
        n, at, base = vocab.count(data[:cut], at, base)
        assert n == len(vocab.encode(data[:cut]))
    assert at > 0, "the count never moved its stable boundary"


def test_a_tokenizer_that_cannot_share_text_is_refused_by_name():
    t = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(TokenizerBytesError, match="'words'.*neither byte-level") as e:
        ByteVocab(PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>"), "words")
    assert isinstance(e.value, TokenizerMismatchError)
    with pytest.raises(TokenizerBytesError, match="'nofallback'.*no token for .*byte_fallback"):
        ByteVocab(sentencepiece_toy(byte_fallback=False), "nofallback")
    with pytest.raises(TokenizerBytesError, match="'prefix'.*adds a space in front"):
        ByteVocab(sentencepiece_toy(prepend=True), "prefix")
    with pytest.raises(TokenizerBytesError, match="not a fast tokenizer"):
        ByteVocab(object(), "slow")


def test_tokens_a_peer_cannot_spell_are_found():
    a, b = ByteVocab(byte_level_toy(), "a"), ByteVocab(sentencepiece_toy(), "b")
    assert unspellable([a, b]) == frozenset()
    a.spells = frozenset(set(range(256)) - {0x04, 0xF5})
    assert unspellable([a, b]) == {0x04, 0xF5}
    banned = b.ids_writing({0x04, 0xF5})
    assert sorted(banned) == sorted([b.byte_ids[0x04], b.byte_ids[0xF5]])
