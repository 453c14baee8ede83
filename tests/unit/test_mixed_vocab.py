"""Routing between models that do not share a tokenizer: two tiny float64 models over two toy
tokenizers built in the tests (a byte-level BPE with merges, a SentencePiece-style BPE with byte
fallback and merges across words). A routed run equals the naive reference, which re-encodes the
whole text for the receiving model at every handoff, byte for byte: with handoffs inside a
multi-byte character and inside a merge, in threads and processes, at concurrency 4. Then what
holds the unit: EOS per model, stop strings, ``max_new_tokens`` in the last model's tokens,
policies seeing their own tokens, the policies refused, streams, abort, the prefix cache and the
metrics."""

import time

import pytest

from tokenrouter_sdk import Handoff, Needs, Policy, Router, SamplingParams
from tokenrouter_sdk.byte_vocab import char_count
from tokenrouter_sdk.engine.messages import Retokenized
from tokenrouter_sdk.policies import (
    CITER,
    R2R,
    CoLLM,
    GlimpRouter,
    R2RAleatoric,
    R2REntropy,
    RandomRouting,
    RandomSpanRouting,
    RStitch,
    TokenEnsemble,
)
from tokenrouter_sdk.reference_mixed import reference_generate_text

from ..helpers import byte_level_toy, pools_free, sentencepiece_toy, toy_lm

PROMPTS = ["the rain", "你好, there", "é", "hi", "three threes", "note: the end"]


@pytest.fixture(scope="module")
def toys():
    """small: byte-level toy (Llama), large: SentencePiece toy (Qwen2 architecture)."""
    ta, tb = byte_level_toy(), sentencepiece_toy()
    return {"small": (toy_lm(ta, 1), ta), "large": (toy_lm(tb, 2, arch="qwen2"), tb)}


def models_of(toys):
    return {n: m for n, (m, _) in toys.items()}


def reference(router, toys, prompt, policy, params, rid):
    prompts = {m: router.encode(prompt, model=m) for m in router.models}
    return reference_generate_text(models_of(toys), router.text, prompts, policy, params, rid=rid)


def cut_inside_a_character(out, text) -> int:
    """Writer changes of ``out`` where the bytes committed so far end inside a character."""
    data, n = b"", 0
    for i, (t, m) in enumerate(zip(out.token_ids, out.token_models)):
        data += text.vocabs[m].table[t]
        if i + 1 < len(out.token_ids) and out.token_models[i + 1] != m:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                n += e.reason == "unexpected end of data"
    return n


def assert_equal_to_reference(router, toys, outs, make_policy, params):
    for o in outs:
        ref = reference(router, toys, o.prompt, make_policy(), params, o.rid)
        assert o.text == ref["text"], (o.index, o.text, ref["text"])
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), o.index
        assert (o.hops, o.discarded, o.finish_reason) == (ref["hops"], ref["discarded"], ref["finish_reason"]), o.index


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
@pytest.mark.parametrize("name", ["random", "rstitch"])
def test_a_routed_run_equals_the_reference_byte_for_byte(toys, name, processes):
    def make():
        return RandomRouting(p=0.4, seed=1) if name == "random" else RStitch(tau=0.35)

    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5)
    with Router(toys, make(), processes=processes) as r:
        outs = r.generate(PROMPTS, sampling=params, concurrency=4)
        events = r.last_run.trace
        assert all(f == u for f, u in pools_free(r).values())
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert_equal_to_reference(r, toys, outs, make, params)
    assert {m for o in outs for m in o.token_models} == {"small", "large"}
    assert sum(cut_inside_a_character(o, r.text) for o in outs) > 0, "no handoff inside a multi-byte character"
    retok = [e for e in events if isinstance(e, Retokenized)]
    assert sum(o.hops for o in outs) == len(retok) > 0
    assert any(e.refed > 0 for e in retok), "no handoff inside a merge (a token of the receiver's view that changed)"
    assert all(e.fed < e.context for e in retok if e.refed), "a hop re-fed the whole context"


