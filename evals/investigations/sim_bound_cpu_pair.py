"""Simulated sync vs async vs delayed with the CPU pair's measured step latencies: what the latency
shape alone allows, without CPU contention or messaging (sim backend, RandomRouting p=0.1, 256
tokens, concurrency 8 and 16).

Two latency inputs: decode steps only (seconds by batch size, as measured by
evals/planner/cpu_sweep.py, recorded in evals/results/planner/, with the sim's default
per-token cost of 0.5 ms), and the same table with the per-token extend cost that
`profile_latency(context=128)` measured on the CPU machine (small 1.7 ms, large 5.0 ms per fed
token beyond one per request). Under RandomRouting the large model's steps are extends (it feeds
every token the small one wrote since its last visit), so the second input is the realistic one.

Run:
    .venv/bin/python evals/investigations/sim_bound_cpu_pair.py

Writes ``<out>/sim_bound_cpu_pair.json`` and ``.csv`` (one row per input and cell).
"""

import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

SMALL = {1: 0.0365, 2: 0.0405, 4: 0.0631, 8: 0.0836, 16: 0.0885}
LARGE = {1: 0.0669, 2: 0.0721, 4: 0.1204, 8: 0.1512, 16: 0.1617}
INPUTS = (
    ("decode table only (per_token_s 0.5 ms)", 0.0005, 0.0005),
    ("with measured extend cost (1.7 / 5.0 ms per token)", 0.0017, 0.0050),
)


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16], help="concurrencies (default 8 16)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request (default 256)")
    args = p.parse_args(argv)

    from tokenrouter_sdk.backends.sim_runner import LatencyModel
    from tokenrouter_sdk.bench import format_table, run_bench
    from tokenrouter_sdk.models import tiny_tokenizer

    cells = [("random10", m, True, n, args.tokens) for n in args.concurrency for m in ("sync", "async", "delayed")]
    prompts = [[5 + i % 200] * 60 for i in range(64)]
    rows = []
    for title, ps, pl in INPUTS:
        lat = {"small": LatencyModel(SMALL, per_token_s=ps), "large": LatencyModel(LARGE, per_token_s=pl)}
        out = run_bench(lat, tiny_tokenizer(), prompts, cells=cells, backend="sim", progress=False)
        print(title)
        print(format_table(out), flush=True)
        rows += [{"input": title, **asdict(c)} for c in out]
    evalkit.Output(args, __file__).write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
