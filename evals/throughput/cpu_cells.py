"""Named sets of throughput cells on the packaged CPU pair (RandomRouting p=0.1, the planner's
delayed thresholds), one set per run; each cell is appended to the CSV as soon as it finishes, so
a long run that is stopped keeps what it measured.

Sets (``--set``):
  grid            delayed and sync at c=8 with 256 and 1024 tokens, c=1/4/16 at 256, large-only and
                  small-only (recorded: evals/results/throughput/cpu_cells_grid.csv)
  c8              delayed at 256 and 1024 tokens and sync at 256, c=8: the cost of the longer
                  context and delayed/sync in one run (evals/results/throughput/cpu_cells_c8.csv;
                  about 9 min on 2 cores)
  retain_kv_1024  delayed against delayed with retain_kv=False at c=8, 1024 tokens
                  (evals/results/throughput/cpu_cells_retain_kv_1024.csv; about 50 min on 2 cores)

Measures per cell: committed tokens/s, mean latency, hop rate, large fraction (`tokenrouter_sdk.bench`).
Sub-server processes import the package afresh: run from a copy of the repository when you edit
the tree during a run.

Run:
    .venv/bin/python evals/throughput/cpu_cells.py --set c8 --out evals_out

Writes ``<out>/cpu_cells_<set>.csv`` (and ``.html`` with plotly).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

R = "random10"
SETS = {
    "grid": [
        (R, "delayed", True, 8, 256),
        (R, "sync", True, 8, 256),
        (R, "delayed", True, 8, 1024),
        (R, "sync", True, 8, 1024),
        (R, "delayed", True, 1, 256),
        (R, "delayed", True, 4, 256),
        (R, "delayed", True, 16, 256),
        (R, "sync", True, 1, 256),
        (R, "sync", True, 4, 256),
        (R, "sync", True, 16, 256),
        ("large_only", "async", True, 8, 256),
        ("small_only", "async", True, 8, 256),
    ],
    "c8": [(R, "delayed", True, 8, 256), (R, "delayed", True, 8, 1024), (R, "sync", True, 8, 256)],
    "retain_kv_1024": [(R, "delayed", True, 8, 1024), (R, "delayed", False, 8, 1024)],
}


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--set", choices=sorted(SETS), default="grid", help="the cells to run (default grid)")
    p.add_argument("--prompts", type=int, default=64, help="GSM8K questions cycled as prompts (default 64)")
    args = p.parse_args(argv)

    import tokenrouter_sdk
    from tokenrouter_sdk.bench import CsvLog, format_table, run_bench, write_html
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.models import default_pair

    out = evalkit.Output(args, __file__, args.set)
    print(tokenrouter_sdk.__file__, evalkit.environment(), flush=True)
    large, small, tok = default_pair()
    log = CsvLog(str(out.path(".csv")))

    def on_cell(c):
        log(c)
        print(time.strftime("%H:%M:%S"), c, flush=True)

    cells = run_bench(
        {"small": small, "large": large},
        tok,
        load_prompts("gsm8k", args.prompts),
        cells=SETS[args.set],
        thresholds="auto",
        on_cell=on_cell,
        progress=False,
    )
    print(format_table(cells))
    log.rewrite(cells)
    write_html(cells, str(out.path(".html")))
    print(f"wrote {out.path('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