def test_each_model_reads_its_own_prompt_and_tokens(toys):
    """A policy sees its own model's prompt (its chat template), tokens and vocabulary, and the
    committed text: the bytes of its tokens of the output are the committed bytes."""
    seen = []

    class Look(Policy):  # three tokens on each model, keeping the token at each handoff
        def route(self, step):
            v = r.text.vocabs[step.model]
            seen.append(
                (
                    step.model,
                    step.token < len(v.table),
                    step.request.prompt_ids,
                    v.bytes_of(step.request.output_ids),
                    step.text,
                )
            )
            return step.models[(step.position // 3) % 2]

        def send(self, req, target):
            return Handoff(keep_sampled=True)

    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=2)
    with Router(toys, Look(), processes=False) as r:
        outs = r.generate(PROMPTS[:3], sampling=params, concurrency=3)
        prompts = {m: [r.encode(p, model=m) for p in PROMPTS[:3]] for m in r.models}
    assert prompts["small"][0] != prompts["large"][0]
    assert r.tokenizers["small"].decode(prompts["small"][0]).startswith("<|user|>the rain")
    assert r.tokenizers["large"].decode(prompts["large"][0]).startswith("<s>[user] the rain")
    assert {m for m, *_ in seen} == {"small", "large"}
    for model, in_vocab, prompt, data, text in seen:
        assert in_vocab and prompt in prompts[model]
        assert text == data.decode("utf-8", "replace")
    assert any(o.text.startswith(t) for o in outs for *_, t in seen if t)


def test_eos_ids_are_per_model_and_max_new_tokens_counts_the_last_models_tokens(toys):
    """Token id 2 is the large model's EOS and, for the byte-level small model, the byte 0x02:
    the small model writing it goes on; the large model writing its EOS ends the request. A
    request that runs to its length holds exactly ``max_new_tokens`` of the large model's tokens."""
    ta, tb = toys["small"][1], toys["large"][1]
    small = toy_lm(ta, 1, favour=["\x02", "th", " e"], boost=8.0)
    large = toy_lm(tb, 2, arch="qwen2", favour=["</s>", "e", " "], boost=3.0)
    pair = {"small": (small, ta), "large": (large, tb)}
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=4)
    pol = RandomRouting(p=0.3, seed=2)
    with Router(pair, pol, processes=False) as r:
        outs = r.generate(PROMPTS, sampling=params, concurrency=4)
    assert_equal_to_reference(r, pair, outs, lambda: RandomRouting(p=0.3, seed=2), params)
    small_twos = [o for o in outs if any(t == 2 and m == "small" for t, m in zip(o.token_ids, o.token_models))]
    assert small_twos and any(o.finish_reason == "length" for o in small_twos)
    eos = [o for o in outs if o.finish_reason == "eos"]
    assert eos and all(o.token_ids[-1] == 2 and o.token_models[-1] == "large" for o in eos)
    unit = r.text.vocabs["large"]
    for o in outs:
        data = b"".join(r.text.vocabs[m].table[t] for t, m in zip(o.token_ids, o.token_models))
        if o.finish_reason == "length":
            assert len(unit.encode(data)) == 30
        else:
            assert len(unit.encode(data)) <= 30


def test_a_stop_string_across_a_handoff_ends_the_request_as_the_reference(toys):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5)
    make = lambda: RandomRouting(p=0.5, seed=7)  # noqa: E731
    with Router(toys, make(), processes=False) as r:
        first = r.generate(PROMPTS[:2], sampling=params)
        # a stop string made of the last character one model wrote and the next one of the other
        stops = []
        for o in first:
            pieces = [r.text.vocabs[m].table[t].decode("utf-8", "ignore") for t, m in zip(o.token_ids, o.token_models)]
            j = next(
                i
                for i in range(1, len(pieces))
                if o.token_models[i] != o.token_models[i - 1] and pieces[i - 1] and pieces[i] and i > 3
            )
            stops.append(pieces[j - 1][-1] + pieces[j][0])
        stopped = [
            r.generate(p, sampling=SamplingParams(**{**params.__dict__, "stop": (s,)}))
            for p, s in zip(PROMPTS[:2], stops)
        ]
    for o, f, s in zip(stopped, first, stops):
        assert o.finish_reason == "stop" and o.stop_reason == s
        assert s not in o.text and f.text.startswith(o.text) and f.text[len(o.text) :].startswith(s)
        ref = reference(r, toys, o.prompt, make(), SamplingParams(**{**params.__dict__, "stop": (s,)}), o.rid)
        assert (o.text, o.finish_reason, o.stop_reason) == (ref["text"], ref["finish_reason"], ref["stop_reason"])


def test_streams_abort_and_the_prefix_cache(toys):
    params = dict(max_new_tokens=30, temperature=1.0, seed=3)
    with Router(toys, RandomRouting(p=0.4, seed=4), processes=False, max_kv_tokens=4096) as r:
        events = list(r.stream(PROMPTS[1], **params))
        streamed = r.last_output
        assert "".join(e.text for e in events) == streamed.text and streamed.ok
        assert [e.token_id for e in events if e.token_id is not None] == streamed.token_ids
        long = [p * 4 for p in PROMPTS[:4]]  # a full block of prompt on each model
        first = r.generate(long, **params, concurrency=4)
        again = r.generate(long, **params, concurrency=4)
        m = r.metrics(r.last_run)
        call = r.submit(PROMPTS, max_new_tokens=200, temperature=1.0, seed=1, ignore_eos=True)
        while sum(len(h.output.token_ids) for h in call) < 10:
            time.sleep(0.01)
        call.abort()
        call.wait(30)
        assert all(h.output.finish_reason in ("aborted", "length", "eos") for h in call)
        assert any(h.output.finish_reason == "aborted" for h in call)
        assert all(f == u for f, u in pools_free(r).values())
    assert [o.text for o in first] == [o.text for o in again]
    assert all(pm.prefix_hit_tokens > 0 for pm in m.per_model.values()), m.per_model


