"""A request's whole life: abort at every stage, KV pressure, bad tokens, dead sub-servers,
per-call settings, reproducible keys, bounded memory."""

import asyncio
import gc
import random
import threading
import time
import tracemalloc

import pytest

from tokenrouter_sdk import Handoff, Policy, Router
from tokenrouter_sdk.models import tiny_model
from tokenrouter_sdk.policies import RandomRouting, TokenEnsemble

from ..helpers import Alternate, HandTo, ScriptedRunner, StayOn, interrupt_main_after, mixed_prompts, pools_free

TOKENS = list(range(65, 91))  # 'A'..'Z' on the byte tokenizer


def scripted_pair(delay_s=0.0, **kw):
    return {
        "small": ScriptedRunner(lambda p: TOKENS[p % 26], delay_s=delay_s, **kw),
        "large": ScriptedRunner(lambda p: TOKENS[(p + 3) % 26], delay_s=delay_s, **kw),
    }


def committed_after(router, rid, t):
    return [
        ev
        for ev in router.engine.recent
        if getattr(ev, "rid", None) == rid and type(ev).__name__ == "Committed" and ev.t > t
    ]


# ---- abort -------------------------------------------------------------------------------
class SlowLarge(Policy):
    """Hands off to the large model at position 2; the large model keeps the request."""

    def route(self, step):
        if step.model == "small" and step.position >= 2:
            return "large"
        return step.model

    def send(self, req, target):
        return Handoff(keep_sampled=True)


@pytest.mark.parametrize("stage", ["queued", "running", "pending", "returned"])
def test_cancel_agenerate_aborts_at_every_stage(tok, stage):
    """Cancelling the task aborts its request wherever it is; nothing is committed afterwards and
    every KV block comes back (repeated, with block counts checked after each)."""
    pair = scripted_pair(delay_s=0.01)
    policy = {
        "queued": StayOn("small"),
        "running": StayOn("small"),
        "pending": HandTo("large", after=2),
        "returned": Alternate(),
    }[stage]
    with Router(pair, policy, tokenizer=tok) as r:
        for rep in range(50):
            # "queued": two requests at concurrency 1, the second waits behind the first
            prompts = [[5, 6], [7, 8, 9]] if stage == "queued" else [[7, 8, 9]]

            async def main():
                task = asyncio.ensure_future(r.agenerate(prompts, max_new_tokens=400, ignore_eos=True, concurrency=1))
                while not r.engine.active_calls():
                    await asyncio.sleep(0.001)
                h = r.engine.active_calls()[0][0]
                want = {"queued": 1, "running": 2, "pending": 3, "returned": 4}[stage] + rep % 3
                while len(h.output.token_ids) < want:  # the stage is reached (varied by a step or two)
                    await asyncio.sleep(0.001)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return time.perf_counter()

            t_cancel = asyncio.run(main())
            free = pools_free(r)
            assert all(f == n for f, n in free.values()), (rep, free)
            run = r.last_run  # the partial result of the cancelled call
            assert run is not None and [o.finish_reason for o in run] == ["aborted"] * len(prompts), run
            assert all(len(o.token_ids) < 400 for o in run)
            if stage == "queued":
                assert run[1].token_ids == []
            for o in run:
                assert not committed_after(r, o.rid, t_cancel + 0.05)
            if stage in ("pending", "returned"):
                assert run[0].hops >= 1  # it was handed off before the cancel
        assert r.generate([[1, 2]], max_new_tokens=5, ignore_eos=True)[0].ok  # still usable


def test_abort_handle_and_stream_close(tok):
    with Router(scripted_pair(delay_s=0.005), Alternate(), tokenizer=tok) as r:
        call = r.submit([[3, 4], [5, 6]], max_new_tokens=1000, ignore_eos=True)
        time.sleep(0.05)
        r.abort(call[0])
        call[1].abort()
        call.wait(timeout=10)
        assert [h.output.finish_reason for h in call] == ["aborted", "aborted"]
        assert all(0 < len(h.output.token_ids) < 1000 for h in call)
        n = len(call[0].output.token_ids)
        time.sleep(0.05)
        assert len(call[0].output.token_ids) == n  # nothing committed after the abort
        it = r.stream([7, 8], max_new_tokens=1000, ignore_eos=True)
        got = [next(it) for _ in range(5)]
        assert len(got) == 5
        it.close()  # closing the stream aborts its request
        assert r.last_output.finish_reason == "aborted"
        assert all(f == n for f, n in pools_free(r).values())


