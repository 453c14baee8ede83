"""The prefix cache: full KV blocks shared by content, across requests, calls and handoffs.

Outputs with the cache equal outputs without it and the naive reference (greedy, float64 pair,
every schedule mode, handoffs both ways, discarded tokens, forced spans, admission prefills);
blocks are reference-counted and every reference comes back; a hit needs equal tokens; idle
cached blocks are evicted least recently used before anything is preempted; the KV reservation
counts a shared prompt block once."""

import collections
import random
import threading

import pytest

from tokenrouter_sdk import Handoff, Needs, Policy, Router, SamplingParams
from tokenrouter_sdk.engine.core.block_allocator import BlockAllocator, KVPoolFull
from tokenrouter_sdk.engine.core.prefix_cache import block_key, chain_keys
from tokenrouter_sdk.engine.core.scheduler import Scheduler, Seq
from tokenrouter_sdk.engine.messages import Admitted, Finished
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate
from tokenrouter_sdk.request import RequestConfig, prompt_key

from ..helpers import DiscardTwoBack, KeepEveryThird, pools_free

N_NEW = 12


def shared_prompts(n=8, prefix_len=37, seed=0, vocab=259):
    """``n`` prompts behind one shared prefix: distinct tails of mixed length, an exact duplicate,
    a prompt that is the bare prefix and one that is a prefix of another prompt."""
    rnd = random.Random(seed)
    prefix = [rnd.randrange(3, vocab) for _ in range(prefix_len)]
    tails = [[rnd.randrange(3, vocab) for _ in range(L)] for L in (1, 3, 9, 16, 21, 30)]
    out = [prefix + t for t in tails] + [prefix + tails[2], prefix]
    return out[:n]


def all_refs_returned(router):
    """Every block of every in-process pool is unreferenced; free + idle cached blocks equal the
    pool's size."""
    assert router.engine.wait_idle(10)
    for name, ss in router.engine.transport.subservers.items():
        pool = ss.sched.blocks
        assert all(r == 0 for r in pool.refs), (name, [i for i, r in enumerate(pool.refs) if r])
        assert len(pool._free) + pool.idle_cached_blocks == pool.num_blocks == pool.num_free, name


