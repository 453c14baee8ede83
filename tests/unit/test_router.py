"""Router facade: sampling, stopping, streaming, async, lifecycle, metrics, asynchrony."""

import asyncio
import time

import pytest

from tokenrouter_sdk import Handoff, Policy, Router, SamplingParams
from tokenrouter_sdk.engine.messages import Admitted, Finished, StepDone
from tokenrouter_sdk.policies import LargeOnly, RandomRouting, RStitch
from tokenrouter_sdk.reference import reference_generate

from ..helpers import mixed_prompts

PROMPTS = mixed_prompts(6, seed=3)


def test_same_seed_same_output_and_seeds_differ(pair, tok):
    params = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, ignore_eos=True)
    with Router(pair, RStitch(tau=0.79), tokenizer=tok) as r:
        x = r.generate(PROMPTS, seed=7, **params)
        y = r.generate(PROMPTS, seed=7, concurrency=1, **params)
        z = r.generate(PROMPTS, seed=8, **params)
    assert [o.token_ids for o in x] == [o.token_ids for o in y]
    assert [o.token_models for o in x] == [o.token_models for o in y]
    assert [o.token_ids for o in x] != [o.token_ids for o in z]
    # seeded sampling equals the reference drawing from the same per-(seed, model) generators
    p = SamplingParams(seed=7, **params)
    for o in x:
        assert o.token_ids == reference_generate(pair, o.prompt, RStitch(tau=0.79), p, rid=o.rid)["token_ids"]


def test_top_k_1_is_greedy(pair, tok):
    with Router(pair, RStitch(tau=0.79), tokenizer=tok) as r:
        g = r.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        k1 = r.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, temperature=0.7, top_k=1, seed=3)
    assert [o.token_ids for o in g] == [o.token_ids for o in k1]


def test_eos_and_stop_strings(pair, tok):
    with Router(pair, LargeOnly(), tokenizer=tok) as r:
        free = r.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True)
        text = free.text
        # pick a stop string from the middle of the free-running text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop
        cut = r.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True, stop=[stop])
        assert cut.finish_reason == "stop"
        assert cut.text == text[: text.find(stop)]
        assert cut.token_ids == free.token_ids[: len(cut.token_ids)]

        eos = tok.eos_token_id

        # EOS: these prompts' greedy runs end on EOS or on length; both must match the reference
        out = r.generate(PROMPTS, max_new_tokens=40)
        for o in out:
            ref = reference_generate(
                pair, o.prompt, LargeOnly(), SamplingParams(max_new_tokens=40), eos_ids=(eos,), rid=o.rid
            )
            assert o.token_ids == ref["token_ids"]
            assert o.finish_reason == ref["finish_reason"]
            if o.finish_reason == "eos":
                assert o.token_ids[-1] == eos and o.token_ids.count(eos) == 1
        assert {o.finish_reason for o in out} == {"eos", "length"}


def test_stream_matches_generate(pair, tok):
    pol = RStitch(tau=0.79)
    with Router(pair, pol, tokenizer=tok) as r:
        events = list(r.stream(PROMPTS[1], max_new_tokens=12, ignore_eos=True))
        final = r.last_output
        ref = r.generate(PROMPTS[1], max_new_tokens=12, ignore_eos=True)
    assert [e.token_id for e in events] == ref.token_ids == final.token_ids
    assert [e.model for e in events] == ref.token_models
    assert "".join(e.text for e in events) == tok.decode(ref.token_ids)


def test_agenerate_and_generate_inside_running_loop(pair, tok):
    """Jupyter runs an event loop in the kernel thread: generate must still work there."""

    async def main(r):
        a = await r.agenerate(PROMPTS, max_new_tokens=8, ignore_eos=True, concurrency=2)
        assert r.engine.config.max_concurrency is None  # the per-call concurrency does not stick
        b = r.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)  # sync call while a loop runs
        s = [e async for e in r.astream(PROMPTS[0], max_new_tokens=8, ignore_eos=True)]
        return a, b, s

    with Router(pair, RandomRouting(0.0), tokenizer=tok) as r:
        a, b, s = asyncio.run(main(r))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [e.token_id for e in s] == a[0].token_ids
    admits = [ev for ev in a.trace if isinstance(ev, Admitted)]
    finishes = [ev for ev in a.trace if isinstance(ev, Finished)]
    assert admits[2].t >= finishes[0].t  # concurrency=2: the third request waited for a finish


