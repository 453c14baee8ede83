"""Hooks of the policy surface, each against the naive reference (greedy and seeded sampling,
concurrency 1 and 8, tiny float64 pair): greedy peer decoding (`Handoff.greedy`), tokens set
from both models' distributions (`Needs.handoff_logits`, `Step.set_token`), discard and
resample on the same model (`Resample`), every prompt position's hidden state
(`Needs.prompt_hidden`), and the admission prefill on peers (`EngineConfig.prefill_peers`)."""

import pytest
import torch

from tokenrouter_sdk import Handoff, Needs, Policy, Router, SamplingParams
from tokenrouter_sdk.engine import messages
from tokenrouter_sdk.policies import LargeOnly, RStitch, SmallOnly
from tokenrouter_sdk.policies.co_llm import CoLLM
from tokenrouter_sdk.policies.glimprouter import GlimpRouter
from tokenrouter_sdk.policies.query_level import QueryRouter
from tokenrouter_sdk.policy import Resample
from tokenrouter_sdk.reference import reference_generate

from ..helpers import mixed_prompts, pools_free

N_NEW = 16
GREEDY = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, temperature=1.5, seed=7)
MODES = [pytest.param(p, c, id=f"{n}-c{c}") for n, p in (("greedy", GREEDY), ("seeded", SAMPLED)) for c in (1, 8)]


def run(pair, tok, policy, params, concurrency, prompts=None, **settings):
    """Engine outputs of ``policy`` (each checked against the naive reference), the call's
    events, and the router's KV pools checked free afterwards."""
    prompts = prompts if prompts is not None else mixed_prompts(8, seed=concurrency)
    with Router(pair, policy, tokenizer=tok, **settings) as r:
        call = r.submit(prompts, sampling=params, concurrency=concurrency)
        call.wait(timeout=300)
        outs, events = call.outputs, list(call.events)
        free = pools_free(r)
    assert all(f == n for f, n in free.values()), free
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid, tokenizer=tok)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), f"rid {o.rid}"
        assert (o.hops, o.discarded) == (ref["hops"], ref["discarded"]), f"rid {o.rid}"
    return outs, events


def large_argmax(pair, o, pos):
    """The large model's greedy token for output position ``pos`` of ``o``."""
    with torch.inference_mode():
        return int(pair["large"](torch.tensor([list(o.prompt) + o.token_ids[:pos]])).logits[0, -1].argmax())


# -- a. greedy peer decoding ---------------------------------------------------------------------
class PeerSpan(Policy):
    """Every fourth position the small token is discarded and the large model writes 2 tokens
    (greedily when ``greedy``), then control returns."""

    def __init__(self, greedy):
        self.greedy = greedy

    def route(self, step):
        return "large" if step.model == "small" and step.position % 4 == 1 else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=False, span=2, greedy=self.greedy)


@pytest.mark.parametrize("params,concurrency", MODES)
def test_greedy_peer_span(pair, tok, params, concurrency):
    outs, _ = run(pair, tok, PeerSpan(greedy=True), params, concurrency)
    large = [(o, i) for o in outs for i, m in enumerate(o.token_models) if m == "large"]
    assert len(large) >= 16
    for o, i in large:  # every token of the peer span is the large model's argmax
        assert o.token_ids[i] == large_argmax(pair, o, i), (o.rid, i)
    if params is SAMPLED:  # the small model still samples: not all its tokens are its argmax
        small_greedy = []
        for o in outs[:3]:
            for i, m in enumerate(o.token_models):
                if m == "small":
                    with torch.inference_mode():
                        ids = torch.tensor([list(o.prompt) + o.token_ids[:i]])
                        small_greedy.append(o.token_ids[i] == int(pair["small"](ids).logits[0, -1].argmax()))
        assert not all(small_greedy)


def test_sampled_peer_span_without_greedy_is_not_argmax(pair, tok):
    """The control: without ``greedy`` the large model samples its span at temperature 1.5."""
    outs, _ = run(pair, tok, PeerSpan(greedy=False), SAMPLED, 8)
    large = [(o, i) for o in outs for i, m in enumerate(o.token_models) if m == "large"]
    assert sum(o.token_ids[i] != large_argmax(pair, o, i) for o, i in large) >= 4


