"""Quality at hop rate (issue 6): sweep a policy's threshold on a benchmark with the packaged CPU
pair and write results.csv, results.json and plot.html to --out (resumable).

    python evals/quality_at_hop_rate.py --policy rstitch --values 0.02,0.05,0.1,0.2,0.4 \\
        --dataset gsm8k --limit 64 --max-new-tokens 256 --out eval_out

Same options as ``tokenrouter eval`` (see `tokenrouter_sdk.eval.cli`).
"""

import sys

from tokenrouter_sdk.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