def test_keyboard_interrupt_in_generate_aborts_the_call(tok):
    with Router(scripted_pair(delay_s=0.005), Alternate(), tokenizer=tok) as r:
        with interrupt_main_after(0.15), pytest.raises(KeyboardInterrupt):
            r.generate([[3, 4], [5, 6], [7, 8]], max_new_tokens=5000, ignore_eos=True)
        assert all(o.finish_reason == "aborted" for o in r.last_run)
        assert all(f == n for f, n in pools_free(r).values())
        t = time.perf_counter()
        assert r.generate([[1, 2]], max_new_tokens=5, ignore_eos=True)[0].ok
        assert time.perf_counter() - t < 2.0


# ---- KV pressure -------------------------------------------------------------------------
def test_request_outgrowing_the_pool_fails_alone_and_never_hangs(tok, pair):
    with Router(pair, RandomRouting(0.3), tokenizer=tok, max_kv_tokens=64) as r:
        outs = r.generate([[7] * 50, [5, 6]], max_new_tokens=100, ignore_eos=True, timeout=60)
        assert outs[0].finish_reason == "failed"
        assert "KV pool" in outs[0].error and "64 tokens" in outs[0].error and "max_kv_tokens" in outs[0].error
        assert outs[1].finish_reason == "failed" or outs[1].ok
        assert all(f == n for f, n in pools_free(r).values())


@pytest.mark.parametrize("admission", ["reserve", "optimistic"])
def test_random_pool_sizes_never_hang(admission):
    """Random pools, prompt lengths and routing (sim backend): every request ends within a step
    bound and the pools come back whole."""
    rnd = random.Random(0)
    for case in range(12):
        kv = rnd.choice([32, 48, 64, 96, 160, 256])
        n = rnd.randint(1, 12)
        prompts = [[5 + rnd.randrange(200)] * rnd.randint(1, 80) for _ in range(n)]
        new = rnd.randint(1, 60)
        with Router(
            {"small": None, "large": None},
            RandomRouting(rnd.random(), seed=case),
            backend="sim",
            max_kv_tokens=kv,
            block_size=8,
            kv_admission=admission,
        ) as r:
            outs = r.generate(
                prompts, max_new_tokens=new, ignore_eos=True, concurrency=rnd.choice([None, 2, 4]), timeout=60
            )
            for p, o in zip(prompts, outs):
                assert o.finish_reason in ("length", "failed"), (case, o.finish_reason, o.error)
                if len(p) + new <= kv:  # it fits alone: it must finish
                    assert o.finish_reason == "length", (case, kv, len(p), new, o.error)
                else:
                    assert o.finish_reason == "length" or "KV pool" in o.error
            assert all(f == n for f, n in pools_free(r).values()), case