# -- b. a token from both models' distributions -------------------------------------------------
class ProductOfExperts(Policy):
    """Odd token on the small model: discard it, the large model writes argmax(log p_small + log
    p_large) and hands back keeping it."""

    needs = Needs(logits=True, handoff_logits=True)

    def route(self, step):
        if step.model == "small":
            return "large" if step.token % 2 else "small"
        peer = step.peer_logits
        assert peer is not None and peer.shape == step.logits.shape
        step.state.setdefault("written", []).append(
            (step.position, int(step.token), int((peer.log_softmax(-1) + step.logits.log_softmax(-1)).argmax()))
        )
        step.set_token(step.state["written"][-1][2])
        return "small"

    def send(self, req, target):
        return Handoff(keep_sampled=req.owner == "large", greedy=True)


@pytest.mark.parametrize("params,concurrency", MODES)
def test_composed_token(pair, tok, params, concurrency):
    outs, _ = run(pair, tok, ProductOfExperts(), params, concurrency)
    n = 0
    for o in outs:
        for pos, m in enumerate(o.token_models):
            if m != "large":
                continue
            with torch.inference_mode():
                ids = torch.tensor([list(o.prompt) + o.token_ids[:pos]])
                ls, ll = pair["small"](ids).logits[0, -1], pair["large"](ids).logits[0, -1]
            assert o.token_ids[pos] == int((ls.log_softmax(-1) + ll.log_softmax(-1)).argmax())
            n += 1
    assert n >= 16


def test_composed_token_may_be_neither_models(pair, tok):
    """The written token is free: here the second most likely token of the large model."""

    class Second(ProductOfExperts):
        def route(self, step):
            if step.model == "small":
                return "large" if step.token % 2 else "small"
            step.set_token(int(step.logits.topk(2).indices[1]))
            return "small"

    outs, _ = run(pair, tok, Second(), GREEDY, 8)
    hits = [(o, i) for o in outs for i, m in enumerate(o.token_models) if m == "large"]
    assert hits and all(o.token_ids[i] != large_argmax(pair, o, i) for o, i in hits)


def test_handoff_logits_travel_only_when_declared(pair, tok, monkeypatch):
    from tokenrouter_sdk.engine.core import subserver

    sent = []
    orig = subserver.SubServer._handoff

    def spy(self, s, target, h, committed, token=None, peer_logits=None):
        sent.append((type(self.policies[s.config.policy_key]).__name__, h.keep_sampled, peer_logits))
        return orig(self, s, target, h, committed, token, peer_logits)

    monkeypatch.setattr(subserver.SubServer, "_handoff", spy)
    with Router(pair, tokenizer=tok) as r:
        r.generate(mixed_prompts(4), max_new_tokens=12, ignore_eos=True, policy=ProductOfExperts())
        r.generate(mixed_prompts(4), max_new_tokens=12, ignore_eos=True, policy=RStitch(tau=0.5))
    poe = [x for x in sent if x[0] == "ProductOfExperts"]
    rs = [x for x in sent if x[0] == "RStitch"]
    assert poe and rs
    assert all((p is not None) == (not keep) for _, keep, p in poe)  # discarding handoffs carry them
    assert all(p.shape == (259,) for _, keep, p in poe if p is not None)
    assert all(p is None for *_, p in rs)  # a policy that does not declare them ships nothing


def test_undeclared_peer_logits_fail_the_request_with_the_flag(pair, tok):
    class Reads(ProductOfExperts):
        needs = Needs(logits=True)

    with Router(pair, Reads(), tokenizer=tok) as r:
        with pytest.warns(RuntimeWarning):
            outs = r.generate(mixed_prompts(3), max_new_tokens=8, ignore_eos=True)
    assert any(o.finish_reason == "failed" and "handoff_logits=True" in o.error for o in outs)


