"""Routing semantics, reference equivalence and defaults of GlimpRouter, TokenEnsemble and the
query-level policies (sources in each policy module's docstring)."""

import math

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams, StepBatch
from tokenrouter_sdk.policies.ensemble import TokenEnsemble
from tokenrouter_sdk.policies.glimprouter import GlimpRouter, topk_entropy
from tokenrouter_sdk.policies.heads import HeadMissingError, save_head
from tokenrouter_sdk.policies.query_level import (
    QueryHead,
    QueryRouter,
    RandomQueryRouting,
    load_query_head,
    save_query_head,
)
from tokenrouter_sdk.policy import request_draw, weighted_pick
from tokenrouter_sdk.reference import reference_generate
from tokenrouter_sdk.request import RequestView, prompt_key

from ..helpers import mixed_prompts


def view_of(o):
    """The `RequestView` key a policy saw for output ``o`` (the default key of a unique prompt)."""
    return RequestView(
        rid=o.rid,
        prompt_ids=list(o.prompt),
        output_ids=[],
        owner="",
        state={},
        hops=0,
        models=(),
        key=prompt_key(o.prompt),
    )


MODELS = ("small", "large")
N_NEW = 24
N_EQ = 16  # new tokens per request in the equivalence tests (the reference recomputes every prefix)


def run_and_compare(models, tok, policy, prompts, concurrency, n_new=N_EQ):
    """Engine outputs, each checked against the naive reference (same tokens, writers, hops)."""
    params = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    with Router(models, policy, tokenizer=tok) as r:
        outs = r.generate(prompts, sampling=params, concurrency=concurrency)
        steps = {m: s.steps for m, s in r.metrics().per_model.items()}
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(models, o.prompt, policy, params, rid=o.rid, tokenizer=tok)
        assert o.token_ids == ref["token_ids"], f"rid {o.rid}"
        assert o.token_models == ref["token_models"]
        assert (o.hops, o.discarded) == (ref["hops"], ref["discarded"])
    return outs, steps


# -- GlimpRouter ---------------------------------------------------------------------------

V = 259
FLAT = torch.full((V,), -30.0, dtype=torch.float64).index_fill(0, torch.arange(20), 0.0)  # H = log 20
PEAKED = torch.full((V,), -30.0, dtype=torch.float64).index_fill(0, torch.tensor([0]), 0.0)  # H ~ 0


def one_step(model, token, out, state, logits, tok):
    view = RequestView(rid=0, prompt_ids=[1], output_ids=list(out), owner=model, state=state, hops=0, models=MODELS)
    return StepBatch(model, list(MODELS), torch.tensor([token]), logits[None], torch.zeros(1, 4), [view], tok)[0]


def drive(pol, tok, script, flat=()):
    """Run ``pol`` on a scripted answer as the engine would: whoever writes position i samples
    ``script[i]``; the small model's logits are flat (H = log 20) at positions in ``flat``,
    peaked (H ~ 0) elsewhere. Returns (writer per position as 'S'/'L', discarded positions, state)."""
    ids, out, who, discarded, owner, st = list(script.encode()), [], "", [], "small", {}
    while len(out) < len(ids):
        i, t = len(out), ids[len(out)]
        dec = pol.route(one_step(owner, t, out, st, FLAT if owner == "small" and i in flat else PEAKED, tok))
        view = RequestView(rid=0, prompt_ids=[1], output_ids=out, owner=owner, state=st, hops=0, models=MODELS)
        keep = dec == owner or pol.send(view, dec).keep_sampled
        if keep:
            out.append(t)
            who += owner[0].upper()
        else:
            discarded.append(i)
        owner = dec
    return who, discarded, st


def test_glimprouter_defaults_match_spec():
    g = GlimpRouter()
    assert (g.theta, g.top_k, g.separator, g.max_step_tokens, g.budget) == (1.0, 20, "\n\n", 512, 8192)
    assert (g.answer_marker, g.stop_on_repeat, g.regenerate_glimpse) == ("</think>", True, False)
    assert g.needs.topk == 20 and GlimpRouter(top_k=5).needs.topk == 5
    assert GlimpRouter(regenerate_glimpse=True).regenerate_glimpse is True  # tests/unit/test_hooks.py


def test_topk_entropy_renormalises_the_top_20():
    assert topk_entropy(FLAT) == pytest.approx(math.log(20))
    assert topk_entropy(PEAKED) < 1e-9
    forty = torch.zeros(40, dtype=torch.float64)  # full entropy log 40, top-20 renormalised: log 20
    assert topk_entropy(forty) == pytest.approx(math.log(20))
    assert topk_entropy(torch.tensor([0.0, 0.0, -1e9])) == pytest.approx(math.log(2))  # V < k