# ---- bad tokens, dead sub-servers ----------------------------------------------------------
def test_padding_rows_are_never_sampled(tok):
    """The large model has 300 logits for a 259-token tokenizer and its padding rows win every
    draw: they are masked, so no request fails and no id >= 259 is written."""
    pair = {
        "small": ScriptedRunner(lambda p: 70),
        "large": ScriptedRunner(lambda p: 71, vocab_size=300, pad_from=259, pad_peak=50.0),
    }
    with Router(pair, Alternate(), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(6), max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert all(t < 259 for o in outs for t in o.token_ids)


class BoomRunner(ScriptedRunner):
    def forward(self, seqs):
        raise SystemExit("the large model's worker died")


def test_dead_sub_server_fails_only_its_requests(tok):
    pair = {"small": ScriptedRunner(lambda p: 70, delay_s=0.005), "large": BoomRunner(lambda p: 71)}
    with Router(pair, StayOn("small"), tokenizer=tok) as r:
        call = r.submit([[3, 4], [5, 6]], max_new_tokens=40, ignore_eos=True)
        doomed = r.submit([[9, 9]], max_new_tokens=40, ignore_eos=True, policy=HandTo("large", after=1))
        call.wait(timeout=10)
        doomed.wait(timeout=10)
        assert [h.output.finish_reason for h in call] == ["length", "length"]  # never touched 'large'
        assert doomed[0].output.finish_reason == "failed" and "'large'" in doomed[0].output.error
        t = time.perf_counter()
        stats = r.kv_stats(timeout=30)
        assert time.perf_counter() - t < 2.0
        assert stats["large"].alive is False and stats["small"].alive
        with pytest.raises(RuntimeError, match="'large'"):
            r.generate([[1, 2]], max_new_tokens=3)


class DiesAt(ScriptedRunner):
    """Its sub-server dies at its ``n``-th forward (once: a restarted one serves)."""

    def __init__(self, *a, n: int, **kw):
        super().__init__(*a, **kw)
        self.n = n

    def forward(self, seqs):
        if self.forwards + 1 == self.n:
            self.forwards += 1
            raise SystemExit("the large model's worker died")
        return super().forward(seqs)


class VisitOnce(Policy):
    """Small writes position 0, large position 1 (keeping the token), small the rest."""

    def route(self, step):
        return "large" if step.model == "small" and step.position == 0 else "small"

    def send(self, req, target):
        return Handoff(keep_sampled=True)


def test_a_dead_sub_server_restarted_serves_again(tok):
    """The large sub-server dies at its second forward: the request that routed there fails, so
    does one whose KV it kept (pending: it visited and went back), one that never reached it
    goes on; new requests get a clear error until `Router.restart`, then are served, and every
    pool is whole."""
    pair = {"small": ScriptedRunner(lambda p: 70, delay_s=0.005), "large": DiesAt(lambda p: 71, n=2)}
    with Router(pair, StayOn("small"), tokenizer=tok) as r:
        initial = {m: (n, n) for m, (_, n) in pools_free(r).items()}
        bystander = r.submit([[3, 4]], max_new_tokens=120, ignore_eos=True)
        pending = r.submit([[5, 6]], max_new_tokens=120, ignore_eos=True, policy=VisitOnce())
        deadline = time.monotonic() + 10
        while len(pending[0].output.token_ids) < 3:  # visited large and came back: its KV waits there
            assert time.monotonic() < deadline
            time.sleep(0.01)
        doomed = r.submit([[9, 9]], max_new_tokens=40, ignore_eos=True, policy=HandTo("large", after=1))
        for call in (bystander, pending, doomed):
            call.wait(timeout=10)
        assert bystander[0].output.finish_reason == "length"
        assert doomed[0].output.finish_reason == "failed" and "'large'" in doomed[0].output.error
        out = pending[0].output
        assert out.finish_reason == "failed" and "model 'large' died while it held this request" in out.error
        with pytest.raises(RuntimeError, match=r"router.restart\('large'\)"):
            r.generate([[1, 2]], max_new_tokens=3)
        assert r.restart() == ["large"]
        outs = r.generate([[5, 6], [7, 8]], policy=VisitOnce(), max_new_tokens=6, ignore_eos=True)
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert [o.token_models for o in outs] == [["small", "large", "small", "small", "small", "small"]] * 2
        assert all(s.alive for s in r.kv_stats().values())
        assert pools_free(r) == initial
        with pytest.raises(RuntimeError, match="is running; only a dead one is restarted"):
            r.restart("large")
        with pytest.raises(ValueError, match="no model 'huge'"):
            r.restart("huge")


# ---- per-call settings, keys, memory -------------------------------------------------------
def test_concurrent_calls_keep_their_own_concurrency_and_metrics(tok):
    with Router(scripted_pair(delay_s=0.002), Alternate(), tokenizer=tok) as r:
        res = {}

        def run(name, conc, n):
            outs = r.generate([[3 + i, 4] for i in range(n)], max_new_tokens=20, ignore_eos=True, concurrency=conc)
            res[name] = (outs, r.metrics())

        ts = [threading.Thread(target=run, args=("a", 1, 3)), threading.Thread(target=run, args=("b", None, 5))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert r.engine.config.max_concurrency is None
        (oa, ma), (ob, mb) = res["a"], res["b"]
        assert ma.requests == 3 and mb.requests == 5
        assert ma.committed_tokens == 60 and mb.committed_tokens == 100
        assert oa.metrics().requests == 3 and ob.metrics().requests == 5
        # call a ran one request at a time: its admissions never overlapped
        adm = [ev for ev in oa.trace if type(ev).__name__ == "Admitted"]
        fin = [ev for ev in oa.trace if type(ev).__name__ == "Finished"]
        assert len(adm) == 3 and all(adm[i + 1].t >= fin[i].t for i in range(2))


@pytest.mark.parametrize("policy", [lambda: RandomRouting(0.5, seed=3), lambda: TokenEnsemble(seed=3)])
def test_seeded_policies_route_the_same_in_every_call(pair, tok, policy):
    prompts = mixed_prompts(4, seed=9)
    with Router(pair, policy(), tokenizer=tok) as r:
        a = r.generate(prompts, max_new_tokens=12, ignore_eos=True)
        b = r.generate(prompts, max_new_tokens=12, ignore_eos=True)
        alone = r.generate([prompts[2]], max_new_tokens=12, ignore_eos=True)
        keyed = r.generate(prompts[:2], max_new_tokens=12, ignore_eos=True, keys=["x", "y"])
        keyed2 = r.generate(prompts[:2], max_new_tokens=12, ignore_eos=True, keys=["x", "y"])
    assert [o.token_models for o in a] == [o.token_models for o in b]
    assert alone[0].token_models == a[2].token_models
    assert [o.token_models for o in keyed] == [o.token_models for o in keyed2]
    assert len({tuple(o.token_models) for o in a}) > 1  # requests still draw differently


def test_memory_does_not_grow_with_requests_served(pair, tok):
    """10,000 requests on a tiny pair: the engine keeps nothing of finished calls, and the
    memory held after 10,000 equals that after 100 (tracemalloc, within noise)."""
    with Router(pair, RandomRouting(0.3), tokenizer=tok) as r:

        def serve(n):
            for _ in range(n // 500):
                outs = r.generate([[5 + i % 50, 6] for i in range(500)], max_new_tokens=2, ignore_eos=True)
                assert all(o.ok for o in outs)
            del outs
            r.last_run = None
            gc.collect()

        serve(500)
        tracemalloc.start()
        serve(500)
        base = tracemalloc.get_traced_memory()[0]
        serve(10_000)
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert not r.engine.active_calls() and not r.engine.handles
        assert len(r.engine.recent) <= r.engine.recent.maxlen
        assert grown < 2_000_000, f"memory grew {grown} bytes over 10,000 requests"
        for ss in r.engine.transport.subservers.values():
            assert not ss.sched.seqs and len(ss.policies) <= 1 and len(ss.aborted) == 0


class Flag(Policy):
    def __init__(self):
        self.to_large = False

    def route(self, step):
        return "large" if self.to_large else "small"


def test_edited_policy_reaches_process_sub_servers(tok):
    pair = {"small": tiny_model(num_layers=1, seed=1), "large": tiny_model(num_layers=2, seed=2)}
    pol = Flag()
    with Router(pair, pol, tokenizer=tok, processes=True) as r:
        a = r.generate([[3, 4, 5]], max_new_tokens=4, ignore_eos=True)[0]
        pol.to_large = True
        b = r.generate([[3, 4, 5]], max_new_tokens=4, ignore_eos=True)[0]
    assert set(a.token_models) == {"small"}
    assert "large" in b.token_models


def test_kv_gauges_split_running_and_pending(tok):
    """While the large model writes, the small model's blocks of the request are pending; the
    gauges in kv_stats() and in the metrics say so."""
    pair = scripted_pair(delay_s=0.01, block_size=4)
    with Router(pair, HandTo("large", after=2), tokenizer=tok) as r:
        call = r.submit([[3] * 10], max_new_tokens=40, ignore_eos=True)
        h = call[0]
        while h.output.hops == 0 or len(h.output.token_ids) < 6:
            time.sleep(0.005)
        st = r.kv_stats()
        assert st["small"].pending == 1 and st["small"].pending_blocks >= 3 and st["small"].running_blocks == 0
        assert st["large"].owned == 1 and st["large"].running_blocks >= 3 and st["large"].pending_blocks == 0
        call.wait(30)
        m = call.metrics()
        assert m.per_model["small"].kv_pending_blocks_peak >= 3
        assert m.per_model["large"].kv_blocks_peak >= 13 // 4 and m.per_model["large"].kv_pending_blocks_peak == 0


def test_kv_reservation_that_limits_a_call_says_so(pair, tok):
    with Router(pair, RandomRouting(0.3), tokenizer=tok, max_kv_tokens=256, block_size=16) as r:
        with pytest.warns(RuntimeWarning, match=r"at most 1 ran at once.*max_kv_tokens"):
            outs = r.generate([[5, 6]] * 3, max_new_tokens=200, ignore_eos=True)
        assert all(o.ok for o in outs)
        adm = [ev for ev in outs.trace if type(ev).__name__ == "Admitted"]
        fin = [ev for ev in outs.trace if type(ev).__name__ == "Finished"]
        assert adm[1].t >= fin[0].t  # one at a time: the second waited for the first


def test_a_pool_held_by_someone_else_fails_the_request_instead_of_waiting(tok):
    """A runner given to two Routers: the second finds the pool full with no request of its own
    holding it, and fails its request with the reason instead of spinning forever."""
    runner = ScriptedRunner(lambda p: 70, delay_s=0.01, max_kv_tokens=16, block_size=4)
    with Router({"m": runner}, tokenizer=tok) as a, Router({"m": runner}, tokenizer=tok) as b:
        hog = a.submit([[3] * 13], max_new_tokens=3, ignore_eos=True)
        while not hog[0].output.token_ids:
            time.sleep(0.002)
        out = b.generate([4] * 6, max_new_tokens=3, ignore_eos=True, timeout=10)
        assert out.finish_reason == "failed" and "another engine" in out.error
        hog.wait(10)


def test_abort_through_processes_frees_every_block(tok):
    """The same abort path with sub-servers in processes: a request aborted while it is pending
    on one model and owned by the other ends at once, and both processes free its KV."""
    pair = {"small": tiny_model(num_layers=1, seed=1), "large": tiny_model(num_layers=2, seed=2)}
    with Router(pair, Alternate(), tokenizer=tok, processes=True, max_kv_tokens=4096) as r:
        for _ in range(3):
            call = r.submit([[3, 4, 5], [6, 7]], max_new_tokens=400, ignore_eos=True)
            while len(call[0].output.token_ids) < 20:
                time.sleep(0.002)
            r.abort(call)
            call.wait(10)
            assert [h.output.finish_reason for h in call] == ["aborted", "aborted"]
            n = [len(h.output.token_ids) for h in call]
            time.sleep(0.1)
            assert [len(h.output.token_ids) for h in call] == n
            assert all(f == total for f, total in pools_free(r).values())
        assert r.generate([3, 4], max_new_tokens=4, ignore_eos=True).ok


class SlowStay(Policy):
    """Requests whose prompt starts with 9 go to the large model; the others stay on the small one."""

    def route(self, step):
        time.sleep(0.005)
        return "large" if step.request.prompt_ids[0] == 9 else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=True)


def test_killed_process_fails_only_the_requests_it_held(tok):
    import os
    import signal

    pair = {"small": tiny_model(num_layers=1, seed=1), "large": tiny_model(num_layers=2, seed=2)}
    with Router(pair, SlowStay(), tokenizer=tok, processes=True) as r:
        call = r.submit([[3, 4], [5, 6], [9, 9]], max_new_tokens=150, ignore_eos=True)
        while len(call[2].output.token_ids) < 3:
            time.sleep(0.002)
        os.kill(r.engine.transport.pids()["large"], signal.SIGKILL)
        call.wait(30)
        assert [h.output.finish_reason for h in call] == ["length", "length", "failed"]
        assert "'large'" in call[2].output.error and "SIGKILL" in call[2].output.error
        t = time.perf_counter()
        stats = r.kv_stats(timeout=30)
        assert time.perf_counter() - t < 2.0 and not stats["large"].alive
        assert stats["small"].free_blocks == stats["small"].num_blocks
        with pytest.raises(RuntimeError, match="model 'large'"):
            r.generate([3, 4], max_new_tokens=3)


def test_policy_error_in_a_process_names_the_file_and_shows_the_line(tok, tmp_path):
    """A policy pickled by value (defined in a script or a notebook cell) keeps its file name and
    source lines in the sub-server process, so its error points at the line that raised."""
    import linecache

    src = (
        "from tokenrouter_sdk import Policy\n\nclass Bad(Policy):\n    def route(self, step):\n"
        "        raise ValueError('the policy broke here')\n"
    )
    fn = str(tmp_path / "cell_17.py")  # a file that exists only in this process's linecache
    linecache.cache[fn] = (len(src), None, src.splitlines(True), fn)
    ns: dict = {"__name__": "__main__"}
    exec(compile(src, fn, "exec"), ns)
    pair = {"small": tiny_model(num_layers=1, seed=1), "large": tiny_model(num_layers=2, seed=2)}
    with Router(pair, ns["Bad"](), tokenizer=tok, processes=True) as r:
        with pytest.warns(RuntimeWarning):
            out = r.generate([3, 4], max_new_tokens=3)
    assert out.finish_reason == "failed"
    assert f"{fn}:5" in out.error, out.error
    assert "raise ValueError('the policy broke here')" in out.traceback
