"""Issue 3's retain_kv bar in one run: `delayed` against `delayed` with ``retain_kv=False`` (every
return re-prefills the whole context) at concurrency 8 and 1024 output tokens on the CPU pair
(RandomRouting p=0.1, planner thresholds). The second cell takes about 50 minutes on 2 cores.

    .venv/bin/python evals/bench_no_retain_1024.py [OUT_CSV]      # default /tmp/b1024.csv
Run it from an isolated copy of the package when you edit the tree meanwhile.
"""
import sys
import time

from tokenrouter_sdk.bench import CsvLog, format_table, run_bench
from tokenrouter_sdk.cli import find_data, load_prompts
from tokenrouter_sdk.models import default_pair

large, small, tok = default_pair()
prompts = load_prompts(find_data(), 64)
log = CsvLog(sys.argv[1] if len(sys.argv) > 1 else "/tmp/b1024.csv")


def on_cell(c):
    log(c)
    print(time.strftime("%H:%M:%S"), c, flush=True)


out = run_bench({"small": small, "large": large}, tok, prompts,
                cells=[("random10", "delayed", True, 8, 1024), ("random10", "delayed", False, 8, 1024)],
                thresholds="auto", on_cell=on_cell, progress=False)
print(format_table(out))
log.rewrite(out)