def test_glimprouter_steps(tok):
    pol = GlimpRouter()
    # high-entropy glimpse at step 1: discarded, L writes "ab\n\n" (separator kept), then S glimpses again
    who, disc, st = drive(pol, tok, "ab\n\ncd\n\nef", flat={0})
    assert (who, disc) == ("LLLLSSSSSS", [0])
    assert [(p, w) for p, _, w in st["glimpses"]] == [(0, "large"), (4, "small"), (8, "small")]
    assert st["glimpses"][0][1] == pytest.approx(math.log(20)) and st["glimpses"][1][1] < 1e-9
    assert drive(pol, tok, "ab\n\ncd\n\nef", flat={4})[:2] == ("SSSSLLLLSS", [4])
    # a step that starts with "\n" is not over before its own "\n\n"
    assert drive(pol, tok, "a\n\n\nb\n\nc", flat={3})[:2] == ("SSSLLLLS", [3])
    # the step cap ends a step without a separator
    assert drive(GlimpRouter(max_step_tokens=3), tok, "abcdefg", flat={3})[:2] == ("SSSLLLS", [3])


def test_glimprouter_answer_phase(tok):
    # the token completing "</think>" is kept, then L writes everything (also past "\n\n")
    who, disc, st = drive(GlimpRouter(), tok, "ab</think>x\n\nyz")
    assert (who, disc, st["answer"]) == ("S" * 10 + "L" * 5, [], True)
    assert drive(GlimpRouter(), tok, "a</think>b\n\ncd", flat={0})[:2] == ("L" * 14, [0])
    assert drive(GlimpRouter(answer_marker=None), tok, "ab</think>x\n\nyz")[0] == "S" * 15
    # budget: the first step end with >= budget tokens starts the answer
    assert drive(GlimpRouter(budget=6), tok, "ab\n\ncd\n\nef\n\n")[0] == "S" * 8 + "L" * 4
    # three steps, the last two identical: the loop stop starts the answer
    assert drive(GlimpRouter(), tok, "ab\n\n" * 4)[0] == "S" * 12 + "L" * 4
    assert drive(GlimpRouter(stop_on_repeat=False), tok, "ab\n\n" * 4)[0] == "S" * 16


def test_glimprouter_needs_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        GlimpRouter().route(one_step("small", 97, [], {}, PEAKED, None))


def test_glimprouter_engine_steps(pair, tok):
    """On the tiny pair (separator "9" = byte 57, steps <= 6 tokens): every step has one writer,
    L exactly when S's glimpse at the step start had H >= theta, one discard per L step."""
    glimpses = {}

    class Rec(GlimpRouter):
        def route(self, step):
            d = super().route(step)
            if step.model == "small" and step.position == step.state["glimpses"][-1][0]:
                glimpses.setdefault(step.request.rid, []).append(step.state["glimpses"][-1])
            return d

    theta, cap = 2.76, 6  # about the median top-20 entropy of the tiny small model
    with Router(pair, Rec(theta=theta, separator="9", max_step_tokens=cap), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(8, seed=1), max_new_tokens=N_NEW, ignore_eos=True)
    n_large_steps = 0
    for o in outs:
        starts, n = [0], 0
        for i, t in enumerate(o.token_ids[:-1]):
            n += 1
            if t == 57 or n == cap:
                starts.append(i + 1)
                n = 0
        g = glimpses[o.rid]
        assert [p for p, _, _ in g] == starts
        large = [w == "large" for _, _, w in g]
        assert large == [h >= theta for _, h, _ in g]
        bounds = starts + [len(o.token_ids)]
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            assert set(o.token_models[a:b]) == {"large" if large[k] else "small"}
        assert o.discarded == sum(large)
        assert o.hops == 2 * sum(large) - large[-1]
        n_large_steps += sum(large)
        if o.rid == outs[0].rid:  # the glimpse is S's top-20 entropy at the step start
            for p, h, _ in g:
                ids = torch.tensor([o.prompt + o.token_ids[:p]])
                logits = pair["small"](ids).logits[0, -1]
                assert h == pytest.approx(topk_entropy(logits), abs=1e-6)
    assert 0 < n_large_steps < sum(len(g) for g in glimpses.values())