@pytest.mark.parametrize("params,concurrency", MODES)
def test_co_llm_compose_is_exact(pair, tok, params, concurrency):
    """CoLLM(compose=True) writes argmax((1 - pi) p_base + pi p_asst) at each deferral, whoever's
    token that is; one assistant visit per deferral."""
    head = CoLLM.random_head(64, seed=0, bias=0.0)
    pol = CoLLM(head, eta=0.5, compose=True)
    outs, _ = run(pair, tok, pol, params, concurrency)
    n = 0
    for o in outs:
        assert o.discarded == o.token_models.count("large")
        for pos, m in enumerate(o.token_models):
            if m != "large":
                continue
            with torch.inference_mode():
                ids = torch.tensor([list(o.prompt) + o.token_ids[:pos]])
                h = pair["small"].model(input_ids=ids).last_hidden_state[0, -1]
                ls, ll = pair["small"].lm_head(h), pair["large"](ids).logits[0, -1]
                pi = float(head(h[None].float()))
            assert pi > 0.5 and o.token_ids[pos] == CoLLM.composed_token(pi, ls, ll)
            n += 1
    assert 8 <= n < 8 * N_NEW


# -- c. discard and resample on the same model --------------------------------------------------
class RedrawOdd(Policy):
    """The small model redraws an odd token up to twice, then keeps whatever it drew; every
    fifth position the large model writes a token."""

    def route(self, step):
        st = step.state
        if step.model == "small" and step.token % 2 and st.get("redraws", (None, 0)) != (step.position, 2):
            at, n = st.get("redraws", (None, 0))
            st["redraws"] = (step.position, n + 1 if at == step.position else 1)
            return Resample()
        if step.model == "small" and step.position % 5 == 4:
            return "large"
        return step.model

    def send(self, req, target):
        return Handoff(keep_sampled=req.owner == "large", span=1 if req.owner == "small" else None)


@pytest.mark.parametrize("params,concurrency", MODES)
def test_resample(pair, tok, params, concurrency):
    outs, events = run(pair, tok, RedrawOdd(), params, concurrency)
    res = [e for e in events if isinstance(e, messages.Resampled)]
    assert len(res) >= 8 and all(e.model == "small" and e.token % 2 for e in res)
    for o in outs:
        mine = [(e.position, e.token, e.model) for e in res if e.rid == o.rid]
        assert set(mine) <= set(o.discarded_log) and len(o.discarded_log) == o.discarded
        hop_discards = sum(1 for e in events if isinstance(e, messages.Hopped) and e.rid == o.rid and not e.kept)
        assert o.discarded == len(mine) + hop_discards
    if params is SAMPLED:  # redraws change the draws: fewer odd small tokens than without them
        odd = sum(t % 2 for o in outs for t, m in zip(o.token_ids, o.token_models) if m == "small")
        small = sum(m == "small" for o in outs for m in o.token_models)
        assert odd / small < 0.4


def test_endless_resample_fails_only_its_request(pair, tok):
    class Forever(Policy):
        def route(self, step):
            return Resample() if step.request.rid % 2 == 0 else step.model

    with Router(pair, Forever(), tokenizer=tok) as r:
        with pytest.warns(RuntimeWarning):
            outs = r.generate(mixed_prompts(4), max_new_tokens=6, ignore_eos=True)
        free = pools_free(r)
    assert all(f == n for f, n in free.values())
    for o in outs:
        if o.rid % 2 == 0:
            assert o.finish_reason == "failed" and "resampled output position 0" in o.error and not o.token_ids
        else:
            assert o.ok and len(o.token_ids) == 6


@pytest.mark.parametrize("params,concurrency", MODES)
def test_glimprouter_regenerated_glimpse(pair, tok, params, concurrency):
    kw = dict(theta=2.76, separator="9", max_step_tokens=6, budget=None)
    outs, _ = run(pair, tok, GlimpRouter(regenerate_glimpse=True, **kw), params, concurrency)
    base, _ = run(pair, tok, GlimpRouter(**kw), params, concurrency) if params is GREEDY else (None, None)
    for i, o in enumerate(outs):  # every glimpse is discarded: one per step
        starts, n = [0], 0
        for j, t in enumerate(o.token_ids[:-1]):
            n += 1
            if t == 57 or n == 6:
                starts.append(j + 1)
                n = 0
        assert o.discarded == len(starts), (o.rid, o.discarded, starts)
        if base is not None:  # greedy: the redraw is the same token
            assert o.token_ids == base[i].token_ids and o.token_models == base[i].token_models
            assert o.discarded >= base[i].discarded
    if base is not None:  # ... but discarded: every glimpse S kept before is redrawn now
        assert sum(o.discarded for o in outs) > sum(o.discarded for o in base)


