"""Where wall time goes per model and mode on the CPU pair (sub-servers in processes): steps, mean
batch, forward time, busy share of the wall clock, gaps between steps, and decode-only vs extend
steps (an extend feeds the tokens the peer wrote since this model's last visit).

    .venv/bin/python evals/step_accounting.py [N] [NEW_TOKENS] [MODES]     # default 8 128 sync,delayed
Run it from an isolated copy of the package when you edit the tree meanwhile.
"""
import statistics as st
import sys
import time
from collections import defaultdict

from tokenrouter_sdk import Router
from tokenrouter_sdk.bench import make_policy
from tokenrouter_sdk.benchmarks import load_prompts
from tokenrouter_sdk.models import default_pair


def ms(x: float) -> str:
    return f"{1000 * x:.1f}ms"


def report(name: str, steps: list, wall: float) -> None:
    ss = sorted((e for e in steps if e.model == name), key=lambda e: e.t_start)
    fw = sum(e.forward_s for e in ss)
    sw = sum(e.t_end - e.t_start for e in ss)
    gaps = [b.t_start - a.t_end for a, b in zip(ss, ss[1:])]
    print(f"  {name}: steps {len(ss)} mean batch {st.mean(e.batch_size for e in ss):.2f}; forward {fw:.1f}s "
          f"({fw / wall:.0%} of wall), step {sw:.1f}s ({sw / wall:.0%}); per step forward {ms(fw / len(ss))}, "
          f"rest of step {ms((sw - fw) / len(ss))}; gap median {ms(st.median(gaps))} mean {ms(st.mean(gaps))}")
    dec = [e for e in ss if e.tokens_fed == e.batch_size]
    ext = [e for e in ss if e.tokens_fed > e.batch_size]
    by_b = defaultdict(list)
    for e in dec:
        by_b[e.batch_size].append(e.forward_s)
    print("    decode-only steps, median forward by batch:",
          {b: f"{ms(st.median(v))} (n={len(v)})" for b, v in sorted(by_b.items())})
    if ext:
        print(f"    steps with an extend: {len(ext)}, fed {st.mean(e.tokens_fed for e in ext):.1f} tokens over "
              f"{st.mean(e.batch_size for e in ext):.2f} requests, median forward {ms(st.median(e.forward_s for e in ext))}")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["sync", "delayed"]
    large, small, tok = default_pair()
    prompts = load_prompts("gsm8k", 64)
    for mode in modes:
        th = {"small": 1, "large": 1} if mode == "delayed" else None
        with Router({"small": small, "large": large}, make_policy("random10"), tokenizer=tok, mode=mode,
                     thresholds=th) as r:
            r.generate(prompts[:2], max_new_tokens=8, ignore_eos=True, progress=False)  # warm-up
            t0, c0 = time.perf_counter(), time.process_time()
            r.generate(prompts[:2 * n], max_new_tokens=new, ignore_eos=True, concurrency=n, progress=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            m = r.metrics()
            steps = [e[1] for e in r.trace if e[0] == "step" and e[1].t_start >= t0]
        print(f"== {mode} N={n} new={new}: {m.throughput_tok_s:.1f} tok/s, wall {wall:.1f}s, "
              f"Router process CPU {cpu:.1f}s")
        for name in ("small", "large"):
            report(name, steps, wall)


if __name__ == "__main__":
    main()
