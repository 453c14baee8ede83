"""The server, planner, demo, CLI, training and evaluation reach the engine through the Router's
public surface: no module outside `router.py` and `engine/` reads ``<router>.engine``, and the
Router members they use answer the engine's values."""

import ast
from pathlib import Path

from tests.helpers import mixed_prompts
from tokenrouter_sdk import Router
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.engine import messages
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tokenrouter_sdk"
# (file, expression) allowed to read a Router's engine outside router.py and engine/
PENDING: set[tuple[str, str]] = set()


def engine_reads() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tokenrouter_sdk/router.py" or rel.startswith("tokenrouter_sdk/engine/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "engine":
                found.add((rel, ast.unparse(node)))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "engine"
            ):
                found.add((rel, ast.unparse(node)))
    return found


def test_no_module_outside_the_router_reaches_into_the_engine():
    found = engine_reads()
    assert found <= PENDING, sorted(found - PENDING)


def test_router_surface_answers_the_engines_values(pair, tok):
    with Router(pair, RandomRouting(p=0.5, seed=3), tokenizer=tok, max_kv_tokens=256, block_size=16) as r:
        assert r.kv_capacity == {"small": (16, 16), "large": (16, 16)}
        stats = r.kv_stats()
        assert {m: (s.num_blocks, s.block_size) for m, s in stats.items()} == r.kv_capacity
        assert r.vocab_limit == pair["large"].config.vocab_size
        assert r.dead == {} and r.transport_name == "ThreadTransport"
        assert r.pids() is None and r.child_threads is None  # sub-servers in threads
        assert r.config.backend == "torch" and r.request_counts() == {"in_flight": 0, "waiting": 0}
        assert set(r.runners) == {"small", "large"} and r.runners["large"].model is pair["large"]
        assert r.thresholds == {"small": 1, "large": 1}
        r.set_thresholds({"small": 3})
        assert r.thresholds == {"small": 3, "large": 1}
        r.thresholds["small"] = 9  # a copy
        assert r.thresholds["small"] == 3
        r.set_thresholds({"small": 1})

        seen = []
        remove = r.add_observer(seen.append)
        r.generate(mixed_prompts(2, seed=1), max_new_tokens=6, ignore_eos=True)
        steps = [ev for ev in seen if isinstance(ev, messages.StepDone)]
        assert steps and sum(ev.model == "large" for ev in steps) > 0
        assert sum(isinstance(ev, messages.Finished) for ev in seen) == 2
        remove()
        last = r.trace
        n = len(seen)
        reqs = r.requests(mixed_prompts(2, seed=2), sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
        call = r.submit_unplanned(reqs, r.policy, concurrency=1)
        call.wait(30)
        assert [h.output.finish_reason for h in call] == ["length", "length"]
        assert len(seen) == n  # removed: sees nothing more
        assert r.trace == last  # not this thread's last call
        recent = r.recent_events()
        assert recent[-len(call.events) :] == list(call.events)


def test_router_surface_of_the_sim_backend():
    lat = {"small": LatencyModel({1: 0.01}), "large": LatencyModel({1: 0.02})}
    with Router(lat, backend="sim", thresholds={"small": 2}, mode="delayed") as r:
        assert r.transport_name == "SimTransport" and r.pids() is None and r.child_threads is None
        assert r.thresholds == {"small": 2, "large": 1}
        assert r.config.backend == "sim" and r.dead == {}