def guard_writes(router):
    """Make every in-process runner fail the test when a step would write K/V into a block the
    prefix cache holds (cached blocks are read-only); returns the list of violations."""
    bad = []
    for name, ss in router.engine.transport.subservers.items():
        runner, pool = ss.runner, ss.sched.blocks
        inner = runner.forward

        def forward(inputs, inner=inner, pool=pool, name=name):
            bs = pool.block_size
            for x in inputs:
                for p in range(x.start, x.start + len(x.tokens)):
                    if pool.cache.holds(x.table[p // bs]):
                        bad.append((name, x.table[p // bs], p))
            return inner(inputs)

        runner.forward = forward
    return bad


def check_reference(models, outs, policy, params):
    """The outputs of one call equal the reference (each request's key as the engine derives it:
    from its prompt and how many equal prompts came before it in the call)."""
    seen = collections.Counter()
    for o in outs:
        key = prompt_key(list(o.prompt), seen[tuple(o.prompt)])
        seen[tuple(o.prompt)] += 1
        ref = reference_generate(models, o.prompt, policy, params, rid=o.rid, key=key)
        assert o.token_ids == ref["token_ids"], o.index
        assert o.token_models == ref["token_models"], o.index
        assert (o.hops, o.discarded) == (ref["hops"], ref["discarded"]), o.index


# -- the pool --------------------------------------------------------------------------------
def _pool(blocks=8, bs=4):
    p = BlockAllocator(blocks, bs)
    p.enable_prefix_cache()
    return p


def test_blocks_are_shared_by_content_and_reference_counted():
    pool, toks = _pool(), list(range(10, 20))  # 10 tokens: 2 full blocks of 4 and a partial one
    keys, t1 = [], []
    pool.ensure(t1, 10)
    pool.register(t1, toks, keys, 0, 2)
    assert pool.cached_blocks == 2 and [pool.refs[b] for b in t1] == [1, 1, 1]
    got = pool.match(toks + [99], [], 2)
    assert got == t1[:2] and [pool.refs[b] for b in t1] == [2, 2, 1]
    pool.free(t1)
    assert pool.idle_cached_blocks == 0 and pool.num_free == 8 - 2
    pool.free(list(got))
    assert pool.idle_cached_blocks == 2 and pool.num_free == 8 and all(r == 0 for r in pool.refs)
    again = pool.match(toks, [], 2)  # idle blocks are found again and leave the idle set
    assert again == got and pool.idle_cached_blocks == 0
    assert pool.match([10, 11, 12, 0] + toks[4:], [], 2) == []  # first block differs: nothing from the chain


def test_a_key_match_needs_equal_tokens():
    """A stored key whose block holds other tokens (a forced collision) is never served."""
    pool = _pool()
    t = []
    pool.ensure(t, 4)
    pool.cache.add(block_key(b"", [1, 2, 3, 4]), t[0], [9, 9, 9, 9])
    assert pool.match([1, 2, 3, 4, 5], [], 1) == []
    assert pool.match([9, 9, 9, 9, 5], [], 1) == []  # right tokens, wrong key: also no hit


def test_chain_keys_depend_on_every_earlier_block():
    a, b = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2), chain_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[1] != b[1] and len(a[0]) == 32
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, a[:1]) == a


def test_idle_cached_blocks_are_evicted_lru_tail_first_before_the_pool_is_full():
    pool = _pool(blocks=6, bs=2)
    a, b = [], []
    pool.ensure(a, 6)
    pool.register(a, [1, 2, 3, 4, 5, 6], [], 0, 3)
    pool.ensure(b, 4)
    pool.register(b, [7, 8, 9, 10], [], 0, 2)
    pool.free(a)  # a's tail is the first in line
    pool.free(b)
    assert pool.num_free == 6 and pool.idle_cached_blocks == 5
    c = []
    pool.ensure(c, 4)  # 1 free block + the least recently used idle one: a's last block
    assert pool.idle_cached_blocks == 4
    assert pool.match([1, 2, 3, 4, 5, 6, 0], [], 3) == a_prefix(pool, [1, 2, 3, 4], 2)
    with pytest.raises(KVPoolFull):
        pool.ensure(c, 100)
    assert len(c) == 2


def a_prefix(pool, tokens, n):
    """The blocks the cache holds for the first ``n`` blocks of ``tokens`` (references released)."""
    got = pool.match(tokens, [], n)
    pool.free(list(got))
    return got


# -- the scheduler ---------------------------------------------------------------------------
def _seq(rid, tokens):
    from tokenrouter_sdk import SamplingParams as SP

    return Seq(RequestConfig(rid, list(tokens), SP(), 0, (), str(rid)), list(tokens))


def test_a_request_waits_one_step_to_share_a_prefix_its_batch_mate_fills():
    pool = BlockAllocator(32, 4)
    sch = Scheduler(pool, prefix_cache=True)
    prompt = list(range(3, 3 + 18))
    a, b = _seq(0, prompt), _seq(1, prompt + [50, 51])
    sch.add_owned(a)
    sch.add_owned(b)
    assert sch.schedule() == [a]  # b's first block is being filled by a
    a.kv_len = len(a.tokens)
    sch.cache_blocks([a])
    assert sch.schedule() == [a, b]
    assert b.table[:4] == a.table[:4] and b.kv_len == 16 and b.n_cached == 4
    assert sch.hit_tokens == 16 and sch.query_tokens == 0  # b arrived (and was counted) in the first step
    assert (sch.total_hit_tokens, sch.total_query_tokens) == (16, 18 + 20)
    assert a.table[4] != b.table[4]  # the block each still writes into is its own


def test_rewind_into_a_shared_block_recomputes_from_its_start_in_a_block_of_its_own():
    pool = BlockAllocator(16, 4)
    sch = Scheduler(pool, prefix_cache=True)
    a = _seq(0, list(range(3, 11)))  # 8 tokens = 2 full blocks
    sch.add_owned(a)
    sch.schedule()
    a.kv_len = 8
    sch.cache_blocks([a])
    shared = list(a.table)
    sch.rewind(a, 7)
    assert a.kv_len == 4 and a.table == shared[:1] and a.n_cached == 1
    assert pool.refs[shared[1]] == 0 and pool.cache.holds(shared[1])  # still cached, idle
    assert sch.schedule() == [a] and a.table[1] != shared[1]


# -- the engine ------------------------------------------------------------------------------
class ForcedSpan(Policy):
    """small hands to large on even tokens, discarding; large writes a span of 2 and returns."""

    def route(self, step):
        return "large" if step.model == "small" and step.token % 2 == 0 else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=False, span=2)


POLICIES = {
    "discard": DiscardTwoBack,
    "keep": KeepEveryThird,
    "span": ForcedSpan,
    "random": lambda: RandomRouting(p=0.4, seed=2),
}


@pytest.mark.parametrize("mode", ["async", "delayed", "sync", "model_sync"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_output_with_the_cache_equals_the_reference_and_the_output_without_it(pair, tok, mode, policy):
    prompts = shared_prompts()
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    kw = dict(
        tokenizer=tok, block_size=4, mode=mode, thresholds={"small": 2, "large": 2} if mode == "delayed" else None
    )
    runs = {}
    for cache in (False, True):
        with Router(pair, POLICIES[policy](), prefix_cache=cache, **kw) as r:
            first = r.generate(prompts, sampling=params, concurrency=4)
            second = r.generate(prompts, sampling=params)  # a second call: the first one's blocks are cached
            st = r.kv_stats()
            all_refs_returned(r)
        runs[cache] = (first, second, st)
    (a1, a2, st_off), (b1, b2, st_on) = runs[False], runs[True]
    for x, y in zip(a1 + a2, b1 + b2):
        assert (x.token_ids, x.token_models, x.hops, x.discarded) == (y.token_ids, y.token_models, y.hops, y.discarded)
    check_reference(pair, b1, POLICIES[policy](), params)
    assert sum(o.hops for o in b1) > 0
    assert all(s.prefix_hit_tokens == 0 and s.prefix_query_tokens > 0 and not s.prefix_cache for s in st_off.values())
    assert st_on["small"].prefix_hit_tokens > 0 and st_on["large"].prefix_hit_tokens > 0


@pytest.mark.parametrize("prefill_peers", [False, True])
def test_first_visits_and_admission_prefills_reuse_the_cache(pair, tok, prefill_peers):
    prompts = shared_prompts()
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    fed = {}
    for cache in (False, True):
        with Router(
            pair, DiscardTwoBack(), tokenizer=tok, block_size=4, prefill_peers=prefill_peers, prefix_cache=cache
        ) as r:
            outs = r.generate(prompts, sampling=params, concurrency=2)
            fed[cache] = outs.metrics().per_model["large"].tokens_fed
            m = outs.metrics().per_model["large"]
            all_refs_returned(r)
        check_reference(pair, outs, DiscardTwoBack(), params)
    assert fed[True] < fed[False] - 100  # the large model's first visits took the shared prefix from the cache
    assert 0 < m.prefix_hit_rate <= 1 and m.prefix_hit_tokens > 100


def test_a_ping_pong_at_a_block_boundary_never_writes_a_shared_block(pair, tok):
    """Both models discard at the first position: the entry model recomputes its last prompt
    position, which lies in a full block that is cached (and shared with the next request)."""

    class PingPong(Policy):
        def route(self, step):
            n = step.state.get("pp", 0)
            if step.position == 0 and n < 2:
                step.state["pp"] = n + 1
                return "large" if step.model == "small" else "small"
            return step.model

        def send(self, req, target):
            return Handoff(keep_sampled=False)

    base = list(range(40, 56))  # 16 tokens = 4 blocks of 4
    prompts = [base, base, base + [7, 8, 9, 10], base]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with Router(pair, PingPong(), tokenizer=tok, block_size=4) as r:
        bad = guard_writes(r)
        outs = r.generate(prompts, sampling=params, concurrency=1)
        outs2 = r.generate(prompts, sampling=params, concurrency=4)
        all_refs_returned(r)
    assert bad == []
    check_reference(pair, outs, PingPong(), params)
    check_reference(pair, outs2, PingPong(), params)
    assert all(o.discarded == 2 for o in outs)


def test_prompt_hidden_policies_feed_every_prompt_position(pair, tok):
    seen = []

    class Pooled(Policy):
        needs = Needs(prompt_hidden=True)

        def route(self, step):
            if step.position == 0:
                seen.append(step.prompt_hidden.shape[0])
            return step.model

    prompts = shared_prompts(4)
    with Router(pair, Pooled(), tokenizer=tok, block_size=4) as r:
        r.generate(prompts, max_new_tokens=2, ignore_eos=True)
        r.generate(prompts, max_new_tokens=2, ignore_eos=True)
    assert sorted(seen) == sorted([len(p) for p in prompts] * 2)


def test_the_reservation_counts_a_shared_prompt_block_once(pair, tok):
    """Pool of 12 blocks of 16; 8 prompts of 68 tokens behind a 64-token prefix, 8 new tokens:
    76 tokens = 5 blocks each. Without the cache at most 2 fit at once; with it, 4 prompt blocks
    are shared and each request reserves 1 of its own."""
    prefix = list(range(20, 84))
    prompts = [prefix + [90 + i] * 4 for i in range(8)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    most = {}
    for cache in (False, True):
        with Router(pair, DiscardTwoBack(), tokenizer=tok, max_kv_tokens=12 * 16, prefix_cache=cache) as r:
            with pytest.warns(RuntimeWarning) if not cache else _nothing():
                outs = r.generate(prompts, sampling=params)
            run, peak = 0, 0
            for ev in outs.trace:
                run += isinstance(ev, Admitted) - isinstance(ev, Finished)
                peak = max(peak, run)
            most[cache] = peak
            assert outs.metrics().preemptions == 0
            all_refs_returned(r)
        check_reference(pair, outs, DiscardTwoBack(), params)
    assert most[False] == 2 and most[True] >= 6


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_abort_mid_prefill_and_a_failed_request_leave_the_sharer_unaffected(pair, tok):
    prefix = list(range(20, 120))
    prompts = [prefix + [5], prefix + [6], prefix + [7]]

    class FailSecond(DiscardTwoBack):
        def route(self, step):
            if step.request.prompt_ids[-1] == 6:
                raise RuntimeError("this request's policy fails")
            return super().route(step)

    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with Router(pair, FailSecond(), tokenizer=tok, block_size=4) as r:
        call = r.submit(prompts, sampling=params)
        call[0].abort()  # aborted before or during its prefill
        call.wait(30)
        outs = [h.output for h in call]
        all_refs_returned(r)
        again = r.generate([prompts[2]], sampling=params)[0]
    assert outs[0].finish_reason == "aborted" and outs[1].finish_reason == "failed"
    check_reference(pair, [outs[2]], DiscardTwoBack(), params)
    check_reference(pair, [again], DiscardTwoBack(), params)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_never_hang_never_serve_wrong_blocks_and_return_every_reference(pair, tok, seed):
    rnd = random.Random(seed)
    prompts = []
    for _ in range(rnd.randint(4, 10)):
        base = shared_prompts(8, prefix_len=rnd.choice([5, 16, 23]), seed=rnd.randrange(3))
        prompts.append(rnd.choice(base)[: rnd.randint(1, 60)])
    bs = rnd.choice([2, 4, 8])
    kv = rnd.choice([96, 160, 400])
    params = SamplingParams(max_new_tokens=rnd.randint(4, 14), ignore_eos=True)
    policy = RandomRouting(p=rnd.random() * 0.6, seed=seed)
    with Router(
        pair,
        policy,
        tokenizer=tok,
        block_size=bs,
        max_kv_tokens=kv,
        kv_admission=rnd.choice(["reserve", "optimistic"]),
        prefill_peers=rnd.random() < 0.5,
    ) as r:
        bad = guard_writes(r)
        call = r.submit(prompts, sampling=params, concurrency=rnd.choice([None, 2, 4]))
        victims = rnd.sample(range(len(prompts)), k=rnd.randint(0, 2))
        timer = threading.Timer(rnd.random() * 0.05, lambda: [call[i].abort() for i in victims])
        timer.start()
        call.wait(60)
        timer.cancel()
        outs = [h.output for h in call]
        all_refs_returned(r)
    assert bad == []
    seen = collections.Counter()
    for o in outs:
        key = prompt_key(list(o.prompt), seen[tuple(o.prompt)])
        seen[tuple(o.prompt)] += 1
        if o.finish_reason == "length":
            ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid, key=key)
            assert o.token_ids == ref["token_ids"], (seed, o.index)
        else:
            assert o.finish_reason in ("aborted", "failed"), o.finish_reason
            assert o.finish_reason == "aborted" or "too small" in o.error, o.error


def test_metrics_and_stats_report_cached_blocks_and_the_hit_rate(pair, tok):
    prompts = shared_prompts(6)
    with Router(pair, DiscardTwoBack(), tokenizer=tok, block_size=4) as r:
        first = r.generate(prompts, max_new_tokens=4, ignore_eos=True, concurrency=1)
        second = r.generate(prompts, max_new_tokens=4, ignore_eos=True)
        pools_free(r)
        st = r.kv_stats()
        table = st.table() if hasattr(st, "table") else None
    m1, m2 = first.metrics().per_model["small"], second.metrics().per_model["small"]
    assert m2.prefix_hit_rate > m1.prefix_hit_rate > 0.3  # later prompts of the first call share the prefix
    assert m2.tokens_fed < m1.tokens_fed
    s = st["small"]
    assert s.prefix_cache and s.cached_blocks >= 9 and s.idle_cached_blocks == s.cached_blocks
    assert 0 < s.hit_rate < 1 and s.free_blocks == s.num_blocks
    assert "hit" in (table or repr(st))


def test_clear_prefix_cache_gives_a_later_call_the_state_of_a_new_router(pair, tok):
    """After `Router.clear_prefix_cache` a call feeds what it fed on a new Router (no block of
    an earlier call is reused), and every block is free again after it."""
    prompts = shared_prompts(4)
    with Router(pair, DiscardTwoBack(), tokenizer=tok, block_size=4) as r:
        fresh = r.generate(prompts, max_new_tokens=4, ignore_eos=True, concurrency=1).metrics()
        warm = r.generate(prompts, max_new_tokens=4, ignore_eos=True, concurrency=1).metrics()
        r.clear_prefix_cache()
        cleared = r.generate(prompts, max_new_tokens=4, ignore_eos=True, concurrency=1).metrics()
        free = pools_free(r)
    assert all(f == n for f, n in free.values())
    for name in ("small", "large"):
        assert warm.per_model[name].tokens_fed < fresh.per_model[name].tokens_fed
        assert cleared.per_model[name].tokens_fed == fresh.per_model[name].tokens_fed
        assert cleared.per_model[name].prefix_hit_tokens == fresh.per_model[name].prefix_hit_tokens


@pytest.mark.timeout(180)
def test_processes_share_prefixes_and_match_the_reference(pair, tok, monkeypatch):
    monkeypatch.delenv("TOKENROUTER_PROCESSES", raising=False)
    prompts = shared_prompts()
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with Router(pair, DiscardTwoBack(), tokenizer=tok, block_size=4, processes=True) as r:
        first = r.generate(prompts, sampling=params, concurrency=3, timeout=120)
        second = r.generate(prompts, sampling=params, timeout=120)
        st = r.kv_stats()
        free = pools_free(r)
    check_reference(pair, first, DiscardTwoBack(), params)
    check_reference(pair, second, DiscardTwoBack(), params)
    assert all(f == n for f, n in free.values())
    assert st["small"].prefix_hit_tokens > 0 and st["large"].prefix_hit_tokens > 0
    assert second.metrics().per_model["small"].prefix_hit_rate > 0.5
