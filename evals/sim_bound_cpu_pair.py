"""Simulated sync vs async vs delayed with the CPU pair's measured step latencies (ms by batch size, from
evals/results/planner_check_cpu.json): what the latency shape alone allows, without CPU contention.

    .venv/bin/python evals/sim_bound_cpu_pair.py
"""
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.bench import run_bench, format_table
from tokenrouter_sdk.models import tiny_tokenizer
lat = {"small": LatencyModel({1: .0365, 2: .0405, 4: .0631, 8: .0836, 16: .0885}),
       "large": LatencyModel({1: .0669, 2: .0721, 4: .1204, 8: .1512, 16: .1617})}
cells = [("random10", m, True, n, 256) for n in (8, 16) for m in ("sync", "async", "delayed")]
out = run_bench(lat, tiny_tokenizer(), [[5 + i % 200] * 60 for i in range(64)], cells=cells, backend="sim", progress=False)
print(format_table(out))
