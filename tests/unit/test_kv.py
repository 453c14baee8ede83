"""KV consistency (a model's KV holds exactly the first kv_len tokens; a step feeds the unseen
suffix), pending keeps KV, nothing lost under a full pool."""

import pytest

from tokenrouter_sdk import Handoff, Policy, Router, SamplingParams
from tokenrouter_sdk.engine.core.block_allocator import BlockAllocator, KVPoolFull
from tokenrouter_sdk.engine.core.kv_pool import KVPool
from tokenrouter_sdk.engine.messages import StepDone
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import mixed_prompts, pools_free


class Scripted(Policy):
    """Token at output position i is followed by a switch to plan[i] (keeping the token)."""

    def __init__(self, plan, probe=None):
        self.plan, self.probe = plan, probe

    def route(self, step):
        if self.probe:
            self.probe(step)
        return self.plan[step.position] if step.position < len(self.plan) else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=True)


def fed_per_step(trace, rid):
    """[(model, tokens fed for rid)] in step order."""
    return [(ev.model, ev.fed[rid]) for ev in trace if isinstance(ev, StepDone) and rid in ev.fed]


def test_return_feeds_exactly_the_unseen_suffix(pair, tok):
    probes = []

    def probe(step):  # while the large model runs, the small one still holds the request's KV
        if step.model == "large":
            ss = router.engine.transport.subservers["small"]
            seq = ss.sched.seqs[step.request.rid]
            probes.append((seq.status, seq.kv_len, len(seq.table)))

    P = 7
    plan = ["small", "small", "large", "large", "large", "small"] + ["small"] * 10
    router = Router(pair, Scripted(plan, probe), tokenizer=tok, block_size=4)
    with router:
        out = router.generate([list(range(10, 10 + P))], max_new_tokens=9, ignore_eos=True)[0]
        trace = list(router.trace)
    assert out.token_models == ["small"] * 3 + ["large"] * 3 + ["small"] * 3
    # small: prefill P, decode, decode, (pending), extend by tok2 (its own, never fed) + 3 large tokens,
    # then decodes. large: prefill of prompt + 3 committed tokens, then two decodes.
    assert fed_per_step(trace, out.rid) == [
        ("small", P),
        ("small", 1),
        ("small", 1),
        ("large", P + 3),
        ("large", 1),
        ("large", 1),
        ("small", 4),
        ("small", 1),
        ("small", 1),
    ]
    # pending on small: KV of prompt + 2 tokens kept, blocks not freed: ceil((P + 2) / 4) = 3
    assert probes == [("pending", P + 2, 3)] * 3


def test_discard_then_return_recomputes_nothing_but_the_suffix(pair, tok):
    """small discards at position 2, large writes 1 token (span), small extends by that token."""

    class DiscardAt2(Policy):
        def route(self, step):
            return "large" if step.model == "small" and step.position == 2 else step.model

        def send(self, req, target):
            return Handoff(keep_sampled=False, span=1)

    P = 5
    with Router(pair, DiscardAt2(), tokenizer=tok) as r:
        out = r.generate([list(range(40, 40 + P))], max_new_tokens=5, ignore_eos=True)[0]
        trace = list(r.trace)
    assert out.token_models == ["small", "small", "large", "small", "small"]
    assert out.discarded == 1 and out.hops == 2
    assert fed_per_step(trace, out.rid) == [
        ("small", P),
        ("small", 1),
        ("small", 1),
        ("large", P + 2),
        ("small", 1),
        ("small", 1),
    ]


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_pools_return_to_initial_free_size(pair, tok, concurrency):
    with Router(pair, RandomRouting(p=0.5, seed=7), tokenizer=tok, max_kv_tokens=2048, block_size=8) as r:
        initial = {n: s.free_blocks for n, s in r.kv_stats().items()}
        outs = r.generate(mixed_prompts(10, seed=1), max_new_tokens=12, ignore_eos=True, concurrency=concurrency)
        assert all(o.finish_reason == "length" for o in outs)
        assert {n: free for n, (free, _) in pools_free(r).items()} == initial
        assert all(v == 2048 // 8 for v in initial.values())
        stats = r.kv_stats()
        assert {n: (s.free_blocks, s.num_blocks, s.block_size, s.owned, s.pending) for n, s in stats.items()} == {
            n: (256, 256, 8, 0, 0) for n in ("small", "large")
        }
    with pytest.raises(RuntimeError, match="closed"):
        r.kv_stats()


@pytest.mark.parametrize("admission", ["optimistic", "reserve"])
def test_full_pool_preempts_and_recomputes_without_loss(pair, tok, admission):
    """A pool that fits ~2 requests serves 8: admitted by count, evictions are counted; admitted
    by reservation, requests wait their turn and nothing is evicted. Outputs equal a roomy run."""
    prompts = mixed_prompts(8, seed=4)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    with Router(pair, RandomRouting(p=0.3, seed=2), tokenizer=tok, max_kv_tokens=4096) as r:
        roomy = r.generate(prompts, sampling=params)
    with Router(
        pair, RandomRouting(p=0.3, seed=2), tokenizer=tok, max_kv_tokens=64, block_size=8, kv_admission=admission
    ) as r:
        tight = r.generate(prompts, sampling=params)
        m = r.metrics()
        assert all(free == usable for free, usable in pools_free(r).values())
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert (m.preemptions > 0 if admission == "optimistic" else m.preemptions == 0) and m.failed == 0


def test_slots_are_each_position_s_block_and_offset():
    """Every [start, end) of a scattered table: slot = table[p // block_size] * block_size +
    p % block_size; a range past the table's blocks is refused, not cut short."""
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=4, num_blocks=40, block_size=8)
    table = [17, 3, 29, 0, 11]
    for start in range(0, 41, 3):
        for end in range(start, 41, 5):
            want = [table[p // 8] * 8 + p % 8 for p in range(start, end)]
            assert pool.slots(table, start, end).tolist() == want, (start, end)
    with pytest.raises(IndexError, match="5 blocks of 8"):
        pool.slots(table, 0, 41)
    with pytest.raises(IndexError):
        pool.slots(table, 6, 5)
    with pytest.raises(IndexError):
        pool.slots(table, -1, 3)
    assert pool.slots(table, 45, 45).tolist() == []  # an empty range anywhere, as before


def test_kv_pool_blocks():
    pool = KVPool(num_layers=2, kv_heads=1, head_dim=4, num_blocks=3, block_size=4)
    blocks = BlockAllocator.over(pool)
    t = []
    blocks.ensure(t, 5)
    assert len(t) == 2 and blocks.num_free == 1
    assert pool.slots(t, 3, 6).tolist() == [t[0] * 4 + 3, t[1] * 4 + 0, t[1] * 4 + 1]
    with pytest.raises(KVPoolFull):
        blocks.ensure(t, 13)
    assert len(t) == 2  # unchanged on failure
    blocks.free(t)
    assert t == [] and blocks.num_free == 3