def test_metrics_in_characters_and_in_the_large_models_tokens(toys):
    params = SamplingParams(max_new_tokens=25, temperature=1.0, seed=6)
    with Router(toys, RStitch(tau=0.35), processes=False) as r:
        outs = r.generate(PROMPTS, sampling=params, concurrency=4)
        m = r.metrics()
    unit = r.text.vocabs["large"]
    data = [b"".join(r.text.vocabs[w].table[t] for t, w in zip(o.token_ids, o.token_models)) for o in outs]
    assert m.large_tokens == sum(len(unit.encode(d)) for d in data)
    assert m.committed_chars == sum(char_count(d) for d in data) > 0
    large_chars = sum(
        char_count(r.text.vocabs["large"].table[t])
        for o in outs
        for t, w in zip(o.token_ids, o.token_models)
        if w == "large"
    )
    assert m.large_fraction_chars == pytest.approx(large_chars / m.committed_chars)
    assert m.hop_rate_large_tok == pytest.approx(m.hops / m.large_tokens)
    assert m.retokenized == m.hops and 0 <= m.refed_per_hop_mean <= m.refed_per_hop_max
    assert m.fed_per_hop_mean < m.context_per_hop_mean
    assert "large_tokens" in m.table()


def test_what_needs_one_vocabulary_is_refused_with_its_reason(toys):
    with pytest.raises(ValueError, match="CITER.*share one tokenizer.*learned head"):
        Router(toys, CITER(tau=0.5), processes=False)

    class Compose(Policy):
        needs = Needs(handoff_logits=True)

    with Router(toys, RandomRouting(p=0.3), processes=False) as r:
        with pytest.raises(ValueError, match="handoff_logits"):
            r.generate("hi", policy=Compose(), max_new_tokens=3)
        outs = r.generate([[1, 2, 3], "hi"], max_new_tokens=3, stop_token_ids=[2])
        assert "token ids" in outs[0].error and "stop_token_ids" in outs[1].error
        with pytest.raises(ValueError, match="score.*share a tokenizer"):
            r.score(["hi"], ["there"])


def test_models_of_one_tokenizer_keep_the_token_path(pair, tok):
    with Router(pair, RandomRouting(p=0.4, seed=1), tokenizer=tok, processes=False) as r:
        out = r.generate([5, 6, 7], max_new_tokens=12, ignore_eos=True)
        assert r.text is None
        assert not [e for e in r.last_run.trace if isinstance(e, Retokenized)]
    assert out.hops > 0 and len(out.token_ids) == 12


def test_a_tiny_gemma3_and_llama_share_text(toys):
    """Another architecture on each side: Gemma 3's text model (sliding windows, soft-capping)
    reading the SentencePiece toy."""
    ta, tb = toys["small"][1], toys["large"][1]
    pair = {
        "small": (toys["small"][0], ta),
        "large": (toy_lm(tb, 3, arch="gemma3", sliding_window=8, max_position_embeddings=256), tb),
    }
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=8)
    with Router(pair, RandomRouting(p=0.5, seed=9), processes=False) as r:
        outs = r.generate(PROMPTS[:3], sampling=params, concurrency=3)
    assert_equal_to_reference(r, pair, outs, lambda: RandomRouting(p=0.5, seed=9), params)
    assert sum(o.hops for o in outs) > 0


TRAINING_FREE = {
    "r2r_entropy": lambda: R2REntropy(threshold=2.0),
    "r2r_aleatoric": lambda: R2RAleatoric(threshold=1.52, k=5),
    "random_span": lambda: RandomSpanRouting(large_visit=2.0, small_visit=3.0, seed=3),
    "ensemble": lambda: TokenEnsemble([0.5, 0.5], seed=2),
    "glimprouter": lambda: GlimpRouter(theta=1.0, separator=" "),
}


@pytest.mark.parametrize("name", list(TRAINING_FREE))
def test_the_training_free_policies_equal_the_reference(toys, name):
    """The other training-free policies read their own model's distribution (entropy, top-k
    aleatoric uncertainty) or draw writers at random, so they route text as RStitch and
    RandomRouting do: equal to the reference, with both models writing."""
    make = TRAINING_FREE[name]
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=7)
    with Router(toys, make(), processes=False) as r:
        outs = r.generate(PROMPTS[:4], sampling=params, concurrency=4)
        assert all(f == u for f, u in pools_free(r).values())
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert_equal_to_reference(r, toys, outs, make, params)
    assert sum(o.hops for o in outs) > 0 and {m for o in outs for m in o.token_models} == {"small", "large"}


@pytest.mark.parametrize("head", [CITER, CoLLM, R2R])
def test_each_learned_head_is_refused_at_construction(toys, head):
    with pytest.raises(ValueError, match=f"{head.__name__}.*share one tokenizer.*learned head"):
        Router(toys, head(), processes=False)
