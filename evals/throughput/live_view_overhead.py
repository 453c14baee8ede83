"""Overhead of the live hop view (``generate(live=...)``; target: < 5% of wall time on a
16-request run).

What runs: the packaged pair (`Router.default()`, R-Stitch tau=0.1, process sub-servers as by
default), the first N GSM8K questions (GSM8K template, chat-templated), greedy, ``ignore_eos=True``,
``max_new_tokens=M``, so every run writes exactly N*M committed tokens. Three variants of the
same call, interleaved per repeat (off, text, widget, off, text, widget, ...) after one warm-up
each, so machine-load noise hits all of them:

  off     router.generate(prompts, ...)                      no view
  text    router.generate(prompts, ..., live="text")         tqdm bar + final summary (non-notebook)
  widget  router.generate(prompts, ..., live="widget")       the notebook view (ipywidgets HTML +
          plotly FigureWidget) built and updated four times a second exactly as in Jupyter, but
          not displayed (no kernel here, so comm messages to a browser are not sent)

Reported per variant (medians): wall seconds of the generate call (perf_counter around it) and of
``router.metrics().wall_s`` (first admission to last finish), committed tok/s, and the live
view's own time (``LiveView.update_s``: seconds spent redrawing, in the caller's thread) with
its number of redraws, view/wall = view time / wall time (the share of the caller's thread the
view took: the view's direct cost, independent of other load on the machine), and the parent
process's CPU seconds (time.process_time: caller thread, hub thread; the sub-servers are child
processes). Overhead = median(live) / median(off) - 1 (also the paired median over repeats of
live/off within one repeat, which is less sensitive to other load on the machine).

Run:
    .venv/bin/python evals/throughput/live_view_overhead.py --requests 16 --max-new-tokens 32 --repeats 5

Writes ``<out>/live_view_overhead_<cells>.json`` (every run and the medians) and ``.csv`` (the
medians, one line per variant).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def run_once(router, prompts: list[str], variant: str, max_new_tokens: int) -> dict:
    live = {"off": False, "text": "text", "widget": "widget"}[variant]
    router.last_view = None
    t, c = time.perf_counter(), time.process_time()
    outs = router.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True, live=live)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    m = router.metrics()
    assert sum(len(o.token_ids) for o in outs) == len(prompts) * max_new_tokens
    v = router.last_view if live else None
    return dict(
        variant=variant,
        wall_s=wall,
        parent_cpu_s=cpu,
        engine_wall_s=m.wall_s,
        tok_s=m.throughput_tok_s,
        hop_rate=m.hop_rate,
        view_s=v.update_s if v else 0.0,
        redraws=v.updates if v else 0,
    )


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--requests", type=int, default=16, help="GSM8K questions per call (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request (default 32)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default 5)")
    ap.add_argument("--variants", nargs="+", default=["off", "text", "widget"], choices=["off", "text", "widget"])
    ap.add_argument(
        "--small-layers",
        type=int,
        default=None,
        help="small = the first k layers of the large model instead of the packaged self-draft",
    )
    args = ap.parse_args(argv)

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.policies import RStitch

    prompts = load_prompts("gsm8k", args.requests)
    rows = []
    with Router.default(policy=RStitch(tau=0.1), small_layers=args.small_layers) as router:
        for v in args.variants:  # warm-up
            run_once(router, prompts[:2], v, 4)
        for rep in range(args.repeats):
            for v in args.variants:
                r = run_once(router, prompts, v, args.max_new_tokens)
                r["repeat"] = rep
                rows.append(r)
                print(
                    f"repeat {rep} {v:>6}: wall {r['wall_s']:.3f} s, engine {r['engine_wall_s']:.3f} s, "
                    f"{r['tok_s']:.1f} tok/s, view {r['view_s'] * 1e3:.1f} ms in {r['redraws']} redraws",
                    flush=True,
                )
    med = {
        v: {
            k: statistics.median(r[k] for r in rows if r["variant"] == v)
            for k in ("wall_s", "engine_wall_s", "tok_s", "view_s", "redraws", "parent_cpu_s")
        }
        for v in args.variants
    }
    off = med.get("off")
    print(f"\n{args.requests} requests x {args.max_new_tokens} tokens, medians of {args.repeats} repeats")
    print(
        f"{'variant':>8} {'wall s':>8} {'engine s':>9} {'tok/s':>7} {'view ms':>8} {'redraws':>8} "
        f"{'overhead':>9} {'paired':>8} {'view/wall':>9} {'cpu s':>6}"
    )
    for v, m in med.items():
        ovh = paired = float("nan")
        if off and v != "off":
            ovh = m["wall_s"] / off["wall_s"] - 1
            paired = statistics.median(
                a["wall_s"] / b["wall_s"] - 1
                for a in rows
                for b in rows
                if a["variant"] == v and b["variant"] == "off" and a["repeat"] == b["repeat"]
            )
        print(
            f"{v:>8} {m['wall_s']:8.3f} {m['engine_wall_s']:9.3f} {m['tok_s']:7.1f} {m['view_s'] * 1e3:8.1f} "
            f"{m['redraws']:8.0f} {ovh:+9.1%} {paired:+8.1%} {m['view_s'] / m['wall_s']:9.2%} {m['parent_cpu_s']:6.2f}"
        )
    out = evalkit.Output(args, __file__, evalkit.cells_tag(r=args.requests, t=args.max_new_tokens))
    out.write([{"variant": v, **m} for v, m in med.items()], runs=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
