"""Issue 3's c=8 CPU bars in one run: delayed at 256 and 1024 tokens (the 256 -> 1024 cost) and sync at
256 tokens (delayed / sync), RandomRouting p=0.1, planner thresholds. About 9 minutes on 2 cores.

    .venv/bin/python evals/bench_issue3_c8.py [OUT_CSV]      # default /tmp/bench_issue3_c8.csv
Run it from an isolated copy of the package when you edit the tree meanwhile.
"""
import sys
import time

from tokenrouter_sdk.bench import CsvLog, format_table, run_bench
from tokenrouter_sdk.cli import find_data, load_prompts
from tokenrouter_sdk.models import default_pair

large, small, tok = default_pair()
prompts = load_prompts(find_data(), 64)
log = CsvLog(sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_issue3_c8.csv")


def on_cell(c):
    log(c)
    print(time.strftime("%H:%M:%S"), c, flush=True)


out = run_bench({"small": small, "large": large}, tok, prompts,
                cells=[("random10", "delayed", True, 8, 256), ("random10", "delayed", True, 8, 1024),
                       ("random10", "sync", True, 8, 256)],
                thresholds="auto", on_cell=on_cell, progress=False)
print(format_table(out))
log.rewrite(out)
