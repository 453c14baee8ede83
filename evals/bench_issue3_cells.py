"""Issue 3 CPU cells in one run (recorded in evals/results/bench_cpu_issue3.csv):
delayed and sync at c=8 with 256 and 1024 tokens, c=1/4/16 at 256, large-only and small-only.

    .venv/bin/python evals/bench_issue3_cells.py [OUT_PREFIX]     # default /tmp/bench_issue3
Run it from an isolated copy of the package when you edit the tree meanwhile (sub-server
processes import the package afresh).
"""
import sys
import time

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_issue3"
import tokenrouter_sdk
from tokenrouter_sdk.bench import CsvLog, environment, format_table, run_bench, write_html
from tokenrouter_sdk.cli import find_data, load_prompts
from tokenrouter_sdk.models import default_pair
print(tokenrouter_sdk.__file__, flush=True)
large, small, tok = default_pair()
prompts = load_prompts(find_data(), 64)
cells = [("random10", "delayed", True, 8, 256), ("random10", "sync", True, 8, 256),
         ("random10", "delayed", True, 8, 1024), ("random10", "sync", True, 8, 1024),
         ("random10", "delayed", True, 1, 256), ("random10", "delayed", True, 4, 256), ("random10", "delayed", True, 16, 256),
         ("random10", "sync", True, 1, 256), ("random10", "sync", True, 4, 256), ("random10", "sync", True, 16, 256),
         ("large_only", "async", True, 8, 256), ("small_only", "async", True, 8, 256)]
print(environment(), flush=True)
log = CsvLog(OUT + ".csv")
def on_cell(c):
    log(c)
    print(time.strftime("%H:%M:%S"), c, flush=True)
out = run_bench({"small": small, "large": large}, tok, prompts, cells=cells, thresholds="auto", on_cell=on_cell,
                progress=False)
print(format_table(out))
log.rewrite(out)
write_html(out, OUT + ".html")