def test_glimprouter_engine_answer_marker_and_budget(pair, tok):
    # theta above log 20: S writes every step; after the first "9" L writes the rest
    with Router(pair, GlimpRouter(theta=10.0, answer_marker="9"), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(8, seed=1), max_new_tokens=N_NEW, ignore_eos=True)
        budget = r.generate(
            mixed_prompts(4, seed=1),
            max_new_tokens=N_NEW,
            ignore_eos=True,
            policy=GlimpRouter(theta=10.0, max_step_tokens=4, budget=10),
        )
    switched = 0
    for o in outs:
        k = o.token_ids.index(57) + 1 if 57 in o.token_ids[:-1] else len(o.token_ids)
        assert o.token_models == ["small"] * k + ["large"] * (len(o.token_ids) - k)
        assert o.discarded == 0 and o.hops == (k < len(o.token_ids))
        switched += k < len(o.token_ids)
    assert switched >= 2
    for o in budget:  # steps of 4 tokens: the step ending at 12 >= 10 tokens starts the answer
        assert o.token_models == ["small"] * 12 + ["large"] * 12 and o.hops == 1


@pytest.mark.parametrize("concurrency", [1, 8])
def test_glimprouter_equivalence(pair, tok, concurrency):
    pol = GlimpRouter(theta=2.76, separator="9", max_step_tokens=6, budget=10)
    outs, _ = run_and_compare(pair, tok, pol, mixed_prompts(8, seed=concurrency), concurrency)
    assert sum(o.discarded for o in outs) >= 4 and {m for o in outs for m in o.token_models} == set(MODELS)


# -- TokenEnsemble ---------------------------------------------------------------------------


def test_ensemble_defaults_and_validation(trio, tok):
    assert TokenEnsemble().probs(["s", "m", "l"]) == pytest.approx([0.5, 0.3, 0.2])
    assert TokenEnsemble().probs(MODELS) == [0.5, 0.5]
    assert TokenEnsemble({"l": 3, "s": 1}).probs(["s", "m", "l"]) == [0.25, 0.0, 0.75]
    assert TokenEnsemble([2, 2]).probs(MODELS) == [0.5, 0.5] and TokenEnsemble().seed == 0
    for bad, msg in (([0.5, -0.1], "non-negative"), ([0, 0], "sum to > 0"), ([float("nan"), 1], "non-negative")):
        with pytest.raises(ValueError, match=msg):
            TokenEnsemble(bad)
    with pytest.raises(ValueError, match="2 weights for 3 models"):
        TokenEnsemble([1, 1]).probs(["s", "m", "l"])
    with Router(trio, tokenizer=tok) as r:  # an unknown name fails the request with a clear error
        o = r.generate(mixed_prompts(1), max_new_tokens=4, policy=TokenEnsemble({"s": 1, "huge": 1}))[0]
    assert o.finish_reason == "failed" and "unknown models ['huge']" in o.error


def test_ensemble_draws_every_writer(trio, tok):
    """Writer of position i = the weighted pick of `request_draw(seed, request, i)`; tokens kept."""
    w = {"s": 0.5, "m": 0.3, "l": 0.2}
    with Router(trio, TokenEnsemble(w, seed=7), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(8, seed=3), max_new_tokens=30, ignore_eos=True)
    counts = dict.fromkeys(w, 0)
    for o in outs:
        want = [weighted_pick(list(w), list(w.values()), request_draw(7, view_of(o), i)) for i in range(30)]
        assert o.token_models == want
        assert o.discarded == 0 and o.hops == sum(a != b for a, b in zip(want, want[1:]))
        for m in want:
            counts[m] += 1
    assert [round(c / 240, 1) for c in counts.values()] == [0.5, 0.3, 0.2]  # 240 draws


@pytest.mark.parametrize("concurrency", [1, 8])
def test_ensemble_equivalence(trio, pair, tok, concurrency):
    outs, _ = run_and_compare(trio, tok, TokenEnsemble(seed=concurrency), mixed_prompts(8, seed=4), concurrency)
    assert {m for o in outs for m in o.token_models} == {"s", "m", "l"} and sum(o.hops for o in outs) > 20
    if concurrency == 8:  # two models, weights as a list
        outs, _ = run_and_compare(pair, tok, TokenEnsemble([0.7, 0.3], seed=1), mixed_prompts(8, seed=5), 8, n_new=10)
        assert sum(o.hops for o in outs) > 8 and all(o.discarded == 0 for o in outs)


# -- query-level routing ---------------------------------------------------------------------


def small_prompt_hidden(pair, prompt):
    """The small model's last-layer hidden state (after the final norm) at the last prompt token."""
    return pair["small"].get_decoder()(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]