def test_policy_defined_in_a_cell_with_per_request_state(pair, tok):
    class EveryOther(Policy):  # counts its own handoffs in per-request state
        def route(self, step):
            step.state["n"] = step.state.get("n", 0) + 1
            return step.state["n"] % 4 == 0

        def send(self, req, target):
            req.state.setdefault("sent", []).append(target)
            return Handoff(keep_sampled=True)

    with Router(pair, EveryOther(), tokenizer=tok) as r:
        outs = r.generate(PROMPTS, max_new_tokens=16, ignore_eos=True)
    for o in outs:
        assert o.token_models[:4] == ["small"] * 4 and o.token_models[4:8] == ["large"] * 4
        assert o.hops == 3


def test_metrics_are_consistent_with_outputs(pair, tok):
    with Router(pair, RandomRouting(0.4, seed=5), tokenizer=tok) as r:
        outs = r.generate(PROMPTS + [""], max_new_tokens=10, ignore_eos=True)
        m = r.metrics()
    ok = [o for o in outs if o.ok]
    n = sum(len(o.token_ids) for o in ok)
    assert m.requests == 7 and m.failed == 1
    assert m.committed_tokens == n == 60
    assert m.hops == sum(o.hops for o in outs) and m.hop_rate == pytest.approx(m.hops / n)
    assert m.discarded_tokens == sum(o.discarded for o in outs)
    assert m.large_fraction == pytest.approx(sum(o.token_models.count("large") for o in ok) / n)
    assert m.per_model["large"].committed_tokens + m.per_model["small"].committed_tokens == n
    assert m.throughput_tok_s == pytest.approx(n / m.wall_s)
    assert 0 < m.mean_ttft_s <= m.mean_latency_s <= m.wall_s
    assert sum(m.per_model["small"].batch_size_hist.values()) == m.per_model["small"].steps > 0
    assert 0 < m.per_model["small"].forward_fraction <= 1
    assert all(0 <= o.ttft_s <= o.latency_s for o in ok)


def test_models_step_concurrently(pair, tok):
    """While the large model is busy, the small one keeps decoding its other requests."""

    class SlowLarge(Policy):  # the large model's route runs (no forced span) and takes 50 ms
        def route(self, step):
            if step.model == "large":
                time.sleep(0.05)
                return "small"
            return "large" if step.token % 5 == 0 else "small"

        def send(self, req, target):
            return Handoff(keep_sampled=(req.owner == "large"))

    with Router(pair, SlowLarge(), tokenizer=tok) as r:
        r.generate(mixed_prompts(8, seed=1), max_new_tokens=20, ignore_eos=True)
        steps = [ev for ev in r.trace if isinstance(ev, StepDone)]
    large = [(s.t_start, s.t_end) for s in steps if s.model == "large"]
    small = [(s.t_start, s.t_end) for s in steps if s.model == "small"]
    inside = sum(any(a < s0 and s1 < b for a, b in large) for s0, s1 in small)
    assert large and inside >= 5, f"only {inside} small steps ran during a large step"


def test_close_is_idempotent_and_frees(pair, tok):
    r = Router(pair, tokenizer=tok)
    r.generate(PROMPTS[:2], max_new_tokens=4)
    r.close()
    r.close()
    assert r.closed
    assert all(ss.runner.pool.k is None for ss in r.engine.transport.subservers.values())
    del r  # the autouse fixture checks that no tokenrouter thread is left


def test_rebinding_a_router_without_close_frees_threads_and_kv(pair, tok):
    """What re-running a notebook cell does: `router = Router(...)` again, never closing the old one."""
    import gc
    import threading
    import weakref

    def alive():
        return sum(t.name.startswith("tokenrouter") and t.is_alive() for t in threading.enumerate())

    base = alive()
    router = Router(pair, RandomRouting(0.3), tokenizer=tok)
    router.generate(PROMPTS[:2], max_new_tokens=4)
    pools = [weakref.ref(ss.runner.pool.k) for ss in router.engine.transport.subservers.values()]
    for _ in range(3):
        router = Router(pair, RandomRouting(0.3), tokenizer=tok)  # noqa: F841 - the old one is dropped
        router.generate(PROMPTS[:2], max_new_tokens=4)
    del router
    gc.collect()
    deadline = time.time() + 10
    while alive() > base and time.time() < deadline:
        time.sleep(0.05)
    assert alive() == base
    assert all(p() is None for p in pools)  # the first Router's KV tensors are gone
