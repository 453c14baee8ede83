"""Side-by-side committed-token throughput: policies x schedule modes x concurrency x output
length, plus retain_kv=False, large-only and small-only, in one run (same as `tokenrouter bench`).

    .venv/bin/python evals/bench_throughput.py --concurrency 1 8 16 --max-new-tokens 256
    .venv/bin/python evals/bench_throughput.py --backend sim          # latency models, simulated time
"""

import sys

from tokenrouter_sdk.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
