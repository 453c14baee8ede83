"""Where wall time goes per model and mode on the CPU pair (sub-servers in processes): steps, mean
batch, forward time, busy share of the wall clock, gaps between steps, and decode-only vs extend
steps (an extend feeds the tokens the peer wrote since this model's last visit).

Sub-server processes import the package afresh: run from a copy of the repository when you edit
the tree during a run.

Run:
    .venv/bin/python evals/investigations/step_accounting.py --concurrency 8 --tokens 128 --modes sync delayed

Writes ``<out>/step_accounting_<cells>.json`` and ``.csv`` (one row per mode and model).
"""

import statistics as st
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def ms(x: float) -> str:
    return f"{1000 * x:.1f}ms"


def report(name: str, steps: list, wall: float) -> dict:
    """Print where ``name``'s steps spent ``wall`` seconds; returns the numbers as a row."""
    ss = sorted((e for e in steps if e.model == name), key=lambda e: e.t_start)
    fw = sum(e.forward_s for e in ss)
    sw = sum(e.t_end - e.t_start for e in ss)
    gaps = [b.t_start - a.t_end for a, b in zip(ss, ss[1:])]
    print(
        f"  {name}: steps {len(ss)} mean batch {st.mean(e.batch_size for e in ss):.2f}; forward {fw:.1f}s "
        f"({fw / wall:.0%} of wall), step {sw:.1f}s ({sw / wall:.0%}); per step forward {ms(fw / len(ss))}, "
        f"rest of step {ms((sw - fw) / len(ss))}; gap median {ms(st.median(gaps))} mean {ms(st.mean(gaps))}"
    )
    dec = [e for e in ss if e.tokens_fed == e.batch_size]
    ext = [e for e in ss if e.tokens_fed > e.batch_size]
    by_b = defaultdict(list)
    for e in dec:
        by_b[e.batch_size].append(e.forward_s)
    print(
        "    decode-only steps, median forward by batch:",
        {b: f"{ms(st.median(v))} (n={len(v)})" for b, v in sorted(by_b.items())},
    )
    if ext:
        print(
            f"    steps with an extend: {len(ext)}, fed {st.mean(e.tokens_fed for e in ext):.1f} tokens over "
            f"{st.mean(e.batch_size for e in ext):.2f} requests, "
            f"median forward {ms(st.median(e.forward_s for e in ext))}"
        )
    return {
        "model": name,
        "steps": len(ss),
        "mean_batch": st.mean(e.batch_size for e in ss),
        "forward_s": fw,
        "step_s": sw,
        "forward_share": fw / wall,
        "step_share": sw / wall,
        "gap_median_ms": 1e3 * st.median(gaps) if gaps else None,
        "decode_median_fwd_ms": {b: 1e3 * st.median(v) for b, v in sorted(by_b.items())},
        "extend_steps": len(ext),
        "extend_median_fwd_ms": 1e3 * st.median(e.forward_s for e in ext) if ext else None,
    }


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight N (default 8); 2N requests run")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument(
        "--modes", nargs="+", default=["sync", "delayed"], choices=["sync", "model_sync", "async", "delayed"]
    )
    args = p.parse_args(argv)

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.bench import make_policy
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.engine.messages import StepDone
    from tokenrouter_sdk.models import default_pair

    n, new = args.concurrency, args.tokens
    large, small, tok = default_pair()
    prompts = load_prompts("gsm8k", 64)
    rows = []
    for mode in args.modes:
        th = {"small": 1, "large": 1} if mode == "delayed" else None
        with Router(
            {"small": small, "large": large}, make_policy("random10"), tokenizer=tok, mode=mode, thresholds=th
        ) as r:
            r.generate(prompts[:2], max_new_tokens=8, ignore_eos=True, progress=False)  # warm-up
            t0, c0 = time.perf_counter(), time.process_time()
            out = r.generate(prompts[: 2 * n], max_new_tokens=new, ignore_eos=True, concurrency=n, progress=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            m = out.metrics()
            steps = [e for e in out.trace if isinstance(e, StepDone) and e.t_start >= t0]
        print(
            f"== {mode} N={n} new={new}: {m.throughput_tok_s:.1f} tok/s, wall {wall:.1f}s, "
            f"Router process CPU {cpu:.1f}s"
        )
        for name in ("small", "large"):
            rows.append(
                {
                    "mode": mode,
                    "tok_s": m.throughput_tok_s,
                    "wall_s": wall,
                    "router_cpu_s": cpu,
                    **report(name, steps, wall),
                }
            )
    evalkit.Output(args, __file__, evalkit.cells_tag("-".join(args.modes), c=n, t=new)).write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