# -- d. hidden states of every prompt position --------------------------------------------------
class RecordPrompt(Policy):
    needs = Needs(prompt_hidden=True)

    def __init__(self):
        self.seen = {}

    def route(self, step):
        ph = step.prompt_hidden
        if step.position == 0 and step.model == "small":
            self.seen[step.request.rid] = ph.clone()
        else:
            assert ph is None
        return "large" if step.position % 3 == 2 else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=True)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_prompt_hidden(pair, tok, concurrency):
    pol = RecordPrompt()
    prompts = mixed_prompts(8, seed=concurrency)
    with Router(pair, pol, tokenizer=tok) as r:
        outs = r.generate(prompts, max_new_tokens=8, ignore_eos=True, concurrency=concurrency)
    assert all(o.ok for o in outs)
    for o in outs:
        with torch.inference_mode():
            want = pair["small"].model(input_ids=torch.tensor([list(o.prompt)])).last_hidden_state[0]
        assert pol.seen[o.rid].shape == (len(o.prompt), 64)
        torch.testing.assert_close(pol.seen[o.rid], want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("params,concurrency", MODES)
def test_query_router_mean_pooling(pair, tok, params, concurrency):
    head = QueryRouter.random_head(64, seed=1)
    prompts = mixed_prompts(8, seed=6)
    with torch.inference_mode():
        p = [
            float(head(pair["small"].model(input_ids=torch.tensor([q])).last_hidden_state[0].mean(0)[None]))
            for q in prompts
        ]
    thr = sorted(p)[4]
    outs, _ = run(pair, tok, QueryRouter(head=head, threshold=thr, pooling="mean"), params, concurrency, prompts)
    for o in outs:
        large = p[prompts.index(o.prompt)] < thr
        assert o.token_models == ["large" if large else "small"] * N_NEW
    assert QueryRouter(head=head).needs == Needs(hidden=True)  # the default is unchanged
    with pytest.raises(ValueError, match="pooling must be one of"):
        QueryRouter(head=head, pooling="max")


# -- admission prefill on peers ------------------------------------------------------------------
class HandAfter(Policy):
    """The small model hands off (discarding) at position 5; the large writes two tokens
    and hands back keeping the second; again at position 11."""

    def route(self, step):
        if step.model == "small":
            return "large" if step.position in (5, 11) else "small"
        return "small" if step.position in (7, 13) else "large"

    def send(self, req, target):
        return Handoff(keep_sampled=req.owner == "large")


def fed_per_step(events, model="large"):
    """Per request: the tokens committed before its first hop to ``model``, and the tokens
    ``model`` was fed for it in each of its steps, in order (a sub-server's own events keep their
    order; how they interleave with the peer's depends on thread timing, so it is not used)."""
    committed, at_hop, fed = {}, {}, {}
    for ev in events:
        if isinstance(ev, messages.Committed):
            committed[ev.rid] = committed.get(ev.rid, 0) + len(ev.tokens)
        elif isinstance(ev, messages.Hopped) and ev.dst == model and ev.rid not in at_hop:
            at_hop[ev.rid] = committed.get(ev.rid, 0)
        elif isinstance(ev, messages.StepDone) and ev.model == model:
            for rid, n in ev.fed.items():
                fed.setdefault(rid, []).append(n)
    return at_hop, fed


@pytest.mark.parametrize("params,concurrency", MODES)
def test_prefill_peers_feeds_only_the_unseen_suffix(pair, tok, params, concurrency):
    """With ``prefill_peers`` the large model prefills each prompt at admission, so the first
    handoff feeds only the 5 tokens written since. Run in ``mode="sync"`` (a global step barrier):
    the large model's admission prefill is then its first step whatever the thread timing (in
    ``async`` a one-token prompt's 5 small steps may all end before the large model's first step
    starts, which then feeds prompt and handoff together, correctly)."""
    prompts = mixed_prompts(8, seed=concurrency)
    outs, events = run(pair, tok, HandAfter(), params, concurrency, prompts, prefill_peers=True, mode="sync")
    at_hop, fed = fed_per_step(events)
    assert set(at_hop) == {o.rid for o in outs}
    for o in outs:
        assert at_hop[o.rid] == 5
        # the admission prefill, then an extend of the 5 tokens written since (not prompt + 5)
        assert fed[o.rid][:2] == [len(o.prompt), 5]
    outs, events = run(pair, tok, HandAfter(), params, concurrency, prompts)  # the default: no admission prefill
    at_hop, fed = fed_per_step(events)
    assert all(at_hop[o.rid] == 5 and fed[o.rid][0] == len(o.prompt) + 5 for o in outs)


def test_prefill_peers_respects_may_use_and_frees_everything(pair, tok):
    prompts = mixed_prompts(8, seed=3)
    with Router(pair, tokenizer=tok, prefill_peers=True) as r:
        for pol, idle in ((SmallOnly(), "large"), (LargeOnly(), "small")):
            outs = r.generate(prompts, max_new_tokens=6, ignore_eos=True, policy=pol)
            assert all(o.ok for o in outs) and r.metrics().per_model[idle].steps == 0
        outs = r.generate(prompts, max_new_tokens=6, ignore_eos=True, policy=RStitch(tau=2.0))  # never hands off
        assert all(o.ok and o.hops == 0 for o in outs)
        # each prompt prefilled on the peer at most once (fed, or reused from the prefix cache); a
        # request that ends on the small model before the peer's prefill ran drops that prefill
        large = r.metrics().per_model["large"]
        assert large.tokens_fed + large.prefix_hit_tokens <= sum(len(p) for p in prompts)
        assert all(f == n for f, n in pools_free(r).values())  # the peers' prompt KV is released
        call = r.submit(prompts, max_new_tokens=200, ignore_eos=True, policy=HandAfter())
        call.abort()
        call.wait(timeout=60)
        assert all(o.finish_reason == "aborted" for o in call.outputs)
        assert all(f == n for f, n in pools_free(r).values())


def test_prefill_peers_survives_evicted_prefills(pair, tok):
    """With pools too small for every request at once, admission prefills are evicted (and
    recomputed on the handoff); outputs are unchanged."""
    prompts = [list(range(3, 43))] * 2 + mixed_prompts(4, seed=2)
    outs, _ = run(
        pair, tok, HandAfter(), GREEDY, 8, prompts, prefill_peers=True, max_kv_tokens=64, kv_admission="optimistic"
    )
    assert all(o.hops >= 2 for o in outs)


def test_hooks_through_processes(pair, tok, monkeypatch):
    """Sub-servers in processes: logits on the wire, `Prefill`, `Resampled` events, greedy spans
    and prompt hidden states give the reference's outputs, and every block comes back."""
    monkeypatch.delenv("TOKENROUTER_PROCESSES", raising=False)
    head = QueryRouter.random_head(64, seed=1)
    policies = [
        CoLLM(CoLLM.random_head(64, seed=0), eta=0.5, compose=True),
        RedrawOdd(),
        PeerSpan(greedy=True),
        QueryRouter(head=head, threshold=0.5, pooling="mean"),
    ]
    prompts = mixed_prompts(8, seed=11)
    with Router(pair, tokenizer=tok, processes=True, prefill_peers=True) as r:
        for pol in policies:
            outs = r.generate(prompts, sampling=SAMPLED, policy=pol, timeout=120)
            for o in outs:
                assert o.finish_reason == "length", o.error
                ref = reference_generate(pair, o.prompt, pol, SAMPLED, rid=o.rid, tokenizer=tok)
                assert (o.token_ids, o.token_models, o.hops, o.discarded) == (
                    ref["token_ids"],
                    ref["token_models"],
                    ref["hops"],
                    ref["discarded"],
                ), (pol, o.rid)
        assert all(f == n for f, n in pools_free(r).values())
