"""Simulated sync vs async vs delayed with the CPU pair's measured step latencies: what the latency
shape alone allows, without CPU contention or messaging.

    .venv/bin/python evals/sim_bound_cpu_pair.py

Two latency inputs: decode steps only (ms by batch size, from evals/results/planner_check_cpu.json,
per_token_s left at the sim default 0.5 ms), and the same table with the per-token extend cost
that `profile_latency(context=128)` measured on this machine (small 1.7 ms, large 5.0 ms per fed
token beyond one per request). Under RandomRouting the large model's steps are extends (it feeds
every token the small one wrote since its last visit), so the second input is the realistic one.
"""
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.bench import format_table, run_bench
from tokenrouter_sdk.models import tiny_tokenizer

small = {1: .0365, 2: .0405, 4: .0631, 8: .0836, 16: .0885}
large = {1: .0669, 2: .0721, 4: .1204, 8: .1512, 16: .1617}
cells = [("random10", m, True, n, 256) for n in (8, 16) for m in ("sync", "async", "delayed")]
prompts = [[5 + i % 200] * 60 for i in range(64)]
for title, ps, pl in (("decode table only (per_token_s 0.5 ms)", 0.0005, 0.0005),
                      ("with measured extend cost (1.7 / 5.0 ms per token)", 0.0017, 0.0050)):
    lat = {"small": LatencyModel(small, per_token_s=ps), "large": LatencyModel(large, per_token_s=pl)}
    out = run_bench(lat, tiny_tokenizer(), prompts, cells=cells, backend="sim", progress=False)
    print(title)
    print(format_table(out))
