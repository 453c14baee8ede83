"""The hub's round trip between simulated nodes: a hop costs one message from one sub-server to
the other through the Router's pyzmq hub. The tiny float64 pair (2 layers, steps of about a
millisecond) writes with a policy that hands off at every token (small writes even positions,
large odd ones, the sampled token kept), so each token is one hop; the same requests run with
the sub-servers as local processes (ipc://) and as Ray actors on two simulated nodes of a
``ray.cluster_utils.Cluster`` on loopback (tcp:// to 127.0.0.1), alternately, ``--repeats``
times. Reports median milliseconds per committed token for each and their difference (what a
hop through the Ray placement adds), and the Ray actors' start time.

Needs Ray (``pip install 'tokenrouter-sdk[ray]'``).

Run:
    .venv/bin/python evals/throughput/ray_hub.py --tokens 64 --repeats 5

Writes ``<out>/ray_hub_t<tokens>.json`` and ``.csv``.
"""

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--requests", type=int, default=1, help="requests in flight (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="alternating repeats (default 5)")
    a = ap.parse_args(argv)
    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"})  # loopback
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from tokenrouter_sdk import Handoff, Policy, Router
    from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate

    class EveryToken(Policy):
        def route(self, step):
            return step.models[step.position % 2]

        def send(self, req, target):
            return Handoff(keep_sampled=True)

    print(evalkit.environment(), flush=True)
    large = tiny_model(num_layers=2, seed=1)
    pair, tok = {"small": truncate(large, 1), "large": large}, tiny_tokenizer()
    tmp = tempfile.mkdtemp(prefix="tokenrouter-ray-")
    os.environ["RAY_TMPDIR"] = tmp
    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False}
    )
    c.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=c.address, log_to_driver=False)
    rows = []
    try:
        t0 = time.perf_counter()
        on_ray = Router(
            pair,
            EveryToken(),
            tokenizer=tok,
            cluster={"resources": {"small": {"node_a": 0.01}, "large": {"node_b": 0.01}}, "strategy": "SPREAD"},
        )
        ray_start_s = time.perf_counter() - t0
        local = Router(pair, EveryToken(), tokenizer=tok, processes=True)
        prompts = [[5 + i, 6, 7] for i in range(a.requests)]
        per = {"local": [], "ray": []}
        try:
            for r in (local, on_ray):
                r.generate(prompts, max_new_tokens=8, ignore_eos=True)  # warm-up
            for _ in range(a.repeats):
                for name, r in (("local", local), ("ray", on_ray)):
                    t = time.perf_counter()
                    outs = r.generate(prompts, max_new_tokens=a.tokens, ignore_eos=True)
                    wall = time.perf_counter() - t
                    toks = sum(len(o.token_ids) for o in outs)
                    hops = sum(o.hops for o in outs)
                    per[name].append(wall / toks * 1e3)
                    rows.append(
                        {
                            "system": name,
                            "tokens": toks,
                            "hops": hops,
                            "wall_s": round(wall, 4),
                            "ms_per_token": round(wall / toks * 1e3, 3),
                        }
                    )
        finally:
            local.close()
            on_ray.close()
    finally:
        ray.shutdown()
        c.shutdown()
    med = {k: statistics.median(v) for k, v in per.items()}
    print(
        f"ms per token (one hop each): local processes {med['local']:.2f}, Ray actors on two nodes "
        f"{med['ray']:.2f}; a hop through the Ray placement adds {med['ray'] - med['local']:.2f} ms "
        f"(x{med['ray'] / med['local']:.2f}); Ray actors started in {ray_start_s:.1f} s"
    )
    out = evalkit.Output(a, __file__, evalkit.cells_tag(t=a.tokens))
    out.write(rows, median_ms_per_token=med, ray_start_s=ray_start_s, command=" ".join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
