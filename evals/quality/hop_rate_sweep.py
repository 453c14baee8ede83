"""Quality at hop rate: sweep a policy's threshold on a benchmark with the packaged CPU pair and
report, per point, accuracy, realised hop rate and large fraction, next to the large-only,
small-only and random references (`tokenrouter_sdk.eval.evaluate_policy`; the same sweep as
``tokenrouter eval``, with that command's options).

Run:
    .venv/bin/python evals/quality/hop_rate_sweep.py --policy rstitch --values 0.02,0.05,0.1,0.2,0.4 \\
        --dataset gsm8k --limit 64 --max-new-tokens 256

Writes the folder ``<out>/hop_rate_sweep_<policy>_<dataset><limit>/``: results.csv, results.json
(every answer), plot.html, and points/ (finished points: a rerun with the same options resumes).
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def main(argv=None) -> int:
    from tokenrouter_sdk.cli.eval import add_arguments, cmd_eval

    args = add_arguments(evalkit.parser(__file__, __doc__), out=False).parse_args(argv)
    name = Path(args.dataset).stem if ("/" in args.dataset or "." in args.dataset) else args.dataset
    policy = re.sub(r"[^A-Za-z0-9_.=-]+", "_", "+".join(args.policy or ["rstitch"]))[:60]
    args.out = str(Path(args.out) / f"{Path(__file__).stem}_{policy}_{name}{args.limit}")
    return cmd_eval(args)


if __name__ == "__main__":
    sys.exit(main())
