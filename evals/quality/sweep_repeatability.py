"""Is a sweep's throughput column repeatable? Run the same ``tokenrouter eval`` sweep twice (every
option of that command applies; the defaults below are a short GSM8K sweep of R-Stitch on the
packaged pair) and report, per point, the two throughput medians and their ratio, whether every
point is within ``--tolerance`` between the runs, whether small-only is faster than every routed
point (references included) in each run, and the machine's load during each (the share of the
CPUs other processes used: a run under load does not measure the engine).

On a quiet machine, under the benchmark lock. Run:
    flock /tmp/bench.lock .venv/bin/python evals/quality/sweep_repeatability.py \\
        --policy rstitch --values 0.05,0.1 --limit 8 --max-new-tokens 64 --repeats 3 --out evals_out

Writes ``<out>/sweep_repeatability/run1`` and ``run2`` (each a sweep's results.csv/json, plot.html)
and ``<out>/sweep_repeatability.json`` / ``.csv`` (the comparison).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def compare(a, b, tolerance: float) -> tuple[list[dict], dict]:
    """Per point of two `EvalResult` of one sweep: both medians and their ratio; and the bars."""
    rb = {r["label"]: r for r in b.records}
    rows = []
    for r in a.records:
        x, y = r.get("throughput_tok_s"), rb.get(r["label"], {}).get("throughput_tok_s")
        rows.append(
            {
                "point": r["label"],
                "kind": r["kind"],
                "run1_tok_s": x,
                "run2_tok_s": y,
                "ratio": y / x if x and y else None,
                "run1_runs": r.get("throughput_runs"),
                "run2_runs": rb.get(r["label"], {}).get("throughput_runs"),
            }
        )
    within = all(row["ratio"] is not None and abs(row["ratio"] - 1) <= tolerance for row in rows)
    faster = {}
    for name, res in (("run1", a), ("run2", b)):
        small = next((r["throughput_tok_s"] for r in res.records if r["kind"] == "small_only"), None)
        routed = [r for r in res.records if r["kind"] not in ("small_only", "large_only")]
        slow = [r["label"] for r in routed if small is None or (r["throughput_tok_s"] or 0) >= small]
        faster[name] = {"small_only_tok_s": small, "not_slower_than_small_only": slow}
    bars = {
        "within_tolerance": within,
        "tolerance": tolerance,
        "small_only_fastest": all(not v["not_slower_than_small_only"] for v in faster.values()),
        "small_only": faster,
        "machine": {"run1": a.config.get("machine"), "run2": b.config.get("machine")},
    }
    return rows, bars


def main(argv=None) -> int:
    from tokenrouter_sdk.cli.eval import add_arguments, cmd_eval
    from tokenrouter_sdk.eval.result import EvalResult

    p = add_arguments(evalkit.parser(__file__, __doc__), out=False)
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="largest relative difference of a point's median between the runs (default 0.10)",
    )
    args = p.parse_args(argv)
    root = Path(args.out) / Path(__file__).stem
    results = []
    for k in (1, 2):
        args.out = str(root / f"run{k}")
        cmd_eval(args)
        results.append(EvalResult.load(args.out))
    args.out = str(root.parent)
    rows, bars = compare(*results, args.tolerance)
    print(
        evalkit.table(
            rows,
            [
                ("point", "point", "s"),
                ("run1_tok_s", "run 1 tok/s", ".1f"),
                ("run2_tok_s", "run 2 tok/s", ".1f"),
                ("ratio", "2/1", ".3f"),
            ],
        )
    )
    for name in ("run1", "run2"):
        m = bars["machine"][name] or {}
        share = m.get("other_share_median")
        print(
            f"{name}: other processes used {share if share is None else f'{share:.0%}'} of the CPUs in the median "
            f"run{' (UNDER LOAD)' if m.get('high') else ''}; slower-or-equal to small-only: "
            f"{bars['small_only'][name]['not_slower_than_small_only'] or 'none'}"
        )
    print(
        f"every point within {args.tolerance:.0%}: {bars['within_tolerance']}; small-only faster than every "
        f"routed point in both runs: {bars['small_only_fastest']}"
    )
    evalkit.Output(args, __file__).write(rows, bars=bars)
    return 0 if bars["within_tolerance"] and bars["small_only_fastest"] else 1


if __name__ == "__main__":
    sys.exit(main())
