"""Stop strings are found where the text is made: the request handle in the engine finds them
(in the text a stream and the final output show), cuts the output after the token that
completes one and ends the request; the sub-servers decide the other ends (stop ids, EOS,
length) where tokens are committed, and stop the request on the engine's word."""

import time
from types import SimpleNamespace

from tokenrouter_sdk import Policy, Router
from tokenrouter_sdk.engine import messages
from tokenrouter_sdk.engine.front.detokenizer import IncrementalDetokenizer, StopMatcher
from tokenrouter_sdk.engine.front.request_handle import RequestHandle
from tokenrouter_sdk.request import RequestConfig, SamplingParams

from ..helpers import ScriptedRunner


class BytesTokenizer:
    """Token i decodes to ``table[i]`` (bytes, read as UTF-8 with replacement): tokens that hold
    a character's first bytes and the next character's start, as BPE vocabularies have."""

    def __init__(self, table):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.table[i] for i in ids).decode("utf-8", "replace")


TABLE = [b"ab", b"Z\xf0\x9f", b"\x99\x82c", b"d"]  # "ab" "Z" + half of U+1F642, its rest + "c"


def handle(stop, forced=()):
    config = RequestConfig(0, [1], SamplingParams(max_new_tokens=16, stop=stop), 0, forced=tuple(forced))
    call = SimpleNamespace(listener=None)
    return RequestHandle(config, [1], "small", call, 0, BytesTokenizer(TABLE))


def test_the_token_that_completes_a_stop_string_and_begins_a_character_ends_the_text():
    d = IncrementalDetokenizer(BytesTokenizer(TABLE))
    d.add([0])
    assert d.add([1]) == "" and d.text == "ab" and d.peek() == "abZ"
    assert d.add([2]) == "Z\U0001f642c" and d.peek() == d.text == "abZ\U0001f642c"
    h = handle(["bZ"])
    ev, text = h.commit(messages.Committed(0, "small", [0], 1.0))
    assert ev.tokens == [0] and not ev.last and h.stop_hit is None
    ev, text = h.commit(messages.Committed(0, "large", [1, 2, 3], 2.0, logprobs=[(-1.0, ()), (-2.0, ()), (-3.0, ())]))
    assert ev.tokens == [1] and ev.last and ev.logprobs == [(-1.0, ())] and ev.model == "large"
    assert h.stop_hit == "bZ" and h.output.token_ids == [0, 1] and h.output.token_models == ["small", "large"]
    assert text == "a" == h.finalize_text()


def test_a_stop_string_inside_the_forced_output_ends_it_at_the_first_free_token():
    h = handle(["bZ"], forced=[0, 1])
    ev, _ = h.commit(messages.Committed(0, "small", [0, 1], 1.0))
    assert h.stop_hit is None and ev.tokens == [0, 1] and not ev.last
    ev, _ = h.commit(messages.Committed(0, "small", [2, 3], 2.0))
    assert h.stop_hit == "bZ" and ev.tokens == [2] and ev.last and h.finalize_text() == "a"
    h = handle(["d"], forced=[0, 1])
    ev, _ = h.commit(messages.Committed(0, "small", [0, 1, 2, 3], 1.0))
    assert h.stop_hit == "d" and ev.tokens == [0, 1, 2, 3] and h.finalize_text() == "abZ\U0001f642c"


def test_the_token_that_ended_a_request_by_its_id_is_not_text():
    h = handle(["zz"])
    h.commit(messages.Committed(0, "small", [0], 1.0))
    ev, text = h.commit(messages.Committed(0, "small", [3], 2.0, last=True, stop_token=True))
    assert h.output.token_ids == [0, 3] and text == "ab" == h.finalize_text()


class Slow(Policy):
    def route(self, step):
        time.sleep(0.02)
        return step.model


def test_the_engine_ends_a_request_whose_text_completes_a_stop_string(tok):
    """The sub-servers write on (a text without the stop string); a stop string completed by
    committed tokens ends the request at once, there and on every model, and its KV comes back."""
    ids = list(tok.encode(" 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15", add_special_tokens=False))
    script = {m: ScriptedRunner(ids, offset=3, after=ids[-1]) for m in ("small", "large")}
    marker = list(tok.encode(" ZQZ and more", add_special_tokens=False))
    k = next(n for n in range(1, len(marker) + 1) if "ZQZ" in tok.decode(marker[:n]))
    with Router(script, Slow(), tokenizer=tok, processes=False) as r:
        (h,) = r.submit([[1, 2, 3]], max_new_tokens=400, ignore_eos=True, stop=["ZQZ"])
        deadline = time.monotonic() + 30
        while len(h.output.token_ids) < 3:
            assert time.monotonic() < deadline and not h.done.is_set()
            time.sleep(0.01)
        with r.consistent():
            before = list(h.output.token_ids)
            r.engine.handle_event(messages.Committed(h.rid, "small", marker, time.perf_counter()))
        assert h.done.is_set()
        out = h.output
        assert out.finish_reason == "stop" and out.stop_reason == "ZQZ"
        assert out.token_ids == before + marker[:k]
        assert out.text == tok.decode(before, skip_special_tokens=True) + " "
        deadline = time.monotonic() + 10
        while True:
            st = r.kv_stats()
            if all(s.owned == 0 and s.pending == 0 for s in st.values()):
                break
            assert time.monotonic() < deadline, {m: (s.owned, s.pending) for m, s in st.items()}
            time.sleep(0.05)
        again = r.generate([1, 2, 3], max_new_tokens=20, stop=[", 5,"])
        assert again.finish_reason == "stop" and again.text == " 1, 2, 3, 4"


def test_streaming_with_stop_strings_searches_each_character_a_bounded_number_of_times(monkeypatch):
    searched = []
    find = StopMatcher.find

    def counting(self, text, start=0):
        searched.append(len(text) - start)
        return find(self, text, start)

    monkeypatch.setattr(StopMatcher, "find", counting)
    h = handle(["zz"])
    h.call.listener = lambda *a: None
    streamed = []
    for t in range(600):
        _, piece = h.commit(messages.Committed(0, "small", [0 if t % 2 else 3], float(t)))
        streamed.append(piece)
    text = "".join(streamed)
    assert len(text) == 900 and h.stop_hit is None
    assert sum(searched) <= 3 * len(text), sum(searched)  # linear in the text, not quadratic
    h = handle(["bd"])
    h.call.listener = lambda *a: None
    pieces = [h.commit(messages.Committed(0, "small", [t], 1.0))[1] for t in (3, 0, 3)]
    assert pieces == ["d", "a", ""] and h.stop_hit == "bd" and h.finalize_text() == "da"
