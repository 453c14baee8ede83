"""Sub-server processes cost a handful of file descriptors per model pair, not one per weight
tensor: three pairs of 40-layer models (about 365 weight tensors each) serve side by side under
the common soft limit of 1,024 open files; where a limit is too low, the soft limit is raised
within the hard one (logged), or the error names ``ulimit -n`` and the numbers.

Each check runs in a fresh interpreter (`run_script`), whose limits it sets with
`resource.setrlimit`."""

import json

import pytest

from tokenrouter_sdk.engine.transports.wire import pack_shared
from tokenrouter_sdk.models import tiny_model, truncate

from ..helpers import run_script

SCRIPT = """
import copy, json, logging, os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate


def nfd():
    return len(os.listdir("/proc/self/fd"))


logged = []
handler = logging.Handler()
handler.emit = lambda rec: logged.append(rec.getMessage())
logging.getLogger("tokenrouter_sdk").addHandler(handler)
tok = tiny_tokenizer()
params = SamplingParams(max_new_tokens=6, ignore_eos=True)
base = tiny_model(num_layers=40, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
weights = sum(1 for _ in base.parameters())
out = {"weights": weights, "fds": [nfd()], "ok": [], "same": []}
routers = []
for seed in range(3):  # three distinct pairs (own weights each), all alive at once
    large = base if seed == 0 else copy.deepcopy(base)
    pair = {"small": truncate(large, 20), "large": large}
    routers.append((Router(pair, RandomRouting(p=0.5, seed=seed), tokenizer=tok, processes=True), pair))
    out["fds"].append(nfd())
for r, pair in routers:
    outs = r.generate([[5, 6, 7], [9, 10]], sampling=params, timeout=60)
    out["ok"].append([o.finish_reason for o in outs])
    ref = reference_generate(pair, outs[0].prompt, r.policy, params, rid=outs[0].rid)
    out["same"].append(outs[0].token_ids == ref["token_ids"] and outs[0].token_models == ref["token_models"])
out["kind"] = [type(r.engine.transport).__name__ for r, _ in routers]
for r, _ in routers:
    r.close()

# a soft limit too low for another Router: raised within the hard limit, and said so
low = nfd() + 20
resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
pair = {"small": truncate(base, 20), "large": base}
with Router(pair, tokenizer=tok, processes=True) as r:
    out["raised_ok"] = r.generate([[5, 6, 7]], sampling=params, timeout=60)[0].finish_reason
out["raised"] = [low, resource.getrlimit(resource.RLIMIT_NOFILE)[0]]
out["logged"] = logged

# a hard limit too low: a clear error
resource.setrlimit(resource.RLIMIT_NOFILE, (low, low))
try:
    Router(pair, tokenizer=tok, processes=True).close()
    out["error"] = None
except OSError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.timeout(240)
def test_three_process_pairs_fit_under_1024_open_files(tmp_path):
    res = run_script(tmp_path, SCRIPT, "three_pairs.py", timeout=230)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["weights"] > 360  # one descriptor each would pass 1,024 with the third pair
    assert out["kind"] == ["ProcessTransport"] * 3
    assert out["ok"] == [["length", "length"]] * 3 and out["same"] == [True] * 3
    per_pair = [b - a for a, b in zip(out["fds"], out["fds"][1:])]
    assert max(per_pair) <= 32, per_pair  # a handful per pair
    low, now = out["raised"]
    assert out["raised_ok"] == "length" and now > low
    assert any("ulimit -n" in m and f"from {low} to {now}" in m for m in out["logged"]), out["logged"]
    err = out["error"]
    assert err is not None and "ulimit -n" in err and f"limit of {low}" in err and f"hard limit {low}" in err


def test_pack_shared_moves_weights_into_one_segment_keeping_sharing_and_values():
    large = tiny_model(num_layers=3, seed=5)
    small = truncate(large, 2)
    before = {n: p.clone() for n, p in large.named_parameters()}
    tied = small.model.layers[0].self_attn.q_proj.weight
    view = large.model.embed_tokens.weight[3:7]
    tensors = [*large.parameters(), *large.buffers(), *small.parameters(), *small.buffers()]
    distinct = {t.untyped_storage().data_ptr() for t in tensors}
    stats = pack_shared([{"model": large}, {"model": small}, view])
    assert stats["segments"] == 1 and stats["storages"] == len(distinct) > len(before) // 2
    assert stats["bytes"] >= sum(p.numel() * p.element_size() for p in large.parameters())
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(ptrs) == 1 and next(iter(large.parameters())).untyped_storage().is_shared()
    for n, p in large.named_parameters():
        assert p.equal(before[n]), n
    assert tied is large.model.layers[0].self_attn.q_proj.weight  # same objects, now in the segment
    assert view.untyped_storage().data_ptr() in ptrs and view.equal(before["model.embed_tokens.weight"][3:7])
    assert pack_shared([large, small])["segments"] == 0  # already shared: left where it is
    many = pack_shared([tiny_model(num_layers=2, seed=6)], segment_bytes=4096)  # small segments: several
    assert many["segments"] > 1
