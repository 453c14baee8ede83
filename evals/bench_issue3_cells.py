"""Issue 3's CPU cells on the packaged pair (RandomRouting p=0.1, planner thresholds), one named set
per run, each cell appended to OUT_PREFIX.csv as it finishes:

    .venv/bin/python evals/bench_issue3_cells.py [SET] [OUT_PREFIX]     # default: all /tmp/bench_issue3

  all             delayed and sync at c=8 with 256 and 1024 tokens, c=1/4/16 at 256, large-only and
                  small-only (recorded in evals/results/bench_cpu_issue3.csv)
  c8              delayed at 256 and 1024 tokens and sync at 256, c=8: the 256 -> 1024 cost and
                  delayed/sync in one run (evals/results/bench_cpu_c8_session4.csv; ~9 min)
  no_retain_1024  delayed against delayed with retain_kv=False at c=8, 1024 tokens
                  (evals/results/bench_cpu_no_retain_1024.csv; ~50 min on 2 cores)

Run it from an isolated copy of the package when you edit the tree meanwhile (sub-server
processes import the package afresh).
"""
import sys
import time

import tokenrouter_sdk
from tokenrouter_sdk.bench import CsvLog, environment, format_table, run_bench, write_html
from tokenrouter_sdk.benchmarks import load_prompts
from tokenrouter_sdk.models import default_pair

R = "random10"
SETS = {
    "all": [(R, "delayed", True, 8, 256), (R, "sync", True, 8, 256), (R, "delayed", True, 8, 1024),
            (R, "sync", True, 8, 1024), (R, "delayed", True, 1, 256), (R, "delayed", True, 4, 256),
            (R, "delayed", True, 16, 256), (R, "sync", True, 1, 256), (R, "sync", True, 4, 256),
            (R, "sync", True, 16, 256), ("large_only", "async", True, 8, 256), ("small_only", "async", True, 8, 256)],
    "c8": [(R, "delayed", True, 8, 256), (R, "delayed", True, 8, 1024), (R, "sync", True, 8, 256)],
    "no_retain_1024": [(R, "delayed", True, 8, 1024), (R, "delayed", False, 8, 1024)],
}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "all"
    if name not in SETS:
        raise SystemExit(f"unknown cell set {name!r}; choose one of {sorted(SETS)}")
    out_prefix = sys.argv[2] if len(sys.argv) > 2 else "/tmp/bench_issue3"
    print(tokenrouter_sdk.__file__, environment(), flush=True)
    large, small, tok = default_pair()
    log = CsvLog(out_prefix + ".csv")

    def on_cell(c):
        log(c)
        print(time.strftime("%H:%M:%S"), c, flush=True)

    out = run_bench({"small": small, "large": large}, tok, load_prompts("gsm8k", 64), cells=SETS[name],
                    thresholds="auto", on_cell=on_cell, progress=False)
    print(format_table(out))
    log.rewrite(out)
    write_html(out, out_prefix + ".html")


if __name__ == "__main__":
    main()
