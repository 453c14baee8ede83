"""Side-by-side committed-token throughput: policies x schedule modes x concurrency x output
length, plus the baselines (retain_kv=False, large-only, small-only), in one run. The same
benchmark as ``tokenrouter bench`` (`tokenrouter_sdk.bench`), with that command's options.

Measures, per cell: committed tokens/s, mean latency (s), per-user tokens/s, realised hop rate and
large fraction, and the ratios to ``sync`` and to ``retain_kv=False`` in the same cell.

Run:
    .venv/bin/python evals/throughput/side_by_side.py --concurrency 1 8 16 --max-new-tokens 256
    .venv/bin/python evals/throughput/side_by_side.py --backend sim      # latency models, simulated time

Writes ``<out>/side_by_side_<cells>.csv`` (one line per cell) and ``.html`` (a chart, with plotly).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def main(argv=None) -> int:
    from tokenrouter_sdk.cli.main import add_bench_arguments, cmd_bench

    p = add_bench_arguments(evalkit.parser(__file__, __doc__), out=False)
    args = p.parse_args(argv)
    tag = evalkit.cells_tag(args.backend, c=args.concurrency, t=args.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    out_dir = args.out
    args.out = str(out_dir / f"{Path(__file__).stem}_{tag}")  # `tokenrouter bench` takes a file prefix
    return cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())
