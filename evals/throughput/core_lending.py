"""Core lending against a fixed share of the cores per sub-server process, side by side.

The packaged pair under R-Stitch (tau 0.3, tau_back 0.02, prefill_peers), sub-servers in
processes: ``fixed`` gives each process the CPUs divided by the models (``processes={"threads":
N}``, what the engine did before core lending), ``lending`` is the default (each process takes
``cores // busy models`` threads step by step, `tokenrouter_sdk.engine.transports.cores`). Each repeat
builds one Router per setting, in turn, and generates GSM8K questions at every concurrency
(``--concurrency``; max(4, c) questions, ``--tokens`` tokens each, ``ignore_eos``); committed
tokens/s = tokens / wall time of the call. The table shows medians over repeats and the ratio
lending / fixed per concurrency.

Run: (timing under `flock /tmp/bench.lock`: the machine is shared)
    flock /tmp/bench.lock .venv/bin/python evals/throughput/core_lending.py --repeats 3 --out evals/results/throughput

Writes ``<out>/core_lending_c<concurrency>_t<tokens>.json`` and ``.csv``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per request (default 96)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.engine.transports.cores import cpu_count
    from tokenrouter_sdk.policies import RStitch

    print(evalkit.environment(), flush=True)
    prompts = load_prompts("gsm8k", max(4, *a.concurrency))
    fixed = max(1, cpu_count() // 2)
    settings = {"fixed": {"threads": fixed}, "lending": True}
    runs: dict = {s: {c: [] for c in a.concurrency} for s in settings}
    for rep in range(a.repeats):
        for name, processes in settings.items():
            with Router.default(policy=RStitch(tau=0.3, tau_back=0.02), prefill_peers=True, processes=processes) as r:
                r.generate(prompts[:1], max_new_tokens=8)
                for c in a.concurrency:
                    t = time.perf_counter()
                    outs = r.generate(prompts[: max(4, c)], max_new_tokens=a.tokens, concurrency=c, ignore_eos=True)
                    wall = time.perf_counter() - t
                    runs[name][c].append(sum(len(o.token_ids) for o in outs) / wall)
            print(
                f"rep {rep} {name}: " + ", ".join(f"c={c} {runs[name][c][-1]:.1f}" for c in a.concurrency), flush=True
            )
    rows = []
    for c in a.concurrency:
        f, lend = statistics.median(runs["fixed"][c]), statistics.median(runs["lending"][c])
        rows.append(
            {
                "concurrency": c,
                "fixed_tok_s": round(f, 2),
                "lending_tok_s": round(lend, 2),
                "lending/fixed": round(lend / f, 3),
            }
        )
    print(f"\nmedians of {a.repeats} repeats; fixed = {fixed} thread(s) per process")
    print(
        evalkit.table(
            rows,
            [
                ("concurrency", "c", "d"),
                ("fixed_tok_s", "fixed tok/s", ".1f"),
                ("lending_tok_s", "lending tok/s", ".1f"),
                ("lending/fixed", "ratio", ".2f"),
            ],
        )
    )
    out = evalkit.Output(a, __file__, evalkit.cells_tag(c=a.concurrency, t=a.tokens))
    out.write(
        rows,
        runs={s: {str(c): v for c, v in d.items()} for s, d in runs.items()},
        fixed_threads=fixed,
        command=" ".join([sys.executable, *sys.argv]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
