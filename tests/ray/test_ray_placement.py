"""Sub-servers in Ray actors (``Router(..., cluster=...)``) on a simulated two-node cluster on
loopback: small on node A, large on node B, routed output equal to the naive reference; a node
whose raylet is killed mid-call fails only what it held, naming it, the call returns within
10 s and the next call raises `EngineDeadError`; after `close()` no actor or placement group of
ours is left."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.engine.front.engine import EngineDeadError
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import DiscardTwoBack, assert_matches_reference, mixed_prompts

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def _ours_left(actors: dict, before_pgs: set) -> tuple[list, list]:
    """Actors of ours that still answer, and placement groups made since ``before_pgs`` not removed."""
    alive = []
    for name, a in actors.items():
        try:
            ray.get(a.node.remote(), timeout=10)
            alive.append(name)
        except Exception:  # noqa: BLE001 - RayActorError: gone
            pass
    pgs = [
        pid
        for pid, pg in ray.util.placement_group_table().items()
        if pid not in before_pgs and pg["state"] != "REMOVED"
    ]
    return alive, pgs


def _assert_nothing_left(actors: dict, before_pgs: set, timeout: float = 20.0) -> None:
    assert len(actors) == 2
    deadline = time.monotonic() + timeout
    while _ours_left(actors, before_pgs) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ours_left(actors, before_pgs) == ([], [])


def test_small_on_a_large_on_b_equals_the_reference(cluster, pair, tok):
    before = set(ray.util.placement_group_table())
    nodes = {
        n["Resources"].get("node_a") and "a" or n["Resources"].get("node_b") and "b": n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
    }
    r = Router(
        pair,
        DiscardTwoBack(),
        tokenizer=tok,
        cluster={"resources": {"small": {"node_a": 0.01}, "large": {"node_b": 0.01}}, "strategy": "SPREAD"},
    )
    try:
        placed = r.engine.transport.nodes
        assert placed["small"]["node_id"] == nodes["a"] and placed["large"]["node_id"] == nodes["b"]
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        outs = r.generate(mixed_prompts(5, seed=7), sampling=params)
        assert sum(o.hops for o in outs) > 0
        assert_matches_reference(pair, outs, DiscardTwoBack, params)
    finally:
        actors = dict(r.engine.transport.actors)
        r.close()
    _assert_nothing_left(actors, before)


class SlowRandom(RandomRouting):
    def route(self, step):
        time.sleep(0.003)
        return super().route(step)


def test_a_killed_node_fails_what_it_held_and_nothing_hangs(cluster, pair, tok):
    before = set(ray.util.placement_group_table())
    node_c = cluster.add_node(num_cpus=2, resources={"node_c": 1})
    r = Router(
        pair,
        SlowRandom(p=0.5, seed=3),
        tokenizer=tok,
        cluster={"resources": {"small": {"node_a": 0.01}, "large": {"node_c": 0.01}}, "strategy": "SPREAD"},
    )
    try:
        params = SamplingParams(max_new_tokens=400, ignore_eos=True)
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(r.generate, [[5, 6, 7], [8, 9]] * 3, sampling=params, timeout=120)
            time.sleep(2.0)
            assert not fut.done()
            t0 = time.monotonic()
            cluster.remove_node(node_c, allow_graceful=False)
            outs = fut.result(timeout=60)
            took = time.monotonic() - t0
        assert took < 10, took
        failed = [o for o in outs if o.error]
        assert failed and all("large" in o.error for o in failed), [o.error for o in outs]
        with pytest.raises(EngineDeadError, match="large"):
            r.generate([[5, 6]], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True), timeout=60)
    finally:
        actors = dict(r.engine.transport.actors)
        r.close()
    _assert_nothing_left(actors, before)
