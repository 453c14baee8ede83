"""Streams equal the final text (multi-byte characters, stop strings, special tokens), stop ids,
and prompts that already hold the chat template."""

import asyncio

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.engine.front.detokenizer import IncrementalDetokenizer, StopMatcher
from tokenrouter_sdk.models import tiny_model

from ..helpers import Alternate, ScriptedRunner, StayOn


def forced(tok, text, *, extra=(), eos=True):
    """A pair whose greedy output (from position 3 on, after a 3-token prompt) is ``text``'s
    tokens, then ``extra`` ids, then EOS."""
    ids = list(tok.encode(text, add_special_tokens=False)) + list(extra) + ([tok.eos_token_id] if eos else [])
    return {
        "small": ScriptedRunner(ids, offset=3, after=tok.eos_token_id),
        "large": ScriptedRunner(ids, offset=3, after=tok.eos_token_id),
    }, ids


def r_text(pair, tok, policy, **kw):
    with Router(pair, policy, tokenizer=tok) as r:
        return r.generate([1, 2, 3], max_new_tokens=64, **kw).text


def stream_text(r, prompt, **kw):
    evs = list(r.stream(prompt, **kw))
    return "".join(e.text for e in evs), evs


@pytest.mark.parametrize("policy", [StayOn("small"), Alternate()])
def test_multibyte_characters_stream_whole(tok, policy):
    text = "é日🙂 x — ünï"
    pair, ids = forced(tok, text)
    with Router(pair, policy, tokenizer=tok) as r:
        joined, evs = stream_text(r, [1, 2, 3], max_new_tokens=64)
        out = r.last_output
    assert out.text == text and joined == text
    assert r_text(forced(tok, text)[0], tok, policy) == text  # generate (no stream) decodes once at the end
    assert "\ufffd" not in joined
    assert sum(1 for e in evs if e.token_id is not None) == len(ids)


def test_stop_string_is_never_streamed(tok):
    pair, _ = forced(tok, " 4, 5, 6, 7, 8, 9, 10")
    with Router(pair, Alternate(), tokenizer=tok) as r:
        joined, evs = stream_text(r, [1, 2, 3], max_new_tokens=64, stop=["7, 8"])
        out = r.last_output
        assert out.finish_reason == "stop" and out.stop_reason == "7, 8"
        assert out.text == " 4, 5, 6, " and joined == out.text
        assert r.generate([1, 2, 3], max_new_tokens=64, stop=["7, 8"]).text == out.text
        # a stop string that never completes: its held-back prefix is released at the end
        joined2, _ = stream_text(r, [1, 2, 3], max_new_tokens=64, stop=["10!"])
        assert r.last_output.finish_reason == "eos"
        assert joined2 == r.last_output.text == " 4, 5, 6, 7, 8, 9, 10"


def test_special_tokens_are_handled_as_in_text(tok):
    bos = tok.bos_token_id
    pair, _ = forced(tok, "ab", extra=[bos, 99, 100])  # 'ab' <|bos|> 'c' 'd'
    with Router(pair, StayOn("small"), tokenizer=tok) as r:
        joined, _ = stream_text(r, [1, 2, 3], max_new_tokens=64)
        out = r.last_output
        assert out.text == "abcd" and joined == "abcd"
        # a stop string that only matches across the special token's text never matches
        joined, _ = stream_text(r, [1, 2, 3], max_new_tokens=64, stop=["<|bos|>"])
        assert r.last_output.finish_reason == "eos" and joined == "abcd"


def test_astream_equals_text(tok):
    pair, _ = forced(tok, "héllo wörld")
    with Router(pair, Alternate(), tokenizer=tok) as r:

        async def main():
            return [e async for e in r.astream([1, 2, 3], max_new_tokens=64)]

        evs = asyncio.run(main())
        assert "".join(e.text for e in evs) == r.last_output.text == "héllo wörld"


def test_stop_token_ids_and_generation_config_eos_list(tok):
    model = tiny_model(num_layers=1, seed=4)
    with Router({"m": model}, tokenizer=tok) as r:
        free = r.generate([5, 6, 7], max_new_tokens=12, ignore_eos=True)
        x = free.token_ids[3]
        cut = r.generate([5, 6, 7], max_new_tokens=12, ignore_eos=True, stop_token_ids=[x])
    first = free.token_ids.index(x)
    assert cut.finish_reason == "stop" and cut.stop_reason == x
    assert cut.token_ids == free.token_ids[: first + 1]
    assert cut.text == tok.decode(free.token_ids[:first], skip_special_tokens=True)
    model.generation_config.eos_token_id = [tok.eos_token_id, x]  # a list, as Qwen3 and Llama 3 ship
    with Router({"m": model}, tokenizer=tok) as r:
        out = r.generate([5, 6, 7], max_new_tokens=12)
    assert out.finish_reason == "eos" and out.token_ids == free.token_ids[: first + 1]


def test_templated_prompt_is_not_templated_again(pair, tok):
    with Router(pair, tokenizer=tok) as r:
        once = r.encode("What is 2 + 2?")
        text = tok.decode(once)
        assert text.startswith("<|bos|>user")
        assert r.encode(text) == once  # already holds the template's markers: encoded as is
        assert r.encode([{"role": "user", "content": "What is 2 + 2?"}]) == once
        assert r.encode("plain", chat=False) == list(tok.encode("plain", add_special_tokens=False))


# ---- the detokenizer on its own -----------------------------------------------------------
def test_incremental_detokenizer_equals_full_decode(tok):
    text = "a é 日本 🙂🙂 b\n\tc"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    parts = [d.add([i]) for i in ids]
    parts.append(d.flush())
    assert "".join(parts) == text == d.text
    assert all("\ufffd" not in p for p in parts)


def test_stop_matcher_hold_back():
    m = StopMatcher(["7, 8", "END"])
    assert m.held("1, 2, 7") == 1 and m.held("1, 2, 7,") == 2 and m.held("1, 2, 7, ") == 3
    assert m.held("abc EN") == 2 and m.held("abc") == 0
    assert m.find("x 7, 8 y END") == (2, "7, 8")
    assert m.find("aaEND", start=4) == (2, "END")