def test_query_router_refuses_without_head(tmp_path, monkeypatch):
    from tokenrouter_sdk.policies import heads

    monkeypatch.setattr(heads, "packaged_head_path", lambda k, pair=None: tmp_path / f"smollm2_{k}_head.pt")
    with pytest.raises(
        HeadMissingError,
        match="no packaged query head .* is missing.*tokenrouter train query --pair smollm2 --package.*random_head",
    ):
        QueryRouter()
    monkeypatch.undo()
    with pytest.raises(HeadMissingError, match="nope.pt' does not exist"):
        QueryRouter(head=tmp_path / "nope.pt")
    save_head(tmp_path / "other.pt", "citer", {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="holds a 'citer' head, but a 'query' head was expected"):
        QueryRouter(head=tmp_path / "other.pt")
    assert QueryRouter(head=QueryRouter.random_head(8)).threshold == 0.5
    assert RandomQueryRouting().p == 0.5


def test_query_head_save_load(tmp_path):
    head = QueryRouter.random_head(64, seed=3, hidden_dim=16)
    head.mu += 0.5
    save_query_head(head, tmp_path / "q.pt", meta={"small": "tiny"})
    d = torch.load(tmp_path / "q.pt", weights_only=True)
    assert (
        (d["format"], d["kind"]) == ("tokenrouter-head", "query")
        and d["config"] == {"hidden_size": 64, "hidden_dim": 16}
        and d["meta"]["small"] == "tiny"
    )
    loaded = load_query_head(tmp_path / "q.pt")
    h = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(loaded(h), head(h))
    assert ((head(h) > 0) & (head(h) < 1)).all() and isinstance(QueryRouter(head=tmp_path / "q.pt")._head, QueryHead)


def test_query_router_decides_once_from_the_prompt(pair, tok):
    """p = head(small's hidden at the last prompt token); p < threshold -> the small token at
    position 0 is discarded and the large model writes the whole answer; else the small one."""
    head = QueryRouter.random_head(64, seed=1)
    prompts = mixed_prompts(8, seed=6)
    with torch.inference_mode():
        p = [float(head(small_prompt_hidden(pair, q)[None])) for q in prompts]
    thr = sorted(p)[4]  # half of the prompts go to the large model
    with Router(pair, QueryRouter(head=head, threshold=thr), tokenizer=tok) as r:
        outs = r.generate(prompts, max_new_tokens=12, ignore_eos=True)
    for o, pi in zip(outs, p):
        large = pi < thr
        assert o.token_models == ["large" if large else "small"] * 12
        assert (o.hops, o.discarded) == ((1, 1) if large else (0, 0))
    assert sum(pi < thr for pi in p) == 4


def test_query_router_hidden_size_mismatch_fails_the_request(pair, tok):
    with Router(pair, QueryRouter(head=QueryRouter.random_head(32)), tokenizer=tok) as r:
        o = r.generate(mixed_prompts(1), max_new_tokens=3)[0]
    assert o.finish_reason == "failed" and "hidden size 32" in o.error and "64" in o.error


@pytest.mark.parametrize("concurrency", [1, 8])
def test_query_level_equivalence(pair, tok, concurrency):
    pol = QueryRouter(head=QueryRouter.random_head(64, seed=2, hidden_dim=16), threshold=0.5)
    outs, _ = run_and_compare(pair, tok, pol, mixed_prompts(8, seed=concurrency), concurrency, n_new=10)
    assert all(o.hops <= 1 and len(set(o.token_models)) == 1 for o in outs)
    outs, _ = run_and_compare(
        pair, tok, RandomQueryRouting(0.5, seed=1), mixed_prompts(8, seed=2), concurrency, n_new=6
    )
    assert all(o.hops == 0 for o in outs) and {o.token_models[0] for o in outs} == set(MODELS)


def test_random_query_routing_enters_on_the_chosen_model(pair, tok):
    prompts = mixed_prompts(8, seed=7)
    with Router(pair, tokenizer=tok) as r:
        outs = r.generate(prompts, max_new_tokens=6, ignore_eos=True, policy=RandomQueryRouting(0.4, seed=5))
        for o in outs:
            large = request_draw(5, view_of(o), 0) < 0.4
            assert o.token_models == ["large" if large else "small"] * 6 and o.hops == o.discarded == 0
        assert len({o.token_models[0] for o in outs}) == 2
    for p, idle in ((1.0, "small"), (0.0, "large")):  # the other model never runs, not even a prefill
        with Router(pair, RandomQueryRouting(p), tokenizer=tok) as r:
            r.generate(prompts, max_new_tokens=3, ignore_eos=True)
            assert r.metrics().per_model[idle].steps == 0
    with pytest.raises(ValueError, match="p must be in"):
        RandomQueryRouting(p=-0.1)
